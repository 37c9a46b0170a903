"""A rank's data-parallel side, built from the run's config: the gradient sync (flat, or in two
hops: inside the bundle, then between bundles by the masters), the group ``--zero 1`` shards
over, the meetings between bundles (``--bundle-sync local|diloco``) and the sum of weights tied
across stages. ``bundle.session`` builds a session from these."""

from __future__ import annotations

import torch
import torch.distributed as dist

from bundle.collectives.comm import Collectives, Comm
from bundle.config import RunConfig, parse_bundle_sync
from bundle.engine import aggregate, sharded, ties
from bundle.engine.grad_sync import FlatSync, GradSync, HierarchicalSync
from bundle.engine.hops import Hop, HopGroups, Wire, make_hop
from bundle.engine.outer import Meetings, OuterSync
from bundle.engine.stage import Stage
from bundle.runtime.groups import ProcessGroups
from bundle.topology import Coord, Topology


def make_ties(
    cfg: RunConfig, topo: Topology, coord: Coord, stage: Stage, comm: Comm, tied: list[ties.Tie]
) -> ties.TiedGrads:
    """This rank's part in summing the gradients of weights tied across stages."""
    per_step = cfg.parallel.bundle_sync == "step"
    return ties.TiedGrads(
        tied, stage, topo, coord, comm, per_step=per_step, timeout=cfg.launch.timeout
    )


def process_groups(cfg: RunConfig, topo: Topology, coord: Coord) -> ProcessGroups:
    """Every group of this rank (collective): the stage's replicas inside each bundle and the
    masters' too where a sync runs in two hops or ZeRO-1 shards inside the bundle."""
    return ProcessGroups.build(
        topo,
        coord,
        hierarchical=in_two_hops(cfg) or shards_in_bundle(cfg),
        async_save=cfg.checkpoint.async_save,
        timeout=cfg.launch.timeout,
        peers=cfg.parallel.zero == 3 and in_two_hops(cfg),
    )


def shards_in_bundle(cfg: RunConfig) -> bool:
    """Whether --zero 1 shards inside each bundle: under --fault-tolerance bundle, so that a
    lost bundle takes no shard with it (every bundle holds each shard once)."""
    return bool(cfg.parallel.zero) and cfg.launch.fault_tolerance == "bundle"


def shard_group(
    cfg: RunConfig, topo: Topology, coord: Coord, groups: ProcessGroups
) -> dist.ProcessGroup | None:
    """The group --zero 1 shards the optimizer state over: the stage's replicas in every bundle,
    or in this bundle alone (``shards_in_bundle``); None where that is one process."""
    if cfg.parallel.zero != 1:  # --zero 3 shards the optimizer's parameters themselves
        return None
    if shards_in_bundle(cfg):
        return groups.bundle if topo.shape[coord.stage] > 1 else None
    return groups.stage if len(topo.stage_group(coord.stage)) > 1 else None


def in_two_hops(cfg: RunConfig) -> bool:
    """Whether gradients sync inside the bundle first, then between bundles by the masters: the
    hierarchical sync, and what needs each bundle's own sum (local/diloco, robust aggregation)."""
    par = cfg.parallel
    return par.grad_sync == "hierarchical" or par.bundle_sync != "step" or par.aggregate != "mean"


def make_sync(
    cfg: RunConfig,
    topo: Topology,
    coord: Coord,
    stage: Stage,
    groups: ProcessGroups,
    device: torch.device,
    comm: Comm,
) -> GradSync:
    par = cfg.parallel
    if len(topo.stage_group(coord.stage)) == 1:
        return GradSync(stage)
    if par.zero == 3 and any(True for _ in stage.parameters()):
        return _sharded(topo, coord, stage, groups, device, comm)  # a frozen base too
    if not any(p.requires_grad for p in stage.parameters()):
        return GradSync(stage)  # nothing to sum (a reshape; a piece of a frozen base)
    per_step = par.bundle_sync == "step"

    def hop(group: dist.ProcessGroup) -> Hop:
        return make_hop(
            par.grad_compression,
            group,
            comm,
            wire=Wire(),
            powersgd_rank=par.powersgd_rank,
            rule=par.aggregate,
            shares=[topo.global_batch / b for b in topo.bundle_batches],
            bundle=coord.bundle,
            fault=aggregate.fault_from_env(topo.num_bundles) if per_step else None,
            seed=cfg.train.seed,
            warmup=par.compression_warmup if par.grad_compression != "none" else 0,
        )

    if not in_two_hops(cfg):
        return FlatSync(
            stage, groups.stage, device, bucket_mb=par.bucket_mb, comm=comm, hop=hop(groups.stage)
        )
    _same_start(topo, coord, stage, groups.stage, comm)
    crosses = coord.replica == 0 and topo.num_bundles > 1 and per_step
    return HierarchicalSync(
        stage,
        groups=hop_groups(topo, coord, groups, masters=crosses),
        bucket_mb=par.bucket_mb,
        comm=comm,
        hop=hop(groups.masters) if crosses and groups.masters is not None else None,
        # A bundle on its own between meetings: the gradient of its own batch's mean.
        scale=1.0 if per_step else topo.global_batch / topo.bundle_batches[coord.bundle],
        counts_masters=not per_step,
    )


