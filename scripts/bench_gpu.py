"""One-stage, one-process Bundle on a GPU against a plain PyTorch training loop, in one run.

Both sides train the same model (same seed, so the same initial weights) on the same batches,
already resident on the device, with the same SGD optimizer: Bundle through its engine (shape
``1``, one bundle, one micro-batch: ``StageRunner.train_step``), the plain loop as
``loss.backward(); opt.step(); opt.zero_grad()``. Before timing, one step of each on the same
batch checks that both compute the same loss (the same work). Then the two alternate round by
round in ABBA order, so drifts of a shared machine hit both alike; a round is warm-up steps, then
timed steps between two device synchronisations. Throughput is images/s from the median round;
the ratio is Bundle / plain (above 1: Bundle faster).

    python scripts/bench_gpu.py --json bench_gpu.json        # ResNet-50, batch 64, 224x224, CUDA
    python scripts/bench_gpu.py --device cpu --model resnet18 --batch 2 --image 32 \\
        --rounds 1 --steps 1 --warmup 0                       # seconds: proves the script runs
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import models  # noqa: E402
from bundle.config import (  # noqa: E402
    DataConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)
from bundle.worker import build_session, make_topology  # noqa: E402

LR, MOMENTUM, SEED = 0.01, 0.9, 0
NUM_BATCHES = 2  # distinct device-resident batches, cycled through
LOSS_RTOL = 1e-3  # first-step losses must agree this closely (cuDNN picks kernels per run)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu (smoke only)")
    p.add_argument("--model", default="resnet50", choices=models.available())
    p.add_argument("--batch", type=int, default=64, help="images per step (default 64)")
    p.add_argument("--image", type=int, default=224, help="image side in pixels (default 224)")
    p.add_argument("--classes", type=int, default=1000, help="classes (default 1000)")
    p.add_argument("--rounds", type=int, default=6, help="ABBA rounds (default 6)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per case per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per case per round")
    p.add_argument("--json", metavar="PATH", help="write the report here")
    args = p.parse_args(argv)
    for flag in ("batch", "image", "classes", "rounds", "steps"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so wall time covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bundle_step(args: argparse.Namespace, device: torch.device) -> Callable:
    """Bundle's training step of a one-stage, one-process job; returns its loss tensor."""
    cfg = RunConfig(
        parallel=ParallelConfig(shape=(1,), num_bundles=1, micro_batches=1),
        model=ModelConfig(name=args.model),
        data=DataConfig(
            dataset="synthetic",
            image_size=args.image,
            num_classes=args.classes,
            synthetic_size=args.batch,
        ),
        train=TrainConfig(batch_size=args.batch, lr=LR, momentum=MOMENTUM, seed=SEED, eval=False),
    )
    runner = build_session(cfg, make_topology(cfg), 0, device).runner

    def step(i: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return runner.train_step(i, [(x, y)])

    return step


def plain_step(args: argparse.Namespace, device: torch.device) -> Callable:
    """The reference: the whole model, mean loss, backward, optimizer, gradients set to None."""
    torch.manual_seed(SEED)
    shape = (3, args.image, args.image)
    model = models.build(args.model, num_classes=args.classes, input_shape=shape).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    def step(i: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def measure(args: argparse.Namespace, device: torch.device) -> dict:
    """Build both, check they do the same work, time them in ABBA rounds."""
    gen = torch.Generator().manual_seed(SEED)
    batches = [
        (
            torch.randn(args.batch, 3, args.image, args.image, generator=gen).to(device),
            torch.randint(0, args.classes, (args.batch,), generator=gen).to(device),
        )
        for _ in range(NUM_BATCHES)
    ]
    cases = {"bundle": bundle_step(args, device), "plain": plain_step(args, device)}
    first = {name: float(step(0, *batches[0])) for name, step in cases.items()}
    step_s: dict[str, list[float]] = {name: [] for name in cases}
    peak_mib: dict[str, float] = {}
    order = list(cases)
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            step = cases[name]
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            for i in range(args.warmup):
                step(i, *batches[i % NUM_BATCHES])
            sync(device)
            start = time.perf_counter()
            for i in range(args.steps):
                step(i, *batches[i % NUM_BATCHES])
            sync(device)
            step_s[name].append((time.perf_counter() - start) / args.steps)
            if device.type == "cuda":
                peak_mib[name] = torch.cuda.max_memory_allocated(device) / 2**20
    images = {name: args.batch / statistics.median(t) for name, t in step_s.items()}
    return {
        "images_per_s": images,
        "ratio": images["bundle"] / images["plain"],
        "first_step_loss": first,
        "step_s": step_s,
        "peak_memory_mib": peak_mib,
    }


def machine(device: torch.device) -> dict:
    """What the numbers were taken on."""
    info = {"platform": platform.platform(), "torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        info.update(
            gpu=torch.cuda.get_device_name(device),
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
            tf32_cudnn=torch.backends.cudnn.allow_tf32,
        )
    return info


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; --device cpu runs the smoke", file=sys.stderr)
        return 2
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True  # both sides alike
    # Bundle's engine runs inside a process group; one process is a world of one.
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        device_id=device if backend == "nccl" else None,
    )
    try:
        result = measure(args, device)
    finally:
        dist.destroy_process_group()
    report = {
        "command": shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv])),
        "machine": machine(device),
        "model": args.model,
        "batch": args.batch,
        "image": args.image,
        "rounds": args.rounds,
        "steps": args.steps,
        **result,
    }
    img, loss = result["images_per_s"], result["first_step_loss"]
    where = report["machine"].get("gpu", "cpu")
    print(
        f"{args.model}, batch {args.batch}, {args.image}x{args.image}, {where}, "
        f"torch {torch.__version__}\n"
        f"first-step loss: bundle {loss['bundle']:.6f}, plain {loss['plain']:.6f}\n"
        f"images/s: bundle {img['bundle']:.1f}, plain {img['plain']:.1f}, "
        f"ratio {report['ratio']:.3f} (median of {args.rounds} rounds x {args.steps} steps)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if abs(loss["bundle"] - loss["plain"]) > LOSS_RTOL * abs(loss["plain"]):
        print(
            "bench_gpu: the two sides computed different losses: not the same work", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
