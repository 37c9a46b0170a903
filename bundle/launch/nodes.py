"""The nodes of a job watching each other through its store: every node's supervisor ticks a
heartbeat counter, and node 0 reports a node whose counter stopped moving (the job fails; under
``--fault-tolerance bundle`` that node's bundles leave instead, bundle.launch.ft.heal) and, once
its own workers are done, waits for the other nodes to finish before its store goes away.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch.distributed as dist

from bundle.launch.ft.heal import Healer
from bundle.runtime import control, keys
from bundle.runtime.store import post_abort, read_abort

POLL_S = 0.5
HEARTBEAT_STALE_S = 20.0  # a silent node fails the job
MIN_STALE_S = 3.0  # under --fault-tolerance bundle it is found after --timeout, at least this


def heartbeat_check(
    base: dist.Store,
    store: dist.Store,
    node: int,
    nodes: int,
    timeout: float,
    healer: Healer | None,
) -> Callable[[], str | None]:
    """The heartbeat a node's supervisor takes every poll (``heartbeat``). Under
    --fault-tolerance bundle a silent node costs its bundles, not the job, and is found as the
    survivors' waits on it time out (--timeout), so that they agree at once."""
    beats: dict[int, tuple[int, float]] = {}
    if healer is None:
        return lambda: heartbeat(base, store, node, nodes, beats)
    stale = max(MIN_STALE_S, timeout)
    return lambda: heartbeat(base, store, node, nodes, beats, healer.lose_node, stale)


def heartbeat(
    base: dist.Store,
    store: dist.Store,
    node: int,
    nodes: int,
    beats: dict[int, tuple[int, float]],
    lose_node: Callable[[int, str], str | None] | None = None,
    stale_s: float = HEARTBEAT_STALE_S,
) -> str | None:
    """Every node ticks its counter; node 0 reports a node whose counter stopped moving for
    ``stale_s``: the job's failure, or under --fault-tolerance bundle ``lose_node(node, why)``
    (that node's bundles leave; returns the job's failure if none can train)."""
    base.add(keys.heartbeat(node), 1)
    if node != 0:
        return None
    now = time.monotonic()
    for other in range(1, nodes):
        count = base.add(keys.heartbeat(other), 0)
        last = beats.get(other)
        if last is None or count != last[0]:
            beats[other] = (count, now)
        elif now - last[1] > stale_s and not store.check([keys.done(other)]):
            why = f"node {other} stopped responding for {stale_s:.0f}s"
            if lose_node is None:
                return post_abort(store, why)
            beats[other] = (count, math.inf)  # lost once: not again unless it beats again
            if (failure := lose_node(other, why)) is not None:
                return post_abort(store, failure)
    return None


def wait_done(
    store: dist.Store,
    nodes: int,
    timeout: float,
    check: Callable[[], str | None] = lambda: None,
) -> str | None:
    """Node 0: wait until every node has finished (a node lost under --fault-tolerance bundle
    does not count), or the job failed; ``check`` (the heartbeat) still runs meanwhile, so a node
    that went silent is found here too."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [keys.done(i) for i in range(nodes) if not control.read(store, keys.lost_node(i))]
        if store.check(done):
            return None
        if (msg := check() or read_abort(store)) is not None:
            return msg
        time.sleep(POLL_S)
    return f"not every node reported completion within {timeout:.0f}s"
