"""Every process group of one rank, built once, collectively, in the same order on every rank."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch.distributed as dist
from torch.distributed import ProcessGroup

from bundle.runtime.watchdog import group_timeout
from bundle.topology import Coord, Topology


@dataclass(frozen=True)
class ProcessGroups:
    """The groups one rank trains with (``None`` where its layout has no such group).

    ``control`` spans the job on gloo whatever the training backend: the per-step stop vote,
    checkpoint coordination (CPU tensors, pickled plans) and the trace run there, apart from the
    training traffic. ``async_save`` does the same for the writes of asynchronous saves, which run
    in a thread of their own. ``stage`` holds this stage's replicas over every bundle (flat sync;
    losses and accuracy are summed there on the last stage); ``bundle`` and ``masters`` are the
    hierarchical sync's: this stage's replicas in this bundle, and replica 0 of this stage in
    every bundle; ``peers`` (``--zero 3`` with hierarchical sync) holds this stage's replica of
    this rank's index in every bundle, over which its parameter shards are summed. Under tensor
    parallelism each of these holds the processes of this rank's index in their replicas' TP
    groups (they hold the same shards), and ``tp`` holds this rank's replica's TP group.
    """

    control: ProcessGroup
    stage: ProcessGroup
    bundle: ProcessGroup | None = None
    masters: ProcessGroup | None = None
    async_save: ProcessGroup | None = None
    is_last_stage: bool = False
    peers: ProcessGroup | None = None
    tp: ProcessGroup | None = None

    @property
    def last_stage(self) -> ProcessGroup | None:
        """The last stage's group on its ranks (losses and accuracy are summed there); else None."""
        return self.stage if self.is_last_stage else None

    @classmethod
    def build(
        cls,
        topo: Topology,
        coord: Coord,
        *,
        hierarchical: bool,
        async_save: bool,
        timeout: float,
        peers: bool = False,
    ) -> ProcessGroups:
        """Create every group on every rank in the same order (``new_group`` is collective).

        Every group gets ``--timeout`` (``timeout``; NCCL's a little more, see
        bundle/runtime/watchdog.py): without it, NCCL's sub-groups wait 10 minutes.
        """
        on_gloo = group_timeout("gloo", timeout)
        training = group_timeout(dist.get_backend(), timeout)
        control = _group(None, backend="gloo", timeout=on_gloo)
        saving = _group(None, backend="gloo", timeout=on_gloo) if async_save else None
        mine: dict[str, ProcessGroup] = {}
        for s in range(topo.num_stages):
            keep = _keeper(mine, topo, coord, s, training)
            keep("stage", True, topo.stage_group(s))
            for b, r in _replicas(topo, s) if topo.tp_of(s) > 1 else ():
                ours = (b, s, r) == (coord.bundle, coord.stage, coord.replica)
                _keep(mine, "tp", ours, list(topo.tp_group(b, s, r)), training)
            if not hierarchical:
                continue
            for b in range(topo.num_bundles):
                keep("bundle", b == coord.bundle, topo.bundle_stage_group(b, s))
            keep("masters", True, topo.masters_group(s))
            for r in range(topo.shape[s]) if peers else ():
                keep(
                    "peers",
                    r == coord.replica,
                    tuple(topo.rank(b, s, r) for b in range(topo.num_bundles)),
                )
        return cls(
            control=control,
            stage=mine["stage"],
            bundle=mine.get("bundle"),
            masters=mine.get("masters"),
            async_save=saving,
            is_last_stage=coord.stage == topo.loss_stage,
            peers=mine.get("peers"),
            tp=mine.get("tp"),
        )


def _replicas(topo: Topology, stage: int) -> list[tuple[int, int]]:
    return [(b, r) for b in range(topo.num_bundles) for r in range(topo.shape[stage])]


def _keeper(
    mine: dict[str, ProcessGroup], topo: Topology, coord: Coord, stage: int, timeout: timedelta
) -> Callable[[str, bool, tuple[int, ...]], None]:
    """Creates a group of ``stage``'s replicas (named by their first processes) once per index
    of their TP groups (the processes that hold the same shards), keeping this rank's."""

    def keep(name: str, ours: bool, ranks: tuple[int, ...]) -> None:
        for k in range(topo.tp_of(stage)):
            mine_too = ours and stage == coord.stage and k == coord.tp
            _keep(mine, name, mine_too, list(topo.shifted(ranks, k)), timeout)

    return keep


def _keep(
    mine: dict[str, ProcessGroup], name: str, ours: bool, ranks: list[int], timeout: timedelta
) -> None:
    """Create one group (every rank must, in order) and keep it under ``name`` if it is ours."""
    group = _group(ranks, timeout=timeout)
    if ours:
        mine[name] = group


def _group(ranks: list[int] | None, **kwargs: Any) -> ProcessGroup:
    # new_group returns GroupMember.NON_GROUP_MEMBER to a rank outside ``ranks``; such a group is
    # never kept (``_keep``), and the job-wide ones hold every rank.
    return cast(ProcessGroup, dist.new_group(ranks, **kwargs))
