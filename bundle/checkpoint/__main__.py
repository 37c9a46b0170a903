"""``python -m bundle.checkpoint export SAVE_DIR/step-N OUT.pt``: a checkpoint's weights as one file.

Says in one line on stdout what it wrote; a missing or damaged checkpoint, or a file that cannot
be written, is one line on stderr and exit code 2 (as main.py's input errors)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from bundle.checkpoint import format as ckpt
from bundle.errors import BundleError, CheckpointError

USAGE = "usage: python -m bundle.checkpoint export SAVE_DIR/step-N OUT.pt"


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


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "export":
        print(USAGE, file=sys.stderr)
        return 2
    _, source, out = argv
    try:
        exported = export(source, out)
    except BundleError as exc:
        print(f"python -m bundle.checkpoint: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {exported.out}: {exported.tensors} tensors, {size_text(exported.bytes)} "
        f"(the weights of {source})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
