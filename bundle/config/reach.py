"""How far a setting reaches beyond its process, declared once in its field's metadata, and the
views of a config that follow from it; apart from the sections, so that every section's module
marks its fields from the one place below them all."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import Field, fields, is_dataclass
from types import MappingProxyType
from typing import Any

# The views RunConfig.shared_view (what the nodes compare when they join) and
# RunConfig.run_settings (what a checkpoint records and a resume compares) follow from these marks.
# Unmarked, a setting must agree between nodes and is not recorded.
NODE_LOCAL: Mapping[str, str] = MappingProxyType({"nodes": "local"})  # nodes may differ (paths)
NODES_AGREE_IF_SET: Mapping[str, str] = MappingProxyType({"nodes": "whether set"})


def recorded(key: str = "") -> Mapping[str, str]:
    """A setting a checkpoint records, under ``key`` (default: the field's name); it is the
    option's name too, as the note about a setting changed on resume spells it (``--key``)."""
    return MappingProxyType({"recorded": key})


RECORDED = recorded()


def shared(config: Any) -> dict[str, Any]:
    """The settings of a config and its sections that must agree between nodes (the node-local
    left out, those agreed if set as whether they are)."""
    view: dict[str, Any] = {}
    for f in fields(config):
        nodes, value = f.metadata.get("nodes"), getattr(config, f.name)
        if nodes == "local":
            continue
        if is_dataclass(value):
            view[f.name] = shared(value)
        else:
            view[f.name] = value is not None if nodes == "whether set" else value
    return view


def leaves(config: Any) -> Iterator[tuple[Field[Any], Any]]:
    """Every setting of a config and its sections, with its field, in declaration order."""
    for f in fields(config):
        value = getattr(config, f.name)
        if is_dataclass(value):
            yield from leaves(value)
        else:
            yield f, value
