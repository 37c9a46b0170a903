"""What a training process is doing now, for its step watchdog and its error reports."""

from __future__ import annotations

from typing import Protocol


class Positioned(Protocol):
    @property
    def position(self) -> str: ...


class Phase:
    """Owned by the process wrapper; the training loop names its phases (``resume``,
    ``evaluation after step 4, batch 2 of 9``, ``checkpoint after step 4``...), and while a step
    runs the engine's own position ("step 3 recv_act1") is read instead.

    The watchdog takes a position that stops changing for ``--timeout`` as a stall, and a failing
    process reports ``failed at <position>``; reading it formats a string, writing it does not.
    """

    def __init__(self, label: str = "start-up") -> None:
        self._label: str | None = label
        self._engine: Positioned | None = None

    def follow(self, engine: Positioned | None) -> None:
        """From now on, outside named phases, the engine's position is this process's (None:
        forget the engine, whose session is being dropped)."""
        self._engine = engine

    def enter(self, label: str) -> None:
        self._label = label

    def training(self) -> None:
        """A step begins: the engine's position tells where this process is."""
        self._label = None

    def __str__(self) -> str:
        if self._label is not None or self._engine is None:
            return self._label or "start-up"
        return self._engine.position
