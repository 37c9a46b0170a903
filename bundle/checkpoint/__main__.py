"""``python -m bundle.checkpoint export SAVE_DIR/step-N OUT.pt``: a checkpoint's weights as one file;
``... export SAVE_DIR/step-N --hf OUT``: a ``transformers`` model's step as the directory
``from_pretrained`` reads (bundle.checkpoint.hf_export); ``... export SAVE_DIR/step-N --peft OUT``:
a ``--lora`` run's adapters as the directory ``peft.PeftModel.from_pretrained`` reads
(bundle.checkpoint.peft_export). Given a save directory, the newest whole step in it is exported,
and said. ``OUT.pt`` and ``--hf`` of a ``--lora`` run write the plain model, its adapters merged
into the frozen base built again (bundle.checkpoint.merged; ``--base FILE|DIR`` where the base
came from a ``--weights`` file or lies elsewhere now).

Says in one line on stdout what it wrote; a missing or damaged checkpoint, or a file that cannot
be written, is one line on stderr and exit code 2 (as main.py's input errors)."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from bundle.checkpoint import format as ckpt
from bundle.checkpoint import merged
from bundle.errors import BundleError, CheckpointError, ConfigError, ExitCode

PROG = "python -m bundle.checkpoint export"


@dataclass(frozen=True)
class Exported:
    """What ``export`` wrote: the file, how many tensors it holds, its size in bytes."""

    out: str
    tensors: int
    bytes: int


def export(path: str, out: str, *, base: str | None = None, trust: bool = False) -> Exported:
    """Write the canonical weights of checkpoint ``path`` as one ``--checkpoint``-format file,
    once the checkpoint is verified (``damage``); what it wrote. A ``--lora`` run's are the plain
    model's, its adapters merged (``merged``: ``base``, where its frozen base is; ``trust``: run
    the factory the checkpoint names to build it)."""
    try:
        state = ckpt.weights(path)
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}; nothing exported") from None
    info = ckpt.read_info(path)
    if merged.is_lora(info):
        state = merged.merged_state(path, info, state, base=base, trust=trust)
    elif base is not None:
        raise ConfigError(
            merged.BASE, base, f"is for a --lora run's step; {path} holds no adapters"
        )
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
        "[--max-shard-size 5GB] [--force] [--model-config FILE|DIR] [--tokenizer DIR] | "
        f"{PROG} SAVE_DIR/step-N --peft OUT [--force]; OUT.pt and --hf of a --lora run: "
        f"[--base FILE|DIR] [{merged.TRUST}]",
        description="A checkpoint's weights as one file, a transformers model's as the "
        "directory from_pretrained reads, or a --lora run's adapters as PEFT's directory.",
    )
    p.add_argument("checkpoint", metavar="SAVE_DIR/step-N",
                   help="a step directory, or a save directory (its newest whole step)")  # fmt: skip
    p.add_argument("out", nargs="?", metavar="OUT.pt", help="one weights file (torch.load)")
    p.add_argument("--hf", metavar="OUT", help="a transformers model's save_pretrained directory")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="--hf: the largest safetensors file (default 5GB)")  # fmt: skip
    p.add_argument("--peft", metavar="OUT",
                   help="a --lora run's adapters as the directory PeftModel.from_pretrained "
                        "reads")  # fmt: skip
    p.add_argument("--force", action="store_true", help="--hf, --peft: replace OUT if it exists")
    p.add_argument("--model-config", metavar="FILE|DIR",
                   help="--hf, a step that records no config: the run's --model-config")  # fmt: skip
    p.add_argument("--tokenizer", metavar="DIR",
                   help="--hf: the tokenizer to copy (default: the one the run recorded)")  # fmt: skip
    p.add_argument(merged.BASE, metavar="FILE|DIR",
                   help="OUT.pt, --hf of a --lora run: the --weights file or --pretrained "
                        "directory its frozen base came from (default: as bundle.json records)")  # fmt: skip
    p.add_argument(merged.TRUST, action="store_true",
                   help="OUT.pt of a --lora run: run the model factory the checkpoint names to "
                        "build its base (only for checkpoints you trust)")  # fmt: skip
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
        base=args.base,
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
        if [args.out, args.hf, args.peft].count(None) != 2:
            parser.error(
                "give OUT.pt (one weights file), --hf OUT or --peft OUT (a directory), one of them"
            )
    except SystemExit as exc:  # argparse said why: usage and one line, exit 2
        return exc.code if isinstance(exc.code, int) else ExitCode.INPUT
    try:
        # A save directory: its newest whole step (bundle.generate reads one so too).
        args.checkpoint = ckpt.step_or_newest(args.checkpoint, _note)
        if args.hf is not None:
            line = _hf(args)
        elif args.peft is not None:
            line = _peft(args)
        else:
            line = _pt(args)
    except BundleError as exc:
        print(f"python -m bundle.checkpoint: error: {exc}", file=sys.stderr)
        return ExitCode.INPUT
    print(line)
    return 0


def _note(text: str) -> None:
    print(f"python -m bundle.checkpoint: note: {text}", file=sys.stderr)


def _pt(args: argparse.Namespace) -> str:
    source = args.checkpoint
    exported = export(source, args.out, base=args.base, trust=args.trust_checkpoint_code)
    return (
        f"wrote {exported.out}: {exported.tensors} tensors, {size_text(exported.bytes)} "
        f"(the weights of {source})"
    )


def _peft(args: argparse.Namespace) -> str:
    from bundle.checkpoint.peft_export import export_peft

    if args.base is not None:  # PEFT's directory holds no base: it is the user's to load
        raise ConfigError(merged.BASE, args.base, "--peft writes the adapters alone: leave it out")
    done = export_peft(args.checkpoint, args.peft, force=args.force)
    whole = f", {len(done.trained)} module(s) saved whole" if done.trained else ""
    return (
        f"wrote {done.out}: a LoRA adapter on {done.adapted} modules{whole}, {done.tensors} "
        f"tensors, {size_text(done.bytes)} (the adapters of {args.checkpoint})"
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
