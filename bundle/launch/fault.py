"""One process's training under ``--fault-tolerance bundle``: a world per membership epoch.

While every bundle trains, this is the ordinary run plus one vote per step: after the gradient
sync and before the optimizer steps, every process of the job meets in one small all-reduce on
the control group (``commit_vote``). A step is thereby taken by all or by none: a process that
fails before the vote leaves every other one without the vote, so no one steps. When a step
fails because a peer went away, this process keeps its stage's state in memory (``Carried``),
drops every group of the epoch, agrees with the others which bundles train on
(bundle.launch.membership), forms a world of those on a fresh store prefix, and runs the failed
step again with their rows: the survivors' processes and attempt never change, no step is lost,
and no checkpoint is read.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from bundle import log
from bundle.config import RunConfig
from bundle.launch.membership import Membership, is_peer_loss
from bundle.observe.metrics import Summary
from bundle.partition import Capture
from bundle.runtime.phase import Phase
from bundle.runtime.preemption import StopRequest
from bundle.session import Session, build_session
from bundle.topology import Topology
from bundle.trainer import Trainer, build_trainer

# The groups of the epochs a failure ended. Kept, never destroyed: a gloo group's destructor
# waits for its collectives still in flight, which wait on peers that are leaving them too, until
# --timeout; kept, they time out in their own threads while this process trains on.
_ENDED: list[dist.ProcessGroup] = []

# join(layout, rank, prefix): create the default group of a layout's world, returns the device.
Join = Callable[[Topology, int, str], torch.device]
# arrive(layout, name): wait until every process of the layout reaches ``name``.
Arrive = Callable[[Topology, str], None]


@dataclass
class Carried:
    """A stage's training state kept in memory across a change of members."""

    step: int  # steps committed
    model: dict[str, Any]
    optimizer: dict[str, Any]
    extra: dict[str, torch.Tensor]  # the loss scaler's state (the checkpoint's extra entries)

    @classmethod
    def of(cls, session: Session, trainer: Trainer) -> Carried:
        return cls(
            step=trainer.committed,
            model=session.stage.state_dict(),
            optimizer=session.optimizer.state_dict(),
            extra={k: v.detach().clone() for k, v in trainer.checkpointer.extra.items()},
        )

    def load(self, session: Session, trainer: Trainer) -> None:
        session.stage.load_state_dict(self.model)
        session.optimizer.load_state_dict(self.optimizer)
        for k, v in self.extra.items():
            trainer.checkpointer.extra[k].copy_(v)


def _arrive_in(arrive: Arrive, layout: Topology, prefix: str) -> Callable[[str], None]:
    """The session's start-up meetings, among the processes of ``layout``, under ``prefix``."""
    return lambda name: arrive(layout, f"{prefix}/{name}")


def commit_vote(group: dist.ProcessGroup, timeout: float) -> Callable[[int], None]:
    """The engine's vote before its optimizer steps: returns once every process of the job has
    finished its gradient sync; raises (a peer loss) when one cannot."""
    flag = torch.ones(1)
    wait = timedelta(seconds=timeout)

    def vote(step: int) -> None:
        dist.all_reduce(flag, group=group, async_op=True).wait(wait)

    return vote


def train_on(
    cfg: RunConfig,
    topo: Topology,
    rank: int,
    *,
    store: dist.Store,
    phase: Phase,
    join: Join,
    arrive: Arrive,
    attempt: int = 0,
    resume: str | None = None,
    stop: StopRequest | None = None,
    step_now: Any = None,
    capture: Capture | None = None,
) -> Summary | None:
    """Train this process (job rank ``rank``) to the end, in as many epochs as failures take."""
    members = Membership(store, topo, rank, cfg.launch.timeout, min_bundles=cfg.launch.min_bundles)
    carried: Carried | None = None
    while True:
        layout, me, prefix = members.layout, members.my_rank, members.prefix()
        phase.enter("start-up")
        device = join(layout, me, prefix)
        session = build_session(
            cfg,
            layout,
            me,
            device,
            arrive=_arrive_in(arrive, layout, prefix),
            capture=capture,
        )
        trainer = build_trainer(
            cfg,
            layout,
            me,
            session,
            phase=phase,
            attempt=attempt,
            resume=resume if carried is None else None,
            start=carried.step if carried is not None else None,
            stop=stop,
            store=store,
            step_now=step_now,
        )
        if carried is not None:
            carried.load(session, trainer)
        trainer.bundle_failures = members.failures
        session.engine.commit = commit_vote(session.groups.control, cfg.launch.timeout)
        phase.follow(session.engine)
        try:
            summary = trainer.train()
            session.comm.barrier()
            return summary
        except BaseException as exc:  # noqa: BLE001 - sorted below: a peer lost, or our own fault
            if not is_peer_loss(exc):
                raise
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        carried = Carried.of(session, trainer)
        # The epoch's groups leave the registry (``_ENDED`` keeps them), and the session goes.
        phase.follow(None)
        _ENDED.extend(dist.distributed_c10d._world.pg_map)
        del trainer, session
        dist.destroy_process_group()
        gc.collect()
        phase.enter("start-up: the bundles that train on agree")
        was = members.members
        members.agree(carried.step)
        lost = sorted(set(was) - set(members.members))
        log.get().warning(
            f"bundle(s) {', '.join(map(str, lost)) or 'none'} left after {carried.step} step(s) "
            f"({why}); bundles {', '.join(map(str, members.members))} train on from step "
            f"{carried.step + 1}"
        )
