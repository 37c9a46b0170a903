"""Typed errors of the engine: each carries the offending value; only bundle.cli.main maps them to
exit codes. Every exit code a process of a job ends with is one ``ExitCode``."""

from __future__ import annotations

from collections.abc import Iterator
from enum import IntEnum


class ExitCode(IntEnum):
    """How a process ends, and who reads it (a supervisor watching its workers, a user's shell).

    A signal's code is ``128 + signum`` (``signalled``), as a shell reports it."""

    OK = 0  # done: trained, exported, generated
    FAILED = 1  # a failure (a crash, a stall, a lost peer): its line says which rank and step
    INPUT = 2  # an input refused before any work: a flag, a file, a model (main.py, the tools)
    LEFT = 3  # --fault-tolerance bundle: a worker whose bundle left the job; not a failure itself
    HANDOFF = 4  # a survivor that wrote its state for a new process of its rank; not a failure


def signalled(signum: int) -> int:
    """The exit code of a process ended by a stop signal (``128 + signum``, as a shell has it)."""
    return 128 + signum


# Characters of a value an error shows at most: a value read from a file may be as large as the
# file lets it be (or larger: a YAML list repeated by aliases), and one line must stay one line.
SHOWN = 200


class BundleError(Exception):
    """Base of every error the engine raises on purpose."""


class ConfigError(BundleError, ValueError):
    """A flag or config key has a value that is not allowed (raised before any process group)."""

    def __init__(self, key: str, value: object, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}: {shown(value)} is not valid; {allowed}")

    def __reduce__(self):
        # Pickled whole (a planner child sends it back to its parent): rebuilt from its fields.
        return type(self), (self.key, self.value, self.allowed)


class TopologyError(ConfigError):
    """The bundle shape, bundle count or batch cannot be laid out on the processes."""


class PartitionError(BundleError, ValueError):
    """A partition spec does not fit its model (unknown or out-of-order split point)."""


class ScheduleError(BundleError, ValueError):
    """A schedule was asked for with parameters it cannot run."""


class DataError(BundleError, ValueError):
    """A dataset is missing, empty or malformed."""


class LaunchError(BundleError, RuntimeError):
    """Processes could not be started or the rendezvous failed (port in use, config mismatch)."""


class PeerFailure(BundleError, RuntimeError):
    """Another process of the job failed; the message names its rank, stage and step."""


class CheckpointError(BundleError, ValueError):
    """A checkpoint is missing, incomplete, or does not fit the model being trained."""


def shown(value: object, limit: int = SHOWN) -> str:
    """``repr(value)``; of a longer one its first ``limit`` characters, ending in ``...``. Built
    piece by piece and stopped there, so a list that would print as gigabytes costs no more."""
    text, size = [], 0
    for piece in _pieces(value, limit):
        text.append(piece)
        size += len(piece)
        if size > limit:
            return "".join(text)[: limit - 3] + "..."
    return "".join(text)


def _pieces(value: object, limit: int) -> Iterator[str]:
    """``repr(value)`` in pieces: lists, tuples and dicts opened (their own types only, as
    ``repr`` shows them), a long string cut."""
    if type(value) is str and len(value) > limit:
        yield repr(value[:limit])
    elif type(value) is list or type(value) is tuple:
        yield "[" if type(value) is list else "("
        for i, item in enumerate(value):
            yield ", " if i else ""
            yield from _pieces(item, limit)
        yield "]" if type(value) is list else ",)" if len(value) == 1 else ")"
    elif type(value) is dict:
        yield "{"
        for i, (k, v) in enumerate(value.items()):
            yield ", " if i else ""
            yield from _pieces(k, limit)
            yield ": "
            yield from _pieces(v, limit)
        yield "}"
    else:
        yield repr(value)


def positive(key: str, value: int, minimum: int = 1) -> None:
    """Refuse ``value`` for ``key`` unless it is an integer >= ``minimum``."""
    if not isinstance(value, int) or value < minimum:
        raise ConfigError(key, value, f"must be an integer >= {minimum}")
