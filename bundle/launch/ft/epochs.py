"""One process's training under ``--fault-tolerance bundle``: a world per membership epoch.

While every bundle trains, this is the ordinary run but for its stop vote: instead of overlapping
the step, it is cast after the gradient sync and waited for before the optimizer steps, so every
process of the job meets there (one small all-reduce on the control group). A step is thereby
taken by all or by none: a process that fails before the vote leaves every other one without the
vote, so no one steps. When a step
fails because a peer went away, this process keeps its stage's state in memory (``Carried``),
drops every group of the epoch, agrees with the others which bundles train on
(bundle.launch.ft.membership), forms a world of those on a fresh store prefix, and runs the failed
step again with their rows: the survivors' processes and attempt never change, no step is lost,
and no checkpoint is read.

On NCCL a wait on a dead peer never ends (the kernel spins, the CPU blocks in the next
synchronisation), and aborting the communicators in place hung, so there a survivor goes on in a
new process of its rank instead (bundle.launch.ft.handoff): each epoch runs a loss watch
(``LossWatch``), a thread that sees a member bundle marked dead in the store and hands this
process's state over (run on an H200 end to end: docs/fault-tolerance.md; BUNDLE_NCCL_FT=0 turns
it off).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import re
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from bundle import log
from bundle.checkpoint.state import shared
from bundle.engine.parts import StepHooks
from bundle.launch.context import ProcessContext
from bundle.launch.ft import handoff
from bundle.launch.ft.handoff import GUARD_WAIT_S, Carried, Handoff, StepGuard
from bundle.launch.ft.membership import Membership, is_peer_loss
from bundle.observe.metrics import Summary
from bundle.runtime import keys
from bundle.runtime.devices import resolve_backend
from bundle.runtime.phase import Phase
from bundle.runtime.preemption import Regroup, maybe_fail_heal
from bundle.session import Session, build_session
from bundle.topology import Topology
from bundle.trainer import Links, Trainer, build_trainer

# The groups of the epochs a failure ended. Kept, never destroyed: a gloo group's destructor
# waits for its collectives still in flight, which wait on peers that are leaving them too, until
# --timeout; kept, they time out in their own threads while this process trains on.
_ENDED: list[dist.ProcessGroup] = []

LOSS_POLL_S = 0.1

# join(layout, rank, prefix): create the default group of a layout's world, returns the device.
Join = Callable[[Topology, int, str], torch.device]
# arrive(layout, name): wait until every process of the layout reaches ``name``.
Arrive = Callable[[Topology, str], None]


class LossWatch:
    """A thread that calls ``on_loss(why)`` once a member bundle of this epoch is marked dead
    (polling the one counter every mark bumps, then the members' keys), unless stopped first.
    ``fired`` says why it acted."""

    def __init__(
        self,
        members: Membership,
        on_loss: Callable[[str], None],
        poll_s: float = LOSS_POLL_S,
    ) -> None:
        self.members, self.on_loss, self.poll_s = members, on_loss, poll_s
        self.fired: str | None = None
        self._seen = members.store.add(keys.FT_LOSSES, 0)
        self._stopped = threading.Event()
        self._lock = threading.Lock()

    def start(self) -> LossWatch:
        threading.Thread(target=self._watch, name="bundle-loss-watch", daemon=True).start()
        return self

    def check(self) -> bool:
        """One look; True when it acted."""
        marks = self.members.store.add(keys.FT_LOSSES, 0)
        if marks == self._seen:
            return False
        self._seen = marks
        lost = self.members.lost()
        with self._lock:
            if not lost or self._stopped.is_set():
                return False
            self.fired = f"bundle(s) {', '.join(map(str, lost))} marked lost"
            self._stopped.set()
            self.on_loss(self.fired)
        return True

    def stop(self) -> None:
        """The epoch ends: it does not act after this returns (an action under way ends
        first; a handoff ends the process)."""
        with self._lock:
            self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(self.poll_s):
            try:
                self.check()
            except (RuntimeError, dist.DistError):  # the store is gone: the job is over
                return


def _arrive_in(arrive: Arrive, layout: Topology, prefix: str) -> Callable[[str], None]:
    """The session's start-up meetings, among the processes of ``layout``, under ``prefix``."""
    return lambda name: arrive(layout, f"{prefix}/{name}")


def train_on(proc: ProcessContext, *, join: Join, arrive: Arrive) -> Summary | None:
    """Train this process to the end, in as many epochs as failures and heals take. An
    incarnation number > 0 (``proc.start.incarnation``): this process heals its bundle (started
    again by its supervisor): it waits to be taken in, and receives its stage's state from a
    peer; ``handed``: it goes on from a survivor's state, in that file."""
    cfg, rank, phase = proc.start.cfg, proc.start.rank, proc.phase
    incarnation, handed = proc.start.incarnation.number, proc.start.incarnation.handed
    members = Membership(
        proc.store,
        proc.start.topo,
        rank,
        cfg.launch.timeout,
        min_bundles=cfg.launch.min_bundles,
        incarnation=incarnation,
    )
    epochs = _Epochs(proc, members, join, arrive)
    if handed is not None:
        epochs.take_over(Handoff.read(handed))
    elif incarnation:
        maybe_fail_heal(rank, incarnation)
        phase.enter("start-up: waiting to be taken back in")
        if (after := members.ask_to_join(cfg.launch.init_timeout)) < 0:
            log.get().info(f"bundle {members.bundle}: training ended before it could rejoin")
            return None
        log.get().info(f"bundle {members.bundle} rejoins after step {after}")
        epochs.fresh = (members.bundle,)
    while True:
        done, summary = epochs.run()
        if done:
            return summary


class _Epochs:
    """One process's epochs: each builds a session for the members, trains until the end, a
    failure or a rejoin, and keeps the stage's state for the next."""

    def __init__(
        self, proc: ProcessContext, members: Membership, join: Join, arrive: Arrive
    ) -> None:
        self.cfg, self.members, self.phase = proc.start.cfg, members, proc.phase
        self.join, self.arrive = join, arrive
        # The first epoch's checkpoint (later ones carry the state), the model's graph split,
        # and what build_trainer is given alike in every epoch.
        self.resume, self.capture = proc.start.resume, proc.start.capture
        self.links = Links(
            phase=proc.phase,
            attempt=proc.start.attempt,
            stop=proc.stop,
            store=proc.store,
            step_now=proc.start.counters.step_now,
            asks=members.joining,
        )
        self.carried: Carried | None = None
        self.fresh: tuple[int, ...] = ()  # bundles that start this epoch without the state
        self.watch: LossWatch | None = None  # this epoch's, where survivors hand off
        self.handoff_to = proc.start.incarnation.handoff_to
        self.live: Trainer | None = None  # while an epoch trains (with ``guard``)
        self.watch_on = False
        self.guard: StepGuard | None = (
            None  # the epoch's; kept after it for its last update's event
        )

    def run(self) -> tuple[bool, Summary | None]:
        """One epoch; returns (whether training is over, the summary)."""
        session: Session | None = None
        trainer: Trainer | None = None
        try:
            session, trainer = self._build()
            summary = trainer.train()
            session.comm.barrier()
            self.members.store.set(keys.FT_DONE, "1")
            return True, summary
        except Regroup as regroup:
            assert session is not None and trainer is not None  # noqa: S101 - raised by train()
            self.carried = Carried.of(trainer)
            session = trainer = None
            if (why := self._stop_watch()) is None:
                self._rejoin(regroup.bundles)
                return False, None
        except BaseException as exc:  # noqa: BLE001 - sorted below: a peer lost, or our own fault
            fired = self._stop_watch()
            if not (fired or is_peer_loss(exc)):
                raise
            why = fired or _loss_text(exc)
            if self.watch_on:
                if self.members.gone():  # this process's own bundle is out: nothing to hand
                    raise self.members.leave() from exc
                self._hand_off(why, wait=0.0)
                raise  # mid-update: nothing consistent to hand over
        finally:
            self._stop_watch()
            self.live = None
        # The state: the trainer's where this epoch's was loaded, else the one brought into it.
        if session is not None and trainer is not None:
            self.carried = Carried.of(trainer)
        session = trainer = None
        self._after_failure(why)
        return False, None

    def _build(self) -> tuple[Session, Trainer]:
        cfg, members, phase = self.cfg, self.members, self.phase
        layout, me, prefix = members.layout, members.my_rank, members.prefix()
        phase.enter("start-up")
        device = self.join(layout, me, prefix)
        self.watch_on = self.handoff_to is not None and handoff.wanted(resolve_backend(self.cfg))
        if self.watch_on:
            self.watch = LossWatch(members, lambda why: self._hand_off(why, GUARD_WAIT_S)).start()
        session = build_session(
            cfg,
            layout,
            me,
            device,
            arrive=_arrive_in(self.arrive, layout, prefix),
            capture=self.capture,
            abort=members.gone,
        )
        if self.fresh:
            phase.enter("start-up: a bundle rejoins, its state sent from a peer")
            self.carried = share_state(session, layout, self.carried, self.fresh)
        carried = self.carried
        trainer = build_trainer(
            cfg,
            layout,
            me,
            session,
            links=self.links,
            resume=self.resume if carried is None else None,
            start=carried.step if carried is not None else None,
        )
        if carried is not None:
            carried.load(trainer)
            if session.engine.outer is not None and not self.fresh:
                session.engine.outer.catch_up(carried.step)  # a meeting a failure cut short
        if self.fresh:
            same_everywhere(trainer, layout)
            self.fresh = ()
        trainer.bundle_failures, trainer.heals = members.failures, members.heals
        # The stop vote, cast at the commit; watched, the step guard's around it.
        session.engine.hooks = StepHooks(commit=trainer.vote.commit)
        if self.watch_on:
            guard = StepGuard(trainer.committed, trainer.vote.commit, cuda=device.type == "cuda")
            session.engine.hooks = StepHooks(commit=guard.commit, updated=guard.updated)
            self.live, self.guard = trainer, guard
        phase.follow(session.engine)
        return session, trainer

    def take_over(self, handed: Handoff) -> None:
        """This new process goes on where the survivor before it left off (bundle.launch.ft.handoff):
        its state and membership, then the agreement it would have joined."""
        m = self.members
        m.epoch, m.members, m.incs = handed.epoch, handed.members, handed.incs
        m.failures, m.heals = handed.failures, handed.heals
        self.carried = handed.carried
        log.get().info(f"goes on from step {handed.carried.step} with the state handed over")
        self._after_failure(handed.why)

    def _hand_off(self, why: str, wait: float) -> None:
        """Write this process's state for a new process of its rank and end this one; returns
        when there is no consistent state to hand (an update in progress after ``wait`` s)."""
        assert self.handoff_to is not None  # noqa: S101 - only where survivors hand off

        def state() -> Handoff | None:
            got = self._handoff(why, wait)
            if got is not None:  # writing it is a checkpoint's work: not a stall
                self.phase.enter(f"checkpoint: the state handed over after step {got.carried.step}")
            return got

        handoff.leave(self.handoff_to, state, log.get().warning)

    def _handoff(self, why: str, wait: float) -> Handoff | None:
        m, live = self.members, self.live
        if m.store.check([keys.FT_DONE]) or m.gone():  # training is over, or this bundle is out
            return None
        if live is None:  # between epochs: the state carried into the next one, if any
            if self.carried is None:
                return None
            # On the last guard's side stream: the compute stream may wait on the lost peer.
            with self.guard.side_stream() if self.guard else contextlib.nullcontext():
                carried = self.carried.on_cpu()
        else:
            trainer, guard = live, self.guard
            assert guard is not None  # noqa: S101 - set with ``live``
            with guard.held(wait) as between_steps:
                if not between_steps:
                    log.get().error(
                        f"{why}: an update is in progress; this process cannot hand off"
                    )
                    return None
                with guard.side_stream():
                    carried = Carried.of(trainer, guard.committed).on_cpu()
        return Handoff(carried, m.epoch, m.members, dict(m.incs), m.failures, m.heals, why)

    def _stop_watch(self) -> str | None:
        """Stop this epoch's loss watch; returns why it aborted the epoch, if it did."""
        watch, self.watch = self.watch, None
        if watch is None:
            return None
        watch.stop()
        return watch.fired

    def _rejoin(self, bundles: list[int]) -> None:
        """After the step the members agreed ``bundles`` join at: the next epoch takes them in."""
        assert self.carried is not None  # noqa: S101 - a rejoin follows a step trained
        _drop(self.phase, ended=False)
        self.members.admit(bundles, self.carried.step)
        self.fresh = tuple(bundles)
        log.get().info(
            f"bundle(s) {', '.join(map(str, bundles))} rejoin after step {self.carried.step}: "
            f"bundles {', '.join(map(str, self.members.members))} train on"
        )

    def _after_failure(self, why: str) -> None:
        """A peer was lost: agree which bundles train on (this one leaves if it is not one)."""
        _drop(self.phase, ended=True)
        if self.carried is None:  # a new incarnation that never received its state
            raise self.members.leave()
        self.phase.enter("start-up: the bundles that train on agree")
        was = self.members.members
        self.members.agree(self.carried.step)
        self.fresh = ()
        lost = sorted(set(was) - set(self.members.members))
        log.get().warning(
            f"bundle(s) {', '.join(map(str, lost)) or 'none'} left after {self.carried.step} "
            f"step(s) ({why}); bundles {', '.join(map(str, self.members.members))} train on "
            f"from step {self.carried.step + 1}"
        )


# A backend's source location (gloo's ``[.../pair.cc:545] ``), and the wrapper c10d puts around
# an error raised in a future's callback: neither says what happened.
_WHERE = re.compile(r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")
_WRAPPED = re.compile(r"^.*Got the following error when running the callback: (?:\w+: )?")
_ADVICE = re.compile(r"\. This is typically caused by .*$")  # gloo's advice after the fact


def _loss_text(exc: BaseException) -> str:
    """How a step that failed on a lost peer is said: the error's first line without the
    backend's source location (gloo's ``[.../pair.cc:545] Read error ...``); the whole text
    goes to the debug log."""
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    log.get().debug(f"the step failed on a lost peer: {type(exc).__name__}: {exc}")
    said = _ADVICE.sub("", _WRAPPED.sub("", _WHERE.sub("", first)))
    return f"a peer was lost: {said[:160]}"


def _drop(phase: Phase, *, ended: bool) -> None:
    """Leave the epoch once the caller has dropped its session: its groups leave the registry.
    The groups of an epoch a failure ended are kept (``_ENDED``), not destroyed."""
    phase.follow(None)
    if dist.is_initialized():
        if ended:
            _ENDED.extend(dist.distributed_c10d._world.pg_map)
        dist.destroy_process_group()
    gc.collect()


def share_state(
    session: Session, layout: Topology, carried: Carried | None, fresh: tuple[int, ...]
) -> Carried:
    """Every stage's state, sent to the bundles in ``fresh`` (which have none) from the first
    bundle that has it: replica r of a stage from replica r of the source, for a state sharded
    inside each bundle (``--zero 1``) is the same at the same replica, not across replicas
    (collective on the stage group, one broadcast per replica). A rank that has its state keeps
    it; a fresh one takes the sender's without the parts a rank keeps for itself (PowerSGD's
    error feedback starts from zero)."""
    source = next(k for k, b in enumerate(layout.bundles) if b not in fresh)
    coord, me = session.coord, dist.get_rank()
    got: Carried | None = carried
    for replica in range(layout.shape[coord.stage]):
        src = layout.rank(source, coord.stage, replica)
        box: list[Any] = [carried.on_cpu() if carried is not None and me == src else None]
        dist.broadcast_object_list(box, src=src, group=session.groups.stage)
        if replica == coord.replica and carried is None:
            sent: Carried = box[0]
            got = Carried(sent.step, shared(sent.state))
    assert got is not None  # noqa: S101 - a fresh rank received its replica's
    return got


def same_everywhere(trainer: Trainer, layout: Topology) -> None:
    """Every replica of this stage holds the same parameters and outer state, and the same
    optimizer state where the optimizer is not sharded (else every bundle's replica r the same;
    with --bundle-sync local|diloco each bundle's own), bit for bit (after a bundle rejoined):
    their digests, all-gathered over the stage group, agree."""
    session, state = trainer.session, trainer.checkpointer.rank_state.state_dict()
    width = layout.shape[session.coord.stage]
    own_optimizer = session.engine.outer is not None
    by_replica = trainer.checkpointer.shards_per_bundle
    group = session.groups.stage
    on = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl"
        else None
    )
    mine = torch.stack([_digest(state, ("model", "outer")), _digest(state, ("optim",))]).to(on)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    differ = [
        i
        for i, d in enumerate(everyone)
        if not torch.equal(d[0], mine[0])
        or (
            not own_optimizer
            and (not by_replica or i % width == session.coord.replica)
            and not torch.equal(d[1], mine[1])
        )
    ]
    if differ:
        raise RuntimeError(
            f"{layout.describe(dist.get_rank())}: after the rejoin, replicas {differ} of stage "
            f"{session.coord.stage} hold other state than this one"
        )


def _digest(state: dict[str, dict[str, torch.Tensor]], parts: tuple[str, ...]) -> torch.Tensor:
    """A SHA-256 of the parts' tensors, in name order, as 32 bytes."""
    digest = hashlib.sha256()
    for part in parts:
        for _, t in sorted(state[part].items()):
            # reshape: a 0-d tensor (Adam's step count) has no byte view of its own
            digest.update(t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8)
