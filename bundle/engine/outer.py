"""Bundles that meet every H steps (``--bundle-sync local:H|diloco:H``).

Between meetings each bundle trains alone: its stages sync across their replicas inside the bundle
every step (bundle.engine.grad_sync, scaled to the bundle's own mean), and no byte crosses between
bundles. Every H steps, and after the run's last step, each stage's masters combine the bundles'
pseudo-gradients ``anchor - params`` (the drift since the last meeting) over the masters' group,
the result is broadcast inside each bundle, and every replica applies the outer step to the
anchor and starts the next round from it:

    local:H   anchor <- anchor - mean(drift)                  (parameter averaging, local SGD)
    diloco:H  anchor <- Nesterov SGD(anchor, mean(drift))     (DiLoCo; --outer-lr, --outer-momentum)

``--aggregate median|trimmed:K`` combines the drifts robustly instead of by their mean. Inner
optimizer state stays each bundle's own, as in DiLoCo. A checkpoint holds the anchor and the outer
momentum under ``outer.<parameter>.*``; every replica of a stage holds them alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from bundle.collectives.comm import Collectives, Comm
from bundle.engine import aggregate
from bundle.engine.aggregate import Fault
from bundle.engine.hops import HopGroups, Wire


@dataclass(frozen=True, kw_only=True)
class Meetings:
    """How bundles meet: ``mode`` local or diloco, every ``every`` steps (``--bundle-sync``), the
    outer optimizer's ``outer_lr`` and ``outer_momentum`` (DiLoCo's), and the ``rule`` that
    combines the bundles' drifts (``--aggregate``)."""

    mode: str
    every: int
    outer_lr: float
    outer_momentum: float
    rule: str


class OuterSync:
    """The meetings of one replica's stage with the same stage of every other bundle."""

    def __init__(
        self,
        named: Sequence[tuple[str, nn.Parameter]],
        *,
        meetings: Meetings,
        total: int,
        groups: HopGroups,
        wire: Wire,
        fault: Fault | None = None,
        seed: int = 0,
        comm: Comm | None = None,
    ) -> None:
        """``total``: the run's last step (the trainer sets it once known); ``groups``: the
        masters' group (on a master) and the bundle's; ``comm``: the collectives of those groups
        (torch's by default)."""
        self.comm = comm or Collectives()
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.every, self.total, self.rule = meetings.every, total, meetings.rule
        self.masters_group, self.bundle_group = groups.masters_group, groups.bundle_group
        self.bundle_master, self.bundle, self.wire = groups.bundle_master, groups.bundle, wire
        self.fault, self.seed = fault, seed
        self.anchor = [p.detach().clone() for p in self.params]
        diloco = meetings.mode == "diloco"
        lr, momentum = (meetings.outer_lr, meetings.outer_momentum) if diloco else (1.0, 0.0)
        self.optimizer = torch.optim.SGD(
            self.anchor, lr=lr, momentum=momentum, nesterov=diloco and momentum > 0
        )
        # Created now (zero) rather than at the first meeting, so a resume loads into it; a zero
        # buffer's first update is the drift itself, as a fresh one's.
        self.momentum = [torch.zeros_like(a) for a in self.anchor] if momentum > 0 else []
        for a, m in zip(self.anchor, self.momentum, strict=False):
            self.optimizer.state[a]["momentum_buffer"] = m

    def due(self, step: int) -> bool:
        done = step + 1
        return done % self.every == 0 or done == self.total

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        """After the optimizer's step ``step`` (0-based): meet the other bundles when due."""
        if not self.due(step):
            return
        drift = torch.cat(
            [(a - p).flatten() for a, p in zip(self.anchor, self.params, strict=True)]
        )
        nbytes = drift.numel() * drift.element_size()
        if self.masters_group is not None:
            if self.fault is not None and self.fault.applies(self.bundle, step):
                self.fault.corrupt(drift, seed=self.seed, step=step)
            if self.rule == "mean":
                self.comm.all_reduce(drift, self.masters_group).wait()
                drift /= self.masters_group.size()
            else:
                drift = aggregate.gather_and_combine(
                    drift, self.masters_group, self.rule, self.comm
                )
            self.wire.add(nbytes, 0)
        if self.bundle_group is not None:
            self.comm.broadcast(drift, self.bundle_master, self.bundle_group).wait()
            self.wire.add(nbytes, 0)
        offset = 0
        for a in self.anchor:
            n = a.numel()
            a.grad = drift[offset : offset + n].view_as(a)
            offset += n
        self.optimizer.step()
        for a, p in zip(self.anchor, self.params, strict=True):
            a.grad = None
            p.copy_(a)

    @torch.no_grad()
    def catch_up(self, step: int) -> None:
        """After a change of members (``--fault-tolerance bundle``), with ``step`` steps
        committed: the meeting of the last one, if it was due, done on every replica alike. A
        lost bundle can cut a meeting short after some masters finished it (their parameters
        equal the new anchor) and before others did: those take the finished one's anchor and
        momentum; where none finished, the members meet now. Collective on the masters' and the
        bundle's groups."""
        if step == 0 or not self.due(step - 1):
            return
        met = all(torch.equal(a, p) for a, p in zip(self.anchor, self.params, strict=True))
        device = self.anchor[0].device if self.anchor else torch.device("cpu")
        # [some met, none failed to, the lowest master that met] (negated where MIN is meant).
        seen = torch.tensor([int(met), -int(met), -self.bundle_master if met else -(1 << 30)])
        seen = seen.to(device)
        if self.masters_group is not None:
            self.comm.all_reduce(seen, self.masters_group, op=dist.ReduceOp.MAX).wait()
        if self.bundle_group is not None:
            self.comm.broadcast(seen, self.bundle_master, self.bundle_group).wait()
        some, every, source = int(seen[0]) == 1, int(seen[1]) == -1, -int(seen[2])
        if every:
            return
        if not some:
            self.after_step(step - 1)
            return
        held = [*self.anchor, *self.momentum]
        flat = torch.cat([t.flatten() for t in held])
        if self.masters_group is not None:
            self.comm.broadcast(flat, source, self.masters_group).wait()
        if self.bundle_group is not None:
            self.comm.broadcast(flat, self.bundle_master, self.bundle_group).wait()
        offset = 0
        for t in held:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        for a, p in zip(self.anchor, self.params, strict=True):
            p.copy_(a)

    def state(self) -> dict[str, torch.Tensor]:
        """The outer state by full-model name (the same on every replica of the stage)."""
        out = {f"outer.{n}.anchor": a for n, a in zip(self.names, self.anchor, strict=True)}
        for n, m in zip(self.names, self.momentum, strict=False):
            out[f"outer.{n}.momentum"] = m
        return out

    @torch.no_grad()
    def restart(self) -> None:
        """No outer state to resume (a checkpoint of another --bundle-sync): begin a round from
        the parameters as loaded."""
        for a, p in zip(self.anchor, self.params, strict=True):
            a.copy_(p)
        for m in self.momentum:
            m.zero_()
