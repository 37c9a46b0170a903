"""One rank-prefixed logger; only the chosen reporting rank prints progress."""

from __future__ import annotations

import logging
import sys

from termcolor import colored

_LOGGER = logging.getLogger("bundle")


def setup(prefix: str, *, verbose: bool = True) -> logging.Logger:
    """Configure the process-wide logger; warnings and errors always print, info only if verbose."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{colored(prefix, 'cyan')} %(message)s"))
    _LOGGER.handlers[:] = [handler]
    _LOGGER.setLevel(logging.INFO if verbose else logging.WARNING)
    _LOGGER.propagate = False
    return _LOGGER


def get() -> logging.Logger:
    return _LOGGER


def notice(message: str) -> None:
    """A line every process prints whatever its verbosity (what one process alone writes)."""
    _LOGGER.warning(message)
