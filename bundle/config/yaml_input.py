"""YAML a user gives (``--config``, ``--plan``'s, ``--cluster``, ``--partition``) read as data:
``yaml.safe_load``, less the aliases that expand."""

from __future__ import annotations

from typing import IO, Any

import yaml  # type: ignore[import-untyped,unused-ignore]


class ExpandingAlias(yaml.composer.ComposerError):
    """A YAML alias of a list or mapping: every use repeats the whole of it, so a few hundred
    bytes of nested ones stand for billions of values (the "billion laughs")."""

    def __init__(self, name: str, kind: str, mark: Any) -> None:
        super().__init__(problem=f"the alias *{name} repeats a {kind}", problem_mark=mark)
        self.line = mark.line + 1

    def __str__(self) -> str:
        return (
            f"line {self.line}: {self.problem}; only an alias of one value is read "
            "(write the list or mapping out)"
        )


class _UserYaml(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses an alias which expands (``ExpandingAlias``)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call,unused-ignore]
            node = self.anchors.get(event.anchor)
            if isinstance(node, (yaml.SequenceNode, yaml.MappingNode)):
                kind = "list" if isinstance(node, yaml.SequenceNode) else "mapping"
                raise ExpandingAlias(event.anchor, kind, event.start_mark)
        return super().compose_node(parent, index)


def load_yaml(stream: str | IO[str]) -> Any:
    """A YAML file a user gives (``--config``, ``--cluster``, ``--partition``), as
    ``yaml.safe_load`` reads it; an alias of a list or mapping is refused (``ExpandingAlias``,
    a ``yaml.YAMLError``), one of a single value is read."""
    return yaml.load(stream, Loader=_UserYaml)  # noqa: S506 - a SafeLoader
