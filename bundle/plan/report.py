"""What the planner tells a user: a ranked table, its JSON, the main.py command of each plan, and
a picture of the best plan's simulated step beside the throughput of the top plans."""

from __future__ import annotations

import math
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from bundle.config import TrainConfig
from bundle.plan.cost import CostModel
from bundle.plan.plans import Evaluated, Plan
from bundle.plan.simulate import COMPUTE, OPTIMIZER, SEND, SYNC, WAIT
from bundle.row_weights import format_row_weights

_GIB = 2**30


@dataclass(frozen=True)
class Job:
    """What the plans are for: everything of the main.py command that is not the plan."""

    model: str
    batch: int
    nodes: int
    precision: str = "fp32"
    recompute: str = "never"
    optimizer: str = TrainConfig.optimizer  # the optimizer whose state the plans hold
    momentum: float = TrainConfig.momentum
    extra: tuple[str, ...] = ()  # more main.py arguments, as given (data set, image size)
    # The data the plans are for: main.py's data options (YAML keys), "input_shape" and
    # "num_classes"; each plan row carries it, and main.py --plan runs on it (bundle.plan_file).
    data: Mapping[str, Any] = field(default_factory=dict)


def split_names(plan: Plan, cost: CostModel) -> list[str]:
    names = cost.anatomy.names
    return [names[i] for i in plan.starts]


def degrees(plan: Plan) -> str:
    """The ``--tensor-parallel`` spelling: one degree where the stages share it, else one each."""
    ts = plan.degrees
    return str(ts[0]) if len(set(ts)) == 1 else ",".join(map(str, ts))


def weights(plan: Plan) -> str:
    """The plan's ``--row-weights`` ("" : even rows)."""
    return format_row_weights(plan.row_weights) if plan.row_weights else ""


def places(plan: Plan, cost: CostModel) -> list[dict[str, Any]]:
    """Where each rank runs, in bundle-major rank order (nodes filled in order without one)."""
    out = []
    for r in range(plan.processes):
        if plan.placement:
            p = plan.placement[r]
            node, device, kind, cpu = p.node, p.device, p.kind, p.cpu
        else:
            (node, device), kind, cpu = divmod(r, plan.procs_per_node), "", None
        kind = kind or cost.cluster.device_name
        out.append({"node": node, "device": device, "type": kind, "cpu": cpu})
    return out


