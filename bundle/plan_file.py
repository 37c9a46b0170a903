"""``main.py --plan FILE[:INDEX]``: run a planner's plan exactly as saved.

``scripts/plan.py --json plans.json`` writes ranked plans; each carries ``run`` (the main.py
options of the plan, under the keys ``--config`` accepts), ``placement`` (per rank, in rank
order: the node, the local device, the device type and, for an emulated slower device on CPU, the
fraction of one CPU) and ``data`` (the data the plan was made for: main.py's data options, and
the input shape and classes they give)::

    {"plans": [{"run": {"bundle_shape": "2,1", "num_bundle": 1, "micro_batches": 4,
                        "schedule": "1f1b", "grad_sync": "flat", "row_weights": "2:1,1"},
                "placement": [{"node": 0, "device": 0, "type": "A100", "cpu": null}, ...],
                "data": {"dataset": "synthetic", "image_size": 224, "num_classes": 1000,
                         "input_shape": [3, 224, 224]}}]}

``--plan plans.json`` runs ``plans[0]`` (the best), ``--plan plans.json:2`` the third. A file holding
one plan (a mapping with ``run``) works too. The plan's options beat a ``--config`` file's; one
given on the command line must agree with the plan, else the run is refused in one line. The
plan's data are the run's unless the command line or ``--config`` names data (``DATA_DIR`` or
``--dataset``); a plan written before plans recorded their data has none.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple, TypeGuard

from bundle.errors import ConfigError

PlacementRow = tuple[int, int | None, str, float | None]
_ORDER = ("node", "device", "type", "cpu")
_PLACE_KEYS = set(_ORDER)


def split_spec(spec: str) -> tuple[str, int]:
    """``FILE[:INDEX]`` -> (file, index); a path that exists as given is never split."""
    path, sep, index = spec.rpartition(":")
    if not sep or Path(spec).exists() or not index.isdigit():
        return spec, 0
    return path, int(index)


class SavedPlan(NamedTuple):
    """One plan of a plan file, as main.py reads it."""

    run: Mapping[str, Any]  # option values under their YAML keys
    placement: tuple[PlacementRow, ...]  # empty: ranks fill nodes in order
    data: Mapping[str, Any]  # the data's option values (YAML keys); empty in older files


def load(spec: str) -> SavedPlan:
    """The plan's option values, its placement and the data it was made for."""
    path, index = split_spec(spec)
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError("--plan", spec, f"must be a readable file ({exc.strerror})") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(
            "--plan", spec, f"must be JSON from scripts/plan.py --json ({exc})"
        ) from exc
    plans = doc.get("plans") if isinstance(doc, Mapping) and "run" not in doc else [doc]
    if not isinstance(plans, list) or not plans:
        raise ConfigError("--plan", spec, "must hold 'plans' (scripts/plan.py --json) or one plan")
    if index >= len(plans):
        raise ConfigError("--plan", spec, f"the file holds plans 0..{len(plans) - 1}")
    plan = plans[index]
    run = plan.get("run") if isinstance(plan, Mapping) else None
    if not isinstance(run, Mapping) or not run:
        raise ConfigError(
            "--plan", spec, "the plan has no 'run' options (written by an older scripts/plan.py?)"
        )
    return SavedPlan(
        run, placement(plan.get("placement") or [], spec), data(plan.get("data"), spec)
    )


def data(section: Any, spec: str) -> Mapping[str, Any]:
    """The plan's data options without the shape they describe (checked, not applied: the
    options give it again)."""
    if section is None:
        return {}
    where = f"--plan {spec}: data"
    if not isinstance(section, Mapping):
        raise ConfigError(where, section, "must be a mapping of main.py data options")
    shape = section.get("input_shape")
    if shape is not None and not (
        isinstance(shape, list) and shape and all(_count(d) and d > 0 for d in shape)
    ):
        raise ConfigError(f"{where} input_shape", shape, "must be a list of positive integers")
    return {k: v for k, v in section.items() if k != "input_shape"}


def placement(rows: Any, spec: str) -> tuple[PlacementRow, ...]:
    """The placement list as (node, device, type, cpu) rows; each problem is one line."""
    if not isinstance(rows, list):
        raise ConfigError("--plan", spec, "'placement' must be a list, one entry per rank")
    out: list[PlacementRow] = []
    for rank, row in enumerate(rows):
        where = f"--plan {spec}: placement of rank {rank}"
        if not isinstance(row, Mapping) or "node" not in row or set(row) - _PLACE_KEYS:
            raise ConfigError(where, row, f"must be a mapping of {sorted(_PLACE_KEYS)} with node")
        node, device, kind, cpu = (row.get(k) for k in _ORDER)
        if not _count(node) or not (device is None or _count(device)):
            raise ConfigError(where, row, "node and device must be integers >= 0")
        if not isinstance(kind, (str, type(None))):
            raise ConfigError(where, row, "type must be a device type's name")
        if cpu is not None and not (
            isinstance(cpu, (int, float)) and not isinstance(cpu, bool) and 0 < cpu < math.inf
        ):
            raise ConfigError(where, row, "cpu must be a fraction of one CPU > 0")
        out.append((node, device, kind or "", None if cpu is None else float(cpu)))
    return tuple(out)


def _count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
