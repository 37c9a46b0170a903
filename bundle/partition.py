"""Partition specs: where each pipeline stage begins, checked against the model's blocks.

A spec is a YAML file (bare names resolve to ``partitions/<name>.yaml`` at the repo root)::

    model: resnet101          # registry name the split was written for
    stages: [conv1, layer3.5] # where each stage begins; first entry = first block

or the same points inline, comma-separated (``--partition conv1,layer3.5``, as the planner's
commands write them), for whatever model runs.

A point names a block of ``models.blocks(model)`` (``layer3.5``) or a container whose children
are blocks (``layer3`` = its first block ``layer3.0``). The first block may be left out of
``stages``; it is prepended. Without a spec the model is cut automatically, balancing parameter
counts. A boundary may carry several tensors: a block that returns a tuple feeds the next block
as ``block(*prev)``, and ``Stage.forward`` always returns a tuple.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import torch
import torch.nn as nn
import yaml

from bundle import log, models
from bundle.config import ModelConfig
from bundle.engine.memory import run_recomputed
from bundle.errors import ConfigError, PartitionError
from bundle.models import Block, apply_blocks, is_known, split_io
from bundle.models.inputs import Inputs
from bundle.yaml_input import load_yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
PARTITIONS_DIR = REPO_ROOT / "partitions"
_KEYS = ("model", "stages")
_SAY_AFTER_S = 5.0  # a cut that captures for longer says what it is doing


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


class Stage(nn.Module):
    """A contiguous run of blocks; shares modules with the full model (no copies)."""

    def __init__(self, blocks: Sequence[Block]) -> None:
        super().__init__()
        if not blocks:
            raise PartitionError("a stage needs at least one block")
        self.names: tuple[str, ...] = tuple(name for name, _ in blocks)
        self.blocks = nn.ModuleList(module for _, module in blocks)
        # A graph split's blocks name their parameters as the full model does already.
        self._named_fully = tuple(getattr(m, "named_fully", False) for _, m in blocks)
        # Set by the runner per micro-batch: keep only the stage's inputs, recompute the rest.
        self.recompute = False
        # What the model takes (token ids: long), for inputs made up before training.
        self.input_dtype = torch.float32
        # The batch's named inputs (models.inputs), in the order the first stage takes them.
        self.input_names: tuple[str, ...] = ()
        # The named inputs its blocks read from the data besides what they receive (read once
        # here: the engine asks every micro-batch).
        self.side = tuple(dict.fromkeys(n for _, m in blocks for n in getattr(m, "side", ())))

    def forward(
        self, *inputs: torch.Tensor, side: Mapping[str, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, ...]:
        """The blocks applied to ``inputs``; ``side``: the named inputs the blocks read."""
        blocks = list(zip(self.names, self.blocks, strict=True))
        if self.recompute and torch.is_grad_enabled():
            out = run_recomputed(blocks, *inputs, side=side)
        else:
            out = apply_blocks(blocks, *inputs, side=side)
        return out if isinstance(out, tuple) else (out,)

    def full_name(self, name: str) -> str:
        """``blocks.3.weight`` -> the full model's name, e.g. ``layer1.0.conv1.weight``."""
        head, _, rest = name.partition(".")
        index, _, leaf = rest.partition(".")
        if head != "blocks" or not index.isdigit() or int(index) >= len(self.names) or not leaf:
            raise PartitionError(f"{name!r} is not a parameter or buffer name of this stage")
        return leaf if self._named_fully[int(index)] else f"{self.names[int(index)]}.{leaf}"

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's parameters and buffers keyed by full-model names."""
        return {self.full_name(k): v for k, v in self.state_dict().items()}

    def load_full_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load this stage's entries from a full-model state dict (other entries are ignored)."""
        own = {k: self.full_name(k) for k in self.state_dict()}
        missing = sorted(full for full in own.values() if full not in state)
        if missing:
            raise PartitionError(
                f"state dict lacks {len(missing)} entries of stage {self.names[0]}..{self.names[-1]}"
                f", e.g. {missing[:3]}"
            )
        self.load_state_dict({k: state[full] for k, full in own.items()}, strict=True)


def joined(pieces: Sequence[Stage]) -> Stage:
    """The blocks of several pieces as one stage, for what holds a rank's whole state (the
    optimizer, checkpoints) when it runs several model chunks; it is never run forward."""
    return Stage([(n, m) for p in pieces for n, m in zip(p.names, p.blocks, strict=True)])