def run_options(plan: Plan, job: Job, cost: CostModel) -> dict[str, Any]:
    """The plan as main.py's ``--config`` keys (what ``main.py --plan`` reads)."""
    run: dict[str, Any] = {
        # The model and batch the plan was made for: another given with --plan is refused.
        "model": job.model,
        "batch_size": job.batch,
        "bundle_shape": ",".join(map(str, plan.shape)),
        "num_bundle": plan.num_bundles,
        "micro_batches": plan.micro_batches,
        "schedule": plan.schedule,
        "grad_sync": plan.grad_sync,
        "row_weights": weights(plan),
        "nproc_per_node": plan.procs_per_node,
        "num_nodes": -(-plan.processes // plan.procs_per_node),
    }
    given = dict(zip(job.extra[::2], job.extra[1::2], strict=True))
    for flag in ("--model-args", "--lora", "--lora-train"):
        if flag in given:
            run[flag[2:].replace("-", "_")] = given[flag]
    if plan.chunks > 1:
        run["virtual_stages"] = plan.chunks
    if plan.tp:
        run["tensor_parallel"] = degrees(plan)
    if len(plan.shape) > 1:
        run["partition"] = ",".join(split_names(plan, cost))
    flags = plan.dp.flags()
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        run[flag[2:].replace("-", "_")] = int(value) if value.isdigit() else value
    if job.precision != "fp32":
        run["precision"] = job.precision
    if job.recompute != "never":
        run["recompute"] = job.recompute
    if job.optimizer != TrainConfig.optimizer:
        run["optimizer"] = job.optimizer
    if job.momentum != TrainConfig.momentum:
        run["momentum"] = job.momentum
    return run


def _train_flags(job: Job) -> list[str]:
    """``--optimizer`` and ``--momentum`` where not the trainer's defaults (``--zero`` is one of
    the plan's data-parallel options)."""
    out = ["--optimizer", job.optimizer] if job.optimizer != TrainConfig.optimizer else []
    return out + (
        ["--momentum", f"{job.momentum:g}"] if job.momentum != TrainConfig.momentum else []
    )


def command(plan: Plan, job: Job, cost: CostModel) -> str:
    """The main.py command that runs ``plan`` (one per node: add --rank and --IP on each; a plan
    placed on mixed devices runs with ``--plan plans.json:i``, which also carries the placement)."""
    args = ["python", "main.py", "--model", job.model, "--batch-size", str(job.batch)]
    args += [
        "--bundle-shape",
        ",".join(map(str, plan.shape)),
        "--num-bundle",
        str(plan.num_bundles),
    ]
    if plan.tp:
        args += ["--tensor-parallel", degrees(plan)]
    if len(plan.shape) > 1:
        args += ["--partition", ",".join(split_names(plan, cost))]
    if plan.row_weights:
        args += ["--row-weights", weights(plan)]
    args += ["--micro-batches", str(plan.micro_batches), "--schedule", plan.schedule]
    if plan.chunks > 1:
        args += ["--virtual-stages", str(plan.chunks)]
    args += ["--grad-sync", plan.grad_sync, *plan.dp.flags()]
    if job.nodes > 1:
        args += ["--world-size", str(job.nodes), "--nproc-per-node", str(plan.procs_per_node)]
    if job.precision != "fp32":
        args += ["--precision", job.precision]
    if job.recompute != "never":
        args += ["--recompute", job.recompute]
    args += _train_flags(job)
    return shlex.join([*args, *job.extra])


def distinct(ranked: list[Evaluated]) -> list[Evaluated]:
    """The best plan of each kind, best first: plans alike in everything but how the devices
    are shared among the stages (410,350,164,100 and 410,350,166,98) are one alternative."""
    seen: set[tuple[int, ...] | tuple[object, ...]] = set()
    out = []
    for e in ranked:
        p = e.plan
        kind: tuple[object, ...] = (len(p.shape), p.num_bundles, p.micro_batches, p.schedule)
        kind += (p.grad_sync, p.chunks, p.tp)
        if kind not in seen:
            seen.add(kind)
            out.append(e)
    return out


def row(e: Evaluated, job: Job, cost: CostModel) -> dict[str, Any]:
    """One plan as plain JSON types."""
    p = e.plan
    return {
        "shape": list(p.shape),
        "num_bundles": p.num_bundles,
        "processes": p.processes,
        "tensor_parallel": list(p.degrees),
        "split": split_names(p, cost),
        "micro_batches": p.micro_batches,
        "schedule": p.schedule,
        "virtual_stages": p.chunks,
        "grad_sync": p.grad_sync,
        "predicted_samples_per_s": round(e.samples_per_s, 2),
        "step_s": e.sim.step_time,
        "stage_compute_s": e.stage_compute,
        "bubble": round(e.sim.bubble, 4),
        "grad_sync_s": max(e.sim.sync),
        "memory_bytes": [
            {
                "params": m.params,
                "grads": m.grads,
                "optimizer": m.optimizer,
                "ddp_buckets": m.buckets,
                "activations": m.activations,
                "buffers": m.buffers,
                # Only where the options keep any: the default plans' JSON stays as it was.
                **({"data_parallel": m.data_parallel} if m.data_parallel else {}),
                **({"gathered": m.gathered} if m.gathered else {}),  # --zero 3's block
                "total": m.total,
            }
            for m in e.memory
        ],
        "fits": e.fits,
        "command": command(p, job, cost),
        "row_weights": weights(p),
        "placement": places(p, cost),
        "run": run_options(p, job, cost),
        **({"data": dict(job.data)} if job.data else {}),
    }


def stage_devices(r: dict[str, Any]) -> str:
    """Which device types serve which stage (bundle 0), e.g. ``stage 0: 8 A100; stage 1: 8 V100``."""
    out, rank = [], 0
    for s, width in enumerate(r["shape"]):
        kinds: dict[str, int] = {}
        for p in r["placement"][rank : rank + width]:
            kinds[p["type"]] = kinds.get(p["type"], 0) + 1
        nodes = sorted({p["node"] for p in r["placement"][rank : rank + width]})
        where = f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {','.join(map(str, nodes))}"
        out.append(
            f"stage {s}: " + " + ".join(f"{n} {k}" for k, n in kinds.items()) + f" ({where})"
        )
        rank += width
    return "; ".join(out)


def _ms(values: Iterable[float]) -> str:
    return "/".join(f"{v * 1e3:.1f}" for v in values)


def _tp(r: dict[str, Any]) -> str:
    """A row's tensor-parallel degrees per stage (``2,1``)."""
    return ",".join(map(str, r.get("tensor_parallel") or [1] * len(r["shape"])))


def _schedule(r: dict[str, Any]) -> str:
    """A row's schedule, with its model chunks per stage where it runs several (``x2``)."""
    chunks = r.get("virtual_stages", 1)
    return str(r["schedule"]) + (f" x{chunks}" if chunks > 1 else "")


def table(rows: list[dict[str, Any]], device_memory: float, *, mixed: bool = False) -> str:
    """The ranked plans as text, one line each, then each plan's command; ``mixed``: under each
    plan its row weights (where not even) and which device types serve which stage."""
    sw = max([5, *(len(_schedule(r)) for r in rows)])
    # The tp column only where a plan splits a stage: other tables read as they did.
    tw = max((len(_tp(r)) for r in rows if max(r.get("tensor_parallel", [1])) > 1), default=0)
    tp_head = f"{'tp':<{max(tw, 2)}} " if tw else ""
    head = (
        f"{'#':>2} {'shape':<12} {tp_head}{'b':>2} {'M':>3} {'sched':<{sw}} {'sync':<5} {'samples/s':>10} "
        f"{'stage ms':<16} {'bubble':>6} {'sync ms':>7} {'GiB/dev':>8} {'opt GiB':>7}  split"
    )
    lines = [head]
    for i, r in enumerate(rows, 1):
        # The device holding the most, and how much of it is the optimizer's state.
        most = max(r["memory_bytes"], key=lambda m: m["total"])
        mem, opt = most["total"] / _GIB, most["optimizer"] / _GIB
        fit = "" if r["fits"] else " (does not fit)"
        lines.append(
            f"{i:>2} {','.join(map(str, r['shape'])):<12} "
            + (f"{_tp(r):<{max(tw, 2)}} " if tw else "")
            + f"{r['num_bundles']:>2} "
            f"{r['micro_batches']:>3} {_schedule(r):<{sw}} {r['grad_sync'][:5]:<5} "
            f"{r['predicted_samples_per_s']:>10.1f} {_ms(r['stage_compute_s']):<16} "
            f"{r['bubble']:>6.1%} {r['grad_sync_s'] * 1e3:>7.1f} {mem:>8.2f} {opt:>7.2f}  "
            f"{','.join(r['split'])}{fit}"
        )
        if mixed:
            rw = f"row weights {r['row_weights']}; " if r["row_weights"] else "even rows; "
            lines.append(f"{'':>3}{rw}{stage_devices(r)}")
    if math.isfinite(device_memory):
        lines.append(f"device memory {device_memory / _GIB:.1f} GiB")
    else:  # a nominal device: no capacity to check plans against
        lines.append("device memory unknown: every plan counted as fitting (--cluster gives it)")
    lines += [f"{i:>2} {r['command']}" for i, r in enumerate(rows, 1)]
    return "\n".join(lines)


_COLOURS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    SEND: "#55A868",
    WAIT: "#DDDDDD",
    SYNC: "#C44E52",
    OPTIMIZER: "#8172B3",
}


