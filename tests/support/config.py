"""The one factory for test configs: ``RunConfig`` with only the named fields changed."""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace
from typing import Any

from bundle.config import RunConfig


def make_config(**changes: Any) -> RunConfig:
    """``make_config(parallel={"shape": (2, 1)}, train={"steps": 3}, metrics_out="m.jsonl")``:
    a section given as a mapping changes those of its fields; anything else replaces the field.
    Every section validates itself as the command line's config does."""
    base = RunConfig()
    known = {f.name for f in fields(RunConfig)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise TypeError(f"RunConfig has no field {unknown[0]!r}")
    values = {}
    for name, change in changes.items():
        section = getattr(base, name)
        if isinstance(change, dict) and is_dataclass(section):
            values[name] = replace(section, **change)
        else:
            values[name] = change
    return replace(base, **values)
