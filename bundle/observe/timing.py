"""Where each step's time goes: a lap clock around the engine's actions, read once per window.

Every action of a step ends with ``timer.lap(mark, micro)``, which charges the time since the
previous lap to that action, so a step's time is split between categories with nothing left
over and nothing counted twice. An action that talks to a neighbour laps inside too: posting its
calls (``post``), waiting for a receive (``wait_act``/``wait_grad``), putting a forward's outputs in
their wire form (``copy``), and the engine's own work around them (``engine``), so a boundary's cost
is seen apart from the compute. On the CPU the clock is the host's monotonic clock
(``perf_counter_ns``, one call per lap); on CUDA each lap records an event on the current
stream and a window's events are read once, when the window closes, so timing never adds a
synchronisation inside a step. Steps chosen for ``--trace`` also keep every lap as a slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from time import perf_counter_ns
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from bundle.ir.schedule import REGISTRY, Op

if TYPE_CHECKING:
    from bundle.ir.p2p import StepPlan


class Mark(IntEnum):
    """What a lap was: the engine's actions, the data fetch, the gradient sync and the optimizer."""

    DATA = 0
    FORWARD = 1
    BACKWARD = 2
    WAIT_ACT = 3
    WAIT_GRAD = 4
    SEND_ACT = 5
    SEND_GRAD = 6
    SEND_WAIT = 7
    SYNC = 8
    OPTIMIZER = 9
    OTHER = 10  # the training loop's own work in a step: the stop vote, checkpoint polls
    # A split backward's halves (zero-bubble schedules): slices of their own in a trace, counted
    # as backward in the breakdown.
    BACKWARD_INPUT = 11
    BACKWARD_WEIGHT = 12
    # Inside the actions that cross a boundary: posting calls (building their operations and
    # handing them to the backend), a forward's outputs put in their wire form, and the engine's
    # own work on a receive or a send besides posting and waiting (a send's lap is SEND_ACT or
    # SEND_GRAD, counted as this).
    POST = 13
    COPY = 14
    ENGINE = 15


MARK_OF_OP = {
    Op.RECV_ACT: Mark.WAIT_ACT,
    Op.FORWARD: Mark.FORWARD,
    Op.SEND_ACT: Mark.SEND_ACT,
    Op.RECV_GRAD: Mark.WAIT_GRAD,
    Op.BACKWARD: Mark.BACKWARD,
    Op.SEND_GRAD: Mark.SEND_GRAD,
    Op.BACKWARD_INPUT: Mark.BACKWARD_INPUT,
    Op.BACKWARD_WEIGHT: Mark.BACKWARD_WEIGHT,
}
LABELS = {m: m.name.lower().replace("_", " ") for m in Mark}


def step_laps(plan: StepPlan, *, wire: Sequence[bool]) -> list[tuple[Mark, int]]:
    """(mark, micro) of every lap of one step's actions, in the engine's order: the calls posted
    as an action begins (labelled by the first one's micro-batch), a receive's wait, a forward's
    compute before its outputs go into wire form (its chunk's ``wire``), the action's last lap."""
    laps = []
    for a, posts in zip(plan.actions, plan.post_at, strict=True):
        if posts:
            laps.append((Mark.POST, plan.calls[posts[0]].ops[0].micro))
        if a.op in (Op.RECV_ACT, Op.RECV_GRAD) or (a.op is Op.FORWARD and wire[a.chunk]):
            laps.append((MARK_OF_OP[a.op], a.micro))
        laps.append((last_mark(a.op, wire=wire[a.chunk]), a.micro))
    return laps


def last_mark(op: Op, *, wire: bool) -> Mark:
    """The mark of an action's last lap (its earlier ones: ``Mark.POST`` for the calls posted as
    it begins, and a receive's wait): after its wait, a receive's remaining work is the engine's
    own; a forward whose outputs go out in ``wire`` form ends converting them."""
    if op in (Op.RECV_ACT, Op.RECV_GRAD):
        return Mark.ENGINE
    if op is Op.FORWARD and wire:
        return Mark.COPY
    return MARK_OF_OP[op]


# The breakdown's categories, in the order tables show them: ``send`` is waiting for the step's
# sends to complete, ``engine`` the engine's own work on a send or a receive.
CATEGORIES = (
    "data",
    "forward",
    "backward",
    "copy",
    "post",
    "wait_act",
    "wait_grad",
    "send",
    "engine",
    "sync",
    "optimizer",
    "other",
)
CATEGORY_OF = {
    m: "send"
    if m is Mark.SEND_WAIT
    else "engine"
    if m.name.startswith("SEND")
    else "backward"
    if m.name.startswith("BACKWARD")
    else m.name.lower()
    for m in Mark
}
# Time a stage spends waiting on its neighbours: the measured bubble.
WAITING = ("wait_act", "wait_grad", "send")

