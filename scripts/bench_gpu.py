"""One-stage, one-process Bundle on a GPU against a plain PyTorch training loop, in one run.

Both sides train the same model (same seed, so the same initial weights) on the same batches,
already resident on the device, with the same SGD optimizer: Bundle through its engine (shape
``1``, one bundle, one micro-batch: ``StageEngine.train_step``), the plain loop as
``loss.backward(); opt.step(); opt.zero_grad()``. Before timing, one step of each on the same
batch checks that both compute the same loss (the same work). Then the two alternate round by
round in ABBA order, so drifts of a shared machine hit both alike; a round is warm-up steps, then
timed steps between two device synchronisations. Throughput is images/s from the median round;
the ratio is Bundle / plain (above 1: Bundle faster).

Both sides compute alike: ``--precision bf16|fp16`` is Bundle's ``--precision`` against
``torch.autocast`` with that dtype (fp16 with ``torch.amp.GradScaler``), ``--channels-last`` puts
model and batches in channels-last on both sides, and TF32 (on unless ``--no-tf32``) is set once
for the process, which both share. The report places Bundle's images/s next to NVIDIA's published
single-A100 figures for ResNet-50 v1.5 and checks the ratio against its 0.97 target.

    python scripts/bench_gpu.py --json bench_gpu.json        # ResNet-50, batch 64, 224x224, CUDA
    python scripts/bench_gpu.py --precision bf16 --channels-last --batch 256 --json bench_gpu.json
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

from bundle import models
from bundle.config import (
    PRECISIONS,
    ComputeConfig,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)
from bundle.session import build_session
from bundle.topology import Topology

LR, MOMENTUM, SEED = 0.01, 0.9, 0
NUM_BATCHES = 2  # distinct device-resident batches, cycled through
# First-step losses must agree this closely (cuDNN picks kernels per run, and in 16 bits two
# kernels' roundings differ more than in fp32).
LOSS_RTOL = {"fp32": 1e-3, "bf16": 1e-2, "fp16": 1e-2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TARGET_RATIO = 0.97  # Bundle / plain
# NVIDIA DeepLearningExamples, PyTorch ResNet50 v1.5 README, "Training performance: NVIDIA DGX
# A100 (8x A100 80GB)", 1 GPU, pytorch-21.03 NGC container, batch 256, real ImageNet through
# DALI: mixed precision (fp16 AMP) in NHWC, and TF32.
NVIDIA_A100 = {
    "source": "NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5, "
    "1x A100 80GB, batch 256",
    "mixed_precision_channels_last": 2470.0,
    "tf32": 938.0,
}


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
    p.add_argument(
        "--precision",
        default="fp32",
        choices=PRECISIONS,
        help="compute dtype of both sides: autocast with fp32 weights (default fp32)",
    )
    p.add_argument(
        "--channels-last", action="store_true", help="model and batches in channels-last, both"
    )
    p.add_argument(
        "--no-tf32", action="store_true", help="CUDA fp32 matmuls and convolutions in IEEE fp32"
    )
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


def set_tf32(enabled: bool) -> None:
    """TF32 for CUDA fp32 matmuls and convolutions, for the whole process (so for both sides)."""
    mode = "tf32" if enabled else "ieee"
    torch.backends.cuda.matmul.fp32_precision = mode
    torch.backends.cudnn.conv.fp32_precision = mode


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
        compute=ComputeConfig(
            precision=args.precision, channels_last=args.channels_last, tf32=not args.no_tf32
        ),
    )
    runner = build_session(cfg, Topology.from_config(cfg), 0, device).engine

    def step(i: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return runner.train_step(i, [(x, y)])

    return step


def plain_step(args: argparse.Namespace, device: torch.device) -> Callable:
    """The reference: the whole model, mean loss, backward, optimizer, gradients set to None;
    the usual PyTorch recipe for the precision (autocast; fp16 adds a GradScaler) and layout."""
    torch.manual_seed(SEED)
    shape = (3, args.image, args.image)
    model = models.build(args.model, num_classes=args.classes, input_shape=shape).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    mixed = args.precision != "fp32"
    scaler = torch.amp.GradScaler(device.type) if args.precision == "fp16" else None

    def step(i: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=DTYPES[args.precision], enabled=mixed):
            loss = F.cross_entropy(model(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def measure(args: argparse.Namespace, device: torch.device) -> dict:
    """Build both, check they do the same work, time them in ABBA rounds."""
    gen = torch.Generator().manual_seed(SEED)
    layout = torch.channels_last if args.channels_last else torch.contiguous_format
    batches = [
        (
            torch.randn(args.batch, 3, args.image, args.image, generator=gen).to(
                device, memory_format=layout
            ),
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
    ratio = images["bundle"] / images["plain"]
    return {
        "images_per_s": images,
        "ratio": ratio,
        "target_ratio": TARGET_RATIO,
        "meets_target": grade(ratio, device),
        "first_step_loss": first,
        "step_s": step_s,
        "peak_memory_mib": peak_mib,
    }


GRADES = {True: "met", False: "NOT met", None: "not graded: a smoke on the CPU"}


def grade(ratio: float, device: torch.device) -> bool | None:
    """Whether the ratio meets the target: on a GPU only (a CPU run is a smoke of a few steps
    whose ratio is noise, so it is not graded: None)."""
    return ratio >= TARGET_RATIO if device.type == "cuda" else None


def machine(device: torch.device) -> dict:
    """What the numbers were taken on."""
    info = {"platform": platform.platform(), "torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        info.update(
            gpu=torch.cuda.get_device_name(device),
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            # The fp32_precision API only: reading allow_tf32 after it was used raises.
            fp32_matmul=torch.backends.cuda.matmul.fp32_precision,
            fp32_conv=torch.backends.cudnn.conv.fp32_precision,
        )
    return info


def against_nvidia(args: argparse.Namespace, bundle_images: float) -> dict:
    """Bundle's images/s next to NVIDIA's single-A100 ResNet-50 figure for the same precision.

    ``same_settings``: ResNet-50 at 224x224, batch 256, 16-bit precision in channels-last (or
    TF32), as NVIDIA ran it; even then NVIDIA's run also decoded and augmented real images (DALI),
    which this one does not, so the comparison favours this script.
    """
    key = "tf32" if args.precision == "fp32" else "mixed_precision_channels_last"
    same = (
        args.model == "resnet50"
        and args.image == 224
        and args.batch == 256
        and (not args.no_tf32 if key == "tf32" else args.channels_last)
    )
    return {
        **NVIDIA_A100,
        "compared_with": key,
        "same_settings": same,
        "bundle_over_reference": bundle_images / NVIDIA_A100[key],
    }


def with_index(device: torch.device) -> torch.device:
    """``cuda`` as ``cuda:<current index>``: ``torch.cuda.set_device`` and
    ``init_process_group(device_id=...)`` both refuse a CUDA device without an index."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; --device cpu runs the smoke", file=sys.stderr)
        return 2
    if device.type == "cuda":
        device = with_index(device)
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True  # both sides alike
        # Both sides alike; Bundle's engine sets the same again from its config.
        set_tf32(not args.no_tf32)
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
        "precision": args.precision,
        "channels_last": args.channels_last,
        "tf32": not args.no_tf32 and device.type == "cuda",
        **result,
    }
    img, loss = result["images_per_s"], result["first_step_loss"]
    ref = report["nvidia_a100"] = against_nvidia(args, img["bundle"])
    where = report["machine"].get("gpu", "cpu")
    settings = [args.precision] + ["channels-last"] * args.channels_last
    if device.type == "cuda":
        settings.append("TF32" if report["tf32"] else "no TF32")
    print(
        f"{args.model}, batch {args.batch}, {args.image}x{args.image}, {', '.join(settings)}, "
        f"{where}, torch {torch.__version__}\n"
        f"first-step loss: bundle {loss['bundle']:.6f}, plain {loss['plain']:.6f}\n"
        f"images/s: bundle {img['bundle']:.1f}, plain {img['plain']:.1f}, "
        f"ratio {report['ratio']:.3f} (target >= {TARGET_RATIO}: "
        f"{GRADES[report['meets_target']]}; "
        f"median of {args.rounds} rounds x {args.steps} steps)"
    )
    if device.type == "cuda":
        figure = {"tf32": "TF32", "mixed_precision_channels_last": "mixed-precision"}
        caveat = "" if ref["same_settings"] else " (model, size or settings differ from NVIDIA's)"
        print(
            f"NVIDIA's A100 reference, ResNet-50 v1.5, batch 256: mixed precision + channels-last "
            f"{NVIDIA_A100['mixed_precision_channels_last']:,.0f} images/s, TF32 "
            f"{NVIDIA_A100['tf32']:,.0f} images/s; Bundle here {img['bundle']:,.0f} images/s = "
            f"{ref['bundle_over_reference']:.2f} x the {figure[ref['compared_with']]} figure{caveat}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if abs(loss["bundle"] - loss["plain"]) > LOSS_RTOL[args.precision] * abs(loss["plain"]):
        print(
            "bench_gpu: the two sides computed different losses: not the same work", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
