"""Traces of a run: every process's traced laps merged by rank 0 into one Chrome/Perfetto trace on
one time axis, and torch.profiler's kernel-level traces per process.

Each process's slices are on its own host's monotonic clock. Before merging, every process
measures its offset to rank 0's clock through the job's store (the round trip with the smallest
delay wins, so the error is at most half of it), which lines up a receive's wait with the send it
waited for even across nodes.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from time import perf_counter_ns

import torch
import torch.distributed as dist

from bundle import log
from bundle.observe.timing import CATEGORY_OF, LABELS, Mark, Slice
from bundle.runtime import keys
from bundle.topology import Topology

ROUNDS = 8  # store round trips per process when measuring its clock offset


def clock_offset(store: dist.Store, rank: int, world: int, timeout: float) -> int:
    """Nanoseconds to add to this process's ``perf_counter_ns`` to read rank 0's.

    Rank 0 answers the others' pings one process at a time, so no round trip queues behind
    another's.
    """
    wait = timedelta(seconds=timeout)
    if rank == 0:
        for r in range(1, world):
            store.set(keys.clock_go(r), "1")
            for i in range(ROUNDS):
                store.wait([keys.clock_ping(r, i)], wait)
                store.set(keys.clock_pong(r, i), str(perf_counter_ns()))
        return 0
    store.wait([keys.clock_go(rank)], wait)
    best: tuple[int, int] | None = None
    for i in range(ROUNDS):
        t1 = perf_counter_ns()
        store.set(keys.clock_ping(rank, i), "1")
        store.wait([keys.clock_pong(rank, i)], wait)
        t3 = perf_counter_ns()
        t2 = int(store.get(keys.clock_pong(rank, i)))
        if best is None or t3 - t1 < best[0]:
            best = (t3 - t1, t2 - (t1 + t3) // 2)
    assert best is not None  # ROUNDS >= 1
    return best[1]


def chrome_events(gathered: list[tuple[int, list[Slice]]], topo: Topology) -> list[dict]:
    """Trace events from each rank's (clock offset, slices): a named row per rank, microseconds
    from the earliest slice, on rank 0's clock."""
    starts = [t0 + off for off, slices in gathered for (_, _, _, t0, _) in slices]
    origin = min(starts, default=0)
    events: list[dict] = []
    for rank, (off, slices) in enumerate(gathered):
        c = topo.coord(rank)
        name = f"bundle {c.bundle} stage {c.stage} replica {c.replica}"
        events.append(
            {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": name}}
        )
        events.append(
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": rank,
                "tid": 0,
                "args": {"sort_index": rank},
            }
        )
        for mark, micro, step, t0, t1 in slices:
            label = LABELS[Mark(mark)]
            args = {"step": step + 1}
            if micro >= 0:
                label, args["micro"] = f"{label} {micro}", micro
            events.append(
                {
                    "ph": "X",
                    "name": label,
                    "cat": CATEGORY_OF[Mark(mark)],
                    "pid": rank,
                    "tid": 0,
                    "ts": (t0 + off - origin) / 1e3,
                    "dur": (t1 - t0) / 1e3,
                    "args": args,
                }
            )
    return events


def write_trace(
    path: str | None,
    slices: list[Slice],
    *,
    rank: int,
    topo: Topology,
    group: dist.ProcessGroup,
    store: dist.Store | None,
    timeout: float,
    info: dict,
) -> None:
    """Collective over ``group`` (every rank): gather the slices to rank 0, which writes ``path``.

    Without a store (processes sharing one clock, as in tests) no offsets are measured.
    """
    offset = clock_offset(store, rank, topo.world_size, timeout) if store is not None else 0
    gathered: list | None = [None] * topo.world_size if rank == 0 else None
    dist.gather_object((offset, slices), gathered, dst=0, group=group)
    if gathered is None or not path:
        return
    doc = {
        "traceEvents": chrome_events(gathered, topo),
        "displayTimeUnit": "ms",
        "otherData": {
            **info,
            "clock_offsets_us": {str(r): o / 1e3 for r, (o, _) in enumerate(gathered)},
        },
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)
    log.notice(f"trace of steps {info['steps'][0]}..{info['steps'][1]} written to {path}")


class KernelProfiler:
    """``torch.profiler`` over steps A..B (1-based) of this process, written as DIR/rank<N>.json."""

    def __init__(
        self, steps: tuple[int, int] | None, directory: str, rank: int, device: torch.device
    ) -> None:
        self.steps, self.rank = steps, rank
        self.path = os.path.join(directory, f"rank{rank}.json")
        # Kineto reports a CPU-only machine's missing GPUs as errors; keep warnings and up.
        os.environ.setdefault("KINETO_LOG_LEVEL", "3")
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof: torch.profiler.profile | None = None

    def before(self, step: int) -> None:
        if self.steps and step + 1 == self.steps[0]:
            self._prof = torch.profiler.profile(activities=self.activities)
            self._prof.start()

    def after(self, step: int) -> None:
        if self._prof is not None and self.steps and step + 1 >= self.steps[1]:
            self.close()

    def close(self) -> None:
        """Stop and write (also when the run ends or stops inside the range)."""
        if self._prof is None:
            return
        self._prof.stop()
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._prof.export_chrome_trace(self.path)
        self._prof = None
        if self.rank == 0:
            log.notice(f"profiler traces written to {os.path.dirname(self.path)}/rank<N>.json")