# One window of one process, as gathered: [steps, wall seconds, seconds per category...].
ROW = 2 + len(CATEGORIES)

# A traced lap: (mark, micro (-1: none), step (0-based), start ns, end ns) on this host's clock.
Slice = tuple[int, int, int, int, int]


class StepTimer:
    """Laps on the host's monotonic clock; the window and run totals of one process.

    ``begin(step)`` opens a step (the runner opens it itself when the loop has not), ``lap`` charges
    time, ``end()`` closes it. The first step this timer sees is warm-up: it counts in its window
    but not in the run's totals, as the throughput meter leaves it out.
    """

    def __init__(self, *, trace: tuple[int, int] | None = None) -> None:
        self.trace = trace
        self.slices: list[Slice] = []
        self.step, self.is_open, self.tracing = -1, False, False
        self.seen = 0
        self.window = [0.0] * ROW
        self.run = [0.0] * ROW
        self._laps = [0] * len(Mark)
        self._t0 = self._last = 0

    def begin(self, step: int) -> None:
        if self.is_open:
            return
        self.is_open, self.step = True, step
        self.tracing = self.trace is not None and self.trace[0] <= step + 1 <= self.trace[1]
        self._start()

    def _start(self) -> None:
        self._t0 = self._last = perf_counter_ns()

    def lap(self, mark: Mark, micro: int = -1) -> None:
        t = perf_counter_ns()
        self._laps[mark] += t - self._last
        if self.tracing:
            self.slices.append((mark, micro, self.step, self._last, t))
        self._last = t

    def end(self) -> None:
        self._close(self._laps, self._last - self._t0)
        self._laps = [0] * len(Mark)
        self.is_open = False

    def _close(self, laps: list[int], wall_ns: int) -> None:
        row = [1.0, wall_ns * 1e-9] + [0.0] * len(CATEGORIES)
        for m, ns in enumerate(laps):
            row[2 + CATEGORIES.index(CATEGORY_OF[Mark(m)])] += ns * 1e-9
        targets = (self.window, self.run) if self.seen else (self.window,)
        for total in targets:
            for i, v in enumerate(row):
                total[i] += v
        self.seen += 1

    def take_window(self) -> list[float]:
        """This window's row (see ``ROW``), and a fresh window."""
        row, self.window = self.window, [0.0] * ROW
        return row


class CudaStepTimer(StepTimer):
    """Laps as CUDA events on the current stream, read when a window closes (one synchronisation).

    A traced step synchronises once at its start to pin its events to the host clock, so its
    slices share the time axis of the other processes' traces.
    """

    PENDING = 256  # steps of events held before they are read anyway (callers that never window)

    def __init__(self, device: torch.device, *, trace: tuple[int, int] | None = None) -> None:
        super().__init__(trace=trace)
        self.device = device
        self._pool: list[torch.cuda.Event] = []
        self._used = 0
        # Per step: (step, host ns at its start event or None, [(mark, micro, event index)...]).
        self._steps: list[tuple[int, int | None, list[tuple[int, int, int]]]] = []

    def _event(self) -> int:
        if self._used == len(self._pool):
            self._pool.append(torch.cuda.Event(enable_timing=True))
        self._pool[self._used].record()
        self._used += 1
        return self._used - 1

    def _start(self) -> None:
        host = None
        if self.tracing:
            torch.cuda.synchronize(self.device)
            host = perf_counter_ns()
        self._steps.append((self.step, host, [(-1, -1, self._event())]))

    def lap(self, mark: Mark, micro: int = -1) -> None:
        self._steps[-1][2].append((mark, micro, self._event()))

    def end(self) -> None:
        self.is_open = False
        if len(self._steps) >= self.PENDING:
            self._drain()

    def _drain(self) -> None:
        """Read the recorded events into the window's and run's totals (one synchronisation)."""
        if self._used:
            self._pool[self._used - 1].synchronize()
        for step, host, laps in self._steps:
            start = self._pool[laps[0][2]]
            ends = [start.elapsed_time(self._pool[i]) * 1e6 for _, _, i in laps[1:]]
            per_mark = [0] * len(Mark)
            prev = 0.0
            for (mark, micro, _), end in zip(laps[1:], ends, strict=True):
                per_mark[mark] += int(end - prev)
                if host is not None:
                    self.slices.append((mark, micro, step, host + int(prev), host + int(end)))
                prev = end
            self._close(per_mark, int(prev))
        self._steps, self._used = [], 0

    def take_window(self) -> list[float]:
        self._drain()
        return super().take_window()


