"""Partition specs: where each piece of the model begins, checked against the model's blocks.

A spec is a YAML file (bare names resolve to ``partitions/<name>.yaml`` at the repo root)::

    model: resnet101          # registry name the split was written for
    stages: [conv1, layer3.5] # where each stage begins; first entry = first block

or the same points inline, comma-separated (``--partition conv1,layer3.5``, as the planner's
commands write them), for whatever model runs.

A point names a block of ``models.blocks(model)`` (``layer3.5``) or a container whose children
are blocks (``layer3`` = its first block ``layer3.0``). The first block may be left out of
``stages``; it is prepended. Without a spec the model is cut automatically, balancing parameter
counts (``auto_starts``). ``resolve`` turns either into the start index of each piece, which
``models.cut`` cuts the blocks at.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from bundle.config.yaml_input import load_yaml
from bundle.errors import ConfigError, PartitionError
from bundle.models import Block, is_known

REPO_ROOT = Path(__file__).resolve().parent.parent
PARTITIONS_DIR = REPO_ROOT / "partitions"
_KEYS = ("model", "stages")


@dataclass(frozen=True)
class PartitionSpec:
    """A split as written: the model it is for (None: inline, any) and where each stage begins."""

    model: str | None
    starts: tuple[str, ...]


def available_specs() -> list[str]:
    """Names of the specs shipped in partitions/, sorted."""
    return sorted(p.stem for p in PARTITIONS_DIR.glob("*.yaml"))


def load_spec(ref: str) -> PartitionSpec:
    """Read a spec from a YAML path, a bare name in partitions/, or inline split points."""
    path = Path(ref)
    if "," in ref and path.suffix not in (".yaml", ".yml"):
        points = tuple(p.strip() for p in ref.split(","))
        if not all(points):
            raise ConfigError("--partition", ref, "inline split points need a name between commas")
        return PartitionSpec(model=None, starts=points)
    if not (path.suffix in (".yaml", ".yml") or path.parent != Path(".")):
        if not (PARTITIONS_DIR / f"{ref}.yaml").is_file():
            return PartitionSpec(model=None, starts=(ref,))  # one split point: two stages
        path = PARTITIONS_DIR / f"{ref}.yaml"
    if not path.is_file():
        names = ", ".join(available_specs())
        raise ConfigError("--partition", ref, f"choose one of: {names} or a path to a .yaml file")
    try:
        doc = load_yaml(path.read_text())
    except yaml.YAMLError as exc:
        raise PartitionError(f"{path}: malformed YAML: {exc}") from exc
    if not isinstance(doc, Mapping):
        raise PartitionError(f"{path}: expected a mapping with keys {list(_KEYS)}, got {doc!r}")
    unknown = sorted(set(doc) - set(_KEYS))
    if unknown:
        raise PartitionError(f"{path}: unknown key(s) {unknown}; allowed: {list(_KEYS)}")
    missing = [k for k in _KEYS if k not in doc]
    if missing:
        raise PartitionError(f"{path}: missing key(s) {missing}")
    model, stages = doc["model"], doc["stages"]
    if not isinstance(model, str) or not model:
        raise PartitionError(f"{path}: key 'model' must be a model name, got {model!r}")
    if (
        not isinstance(stages, list)
        or not stages
        or not all(isinstance(s, str) and s for s in stages)
    ):
        raise PartitionError(
            f"{path}: key 'stages' must be a non-empty list of names, got {stages!r}"
        )
    return PartitionSpec(model=model, starts=tuple(stages))


def split_model_name(name: str, partition: str | None) -> tuple[str, str | None]:
    """The original's model names: ``MODEL_SPLIT`` is ``MODEL`` cut by ``partitions/MODEL_SPLIT.yaml``
    (``resnet101_trial4``), when that spec is written for the registered ``MODEL``.

    Returns (model, partition); any other name is returned as it is, to be checked as a model.
    """
    path = PARTITIONS_DIR / f"{name}.yaml"
    if is_known(name) or not path.is_file():
        return name, partition
    model = load_spec(name).model
    if model is None or not is_known(model) or not name.startswith(f"{model}_"):
        return name, partition
    if partition not in (None, name):
        raise ConfigError(
            "--partition",
            partition,
            f"--model {name} is {model} cut by partitions/{name}.yaml; "
            f"leave --partition out, or give --model {model}",
        )
    return model, name


def valid_points(names: Sequence[str]) -> list[str]:
    """Every name a split point may use: the blocks and the containers that group them."""
    points: list[str] = []
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix not in points:
                points.append(prefix)
    return points


def _index_of(point: str, names: Sequence[str]) -> int:
    if point in names:
        return names.index(point)
    # A container stands for its first block; a bare prefix like "layer" is no container.
    for i, name in enumerate(names):
        if name.startswith(point + "."):
            return i
    specs = "" if "." in point else f"; or a spec of partitions/: {', '.join(available_specs())}"
    raise PartitionError(
        f"unknown split point {point!r}; valid points: {', '.join(valid_points(names))}{specs}"
    )


def resolve(
    spec: PartitionSpec | None,
    blocks: Sequence[Block],
    num_stages: int,
    model_name: str,
) -> tuple[int, ...]:
    """Start index in ``blocks`` of each of ``num_stages`` stages (the first is always 0)."""
    names = [name for name, _ in blocks]
    if num_stages < 1:
        raise PartitionError(f"number of stages must be >= 1, got {num_stages}")
    if spec is None:
        return auto_starts(blocks, num_stages)
    if spec.model is not None and spec.model != model_name:
        raise PartitionError(
            f"partition was written for model {spec.model!r}, but the model is {model_name!r}"
        )
    starts = [_index_of(point, names) for point in spec.starts]
    points = list(spec.starts)
    if starts[0] != 0:
        starts.insert(0, 0)
        points.insert(0, names[0])
    for i in range(1, len(starts)):
        if starts[i] <= starts[i - 1]:
            raise PartitionError(
                f"split points out of order or repeated: {points[i]!r} (block {starts[i]}) "
                f"does not come after {points[i - 1]!r} (block {starts[i - 1]})"
            )
    if len(starts) != num_stages:
        raise PartitionError(
            f"partition has {len(starts)} stages ({', '.join(points)}) "
            f"but the bundle shape has {num_stages}"
        )
    return tuple(starts)


def auto_starts(blocks: Sequence[Block], num_stages: int) -> tuple[int, ...]:
    """Contiguous non-empty stages minimising the largest stage's parameter count."""
    n = len(blocks)
    if num_stages > n:
        raise PartitionError(f"cannot cut {n} blocks into {num_stages} non-empty stages")
    # +1 per block so parameterless blocks still spread out instead of piling on one stage.
    weights = [1 + sum(p.numel() for p in m.parameters()) for _, m in blocks]
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # cost[k][i]: best largest-stage weight putting blocks[:i] into k stages; cut[k][i]: last start.
    cost = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    cost[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                c = max(cost[k - 1][j], prefix[i] - prefix[j])
                if c < cost[k][i]:
                    cost[k][i], cut[k][i] = c, j
    starts, i = [], n
    for k in range(num_stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return tuple(reversed(starts))
