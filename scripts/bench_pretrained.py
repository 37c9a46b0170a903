"""Peak memory of one process loading ``--pretrained`` weights: one stage of the model, or one
process's tensor-parallel shards, vs all of it.

    python scripts/bench_pretrained.py                       # GPT-2, 6 layers x 768, 4 stages
    python scripts/bench_pretrained.py --layers 12 --stages 4 --json out.json
    python scripts/bench_pretrained.py --tensor-parallel 2   # a Llama, each TP process's shards

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

``--tensor-parallel T``: a Llama of the same layers and width (GPT-2 has no tensor-parallel plan
in transformers; this one splits by its own ``base_model_tp_plan``) is saved instead, and each
measurement after the whole model's is one process of a TP group of ``T`` at one stage
(``build_stages(..., split=Split(j, T))``: split on the meta device, then only its rows or columns
of each split tensor read from the files, by byte range).
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


def child(
    directory: str, text: str, seq: int, stages: int, keep: int, capture_file: str, degree: int
) -> dict:
    """One measurement in this process: the whole model (keep < 0), stage ``keep`` alone, or
    (``degree`` > 1) process ``keep`` of a TP group of ``degree`` at one stage."""
    import torch

    from bundle.engine.stage_engine import build_stages
    from bundle.engine.tensor_parallel import Split
    from bundle.models.cut import Capture

    torch.set_num_threads(1)
    cfg = _config(directory, text, seq)
    capture = None
    if keep >= 0 and degree == 1:
        key, _, blocks = Path(capture_file).read_bytes().partition(b"\0")
        capture = Capture(key.decode(), blocks)
    _warm_up()
    _reset_peak()
    before = _status_mb("VmRSS")
    started = time.perf_counter()
    if keep < 0:
        built = build_stages(cfg, 1, (seq,), 256)
    elif degree > 1:
        built = build_stages(cfg, 1, (seq,), 256, split=Split(keep, degree))
    else:
        built = build_stages(cfg, stages, (seq,), 256, capture, keep={keep})
    seconds = time.perf_counter() - started
    held = built[0 if keep < 0 or degree > 1 else keep]
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


def _save(args: argparse.Namespace, directory: str) -> str:
    """Save the model measured in ``directory`` (random weights, sharded); what it is, in words."""
    import torch
    import transformers

    torch.manual_seed(0)
    heads = args.width // 64
    if args.tensor_parallel > 1:  # a plan of its own (GPT-2 has none)
        step = 64 * args.tensor_parallel
        config = transformers.LlamaConfig(
            num_hidden_layers=args.layers,
            hidden_size=args.width,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            intermediate_size=-(-(8 * args.width // 3) // step) * step,
            vocab_size=32000,
            max_position_embeddings=1024,
        )
        model = transformers.LlamaForCausalLM(config)
        name = f"Llama {args.layers} layers x {args.width}, vocab 32000, untied embeddings"
    else:
        config = transformers.GPT2Config(
            n_layer=args.layers, n_embd=args.width, n_head=heads, n_positions=1024
        )
        model = transformers.GPT2LMHeadModel(config)
        name = f"GPT-2 {args.layers} layers x {args.width}, vocab 50257, tied embeddings"
    model.save_pretrained(directory, max_shard_size=f"{args.shard_mb}MB")
    total_mb = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    shards = len(list(Path(directory).glob("*.safetensors")))
    return (
        f"{name}: {total_mb:.0f} MB of fp32 parameters in {shards} shards of <= {args.shard_mb} MB"
    )


def _capture_file(directory: str, text: str, args: argparse.Namespace, tmp: str) -> str:
    """The cut into ``--stages`` stages, captured once as the launch's checks make it, written
    for the children ('' for a tensor-parallel measurement: one stage, no cut)."""
    if args.tensor_parallel > 1:
        return ""
    from bundle import preflight

    _, capture = preflight.check_model(_config(directory, text, args.seq), args.stages)
    assert capture is not None, "GPT-2 is cut by its graph"
    path = os.path.join(tmp, "capture.bin")
    Path(path).write_bytes(capture.key.encode() + b"\0" + capture.blocks)
    return path


def _print(result: dict) -> None:
    print(result["command"])
    print(result["conditions"])
    print(
        f"{'loaded':<44} {'params MB':>9} {'share':>6} {'cost MB':>8} {'peak MB':>8} "
        f"{'ratio':>6} {'s':>5}"
    )
    whole, each = result["whole"], "stage" if "stages" in result else "TP process"
    parts = result.get("stages") or result["tp_processes"]
    for name, r in [("whole model", whole)] + [
        (f"{each} {k} ({r['blocks']})", r) for k, r in enumerate(parts)
    ]:
        ratio = r["cost_mb"] / whole["cost_mb"]
        share = r["params_mb"] / whole["params_mb"]
        print(
            f"{name:<44} {r['params_mb']:>9.0f} {share:>6.2f} {r['cost_mb']:>8.0f} "
            f"{r['peak_mb']:>8.0f} {ratio:>6.2f} {r['seconds']:>5.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="T")
    parser.add_argument("--shard-mb", type=int, default=100)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        d, text, seq, stages, keep, capture, degree = args.child
        out = child(d, text, int(seq), int(stages), int(keep), capture, int(degree))
        print(json.dumps(out))
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        directory, text = os.path.join(tmp, "model"), os.path.join(tmp, "corpus.txt")
        Path(text).write_text("the quick brown fox jumps over the lazy dog. " * 200)
        model = _save(args, directory)
        capture_file = _capture_file(directory, text, args, tmp)

        def run(keep: int) -> dict:
            cmd = [sys.executable, __file__, "--child", directory, text, str(args.seq)]
            cmd += [str(args.stages), str(keep), capture_file, str(args.tensor_parallel)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
            return json.loads(out.stdout.strip().splitlines()[-1])

        whole = run(-1)
        tp = args.tensor_parallel
        parts = [run(k) for k in range(tp if tp > 1 else args.stages)]
    split = f"one stage at TP {tp}" if tp > 1 else f"{args.stages} stages"
    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "conditions": f"{model}; {split}; one process each, 1 thread, {os.cpu_count()} CPUs",
        "whole": whole,
        "tp_processes" if tp > 1 else "stages": parts,
    }
    _print(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
