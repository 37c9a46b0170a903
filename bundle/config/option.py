"""One option of the table (``bundle.config.options``): its spelling, the RunConfig field it
fills, how its text becomes the field's value and how ``--help`` shows it."""

from __future__ import annotations

import argparse
import functools
import types
import typing
from dataclasses import KW_ONLY, dataclass
from operator import attrgetter
from typing import Any

from bundle import config as C
from bundle.errors import ConfigError

_DEFAULTS = C.RunConfig()
_FROM_FIELD: Any = object()  # an option's unset value is its field's dataclass default


@functools.cache
def _annotation(path: str) -> Any:
    """The resolved type of a RunConfig field, ``"train.lr"`` -> ``float``."""
    owner: Any = C.RunConfig
    for name in path.split("."):
        owner = typing.get_type_hints(owner)[name]
    return owner


def _scalar(annotation: Any) -> type:
    """``str | None`` -> ``str``; ``tuple[int, ...]`` -> ``tuple``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = (a for a in typing.get_args(annotation) if a is not type(None))
    scalar: type = typing.get_origin(annotation) or annotation
    return scalar


@dataclass(frozen=True)
class Option:
    """One option: its spelling, the RunConfig field it fills, and how --help shows it.

    Type and unset value come from the field, so the dataclass stays the one place that knows
    them. An option without a field (``--DP-ONLY``, ``--config``) is a mode that cli.to_config
    reads itself and names its own ``kind``.
    """

    group: str | None  # argparse group title; None: the parser's own (the positional)
    flag: str  # names the argparse dest and the YAML key; without dashes: a positional
    field: str | None  # "section.name" in RunConfig; None: a mode cli.to_config reads
    _: KW_ONLY
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    aliases: tuple[str, ...] = ()  # other spellings, shown beside it in --help
    negate: bool = False  # "--no-X": given sets the (bool) field to False
    kind: type | None = None  # only for options without a field
    default: Any = _FROM_FIELD  # only where unset must not be the field's default
    yaml: bool = True  # accepted as a --config key
    parse: Any = None  # a tuple field's text -> its value (unset: C.parse_shape)

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def keys(self) -> tuple[str, ...]:
        """YAML keys, normalised to '_' (a file may spell them with '-' or '_')."""
        return tuple(f.lstrip("-").replace("-", "_") for f in (self.flag, *self.aliases))

    @property
    def value_type(self) -> type:
        if self.field is not None:
            return _scalar(_annotation(self.field))
        if self.kind is None:
            raise TypeError(f"{self.flag} fills no RunConfig field, so it must name its kind")
        return self.kind

    @property
    def unset(self) -> Any:
        """The value args holds when neither the command line nor YAML gives the option."""
        if self.default is not _FROM_FIELD:
            return self.default
        if self.field is None:
            return False if self.kind is bool else None
        value = attrgetter(self.field)(_DEFAULTS)
        if self.negate:
            return not value
        # A tuple field is spelled "1,1" on the command line, so its unset value is too.
        return ",".join(map(str, value)) if isinstance(value, tuple) else value

    def to_field(self, value: Any) -> Any:
        if self.negate:
            return not value
        return (self.parse or C.parse_shape)(value) if self.value_type is tuple else value

    def from_yaml(self, value: Any, where: str) -> Any:
        """A YAML value as the command line would have given it."""
        kind = self.value_type
        if kind is bool:
            if not isinstance(value, bool):
                raise ConfigError(where, value, "must be true or false")
            return value
        if value is None and self.unset is None:
            return None
        if kind is tuple and isinstance(value, list):
            if not all(isinstance(v, (int, float, str)) and not isinstance(v, bool) for v in value):
                raise ConfigError(where, value, "must be a flat list of numbers or words")
            value = ",".join(map(str, value))
        parse = str if kind is tuple else kind
        wrong = ConfigError(where, value, f"must be {parse.__name__}")
        if isinstance(value, (bool, list, dict)) or value is None:
            raise wrong
        # Through str, as from the command line: YAML's 3.7 is then no int (int() would truncate
        # it) and its "1e-3" (a string to YAML 1.1) a float.
        try:
            value = parse(str(value))
        except ValueError as exc:
            raise wrong from exc
        if self.choices and value not in self.choices:
            raise ConfigError(where, value, f"choose one of: {', '.join(self.choices)}")
        return value

    def add_to(self, group: Any, *, suppress: bool) -> None:
        kw: dict[str, Any] = {
            "help": self.help,
            "default": argparse.SUPPRESS if suppress else self.unset,
        }
        if self.value_type is bool:
            kw["action"] = "store_true"
        else:
            # A tuple stays text until to_field, so that a bad shape is a ConfigError naming it.
            kind = str if self.value_type is tuple else self.value_type
            kw.update(type=kind, metavar=self.metavar, choices=self.choices)
        if not self.flag.startswith("-"):
            kw["nargs"] = "?"
        group.add_argument(self.flag, *self.aliases, **kw)
