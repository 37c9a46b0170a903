"""``python -m bundle.checkpoint export SAVE_DIR/step-N OUT.pt``: a checkpoint's weights as one file."""

import sys

from bundle.checkpoint.format import export

if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "export":
        sys.exit("usage: python -m bundle.checkpoint export SAVE_DIR/step-N OUT.pt")
    export(sys.argv[2], sys.argv[3])
