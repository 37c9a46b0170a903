"""Any model, measured: the GPT model through Bundle's pipeline against one process, and how long
cutting a large model into stages takes.

    python scripts/bench_models.py --gpt           # GPT, shape 1,1, M=4 vs one process
    python scripts/bench_models.py --cut           # build + trace + cut of large models
    python scripts/bench_models.py --gpt --cut --json out.json

``--gpt``: two gloo processes on loopback run Bundle at shape 1,1 with 1F1B and M=4 micro-batches
on a GPT (``--gpt-args``) over byte-level text (this Python's own source), AdamW; rank 0 also
trains the unsplit model on the same global batches as one process, once with one thread (as
each Bundle process has) and once with two (the cores the pipeline uses). The three run
interleaved step by step (the order reversed every round) so that they meet the same moment of
a shared machine; samples/s is global batch / median step time, and each ratio is the median of
the per-round ratios.

``--cut``: for each model, the seconds to build it (random weights), to cut it into blocks
(``models.blocks``: a trace and a probe run for a graph split) and into two stages, and the
seconds of a graph split of it even where it has blocks of its own (ResNets).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from bundle import data, models
from bundle.config import DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from bundle.engine.optim import make_optimizer
from bundle.engine.stage import split_model
from bundle.launch.localworld import run_world
from bundle.models.partition import auto_starts
from bundle.session import build_session, make_loss, train_stream
from bundle.topology import Topology

CUT_MODELS = {
    "resnet152": (3, 224, 224),
    "vit_b_16": (3, 224, 224),
    "vit_l_16": (3, 224, 224),
    "convnext_large": (3, 224, 224),
    "efficientnet_b7": (3, 224, 224),
    "densenet201": (3, 224, 224),
    "swin_b": (3, 224, 224),
}


def cut_times(names: list[str]) -> list[dict]:
    out = []
    for name in names:
        shape = CUT_MODELS.get(name, (3, 224, 224))
        torch.manual_seed(0)
        t0 = time.perf_counter()
        model = models.build(name, num_classes=1000, input_shape=shape)
        t1 = time.perf_counter()
        blocks = models.blocks(model, shape)
        t2 = time.perf_counter()
        stages = split_model(blocks, auto_starts(blocks, 2))
        t3 = time.perf_counter()
        # The graph split, also for a model with blocks of its own (ResNet, VGG): trace + probe.
        graph_blocks = models.graph.blocks(model, models.example_input(model, shape, rows=3))
        t4 = time.perf_counter()
        record = {
            "model": name,
            "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
            "blocks": len(blocks),
            "graph_split": isinstance(blocks[0][1], models.graph.Segment),
            "build_s": round(t1 - t0, 2),
            "blocks_s": round(t2 - t1, 2),
            "split_s": round(t3 - t2, 3),
            "graph_blocks": len(graph_blocks),
            "graph_split_s": round(t4 - t3, 2),
            "second_stage_starts": stages[1].names[0],
        }
        print(json.dumps(record), flush=True)
        out.append(record)
    return out


def gpt_config(text: str, args: str, batch: int, micro: int, seq_len: int) -> RunConfig:
    return RunConfig(
        parallel=ParallelConfig(shape=(1, 1), micro_batches=micro),
        model=ModelConfig(name="gpt", args=args),
        data=DataConfig(dataset="text", data_file=text, seq_len=seq_len),
        train=TrainConfig(batch_size=batch, steps=1000, optimizer="adamw", lr=1e-3, eval=False),
    )


def _gpt_world(rank: int, world: int, cfg, rounds: int, steps: int) -> dict | None:
    torch.set_num_threads(1)
    topo = Topology.from_config(cfg)
    session = build_session(cfg, topo, rank, torch.device("cpu"))
    stream = train_stream(session, topo, cfg.train.seed, 1000, 0)
    batches = [next(stream) for _ in range(steps)]
    single = None
    if rank == 0:
        splits = data.load(cfg.data, cfg.train.seed)
        torch.manual_seed(cfg.train.seed)
        model = models.build_model(cfg.model, splits.num_classes, splits.input_shape)
        opt, loss_fn = make_optimizer(cfg.train, model), make_loss(cfg)
        x, y = splits.train.tensors
        whole = [
            (x[ix], y[ix])
            for ix in (
                data.global_batch(len(y), cfg.train.batch_size, cfg.train.seed, t)
                for t in range(steps)
            )
        ]

        def single(i: int) -> None:
            xb, yb = whole[i % steps]
            opt.zero_grad()
            loss_fn(model(xb), yb).backward()
            opt.step()

    times: dict[str, list[float]] = {"bundle": [], "one_1t": [], "one_2t": []}
    barrier = torch.distributed.barrier
    for r in range(rounds + 1):
        order = ["bundle", "one_1t", "one_2t"]
        if r % 2:
            order.reverse()
        for case in order:
            for i in range(steps):
                barrier()
                t0 = time.perf_counter()
                if case == "bundle":
                    session.engine.train_step(i, batches[i])
                elif rank == 0 and single is not None:
                    torch.set_num_threads(1 if case == "one_1t" else 2)
                    single(i)
                    torch.set_num_threads(1)
                if r:  # the first round warms up
                    times[case].append(time.perf_counter() - t0)
    return times if rank == 0 else None


def gpt_bench(args: argparse.Namespace) -> dict:
    text = str(Path(os.__file__))  # any UTF-8 file: this Python's os.py
    cfg = gpt_config(text, args.gpt_args, args.batch, args.micro, args.seq_len)
    times = run_world(2, _gpt_world, cfg, args.rounds, args.steps)[0]
    per_round = args.steps
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = {}
    for other in ("one_1t", "one_2t"):
        pairs = [
            statistics.median(times[other][i : i + per_round])
            / statistics.median(times["bundle"][i : i + per_round])
            for i in range(0, len(times["bundle"]), per_round)
        ]
        ratios[f"bundle_vs_{other}"] = round(statistics.median(pairs), 3)
    report = {
        "model": f"gpt {args.gpt_args}",
        "seq_len": args.seq_len,
        "batch": args.batch,
        "micro_batches": args.micro,
        "samples_per_s": {k: round(args.batch / v, 1) for k, v in med.items()},
        "throughput_ratios": ratios,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
    }
    print(json.dumps(report), flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gpt", action="store_true", help="GPT at 1,1 M=4 against one process")
    p.add_argument("--cut", action="store_true", help="time building and cutting large models")
    p.add_argument("--cut-models", default=",".join(CUT_MODELS))
    p.add_argument("--gpt-args", default="layers=6,width=256,heads=8")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="timed steps per case per round")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if not (args.gpt or args.cut):
        p.error("give --gpt, --cut or both")
    report: dict = {}
    if args.cut:
        report["cut"] = cut_times(args.cut_models.split(","))
    if args.gpt:
        report["gpt"] = gpt_bench(args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
