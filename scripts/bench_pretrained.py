"""Peak memory of one process loading ``--pretrained`` weights: one stage of the model vs all of it.

    python scripts/bench_pretrained.py                       # GPT-2, 6 layers x 768, 4 stages
    python scripts/bench_pretrained.py --layers 12 --stages 4 --json out.json

A GPT-2 (tied embeddings, vocabulary 50257) is built from its config with random weights and
saved sharded (``save_pretrained``, ``--shard-mb``) in a temporary directory. The cut into
``--stages`` stages is captured once, on the meta device, as the launch's checks make it. Then
each measurement runs in a fresh process: the whole model loaded (shape 1), and each stage of the
cut loaded alone (``build_stages(..., keep={k})``, what one process of a pipeline keeps). A
process's peak resident memory (``VmHWM``, its peak started again from the resident memory just
before loading) is read after loading; its cost is that peak less the resident memory before
loading (the interpreter, torch and transformers imported, and a
tiny model built, so that the library pages every load maps once are not counted). Each
ratio is one stage's cost over the whole model's, beside the stage's share of the parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _reset_peak() -> None:
    """Start the peak (VmHWM) again from the resident memory now (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _config(directory: str, text: str, seq: int):
    from bundle.config import DataConfig, ModelConfig, RunConfig

    return RunConfig(
        model=ModelConfig(pretrained=directory),
        data=DataConfig(dataset="text", data_file=text, seq_len=seq),
    )


def _warm_up() -> None:
    """What every load pays once, whatever its size, before the baseline is read: the code of
    the ops and of the model's module (first use maps ~150 MB of library pages), a tiny build."""
    import torch
    import transformers

    from bundle.models import pretrained

    with pretrained.parameters_on_meta():
        tiny = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(n_layer=1, n_embd=64, n_head=1, vocab_size=64)
        )
    torch.empty(8, device="meta").normal_()
    torch.empty(8).normal_().clone().copy_(torch.zeros(8))
    del tiny


def child(directory: str, text: str, seq: int, stages: int, keep: int, capture_file: str) -> dict:
    """One measurement in this process: the whole model (keep < 0) or stage ``keep`` alone."""
    import torch

    from bundle.engine.stage_engine import build_stages
    from bundle.models.cut import Capture

    torch.set_num_threads(1)
    cfg = _config(directory, text, seq)
    capture = None
    if keep >= 0:
        key, _, blocks = Path(capture_file).read_bytes().partition(b"\0")
        capture = Capture(key.decode(), blocks)
    _warm_up()
    _reset_peak()
    before = _status_mb("VmRSS")
    started = time.perf_counter()
    if keep < 0:
        built = build_stages(cfg, 1, (seq,), 256)
    else:
        built = build_stages(cfg, stages, (seq,), 256, capture, keep={keep})
    seconds = time.perf_counter() - started
    held = built[0 if keep < 0 else keep]
    nbytes = sum(
        p.numel() * p.element_size() for p in {id(p): p for p in held.parameters()}.values()
    )
    return {
        "before_mb": before,
        "peak_mb": _status_mb("VmHWM"),
        "cost_mb": _status_mb("VmHWM") - before,
        "params_mb": nbytes / 2**20,
        "seconds": seconds,
        "blocks": f"{held.names[0]}..{held.names[-1]}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--shard-mb", type=int, default=100)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        d, text, seq, stages, keep, capture = args.child
        print(json.dumps(child(d, text, int(seq), int(stages), int(keep), capture)))
        return 0

    import torch
    import transformers

    from bundle import preflight

    with tempfile.TemporaryDirectory() as tmp:
        directory, text = os.path.join(tmp, "gpt2"), os.path.join(tmp, "corpus.txt")
        Path(text).write_text("the quick brown fox jumps over the lazy dog. " * 200)
        config = transformers.GPT2Config(
            n_layer=args.layers, n_embd=args.width, n_head=args.width // 64, n_positions=1024
        )
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
        model.save_pretrained(directory, max_shard_size=f"{args.shard_mb}MB")
        total_mb = sum(p.numel() for p in model.parameters()) * 4 / 2**20
        del model
        cfg = _config(directory, text, args.seq)
        _, capture = preflight.check_model(cfg, args.stages)
        assert capture is not None, "GPT-2 is cut by its graph"
        capture_file = os.path.join(tmp, "capture.bin")
        Path(capture_file).write_bytes(capture.key.encode() + b"\0" + capture.blocks)
        shards = sorted(p.name for p in Path(directory).glob("*.safetensors"))

        def run(keep: int) -> dict:
            cmd = [sys.executable, __file__, "--child", directory, text, str(args.seq)]
            cmd += [str(args.stages), str(keep), capture_file]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
            return json.loads(out.stdout.strip().splitlines()[-1])

        whole = run(-1)
        per_stage = [run(k) for k in range(args.stages)]
    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "conditions": (
            f"GPT-2 {args.layers} layers x {args.width}, vocab 50257, tied embeddings: "
            f"{total_mb:.0f} MB of fp32 parameters in {len(shards)} shards of <= {args.shard_mb} MB; "
            f"{args.stages} stages; one process each, 1 thread, {os.cpu_count()} CPUs"
        ),
        "whole": whole,
        "stages": per_stage,
    }
    print(result["command"])
    print(result["conditions"])
    print(
        f"{'loaded':<44} {'params MB':>9} {'share':>6} {'cost MB':>8} {'peak MB':>8} "
        f"{'ratio':>6} {'s':>5}"
    )
    for name, r in [("whole model", whole)] + [
        (f"stage {k} ({r['blocks']})", r) for k, r in enumerate(per_stage)
    ]:
        ratio = r["cost_mb"] / whole["cost_mb"]
        share = r["params_mb"] / whole["params_mb"]
        print(
            f"{name:<44} {r['params_mb']:>9.0f} {share:>6.2f} {r['cost_mb']:>8.0f} "
            f"{r['peak_mb']:>8.0f} {ratio:>6.2f} {r['seconds']:>5.1f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
