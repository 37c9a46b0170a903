"""Train every torchvision classification model for a few steps through ``main.py`` and say which
ones work: one JSON record per model (time taken, how it was cut, or the error line).

    python scripts/zoo_check.py --json zoo.json                  # every model, shape 2,1
    python scripts/zoo_check.py --models mobilenet_v3_small,vit_b_16 --shape 1,2,1

Each model runs at the smallest image side it takes that is at least ``--image-size`` (ViTs a
multiple of their patch, MaxViT 224, Inception 75 ...), on synthetic data with ``--num-classes``
classes, ``--steps`` steps of ``--batch-size`` rows in ``--micro-batches`` micro-batches, no
evaluation. A model that fails or passes ``--timeout`` seconds is recorded with the last line
the run printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torchvision

from bundle.launch.localworld import free_port
from bundle.models.vision import size_rule

MAIN = Path(__file__).resolve().parent.parent / "main.py"


def side_for(name: str, at_least: int) -> int:
    multiple, minimum = size_rule(name)
    side = max(at_least, minimum)
    return math.ceil(side / multiple) * multiple


def run_one(name: str, args: argparse.Namespace) -> dict:
    side = side_for(name, args.image_size)
    cmd = [
        sys.executable, str(MAIN), "--model", name, "--dataset", "synthetic",
        "--image-size", str(side), "--num-classes", str(args.num_classes),
        "--synthetic-size", str(4 * args.batch_size), "--batch-size", str(args.batch_size),
        "--micro-batches", str(args.micro_batches), "--itr", str(args.steps),
        "--bundle-shape", args.shape, "--no-eval", "--log-every", "1", "--timeout", "300",
        "--portNum", str(free_port()),
    ]  # fmt: skip
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        code, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as exc:
        code, out = None, f"timed out after {args.timeout}s " + str(exc.stdout or "")[-200:]
    seconds = round(time.perf_counter() - t0, 1)
    lines = [ln for ln in out.splitlines() if ln.strip() and "warn" not in ln.lower()]
    record: dict = {"model": name, "image_size": side, "ok": code == 0, "seconds": seconds}
    summary = next((ln for ln in reversed(lines) if ln.startswith("{")), None)
    if code == 0 and summary:
        record["final_loss"] = json.loads(summary).get("final_loss")
    else:
        failed = [ln for ln in lines if "failed" in ln or "Error" in ln or "error:" in ln]
        record["error"] = (failed or lines or ["(no output)"])[-1][-400:]
    return record


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", help="comma-separated names (default: every classification model)")
    p.add_argument("--shape", default="2,1")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", help="write the records here (one JSON list)")
    args = p.parse_args()
    names = (
        args.models.split(",")
        if args.models
        else torchvision.models.list_models(module=torchvision.models)
    )
    records = []
    for name in names:
        record = run_one(name, args)
        records.append(record)
        print(json.dumps(record), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(records, indent=1) + os.linesep)
    failed = [r["model"] for r in records if not r["ok"]]
    print(f"{len(records) - len(failed)} of {len(records)} trained; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
