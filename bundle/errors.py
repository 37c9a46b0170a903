"""Typed errors of the engine: each carries the offending value; only bundle.cli.main maps them to exit codes."""

from __future__ import annotations


class BundleError(Exception):
    """Base of every error the engine raises on purpose."""


class ConfigError(BundleError, ValueError):
    """A flag or config key has a value that is not allowed (raised before any process group)."""

    def __init__(self, key: str, value: object, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}: {value!r} is not valid; {allowed}")

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


def positive(key: str, value: int, minimum: int = 1) -> None:
    """Refuse ``value`` for ``key`` unless it is an integer >= ``minimum``."""
    if not isinstance(value, int) or value < minimum:
        raise ConfigError(key, value, f"must be an integer >= {minimum}")
