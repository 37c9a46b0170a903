"""Which bundles train (``--fault-tolerance bundle``): agreed through the job's store after a
failure, by every process that is still running.

    epoch 0: bundles 0 1 2        bundle 1's worker dies in step t
      every other process: its step fails (a wait on the dead process, or on a peer that has
      left the old groups); it drops every group of epoch 0, which closes their connections and
      ends its peers' waits at once, and checks in: ``ft/1/in/<job rank>`` = steps it committed
      bundles complete when all their processes checked in; a supervisor marks a bundle whose
      process exited ``ft/dead/<bundle>``; once every bundle is complete or dead (or after
      twice ``--timeout``) the first to decide writes ``ft/1/members`` (compare-and-set): "0,2"
    epoch 1: bundles 0 2, a world of their own on a fresh prefix; step t again, with their rows

A process whose bundle is not among the members leaves (``BundleLeft``); fewer than
``--min-bundles`` members fail the job (``TooFewBundles``).

A bundle comes back as a new incarnation: its supervisors start its processes again and mark
``ft/healing/<bundle>`` = incarnation; each new process checks in at ``ft/join/<bundle>.<inc>``.
The members see it in their per-step vote (``joining``: every member must have seen every one of
its processes checked in), take it in after that step (``admit``: a new epoch, the state sent from
a peer), and tell the new processes the epoch at ``ft/join/<bundle>.<inc>/epoch``.
Pure but for the store (its keys: ``bundle.runtime.keys``): tested with a ``HashStore``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

from bundle.errors import BundleError, ExitCode, PeerFailure
from bundle.runtime import control, keys
from bundle.topology import Topology

POLL_S = 0.05
EXIT_LEFT = ExitCode.LEFT  # a worker whose bundle left the job (a process of it failed)

# How gloo words a peer that went away or a wait that ran out (c10d raises them as RuntimeError).
_LOSS_WORDS = ("Connection closed", "Connection reset", "Timed out", "timed out", "Broken pipe")


class BundleLeft(BundleError):
    """This process's bundle is not among the bundles that train on (a process of it failed)."""


class TooFewBundles(BundleError, RuntimeError):
    """Fewer bundles than ``--min-bundles`` remain: the job fails (the checkpoints remain)."""


