"""Throughput meter and the JSON-lines metrics file (the last line is the run's summary)."""

from __future__ import annotations

import json
import os
import time


class Meter:
    """Samples per second over steps after the first ``warmup`` ones (start-up is not throughput)."""

    def __init__(self, *, warmup: int = 1) -> None:
        self.warmup, self.steps, self.samples = warmup, 0, 0
        self.t0: float | None = None
        self.t_last = time.perf_counter()

    def step(self, samples: int) -> None:
        self.steps += 1
        now = time.perf_counter()
        if self.steps == self.warmup:
            self.t0 = now
        elif self.steps > self.warmup:
            self.samples += samples
        self.t_last = now

    @property
    def samples_per_s(self) -> float:
        if self.t0 is None or self.t_last <= self.t0:
            return 0.0
        return self.samples / (self.t_last - self.t0)


class MetricsFile:
    """Appends one JSON object per line; a ``None`` path writes nothing."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w"):
                pass

    def write(self, record: dict) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")