def build_model(
    cfg: ModelConfig, num_classes: int, input_shape: Sequence[int], *, seed: int = 0
) -> nn.Module:
    """``--model`` built for the data (``--model-args`` passed), ``--weights`` loaded; a
    ``--pretrained`` model with all its weights read (its tensors the checkpoint lacks seeded
    from ``seed``; ``build_stages`` reads only a process's own stages')."""
    if cfg.pretrained:
        model = models.pretrained.build_empty(
            cfg.name,
            cfg.pretrained,
            num_classes=num_classes,
            input_shape=input_shape,
            args=cfg.kwargs,
        )
        models.pretrained.load(model, cfg.pretrained, seed=seed, strict=cfg.weights_strict)
        return model
    model = models.build(
        cfg.name,
        num_classes=num_classes,
        input_shape=input_shape,
        args=cfg.kwargs,
        config_file=cfg.config_file,
    )
    if cfg.weights:
        models.load_weights(model, cfg.weights, strict=cfg.weights_strict)
    return model


@dataclass(frozen=True)
class Capture:
    """A model's graph split, made once by the launch's checks (on the meta device) and handed
    to the job's processes, which load it instead of capturing the forward again; ``key`` names
    what was cut (``capture_key``)."""

    key: str
    blocks: bytes


def capture_key(cfg: ModelConfig, input_shape: Sequence[int], inputs: Inputs | None = None) -> str:
    """What a capture depends on: the model as built, its cut points, its output and input."""
    return repr(
        (cfg.name, sorted(cfg.kwargs.items()), cfg.config_file, cfg.pretrained, cfg.partition)
        + (cfg.output, tuple(input_shape), inputs.key() if inputs else None)
    )


def capture_of(
    stages: Sequence[Stage],
    cfg: ModelConfig,
    input_shape: Sequence[int],
    inputs: Inputs | None = None,
) -> Capture | None:
    """The graph split behind ``cut``'s stages, for the job's other processes (None: the model
    was not cut by its graph, or holds an operation that cannot be handed on)."""
    blocks = [(n, m) for s in stages for n, m in zip(s.names, s.blocks, strict=True)]
    dumped = split_io.dump(blocks)
    key = capture_key(cfg, input_shape, inputs)
    return Capture(key, dumped) if dumped is not None else None


def cut(
    model: nn.Module,
    cfg: ModelConfig,
    num_stages: int,
    input_shape: Sequence[int],
    capture: Capture | None = None,
    inputs: Inputs | None = None,
) -> list[Stage]:
    """The model cut into ``num_stages`` stages at ``--partition`` (default: balanced); from
    ``capture`` when it was made for the same model and input (``capture_of``). ``inputs``:
    the batch's named inputs (None: one tensor)."""
    spec = load_spec(cfg.partition) if cfg.partition else None
    names = inputs.names if inputs is not None else ()
    if num_stages == 1 and spec is None:  # nothing to cut: never traced
        stages = [Stage(models.whole(model, cfg.output, inputs))]
        stages[0].input_dtype, stages[0].input_names = models.input_dtype(model), names
        return stages
    try:
        if capture is not None and capture.key == capture_key(cfg, input_shape, inputs):
            blocks = split_io.load(model, capture.blocks)
        else:
            blocks = _captured(model, spec, cfg, num_stages, input_shape, inputs)
        stages = split_model(blocks, resolve(spec, blocks, num_stages, cfg.name))
    except PartitionError as exc:
        if spec is None:
            raise
        raise PartitionError(f"--partition {cfg.partition}: {exc}") from None
    for stage in stages:
        stage.input_dtype, stage.input_names = models.input_dtype(model), names
    return stages


def _captured(
    model: nn.Module,
    spec: PartitionSpec | None,
    cfg: ModelConfig,
    num_stages: int,
    input_shape: Sequence[int],
    inputs: Inputs | None,
) -> list[Block]:
    """The model's blocks from a capture of its forward made here, saying so when it runs long."""
    started = time.monotonic()
    # Capturing a large model's forward takes tens of seconds: say so once it runs long.
    said = threading.Timer(
        _SAY_AFTER_S,
        lambda: log.get().info(
            f"cutting {cfg.name} into {num_stages} stages: capturing its forward "
            "(fx, or torch.export where fx cannot trace it)"
        ),
    )
    said.daemon = True
    said.start()
    try:
        points = spec.starts if spec else ()
        blocks = models.blocks(model, input_shape, points, cfg.output, inputs)
    finally:
        said.cancel()
    if time.monotonic() - started > _SAY_AFTER_S:
        log.get().info(f"cut {cfg.name} in {time.monotonic() - started:.0f}s")
    return blocks


def split_model(model: nn.Module | Sequence[Block], starts: Sequence[int]) -> list[Stage]:
    """Cut a model (or its ``blocks``) into stages beginning at the given block indices (from
    ``resolve``). A parameter several stages use (tied weights) is held by each of them; their
    gradients are summed among them every step (bundle.engine.ties)."""
    blocks = models.blocks(model) if isinstance(model, nn.Module) else list(model)
    bounds = [*starts, len(blocks)]
    if not starts or starts[0] != 0 or any(a >= b for a, b in pairwise(bounds)):
        raise PartitionError(
            f"stage starts {tuple(starts)} must begin at 0 and increase below {len(blocks)}"
        )
    return [Stage(blocks[a:b]) for a, b in pairwise(bounds)]