def make_timer(device: torch.device, trace: tuple[int, int] | None = None) -> StepTimer:
    return CudaStepTimer(device, trace=trace) if device.type == "cuda" else StepTimer(trace=trace)


def ideal_bubble(
    num_stages: int, micro_batches: int, schedule: str = "1f1b", chunks: int = 1
) -> tuple[float, str]:
    """The fill-and-drain share of a step with equal stages under ``schedule`` (``chunks`` model
    chunks per stage), and its formula: (S - 1) / (M + S - 1) for GPipe and 1F1B."""
    sched = REGISTRY[schedule]
    return sched.bubble(num_stages, micro_batches, chunks), sched.bubble_formula


def breakdown(
    rows: list[list[float]],
    stage_of: list[int],
    ideal: float,
    formula: str = REGISTRY["1f1b"].bubble_formula,
) -> dict | None:
    """Per stage, seconds per step in each category (mean and max over the stage's processes).

    ``rows[rank]`` is that process's window row; None when the window holds no step; ``ideal``
    the schedule's bubble with equal stages, by ``formula``.
    """
    if not rows or any(r[0] == 0 for r in rows):
        return None
    stages = []
    for s in sorted(set(stage_of)):
        mine = [r for r, st in zip(rows, stage_of, strict=True) if st == s]
        per_step = [[v / r[0] for v in r[1:]] for r in mine]  # [wall, categories...]

        def stat(values: list[float]) -> dict:
            return {"mean": sum(values) / len(values), "max": max(values)}

        seconds = {c: stat([p[1 + i] for p in per_step]) for i, c in enumerate(CATEGORIES)}
        waits = [
            sum(p[1 + CATEGORIES.index(c)] for c in WAITING) / p[0] if p[0] else 0.0
            for p in per_step
        ]
        stages.append(
            {
                "stage": s,
                "processes": len(mine),
                "step_s": stat([p[0] for p in per_step]),
                "bubble": stat(waits),
                "seconds": seconds,
            }
        )
    return {"ideal_bubble": ideal, "ideal_formula": formula, "stages": stages}


def table(report: dict) -> list[str]:
    """A breakdown as fixed-width lines: milliseconds per step (mean over the stage's processes)."""
    heads = ["stage", "procs", "step", *CATEGORIES, "bubble"]
    lines = ["  ".join(f"{h:>9}" for h in heads) + "   (ms/step; bubble: waiting/step)"]
    for st in report["stages"]:
        cells = [str(st["stage"]), str(st["processes"]), f"{st['step_s']['mean'] * 1e3:.2f}"]
        cells += [f"{st['seconds'][c]['mean'] * 1e3:.2f}" for c in CATEGORIES]
        cells.append(f"{st['bubble']['mean']:.3f}")
        lines.append("  ".join(f"{c:>9}" for c in cells))
    formula = report.get("ideal_formula", REGISTRY["1f1b"].bubble_formula)
    lines.append(f"ideal bubble {formula} = {report['ideal_bubble']:.3f}")
    return lines


class Breakdown:
    """Every process's timer rows, gathered to the reporting rank as per-stage breakdowns.

    ``window()`` and ``run()`` are collective over ``group`` (every process of the job); the
    reporting rank gets the breakdown, the others None.
    """

    def __init__(
        self,
        timer: StepTimer,
        *,
        group: dist.ProcessGroup,
        rank: int,
        reporter: int,
        stage_of: list[int],
        ideal: tuple[float, str],
    ) -> None:
        self.timer, self.group, self.rank, self.reporter = timer, group, rank, reporter
        self.stage_of, self.ideal = stage_of, ideal

    def _gather(self, row: list[float]) -> dict | None:
        mine = torch.tensor(row, dtype=torch.float64)
        rows = (
            [torch.empty_like(mine) for _ in self.stage_of] if self.rank == self.reporter else None
        )
        dist.gather(mine, rows, dst=self.reporter, group=self.group)
        if rows is None:
            return None
        return breakdown([r.tolist() for r in rows], self.stage_of, *self.ideal)

    def window(self) -> dict | None:
        """Since the last window."""
        return self._gather(self.timer.take_window())

    def run(self) -> dict | None:
        """Over the run's steps after the first (as samples/s counts them)."""
        self.timer.take_window()  # reads what a CUDA timer still holds into the run totals
        return self._gather(self.timer.run)
