"""Bundle: train a model with bundle-based hybrid parallelism (pipeline stages x data-parallel bundles).

With no arguments it trains a small CNN on scikit-learn's 8x8 digit images as one bundle of shape
1,1 on two CPU processes. See docs/multi-node.md for multi-node, torchrun and container launches.
"""

import sys

from bundle.cli import main

if __name__ == "__main__":
    sys.exit(main())