def is_peer_loss(exc: BaseException) -> bool:
    """Whether ``exc`` says that a peer went away (train on without its bundle), not a fault of
    this process's own (which fails the job as always)."""
    if isinstance(exc, PeerFailure | dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(w in str(exc) for w in _LOSS_WORDS)


def mark_dead(store: dist.Store, bundle: int, incarnation: int, why: str) -> str:
    """Mark ``bundle``'s ``incarnation`` dead; returns the reason that stands (the first one).
    Marks are control keys (bundle.runtime.control): sealed, and read checked (``is_dead``)."""
    kept = control.put_first(store, keys.dead(bundle, incarnation), why)
    store.add(keys.FT_LOSSES, 1)
    return kept


def is_dead(store: dist.Store, bundle: int, incarnation: int) -> bool:
    return control.read(store, keys.dead(bundle, incarnation)) is not None


@dataclass
class Membership:
    """The bundles of the job that train now, as this process (job rank ``rank``) knows them."""

    store: dist.Store
    job: Topology
    rank: int
    timeout: float  # --timeout: the decision waits at most twice as long for a bundle's processes
    min_bundles: int = 1
    epoch: int = 0
    members: tuple[int, ...] = ()
    failures: int = 0  # bundles lost so far
    heals: int = 0  # bundles taken in again so far
    incarnation: int = 0  # this process's bundle's
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    incs: dict[int, int] = field(default_factory=dict)  # every member's incarnation

    def __post_init__(self) -> None:
        self.members = self.members or tuple(range(self.job.num_bundles))
        self.incs = self.incs or dict.fromkeys(self.members, 0)

    @property
    def bundle(self) -> int:
        return self.job.coord(self.rank).bundle

    def gone(self) -> str | None:
        """Why this process's bundle has left (a process of it failed), or None."""
        return control.read(self.store, keys.dead(self.bundle, self.incarnation))

    def lost(self) -> list[int]:
        """The members marked dead (a process of their incarnation exited, froze or left)."""
        return [b for b in self.members if is_dead(self.store, b, self.incs[b])]

    def leave(self) -> BundleLeft:
        """This process leaves with its bundle: marked, so that no one waits for it."""
        mark_dead(self.store, self.bundle, self.incarnation, f"rank {self.rank} left")
        return BundleLeft(f"bundle {self.bundle} left the job at epoch {self.epoch}")

    @property
    def layout(self) -> Topology:
        """The layout of the members (the job's, while every bundle trains)."""
        return self.job.keep(self.members)

    @property
    def my_rank(self) -> int:
        """This process's rank in the members' world."""
        c = self.job.coord(self.rank)
        return self.layout.rank(self.members.index(c.bundle), c.stage, c.replica)

    def prefix(self) -> str:
        """Where this epoch's process groups meet in the store."""
        return keys.epoch_group(self.epoch)

    def agree(self, committed: int) -> tuple[int, ...]:
        """After a failure: check in with the steps this process committed, wait for the
        decision, and move to the next epoch; returns the members. Every surviving process
        calls it. Raises ``BundleLeft`` when this process's bundle is not a member,
        ``TooFewBundles`` below ``min_bundles``."""
        new = self.epoch + 1
        mine = self.bundle
        self.store.set(keys.checked_in(new, self.rank), str(committed))
        self.store.add(keys.checked_in_count(new, mine), 1)
        decided = self._decide(new, mine)
        members = tuple(int(b) for b in decided.split(",") if b)
        self.failures += len(self.members) - len(members)
        self.epoch += 1
        if mine not in members:
            raise self.leave()
        if len(members) < self.min_bundles:
            lost = ", ".join(str(b) for b in self.members if b not in members)
            raise TooFewBundles(
                f"bundle(s) {lost} lost after step {committed}: {len(members)} bundle(s) remain "
                f"({decided}), fewer than --min-bundles {self.min_bundles}"
            )
        self._same_steps(new, members, committed)
        self.members = members
        return members

    # -- a bundle taken in again ---------------------------------------------------------------

    def joining(self) -> list[int]:
        """Per job bundle, 1 where a new incarnation of it, not a member, has every process
        checked in (this process's view; the step's vote takes the minimum over the job)."""
        out = [0] * self.job.num_bundles
        for b in range(self.job.num_bundles):
            if b in self.members or (inc := control.read_int(self.store, keys.healing(b))) is None:
                continue
            count = self.store.add(keys.join_count(b, inc), 0)
            out[b] = int(count >= self.job.bundle_width)
        return out

    def admit(self, bundles: list[int], step: int) -> None:
        """Take ``bundles`` in after step ``step`` (every member calls it, with the same list):
        the next epoch, whose members the new processes read at their join key."""
        self.epoch += 1
        for b in bundles:  # every member voted for it: its mark was there and checked
            self.incs[b] = control.read_int(self.store, keys.healing(b)) or 0
        self.members = tuple(sorted({*self.members, *bundles}))
        self.heals += len(bundles)
        told = _admission(self, step)
        for b in bundles:
            self.store.compare_set(keys.join_epoch(b, self.incs[b]), "", told)

    def ask_to_join(self, wait: float) -> int:
        """A process of a new incarnation: check in, and wait until the members take its bundle
        in (returns the step it starts from) or training ends (returns -1). Raises
        ``BundleLeft`` when another process of this incarnation failed meanwhile."""
        b, inc = self.bundle, self.incarnation
        self.store.set(keys.join_in(b, inc, self.rank), "1")
        self.store.add(keys.join_count(b, inc), 1)
        deadline = self.clock() + wait
        while not self.store.check([keys.join_epoch(b, inc)]):
            if self.store.check([keys.FT_DONE]):
                return -1
            if self.gone():  # a process of this incarnation failed: this heal is over
                raise self.leave()
            if self.clock() >= deadline:
                raise TooFewBundles(f"bundle {self.bundle} was not taken back in within {wait:g}s")
            time.sleep(POLL_S)
        epoch, members, incs, step, failures, heals = (
            self.store.get(keys.join_epoch(b, inc)).decode().split(";")
        )
        self.epoch, self.failures, self.heals = int(epoch), int(failures), int(heals)
        self.members = tuple(int(b) for b in members.split(","))
        self.incs = dict(zip(self.members, (int(i) for i in incs.split(",")), strict=True))
        return int(step)

    def _decide(self, epoch: int, mine: int) -> str:
        width = self.job.bundle_width
        deadline = self.clock() + 2 * self.timeout
        while True:
            # A process of this bundle failed: leave at once, so that this process's connections
            # close and the peers still waiting on it fail over now, not after --timeout.
            if is_dead(self.store, mine, self.incarnation):
                self.epoch += 1
                raise self.leave()
            counts = {b: self.store.add(keys.checked_in_count(epoch, b), 0) for b in self.members}
            complete = [b for b in self.members if counts[b] >= width]
            dead = self.lost()
            if len(complete) + len(dead) >= len(self.members) or self.clock() >= deadline:
                break
            if self.store.check([keys.members(epoch)]):  # another process decided
                return self.store.get(keys.members(epoch)).decode()
            time.sleep(POLL_S)
        proposal = ",".join(str(b) for b in complete if b not in dead)
        return self.store.compare_set(keys.members(epoch), "", proposal).decode() or proposal

    def _same_steps(self, epoch: int, members: tuple[int, ...], committed: int) -> None:
        """Every member committed the same steps; else some took the failed step's update and
        others not, which no member can undo (the commit vote makes it all but impossible)."""
        width = self.job.bundle_width
        ranks = [self.job.rank(b, 0, 0) + i for b in members for i in range(width)]
        steps = {int(self.store.get(keys.checked_in(epoch, r)).decode()) for r in ranks}
        if steps != {committed}:
            raise TooFewBundles(
                f"the bundles that train on committed different steps ({sorted(steps)}): "
                "resume from the newest checkpoint"
            )


def _admission(m: Membership, step: int) -> str:
    """``epoch;members;their incarnations;step;failures;heals``: what a new incarnation is told
    (the job's counts too: it may be the bundle that reports them)."""
    listed = ",".join(map(str, m.members)), ",".join(str(m.incs[b]) for b in m.members)
    return f"{m.epoch};{listed[0]};{listed[1]};{step};{m.failures};{m.heals}"
