"""What a dataset gives a run (``DataSplits``): its training and validation splits, the classes
and the input the model is built for. Below every source (``sources``, ``stream``, ``classify``),
which each make one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.utils.data import Dataset

from bundle.models.inputs import Inputs


@dataclass(frozen=True)
class DataSplits:
    train: Dataset[Any]
    val: Dataset[Any]
    num_classes: int
    input_shape: tuple[int, ...]  # the primary input's, per row
    # Named inputs (models.inputs): None where a sample's input is one tensor.
    inputs: Inputs | None = None
