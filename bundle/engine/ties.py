"""Weights tied across stages (GPT-2's token embedding and its output head): every stage that
uses one holds a copy, and after each stage's gradient sync the stages holding it sum their
gradients, so every copy takes the same step and they stay equal (Megatron's embedding group).

After a stage's sync every replica of it holds the stage's summed gradient, so one replica per
stage (the first of its group) contributes it and the rest contribute zeros: the sum over the
tie's group is exact, whatever the stages' widths. Bundles that meet only every H steps
(``--bundle-sync local/diloco``) sum within their bundle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from itertools import product

import torch
import torch.distributed as dist

from bundle.collectives.comm import Comm
from bundle.engine.sharded import full, set_grad
from bundle.engine.stage import Stage
from bundle.errors import PartitionError
from bundle.topology import Coord, Topology


@dataclass(frozen=True)
class Tie:
    """One weight used by several stages: (stage, its full-model name there), in stage order."""

    holders: tuple[tuple[int, str], ...]

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(s for s, _ in self.holders)

    def describe(self) -> str:
        return " = ".join(f"{name} (stage {s})" for s, name in self.holders)


def find(stages: Sequence[Stage]) -> list[Tie]:
    """The parameters that more than one stage uses and train, in the order the first stage
    meets them (a frozen one, a LoRA run's tied embedding, never changes: nothing to sum)."""
    holders: dict[int, list[tuple[int, str]]] = {}
    for i, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            if p.requires_grad:
                holders.setdefault(id(p), []).append((i, stage.full_name(name)))
    return [Tie(tuple(h)) for h in holders.values() if len(h) > 1]


def by_stage(ties: Sequence[Tie], stage_of: Callable[[int], int]) -> list[Tie]:
    """Ties found among the pieces of a model cut for several chunks per stage (piece j on stage
    ``stage_of(j)``), as ties between the stages that hold them; one stage holding a tied weight
    twice is refused (its chunks would sync the same parameter in two gradient syncs)."""
    out = []
    for t in ties:
        holders = sorted((stage_of(j), name) for j, name in t.holders)
        stages = [s for s, _ in holders]
        twice = next((x for x in stages if stages.count(x) > 1), None)
        if twice is not None:
            pieces = " = ".join(f"{name} (piece {j})" for j, name in t.holders)
            raise PartitionError(
                f"weights tied across two model chunks of stage {twice}: {pieces}; choose "
                "another --schedule, --virtual-stages or number of stages"
            )
        out.append(Tie(tuple(holders)))
    return out


class TiedGrads:
    """This rank's part in summing the tied weights' gradients (nothing if it holds none)."""

    def __init__(
        self,
        ties: Sequence[Tie],
        stage: Stage,
        topo: Topology,
        coord: Coord,
        comm: Comm,
        *,
        per_step: bool,
        timeout: float,
    ) -> None:
        self.comm = comm
        self.ties = list(ties)
        self._sums: list[tuple[list[torch.nn.Parameter], dist.ProcessGroup, bool]] = []
        params = {stage.full_name(n): p for n, p in stage.named_parameters()}
        rank = topo.rank(coord.bundle, coord.stage, coord.replica, coord.tp)
        # One group per set of stages (and per bundle, where bundles sum on their own; and per
        # index in the TP groups, whose degree the tied stages share), built in the same order
        # on every rank: new_group is collective.
        for stages in dict.fromkeys(t.stages for t in ties):
            for bundle, k in product(
                [None] if per_step else range(topo.num_bundles), range(topo.tp_of(stages[0]))
            ):
                members = [
                    topo.shifted(
                        topo.stage_group(s)
                        if bundle is None
                        else topo.bundle_stage_group(bundle, s),
                        k,
                    )
                    for s in stages
                ]
                ranks = sorted({r for m in members for r in m})
                group = dist.new_group(ranks, timeout=timedelta(seconds=timeout))
                if rank not in ranks or not isinstance(group, dist.ProcessGroup):
                    continue
                mine = [
                    params[name]
                    for t in ties
                    if t.stages == stages
                    for s, name in t.holders
                    if s == coord.stage
                ]
                lead = any(m[0] == rank for m in members)
                self._sums.append((mine, group, lead))

    def __bool__(self) -> bool:
        return bool(self._sums)

    @torch.no_grad()
    def sum(self) -> None:
        """Every tied weight's gradient becomes the sum over the stages that use it."""
        for params, group, lead in self._sums:
            # Whole gradients (under --zero 3 each replica holds a shard of its stage's sum).
            grads = [full(p.grad if p.grad is not None else torch.zeros_like(p)) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            if not lead:
                flat.zero_()
            self.comm.all_reduce(flat, group).wait()
            offset = 0
            for p, g in zip(params, grads, strict=True):
                set_grad(p, flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
