"""Which bundle shape? Rank plans for a model on a cluster (or this machine) by simulated throughput.

    python scripts/plan.py --model resnet101 --nodes 2 --gpus-per-node 4 --batch-size 256 \\
        --cluster clusters/v100_4x4_eth.yaml --top 10 --json plans.json --png plans.png
    python scripts/plan.py --validate --json validation.json   # against real runs here

Without ``--cluster`` the plans are for this machine: the model is timed here, and so are the
engine's overheads and the loopback links (cached under ``--profile-cache``); with
``--gpus-per-node`` or several ``--nodes`` and no cluster file, for nominal GPUs (the figures are
named on stderr). With a cluster file,
the device is estimated from FLOPs and bytes against its speed (or timed here when its speed is
``measure``), and its links are the file's. A cluster file of several device types (e.g.
``clusters/a100_8_v100_8.yaml``) is planned with placement and row weights too, against the plan
chosen as if every device were alike; run a plan with ``main.py --plan plans.json[:i]``.
Predictions are predictions: ``--validate`` says how far they are from measured runs on this
machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bundle import models
from bundle.config import (
    OPTIMIZERS,
    PRECISIONS,
    RECOMPUTES,
    ZERO_LEVELS,
    DataConfig,
    TrainConfig,
    parse_model_args,
)
from bundle.data import TEXT_VOCAB, input_spec
from bundle.errors import BundleError
from bundle.plan import planner, report
from bundle.plan import profile as prof
from bundle.plan.cluster import counted, describe_nominal, load_cluster, nominal
from bundle.plan.dataparallel import DataParallel
from bundle.plan.mixed import contended
from bundle.plan.plans import data_parallel, evaluate, with_options

_UNIFORM_TP = (
    "every stage at one tensor-parallel degree (by default each stage may take its own): the "
    "baseline that per-stage degrees are measured against"
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="plan.py", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a registered model (see main.py --help)")
    p.add_argument("--batch-size", type=int, default=64, help="global batch per step")
    p.add_argument(
        "--nodes", type=int, help="nodes planned on (default: a mixed cluster's nodes, else 1)"
    )
    p.add_argument(
        "--gpus-per-node",
        type=int,
        help="devices (processes) per node (default: the cluster's, or 2 on this machine)",
    )
    p.add_argument("--cluster", metavar="FILE.yaml", help="devices and links (clusters/*.yaml)")
    p.add_argument("--image-size", type=int, default=224, help="input side of image models")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--seq-len", type=int, default=64, help="gpt: tokens per sample")
    p.add_argument("--model-args", help="keyword arguments of the model's builder (main.py's)")
    p.add_argument(
        "--lora",
        metavar="r=R,alpha=A,targets=M1,M2|on",
        help="main.py's --lora: adapters on a frozen model; only what trains holds gradients and "
        "optimizer state and is synced, and a frozen layer's backward has no weight gradient",
    )
    p.add_argument("--lora-train", metavar="M1,M2", help="main.py's --lora-train (with --lora)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32")
    p.add_argument("--recompute", choices=RECOMPUTES, default="never")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size")
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=TrainConfig.optimizer,
        help="main.py's optimizer: its state (momentum, Adam's moments) counts in device memory",
    )
    p.add_argument(
        "--momentum", type=float, default=TrainConfig.momentum, help="sgd: 0 keeps no buffer"
    )
    p.add_argument(
        "--zero",
        type=int,
        choices=ZERO_LEVELS,
        default=0,
        help="1: the optimizer state sharded over each stage's replicas (main.py's --zero 1); "
        "3: the parameters and gradients too, each block gathered per micro-batch (--zero 3, "
        "which the planner also picks where no plan fits in memory without it)",
    )
    p.add_argument("--max-stages", type=int, default=4)
    p.add_argument("--max-micro-batches", type=int, default=64)
    p.add_argument("--uniform-tp", action="store_true", help=_UNIFORM_TP)
    p.add_argument("--top", type=int, default=10, help="plans shown")
    p.add_argument("--json", metavar="OUT", help="write the plans (or the validation) here")
    p.add_argument("--png", metavar="OUT", help="picture of the best plan and the top plans")
    p.add_argument(
        "--profile-cache",
        default=str(prof.default_cache_dir()),
        help="where measured profiles and calibrations are kept ('off' or '': measure every time)",
    )
    p.add_argument(
        "--reprofile",
        action="store_true",
        help="measure the profiles afresh (and cache them) instead of reading the cache",
    )
    p.add_argument("--validate", action="store_true", help="predicted vs measured runs here")
    p.add_argument("--smoke", action="store_true", help="with --validate: two tiny configurations")
    p.add_argument(
        "--spread",
        type=float,
        metavar="FRACTION",
        help="with --validate: measure a configuration again until its rounds' spread is at most "
        "this (default 0.10)",
    )
    p.add_argument(
        "--max-rounds", type=int, metavar="N", help="with --validate: rounds at most (default 11)"
    )
    p.add_argument(
        "--measured",
        metavar="JSON",
        help="with --validate: predict again from the measurements an earlier run's --json "
        "holds, running nothing (the planner changed, the runs did not)",
    )
    args = p.parse_args(argv)
    if not args.validate and not args.model:
        p.error("--model is required (or --validate)")
    return args


def _takes_tokens(args: argparse.Namespace) -> bool:
    """Whether the model reads token ids (``gpt``, a Hugging Face language model, a factory whose
    first layer is an embedding): built on the meta device for text to find out."""
    if args.model == "gpt":
        return True
    if args.model == "digits_cnn" or args.model in models.zoo_names():
        return False
    try:
        model = models.build_on_meta(
            args.model,
            num_classes=TEXT_VOCAB,
            input_shape=(args.seq_len,),
            args=parse_model_args(args.model_args),
        )
    except Exception:  # noqa: BLE001 - a model that cannot take text is planned on images
        return False
    return models.input_dtype(model) == torch.long


def _data(args: argparse.Namespace) -> dict[str, Any]:
    """The data the plans are made for: main.py's data options (what ``main.py --plan`` runs on
    unless given other data), with the input shape and classes they give."""
    if _takes_tokens(args):  # byte-level text: no file is read to plan (main.py needs --data-file)
        options: dict[str, Any] = {"dataset": "text", "seq_len": args.seq_len}
        classes, shape = TEXT_VOCAB, (args.seq_len,)
    else:
        options = {"dataset": "digits"} if args.model == "digits_cnn" else {"dataset": "synthetic"}
        if options["dataset"] == "synthetic":
            options.update(image_size=args.image_size, num_classes=args.num_classes)
        classes, shape = input_spec(DataConfig(**options))
    return {**options, "num_classes": classes, "input_shape": list(shape)}


def _request(args: argparse.Namespace, cluster) -> planner.Request:
    data = _data(args)
    classes, shape = data["num_classes"], tuple(data["input_shape"])
    per_node = args.gpus_per_node or (cluster.devices_per_node if cluster else 2)
    return planner.Request(
        model=args.model,
        batch=args.batch_size,
        nodes=_nodes(args, cluster),
        per_node=per_node,
        input_shape=shape,
        num_classes=classes,
        precision=args.precision,
        recompute=args.recompute,
        bucket_mb=args.bucket_mb,
        optimizer=args.optimizer,
        momentum=args.momentum,
        dp=DataParallel(zero=args.zero),
        max_stages=args.max_stages,
        max_micro=args.max_micro_batches,
        per_stage_tp=not args.uniform_tp,
        model_args=args.model_args,
        lora=args.lora,
        lora_train=args.lora_train,
    )


def _nodes(args: argparse.Namespace, cluster) -> int:
    if args.nodes is not None:
        return args.nodes
    return cluster.nodes if cluster is not None and cluster.mixed else 1


def _cluster(args: argparse.Namespace):
    """The cluster file's; nominal GPUs when GPU counts are given without one; else None (this
    machine, measured)."""
    if args.cluster:
        cluster, note = counted(load_cluster(args.cluster), args.nodes, args.gpus_per_node)
        if note:
            print(f"plan.py: {note}", file=sys.stderr, flush=True)
        return cluster
    if args.gpus_per_node is None and args.nodes in (None, 1):
        return None
    # Counts of GPUs say the plan is for GPUs, not for this machine: timing the model here
    # would be the wrong device (and, on a CPU, minutes of work for a large model).
    print(
        f"plan.py: no --cluster: planning for the {describe_nominal('cuda')}; "
        "give the real devices and links with --cluster FILE.yaml (see clusters/)",
        file=sys.stderr,
        flush=True,
    )
    return nominal("cuda", args.nodes or 1, args.gpus_per_node or 2)


def _say(line: str) -> None:
    print(f"plan.py: {line}", file=sys.stderr, flush=True)


def plan(args: argparse.Namespace) -> dict:
    cluster = _cluster(args)
    request = _request(args, cluster)
    planner.check(request, cluster)
    off = args.profile_cache in ("", "off")
    cache = prof.ProfileCache(None if off else args.profile_cache, refresh=args.reprofile)
    cost = planner.cost_model(request, cluster=cluster, cache=cache, progress=_say)
    for note in cache.notes:  # which cached profiles were used (age, conditions), which were not
        print(f"plan.py: {note}", file=sys.stderr, flush=True)
    mixed = planner.plan_mixed(request, cost, progress=_say) if cost.cluster.mixed else None
    ranked = mixed.ranked if mixed else planner.plan(request, cost, progress=_say)
    data = _data(args)
    job = report.Job(
        model=request.model,
        batch=request.batch,
        nodes=request.nodes,
        precision=request.precision,
        recompute=request.recompute,
        optimizer=request.optimizer,
        momentum=request.momentum,
        extra=_extra(args, data),
        data=data,
    )
    top = report.distinct(ranked)[: args.top]
    rows = [report.row(e, job, cost) for e in top]
    everywhere = with_options(data_parallel(request.nodes, request.per_node), request.dp)
    dp = mixed.data_parallel if mixed else evaluate(cost, everywhere, request.batch)
    best = ranked[0]
    out = {
        "model": request.model,
        "batch": request.batch,
        "devices": request.devices,
        "cluster": cost.cluster.name,
        "device_memory_bytes": cost.cluster.memory_bytes,
        "precision": request.precision,
        "recompute": request.recompute,
        "optimizer": request.optimizer,
        "zero": best.plan.dp.zero,  # 3 where the planner sharded to fit (the request's else)
        "optimizer_state_bytes_per_param": cost.state_bytes,
        # What trains (the trainer's summary names them alike): fewer than all with --lora.
        "trainable_params": int(cost.trained.sum()),
        "all_params": int(cost.params.sum()),
        "plans": rows,
        "data_parallel": report.row(dp, job, cost),
        "speedup_over_data_parallel": round(best.samples_per_s / dp.samples_per_s, 3),
        "simulated": len(ranked),
        "profiles": list(cache.notes),  # the cached entries used (age, conditions), or not used
    }
    if mixed:
        out.update(_mixed_keys(mixed, best, job, cost))
    sharded = _sharding(request.dp.zero, best.plan.dp.zero)
    print(
        f"{request.model}, batch {request.batch}, {request.devices} devices on {cost.cluster.name}"
        f"; {request.optimizer}: {cost.state_bytes} bytes of state per parameter{sharded}"
        f"{_trains(cost)}"
    )
    print(report.table(rows, cost.cluster.memory_bytes, mixed=mixed is not None))
    fits = "" if dp.fits else " (does not fit in memory)"
    print(
        f"best plan: {best.samples_per_s:.1f} samples/s predicted, "
        f"{out['speedup_over_data_parallel']:.2f}x pure data parallelism "
        f"({dp.samples_per_s:.1f} samples/s{fits}); {len(ranked)} plans simulated"
    )
    if mixed:
        print(
            f"{out['speedup_over_uniform']:.2f}x the plan chosen as if every device were alike "
            f"({mixed.uniform.samples_per_s:.1f} samples/s on these devices), "
            f"{out['speedup_over_weighted_data_parallel']:.2f}x data parallelism with "
            f"speed-weighted rows ({mixed.weighted_data_parallel.samples_per_s:.1f} samples/s); "
            "run a plan with: python main.py --plan plans.json[:i] (its run options and placement)"
        )
    if args.png:
        shown = evaluate(cost, best.plan, request.batch, timeline=True)
        shown = contended(cost, shown, request.batch) if mixed else shown
        title = f"{request.model} {rows[0]['shape']} x{best.plan.num_bundles}"
        report.draw(args.png, shown, rows, title)
    return out


def _extra(args: argparse.Namespace, data: dict[str, Any]) -> tuple[str, ...]:
    """main.py's arguments beside the plan's: the data, --model-args and what trains."""
    extra = ["--dataset", "synthetic", "--image-size", str(args.image_size)]
    extra += ["--num-classes", str(args.num_classes)]
    if data["dataset"] == "text":  # add --data-file FILE.txt
        extra = ["--dataset", "text", "--seq-len", str(args.seq_len)]
    if args.model == "digits_cnn":  # its own data set, main.py's default
        extra = []
    extra += ["--model-args", args.model_args] if args.model_args else []
    for flag, value in (("--lora", args.lora), ("--lora-train", args.lora_train)):
        extra += [flag, value] if value is not None else []
    return tuple(extra)


def _trains(cost) -> str:
    """What the header line says of a model that does not train whole (``--lora``)."""
    trained, params = cost.trained.sum(), cost.params.sum()
    if trained == params:
        return ""
    return f"; {trained:,.0f} of {params:,.0f} parameters train ({trained / params:.2%})"


def _sharding(asked: int, planned: int) -> str:
    """What the header line says of the state's sharding: as asked, or ``--zero 3`` chosen."""
    if planned == 3:
        why = "" if asked == 3 else "; no plan fits in device memory without it"
        return (
            ", parameters, gradients and state sharded over each stage's replicas, one block "
            f"gathered at a time (--zero 3{why})"
        )
    return ", sharded over each stage's replicas (--zero 1)" if planned else ""


