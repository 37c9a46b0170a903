"""``python -m bundle.data prepare INPUT... --out DIR``: a corpus tokenized once into token shards.

A bar with an ETA on a terminal's stderr while it runs, one summary line on stdout at the end; a
bad flag or input is one line on stderr and exit code 2 (as main.py's input errors), with nothing
left at ``--out``."""

from __future__ import annotations

import argparse
import os
import sys

from bundle.data.prepare import Options, Summary, prepare
from bundle.data.shards import SPLITS
from bundle.errors import BundleError, ExitCode

PROG = "python -m bundle.data"


def _cores() -> int:
    """The cores this process may run on (a container's or a Slurm job's share, not the host's)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Prepare a corpus for training.")
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser(
        "prepare",
        help="tokenize text files, .jsonl(.gz), .parquet or saved datasets into token shards",
    )
    prep.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="a text file (one document), .jsonl/.jsonl.gz (a document a line), .parquet, or "
        "a directory written by datasets' save_to_disk",
    )
    prep.add_argument("--out", required=True, metavar="DIR", help="the corpus directory to make")
    prep.add_argument(
        "--tokenizer",
        metavar="DIR",
        default=None,
        help="a saved tokenizer (tokenizer.json, or what transformers reads); default: bytes",
    )
    prep.add_argument(
        "--text-field",
        default="text",
        metavar="NAME",
        help="the field or column holding a document's text (default: text)",
    )
    prep.add_argument(
        "--val-fraction",
        type=float,
        default=0.001,
        metavar="F",
        help="the share of documents, chosen by a hash of their index, that validate "
        "(default: 0.001; 0: no validation split)",
    )
    prep.add_argument(
        "--workers",
        type=int,
        default=_cores(),
        metavar="N",
        help="tokenizing processes (default: the cores this process may use; 0 or 1: none); "
        "the output is the same for any N",
    )
    prep.add_argument(
        "--shard-tokens",
        type=int,
        default=100_000_000,
        metavar="N",
        help="tokens a shard holds at most (a longer document is a shard of its own; "
        "default: 100,000,000)",
    )
    return parser


def summary_line(s: Summary) -> str:
    """What was prepared, in one line: documents, tokens and shards per split, bytes, speed."""
    per = ", ".join(f"{n} {s.tokens[n]:,} tokens in {s.shards[n]} shards" for n in SPLITS)
    secs = max(s.seconds, 1e-9)
    return (
        f"prepared {s.out}: {s.documents:,} documents; {per}; {s.bytes_read / 1e6:.1f} MB read, "
        f"{s.bytes_written / 1e6:.1f} MB written in {s.seconds:.1f}s "
        f"({sum(s.tokens.values()) / secs:,.0f} tokens/s, {s.bytes_read / 1e6 / secs:.1f} MB/s)"
    )


def main(argv: list[str]) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse has said what was wrong, on stderr
        return int(exc.code or 0)
    try:
        opts = Options(
            inputs=tuple(args.inputs),
            out=args.out,
            tokenizer=args.tokenizer,
            text_field=args.text_field,
            val_fraction=args.val_fraction,
            workers=args.workers,
            shard_tokens=args.shard_tokens,
        )
        summary = prepare(opts, progress=sys.stderr if sys.stderr.isatty() else None)
    except BundleError as exc:
        print(f"{PROG} prepare: error: {exc}", file=sys.stderr)
        return ExitCode.INPUT
    print(summary_line(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
