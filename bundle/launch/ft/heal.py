"""A node supervisor's side of ``--fault-tolerance bundle``: a worker that failed takes its bundle
out of the job (marked in the store, so that no survivor waits for it), and once every one of
this node's processes of that bundle has exited, they are started again as the bundle's next
incarnation (``--max-restarts`` times per bundle), which the survivors take back in. A node that
stops responding (node 0's supervisor sees its heartbeat stop) takes every bundle with a process
on it out the same way, for good: no supervisor is left there to start them again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from bundle import log
from bundle.launch.ft.membership import is_dead, mark_dead
from bundle.runtime import control, keys
from bundle.topology import Topology

# start(rank, incarnation, handed): a new worker for ``rank``, started (``handed``: it reads the
# state its previous process handed over, bundle.launch.ft.handoff).
Start = Callable[[int, int, bool], Any]


class Healer:
    """This node's bundles: their incarnations, the heals left, the workers started again."""

    def __init__(
        self,
        topo: Topology,
        node: int,
        store: dist.Store,
        *,
        heals: int,
        start: Start,
    ) -> None:
        self.topo, self.store, self.start, self.budget = topo, store, start, heals
        self.local = {
            b: [r for r in topo.node_ranks(node) if topo.coord(r).bundle == b]
            for b in {topo.coord(r).bundle for r in topo.node_ranks(node)}
        }
        self.incarnation = dict.fromkeys(self.local, 0)
        self.healed = dict.fromkeys(self.local, 0)
        self.exited: dict[int, set[int]] = {b: set() for b in self.local}
        nodes: dict[int, set[int]] = {b: set() for b in range(topo.num_bundles)}  # where each runs
        for r in range(topo.world_size):
            nodes[topo.coord(r).bundle].add(topo.node_of(r))
        self.nodes = {b: sorted(n) for b, n in nodes.items()}
        self._marks = 0  # the store's count of dead marks when ``reap`` last looked

    def lose(self, rank: int, what: str) -> str | None:
        """A worker exited non-zero (``what`` says how; empty: it left with its bundle). Returns
        the job's failure, or None while some bundle may still train."""
        bundle = self.topo.coord(rank).bundle
        self.exited[bundle].add(rank)
        if what and mark_dead(self.store, bundle, self.incarnation[bundle], what) == control.clean(
            what
        ):
            log.get().warning(f"bundle {bundle} leaves the job: {what}; the other bundles train on")
        return self._all_lost(what or self.topo.describe(rank))

    def lose_node(self, node: int, why: str) -> str | None:
        """Node ``node`` stopped responding (node 0's supervisor): every bundle with a process
        there leaves for good. Returns the job's failure, or None while some bundle may train."""
        control.put(self.store, keys.lost_node(node), why)
        for b in (b for b, nodes in self.nodes.items() if node in nodes):
            if mark_dead(self.store, b, self._incarnation_of(b), why) == control.clean(why):
                log.get().warning(
                    f"bundle {b} leaves the job for good: {why}; the other bundles train on"
                )
        return self._all_lost(why)

    def _incarnation_of(self, bundle: int) -> int:
        """The incarnation of ``bundle`` its supervisors started last (0: the first)."""
        return control.read_int(self.store, keys.healing(bundle)) or 0

    def _all_lost(self, last: str) -> str | None:
        """The job's failure once every bundle is marked dead and none can come back."""
        everyone = range(self.topo.num_bundles)
        gone = all(is_dead(self.store, b, self._incarnation_of(b)) for b in everyone)
        # With heals left, new processes that are never taken in fail the job after
        # --init-timeout themselves.
        if gone and (self.budget == 0 or all(self._node_lost(b) for b in everyone)):
            return f"every bundle failed (the last: {last})"
        return None

    def _node_lost(self, bundle: int) -> str | None:
        """Why ``bundle`` cannot be started again (a node of it is lost), or None."""
        lost = [n for n in self.nodes[bundle] if control.read(self.store, keys.lost_node(n))]
        return f"its node {lost[0]} is lost" if lost else None

    def frozen(self, procs: Mapping[int, Any]) -> Callable[[int, str], str | None]:
        """What the supervisor does with a worker that stopped responding: kill it, then lose it."""

        def report(rank: int, message: str) -> str | None:
            procs[rank].kill()
            return self.lose(rank, message)

        return report

    def reap(self, procs: Mapping[int, Any]) -> None:
        """Kill this node's live processes of every bundle whose incarnation is marked dead (by
        any node's supervisor, or by a process that left): they have nothing left to do."""
        marks = self.store.add(keys.FT_LOSSES, 0)
        if marks == self._marks:
            return
        self._marks = marks
        for b, ranks in self.local.items():
            if is_dead(self.store, b, self.incarnation[b]):
                for p in (procs[r] for r in ranks if procs[r].exitcode is None):
                    p.kill()

    def go_on(self, rank: int) -> dict[int, Any]:
        """A survivor handed its state over (``EXIT_HANDOFF``): its rank again, in a new process
        that reads it (rank -> worker)."""
        p = self.start(rank, self.incarnation[self.topo.coord(rank).bundle], True)
        log.get().info(f"rank {rank} goes on in a new process with its state (pid {p.pid})")
        return {rank: p}

    def restart(self, rank: int) -> dict[int, Any]:
        """After ``rank`` was lost: its bundle's workers on this node, started again once all of
        them have exited and heals are left (rank -> worker), else none."""
        bundle = self.topo.coord(rank).bundle
        if self.exited[bundle] != set(self.local[bundle]):
            return {}
        self.exited[bundle] = set()
        if (why := self._node_lost(bundle)) is not None:
            log.get().warning(f"bundle {bundle} is not started again: {why}")
            return {}
        if self.healed[bundle] >= self.budget:
            if self.budget:
                log.get().warning(
                    f"bundle {bundle} failed again after {self.healed[bundle]} heal(s) "
                    f"(--max-restarts {self.budget}): it stays out of the job"
                )
            return {}
        self.healed[bundle] += 1
        self.incarnation[bundle] += 1
        inc = self.incarnation[bundle]
        control.put(self.store, keys.healing(bundle), str(inc))
        started = {r: self.start(r, inc, False) for r in self.local[bundle]}
        log.get().info(
            f"bundle {bundle}: ranks {', '.join(map(str, started))} started again "
            f"(heal {self.healed[bundle]} of {self.budget}; pids "
            f"{', '.join(str(p.pid) for p in started.values())})"
        )
        return started
