"""A user's function by reference: ``package.module:function`` (imported from the current
directory first) or ``path/to/file.py:function``, for the factories of models, data and losses.
Below the models package and the modules in it, which all may name one."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bundle.errors import ConfigError


def _import(name: str) -> Any:
    """``pkg.mod:attr`` or ``path/file.py:attr`` -> the attribute (the current directory first)."""
    where, _, attr = name.rpartition(":")
    try:
        if where.endswith(".py"):
            path = Path(where).resolve()
            spec = importlib.util.spec_from_file_location(path.stem, path)
            if spec is None or spec.loader is None or not path.is_file():
                raise ImportError(f"no file {where}")
            module = importlib.util.module_from_spec(spec)
            sys.modules.setdefault(path.stem, module)
            spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(where)
    except Exception as exc:  # noqa: BLE001 - whatever the user's import raised
        raise ConfigError("--model", name, f"cannot import {where}: {_why(exc, where)}") from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError("--model", name, f"{where} has no attribute {attr!r}")
        target = getattr(target, part)
    return target


# What pip installs for a package that is not there, where the distribution is named otherwise.
_PIP_NAMES = {"sklearn": "scikit-learn", "yaml": "pyyaml", "PIL": "pillow"}


def _why(exc: Exception, where: str) -> str:
    """Why importing ``where`` failed: a missing package with the command that installs it, unless
    the missing one is the user's own module (a path to fix, not a package to install)."""
    from bundle.models import hf

    if hf.missing(exc):
        return f"transformers is not installed ({hf.install_command()})"
    package = (exc.name or "") if isinstance(exc, ModuleNotFoundError) else ""
    package = package.partition(".")[0]
    if not package or package == where.partition(".")[0]:
        return f"{type(exc).__name__}: {exc}"
    return (
        f"no module named {package!r} is installed (pip install {_PIP_NAMES.get(package, package)})"
    )


def load_callable(name: str, what: str) -> Callable[..., Any]:
    """A user's function named ``module:function`` (the factories of models, data and losses)."""
    fn = _import(name)
    if not callable(fn):
        raise ConfigError(
            what, name, f"{name.rpartition(':')[2]} is a {type(fn).__name__}, not a function"
        )
    return fn
