"""``python -m bundle.checkpoint export SAVE_DIR/step-N OUT.pt``: a checkpoint's weights as one file;
``... export SAVE_DIR/step-N --hf OUT``: a ``transformers`` model's step as the directory
``from_pretrained`` reads (bundle.checkpoint.hf_export). Given a save directory, the newest whole
step in it is exported, and said.

Says in one line on stdout what it wrote; a missing or damaged checkpoint, or a file that cannot
be written, is one line on stderr and exit code 2 (as main.py's input errors)."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from bundle.checkpoint import format as ckpt
from bundle.errors import BundleError, CheckpointError, ExitCode

PROG = "python -m bundle.checkpoint export"


@dataclass(frozen=True)
class Exported:
    """What ``export`` wrote: the file, how many tensors it holds, its size in bytes."""

    out: str
    tensors: int
    bytes: int


def export(path: str, out: str) -> Exported:
    """Write the canonical weights of checkpoint ``path`` as one ``--checkpoint``-format file,
    once the checkpoint is verified (``damage``); what it wrote."""
    try:
        state = ckpt.weights(path)
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}; nothing exported") from None
    ckpt.save(out, state)
    return Exported(out, len(state), os.path.getsize(out))


def size_text(n: int) -> str:
    """Bytes as a person reads them: ``593.9 KiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} SAVE_DIR/step-N OUT.pt | {PROG} SAVE_DIR/step-N --hf OUT "
        "[--max-shard-size 5GB] [--force] [--model-config FILE|DIR] [--tokenizer DIR]",
        description="A checkpoint's weights as one file, or a transformers model's as the "
        "directory from_pretrained reads.",
    )
    p.add_argument("checkpoint", metavar="SAVE_DIR/step-N",
                   help="a step directory, or a save directory (its newest whole step)")  # fmt: skip
    p.add_argument("out", nargs="?", metavar="OUT.pt", help="one weights file (torch.load)")
    p.add_argument("--hf", metavar="OUT", help="a transformers model's save_pretrained directory")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="--hf: the largest safetensors file (default 5GB)")  # fmt: skip
    p.add_argument("--force", action="store_true", help="--hf: replace OUT if it exists")
    p.add_argument("--model-config", metavar="FILE|DIR",
                   help="--hf, a step that records no config: the run's --model-config")  # fmt: skip
    p.add_argument("--tokenizer", metavar="DIR",
                   help="--hf: the tokenizer to copy (default: the one the run recorded)")  # fmt: skip
    return p


def _hf(args: argparse.Namespace) -> str:
    from bundle.checkpoint.hf_export import export_hf

    done = export_hf(
        args.checkpoint,
        args.hf,
        max_shard_size=args.max_shard_size,
        force=args.force,
        model_config=args.model_config,
        tokenizer=args.tokenizer,
    )
    words = f", tokenizer ({', '.join(done.tokenizer)})" if done.tokenizer else ", no tokenizer"
    return (
        f"wrote {done.out}: {done.cls}, {done.tensors} tensors in {done.shards} safetensors "
        f"file(s), {size_text(done.bytes)}{words} (the weights of {args.checkpoint})"
        + (
            f"; config.json leaves out the source's auto_map: the code it names never ran, the "
            f"model trained and written is transformers' {done.cls}"
            if done.dropped_auto_map
            else ""
        )
    )


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "export":
        _parser().print_usage(sys.stderr)
        return ExitCode.INPUT
    parser = _parser()
    try:
        args = parser.parse_args(argv[1:])
        if (args.out is None) == (args.hf is None):
            parser.error("give OUT.pt (one weights file) or --hf OUT (a directory), one of them")
    except SystemExit as exc:  # argparse said why: usage and one line, exit 2
        return exc.code if isinstance(exc.code, int) else ExitCode.INPUT
    try:
        # A save directory: its newest whole step (bundle.generate reads one so too).
        args.checkpoint = ckpt.step_or_newest(args.checkpoint, _note)
        line = _hf(args) if args.hf is not None else _pt(args.checkpoint, args.out)
    except BundleError as exc:
        print(f"python -m bundle.checkpoint: error: {exc}", file=sys.stderr)
        return ExitCode.INPUT
    print(line)
    return 0


def _note(text: str) -> None:
    print(f"python -m bundle.checkpoint: note: {text}", file=sys.stderr)


def _pt(source: str, out: str) -> str:
    exported = export(source, out)
    return (
        f"wrote {exported.out}: {exported.tensors} tensors, {size_text(exported.bytes)} "
        f"(the weights of {source})"
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
