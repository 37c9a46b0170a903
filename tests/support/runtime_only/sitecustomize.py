"""An interpreter that sees only what ``pip install -r requirements.txt`` installs.

Put this folder first on ``PYTHONPATH`` and name the requirements file in ``BUNDLE_RUNTIME_ONLY``:
every process started so (processes a run spawns too: they inherit both) finds a package only if
its distribution is one ``requirements.txt`` names or one that those depend on, or it belongs to
no distribution (the standard library, the project's own folders). Any other package on the
machine (transformers, safetensors, pytest, ...) looks absent: ``import`` raises
``ModuleNotFoundError`` and ``importlib.util.find_spec`` answers None, as on a machine where it was
never installed, whatever this one happens to have. Standard library only, so it runs before
anything else is importable.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import os
import re
import sys
from collections.abc import Iterable

ENV = "BUNDLE_RUNTIME_ONLY"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def normalized(name: str) -> str:
    """A distribution's name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def named(requirements: str) -> set[str]:
    """The distributions a requirements file names (normalized; options and comments skipped)."""
    names = set()
    with open(requirements) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            match = _NAME.match(line)
            if match and not line.startswith("-"):
                names.add(normalized(match.group()))
    return names


def _needs(requirement: str) -> str | None:
    """The distribution one ``Requires-Dist`` line needs unconditionally (None: only an extra)."""
    spec, _, marker = requirement.partition(";")
    if "extra" in marker:
        return None
    if marker.strip():
        try:
            from packaging.markers import Marker

            if not Marker(marker.strip()).evaluate():
                return None
        except ImportError:  # unevaluated: taken, which can only let more through
            pass
    match = _NAME.match(spec.strip())
    return normalized(match.group()) if match else None


def installed_with(names: Iterable[str]) -> set[str]:
    """``names`` and every distribution they depend on, as installed here (normalized)."""
    seen: set[str] = set()
    todo = [normalized(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [dep for dep in map(_needs, requires) if dep and dep not in seen]
    return seen


def refused(allowed: set[str]) -> set[str]:
    """The top-level import names that no allowed distribution gives."""
    return {
        top
        for top, dists in importlib.metadata.packages_distributions().items()
        if top not in sys.stdlib_module_names and not any(normalized(d) in allowed for d in dists)
    }


class _PathFinderWithout:
    """The path finder, blind to the refused top-level names (and everything under them)."""

    def __init__(self, finder: object, hidden: set[str]) -> None:
        self._finder, self.hidden = finder, hidden

    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        if name.partition(".")[0] in self.hidden:
            return None
        return self._finder.find_spec(name, path, target)  # type: ignore[attr-defined]

    def __getattr__(self, attr: str) -> object:  # invalidate_caches and the rest: the finder's
        return getattr(self._finder, attr)


def install(requirements: str) -> set[str]:
    """Hide every package outside ``requirements`` and its dependencies; returns what is hidden."""
    hidden = refused(installed_with(named(requirements) | {"bundle"}))
    for i, finder in enumerate(sys.meta_path):
        if finder is importlib.machinery.PathFinder:
            sys.meta_path[i] = _PathFinderWithout(finder, hidden)  # type: ignore[call-overload]
    for top in [m for m in sys.modules if m.partition(".")[0] in hidden]:
        del sys.modules[top]  # imported by a .pth file before this ran: gone too
    return hidden


if os.environ.get(ENV):
    install(os.environ[ENV])