def draw(path: str, best: Evaluated, rows: list[dict[str, Any]], title: str) -> None:
    """The best plan's simulated step (one row per process of bundle 0) beside the top plans."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, (ax, bars) = plt.subplots(1, 2, figsize=(14, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    ranks = sorted(set(best.sim.ranks))
    for span in best.sim.timeline:
        kind = span.kind
        if kind == COMPUTE:
            kind = "forward" if span.label.startswith("F") else "backward"
        # Transfers run beside the work: a thin bar under the row.
        band = (
            (ranks.index(span.rank) + 0.25, 0.15)
            if kind == SEND
            else (ranks.index(span.rank) - 0.4, 0.6)
        )
        ax.broken_barh(
            [(span.start * 1e3, (span.end - span.start) * 1e3)], band, facecolors=_COLOURS[kind]
        )
    stage_of = dict(zip(best.sim.ranks, best.sim.stage_of, strict=True))
    place = best.plan.placement
    ax.set_yticks(
        range(len(ranks)),
        [f"rank {r} (stage {stage_of[r]}{', ' + place[r].kind if place else ''})" for r in ranks],
    )
    ax.invert_yaxis()
    ax.set_xlabel("ms (simulated)")
    ax.set_title(f"best plan: {title}")
    ax.legend(
        handles=[Patch(color=c, label=k) for k, c in _COLOURS.items()],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.15),
        ncol=6,
        fontsize=8,
    )
    labels = [
        f"{','.join(map(str, r['shape']))} x{r['num_bundles']} M={r['micro_batches']} "
        f"{r['schedule']} {r['grad_sync'][:4]}"
        for r in rows
    ]
    values = [r["predicted_samples_per_s"] for r in rows]
    colours = ["#4C72B0" if r["fits"] else "#BBBBBB" for r in rows]
    bars.barh(range(len(rows)), values, color=colours)
    bars.set_yticks(range(len(rows)), labels, fontsize=7)
    bars.invert_yaxis()
    bars.set_xlabel("predicted samples/s")
    bars.set_title("top plans (grey: does not fit in memory)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
