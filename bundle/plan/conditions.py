"""The conditions a profile was measured under, and whether to trust it.

A timing taken while other work shared the CPU is slower than the same work on a quiet machine,
and a cached one skews every later plan. So each measured profile records what it was measured
under: the 1-minute load average as it started, the share of the CPU its threads got while they
were ready to run (Linux's per-thread ``schedstat``: time on a CPU against time waiting for one),
the spread of its repetitions, and the torch version, device and thread count. ``trouble()`` says
why not to trust it, or None; the profile cache (``bundle.plan.cache.ProfileCache``) measures
such an entry again rather than use it, and never keeps one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from types import TracebackType

# Below this share of the CPU time its threads were ready for, the process was crowded out.
MIN_CPU_SHARE = 0.8
# Above this load average per CPU as it started, the machine was busy: judged only without a
# share (no schedstat), since the load average lags a minute behind (the last job's load).
MAX_LOAD_PER_CPU = 1.0
# Above this (third quartile - first) / median of the repetitions, the timings are noise.
MAX_SPREAD = 0.25
# A share is judged only from this much CPU time: a process that mostly waited tells little.
_MIN_RUN_S = 0.01


@dataclass(frozen=True)
class Conditions:
    measured_at: float  # seconds since the epoch
    load: float  # the 1-minute load average as the measurement started
    cpus: int
    cpu_share: float | None  # of the time its threads were ready to run, the part they ran
    spread: float | None  # (third quartile - first) / median of the repetitions, the widest
    torch: str
    device: str
    threads: int

    def trouble(self) -> str | None:
        """Why the measurement cannot be trusted, or None."""
        if self.cpu_share is not None and self.cpu_share < MIN_CPU_SHARE:
            return (
                f"the process got {self.cpu_share:.0%} of the CPU time it was ready to use "
                f"(load average {self.load:.1f} on {self.cpus} CPU(s))"
            )
        if self.cpu_share is None and self.load > MAX_LOAD_PER_CPU * self.cpus:
            return f"load average {self.load:.1f} on {self.cpus} CPU(s)"
        if self.spread is not None and self.spread > MAX_SPREAD:
            return f"its repetitions spread {self.spread:.0%} around their median"
        return None

    def describe(self, now: float | None = None, *, age: bool = True) -> str:
        seconds = max((time.time() if now is None else now) - self.measured_at, 0.0)
        parts = [f"measured {_age(seconds)} ago"] if age else []
        parts.append(f"load {self.load:.1f} on {self.cpus} CPU(s)")
        if self.cpu_share is not None:
            parts.append(f"{self.cpu_share:.0%} of the CPU it was ready for")
        if self.spread is not None:
            parts.append(f"repetitions within {self.spread:.0%}")
        parts.append(f"torch {self.torch}, {self.threads} thread(s)")
        return ", ".join(parts)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> Conditions:
        return cls(**doc)


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def spread(values: Sequence[float]) -> float | None:
    """(third quartile - first) / median of repeated timings; None for fewer than 3."""
    if len(values) < 3:
        return None
    v = sorted(values)
    n = len(v)
    median = v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2
    q1, q3 = v[(n - 1) // 4], v[-1 - (n - 1) // 4]
    return (q3 - q1) / median if median > 0 else None


def schedstat() -> dict[str, tuple[int, int]] | None:
    """Per thread of this process: (nanoseconds on a CPU, nanoseconds waiting for one)."""
    try:
        out = {}
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, wait = f.read().split()[:2]
            out[tid] = (int(run), int(wait))
        return out
    except (OSError, ValueError):
        return None


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass
class Watch:
    """Around a measurement: ``with Watch() as w: ...``; then ``w.conditions(device, threads)``.
    ``repeats(values)`` records one set of repetitions (the widest spread is kept). The readers
    are replaceable (tests fake a busy machine)."""

    load: Callable[[], float] = _load
    sched: Callable[[], dict[str, tuple[int, int]] | None] = schedstat
    clock: Callable[[], float] = time.time
    cpus: Callable[[], int] = _cpus
    spreads: list[float] = field(default_factory=list)

    def __enter__(self) -> Watch:
        self.start, self.load0, self.sched0 = self.clock(), self.load(), self.sched()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.sched1 = self.sched()

    def repeats(self, values: Sequence[float]) -> None:
        s = spread(values)
        if s is not None:
            self.spreads.append(s)

    def share(self) -> float | None:
        if self.sched0 is None or self.sched1 is None:
            return None
        run = wait = 0
        for tid, (r1, w1) in self.sched1.items():
            r0, w0 = self.sched0.get(tid, (0, 0))
            run, wait = run + r1 - r0, wait + w1 - w0
        if run < _MIN_RUN_S * 1e9:
            return None
        return run / (run + wait)

    def conditions(self, device: str, threads: int, torch_version: str) -> Conditions:
        return Conditions(
            measured_at=self.start,
            load=round(self.load0, 2),
            cpus=self.cpus(),
            cpu_share=None if (s := self.share()) is None else round(s, 3),
            spread=round(max(self.spreads), 3) if self.spreads else None,
            torch=torch_version,
            device=device,
            threads=threads,
        )
