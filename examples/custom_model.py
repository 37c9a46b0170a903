"""Train a model, dataset and loss of your own with Bundle from Python.

    python examples/custom_model.py                 # shape 2,1: three CPU processes
    python examples/custom_model.py --steps 200     # longer

A small residual network whose skip connection crosses the stage boundary, on a dataset made
here (four classes of noisy 8x8 patterns, the same on every process), with a focal loss, AdamW
and a cosine schedule. ``bundle.api.train`` runs it exactly as ``main.py`` would; every process
imports this file again to find the three functions, so they live at the top level and training
starts under ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from bundle.api import train


class Residual(nn.Module):
    """conv stem -> two residual units -> pooled linear head; the stem's output is the skip."""

    def __init__(self, num_classes: int, channels: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(channels, 16, 3, padding=1)
        self.unit1 = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
        self.unit2 = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = torch.relu(self.stem(x))
        h = self.unit2(self.unit1(skip))
        return self.head((h + skip).mean(dim=(2, 3)))


def build_model(num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """Called in every process with the data's classes and sample shape."""
    return Residual(num_classes, input_shape[0])


def make_dataset(split: str) -> TensorDataset:
    """Four noisy 8x8 patterns; deterministic (seeded), as every process builds it again."""
    gen = torch.Generator().manual_seed(0 if split == "train" else 1)
    patterns = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(42))
    n = 2048 if split == "train" else 256
    labels = torch.randint(0, 4, (n,), generator=gen)
    images = patterns[labels] + 0.5 * torch.randn(n, 1, 8, 8, generator=gen)
    return TensorDataset(images, labels)


def focal_loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Focal loss (gamma 2): the mean over the micro-batch's rows, as torch's losses give it."""
    logp = F.log_softmax(outputs, dim=-1).gather(1, labels[:, None]).squeeze(1)
    return (-((1 - logp.exp()) ** 2) * logp).mean()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--shape", default="2,1")
    p.add_argument("--port", type=int, default=29500, help="the job's rendezvous port")
    args = p.parse_args()
    result = train(
        build_model,
        dataset=make_dataset,
        loss=focal_loss,
        num_classes=4,
        bundle_shape=args.shape,
        partition="unit2",  # the second stage begins at unit2: the skip crosses the boundary
        micro_batches=4,
        batch_size=64,
        itr=args.steps,
        optimizer="adamw",
        lr=3e-3,
        lr_schedule="cosine",
        log_every=20,
        portNum=args.port,
    )
    if not result.ok or result.summary is None:
        return result.exit_code or 1
    s = result.summary
    print(f"final loss {s['final_loss']:.4f}, validation accuracy {s['val_accuracy']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
