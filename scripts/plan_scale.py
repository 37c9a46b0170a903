"""How long the planner takes to answer, against the number of GPUs and against the model's depth.

    python scripts/plan_scale.py --json plan-scale.json      # ResNet-50, 2 .. 1,024 H100s
    python scripts/plan_scale.py --gpus 16,64 --depths 12,24 # fewer points

Each GPU count is planned once, in this process, as ``scripts/plan.py`` plans it: the shipped
``clusters/h100_2x8_ib.yaml`` widened to the count (8 GPUs a node; below 8, one node of them),
ResNet-50 at ``--batch-size`` (default 4096). The clock covers the search alone (split points,
widths, micro-batches, then the simulation of the best plans); the cost model, counted from
FLOPs and bytes on the meta device, is built before it starts. The depth sweep plans a GPT of
width 2048 (16 heads, 2048 tokens, bf16) with each number of layers on ``--depth-gpus`` GPUs.
``--json`` writes ``seconds_by_gpus``, ``seconds_by_depth``, each best plan and the conditions
(load average, CPUs, CPU share) the times were taken under; a machine busier than its cores is
named on stderr, as its times are not the planner's own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import plan as plan_cli  # scripts/plan.py: the same cluster and request as a user's run
import torch

from bundle.plan import planner
from bundle.plan import profile as prof
from bundle.plan.cluster import counted, load_cluster
from bundle.plan.conditions import Watch

CLUSTER = str(Path(__file__).resolve().parent.parent / "clusters" / "h100_2x8_ib.yaml")
GPUS = (2, 8, 16, 64, 256, 1024)
DEPTHS = (6, 12, 24, 48)
PER_NODE = 8


def _args(model: list[str], gpus: int, batch: int) -> argparse.Namespace:
    nodes, per_node = (1, gpus) if gpus < PER_NODE else (gpus // PER_NODE, PER_NODE)
    argv = [*model, "--cluster", CLUSTER, "--batch-size", str(batch)]
    argv += ["--nodes", str(nodes), "--gpus-per-node", str(per_node)]
    return plan_cli.parse_args(argv)


def timed(model: list[str], gpus: int, batch: int) -> dict:
    """One plan: the search's seconds and its best plan."""
    args = _args(model, gpus, batch)
    cluster, _ = counted(load_cluster(args.cluster), args.nodes, args.gpus_per_node)
    request = plan_cli._request(args, cluster)
    cost = planner.cost_model(request, cluster=cluster, cache=prof.ProfileCache(None))
    start = time.perf_counter()
    ranked = planner.plan(request, cost)
    seconds = time.perf_counter() - start
    best = ranked[0]
    return {
        "seconds": round(seconds, 2),
        "plans_simulated": len(ranked),
        "best": {
            "shape": list(best.plan.shape),
            "num_bundles": best.plan.num_bundles,
            "micro_batches": best.plan.micro_batches,
            "samples_per_s": round(best.samples_per_s, 1),
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="plan_scale.py", description=__doc__.splitlines()[0])
    p.add_argument("--gpus", default=",".join(map(str, GPUS)), help="GPU counts, comma-separated")
    p.add_argument("--depths", default=",".join(map(str, DEPTHS)), help="GPT layer counts")
    p.add_argument("--depth-gpus", type=int, default=64, help="GPUs the depth sweep plans for")
    p.add_argument("--batch-size", type=int, default=4096, help="ResNet-50's global batch")
    p.add_argument("--json", metavar="OUT", help="write the times and plans here")
    args = p.parse_args(argv)
    out: dict = {"cluster": "clusters/h100_2x8_ib.yaml", "gpus_per_node": PER_NODE}
    out["batch"] = args.batch_size
    with Watch() as watch:
        by_gpus = {}
        for gpus in [int(g) for g in args.gpus.split(",") if g]:
            by_gpus[gpus] = timed(["--model", "resnet50"], gpus, args.batch_size)
            print(f"resnet50 on {gpus:5d} GPUs: {by_gpus[gpus]['seconds']:7.2f} s", flush=True)
        by_depth = {}
        for layers in [int(d) for d in args.depths.split(",") if d]:
            gpt = ["--model", "gpt", "--model-args", f"layers={layers},width=2048,heads=16"]
            gpt += ["--seq-len", "2048", "--precision", "bf16"]
            by_depth[layers] = timed(gpt, args.depth_gpus, 1024)
            print(
                f"gpt of {layers:3d} layers on {args.depth_gpus} GPUs: "
                f"{by_depth[layers]['seconds']:7.2f} s",
                flush=True,
            )
    conditions = watch.conditions("cpu", torch.get_num_threads(), torch.__version__)
    if (trouble := conditions.trouble()) is not None:
        print(f"plan_scale.py: the times are not the planner's own: {trouble}", file=sys.stderr)
    out["seconds_by_gpus"] = {str(g): r["seconds"] for g, r in by_gpus.items()}
    out["seconds_by_depth"] = {str(d): r["seconds"] for d, r in by_depth.items()}
    out["plans_by_gpus"] = {str(g): r for g, r in by_gpus.items()}
    out["plans_by_depth"] = {str(d): r for d, r in by_depth.items()}
    out["depth_gpus"] = args.depth_gpus
    out["conditions"] = conditions.to_json()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