def _mixed_keys(mixed, best, job: report.Job, cost) -> dict:
    """What a mixed cluster's plans add: the uniform-assumption plan and weighted data parallel."""
    return {
        "uniform_plan": report.row(mixed.uniform, job, cost),
        "speedup_over_uniform": round(best.samples_per_s / mixed.uniform.samples_per_s, 3),
        "data_parallel_weighted": report.row(mixed.weighted_data_parallel, job, cost),
        "speedup_over_weighted_data_parallel": round(
            best.samples_per_s / mixed.weighted_data_parallel.samples_per_s, 3
        ),
    }


def validate(args: argparse.Namespace) -> dict:
    import plan_validate

    spec = plan_validate.SMOKE if args.smoke else plan_validate.FULL
    if args.spread is not None:
        spec = replace(spec, spread=args.spread)
    if args.max_rounds is not None:
        spec = replace(spec, max_rounds=args.max_rounds)
    if args.measured:
        results, wall = plan_validate.load(json.loads(Path(args.measured).read_text())), 0.0
    else:
        results, wall = plan_validate.run(spec)
    out = plan_validate.predict(spec, results)
    out["wall_s"] = round(wall, 1)
    out["measurements"] = {str(world): ranks for world, ranks in results.items()}
    print(plan_validate.render(out))
    return out


def _number(value: Any) -> Any:
    """A numpy scalar (a count or size from the cost model) as the number it holds, for JSON."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not a JSON value")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        out = validate(args) if args.validate else plan(args)
    except BundleError as exc:
        print(f"plan.py: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=_number) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