def _same_start(
    topo: Topology, coord: Coord, stage: Stage, group: dist.ProcessGroup, comm: Comm
) -> tuple[int, ...]:
    """Every replica of the stage starts from its first replica's weights, without relying on
    every process's initialisation agreeing; returns the stage group's ranks."""
    members = topo.shifted(topo.stage_group(coord.stage), coord.tp)  # same shards under TP
    for p in stage.parameters():
        comm.broadcast(p.data, members[0], group).wait()
    return members


def _sharded(
    topo: Topology,
    coord: Coord,
    stage: Stage,
    groups: ProcessGroups,
    device: torch.device,
    comm: Comm,
) -> GradSync:
    """--zero 3: the stage sharded by FSDP over its replicas (bundle.engine.sharded), from the
    same weights on every replica; under tensor parallelism over the replicas' processes of this
    rank's index in their TP groups (``members`` and the groups are that index's)."""
    members = _same_start(topo, coord, stage, groups.stage, comm)
    if groups.peers is None or groups.bundle is None:  # flat: over the stage group
        device_mesh = sharded.mesh(device, groups.stage, [members])
    else:  # hierarchical: inside the bundle, summed with the same replica of every bundle
        # Under tensor parallelism: the processes of this rank's index in their TP groups.
        layout = [
            topo.shifted(topo.bundle_stage_group(b, coord.stage), coord.tp)
            for b in range(topo.num_bundles)
        ]
        device_mesh = sharded.mesh(device, groups.bundle, layout, groups.peers)
    emulated = (comm, device) if not isinstance(comm, Collectives) else None
    return sharded.ShardedSync(sharded.shard_stage(stage, device_mesh, emulated=emulated))


def hop_groups(topo: Topology, coord: Coord, groups: ProcessGroups, *, masters: bool) -> HopGroups:
    """This replica's groups of a sync in two hops (the masters' one only where ``masters``)."""
    return HopGroups(
        bundle_group=groups.bundle if topo.shape[coord.stage] > 1 else None,
        # Under tensor parallelism: the master's process of this rank's index in its TP group.
        bundle_master=topo.stage_master(coord.bundle, coord.stage) + coord.tp,
        masters_group=groups.masters if masters else None,
        is_master=coord.replica == 0,
        bundle=coord.bundle,
    )


def make_outer(
    cfg: RunConfig,
    topo: Topology,
    coord: Coord,
    stage: Stage,
    groups: ProcessGroups,
    wire: Wire,
    comm: Comm,
) -> OuterSync | None:
    """The meetings between bundles of ``--bundle-sync local:H|diloco:H`` (None: every step)."""
    par = cfg.parallel
    mode, every = parse_bundle_sync(par.bundle_sync)
    if mode == "step":
        return None
    return OuterSync(
        [(stage.full_name(n), p) for n, p in stage.named_parameters() if p.requires_grad],
        meetings=Meetings(
            mode=mode,
            every=every,
            outer_lr=par.outer_lr,
            outer_momentum=par.outer_momentum,
            rule=par.aggregate,
        ),
        total=0,  # the run's last step, set by the trainer that knows it
        groups=hop_groups(topo, coord, groups, masters=coord.replica == 0),
        wire=wire,
        fault=aggregate.fault_from_env(topo.num_bundles),
        seed=cfg.train.seed,
        comm=comm,
    )


# -- the data a rank reads ---------------------------------------------------------------------
