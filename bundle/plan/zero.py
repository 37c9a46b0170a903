"""ZeRO-3 (``--zero 3``) costed: each stage's parameters, gradients and optimizer state sharded
over its replicas (FSDP2, one ``fully_shard`` per block), each block gathered for every micro-batch.

- **The shard group**: with ``--grad-sync flat`` a stage's replicas in every bundle (width x
  bundles, ZeRO-1's group); with ``hierarchical`` its replicas in one bundle (width), each shard
  then all-reduced between bundles (HSDP) by the replicas that hold it. A stage whose shard group
  is one replica holds everything, as without sharding.
- **Memory** per replica: parameters, gradients and optimizer state divided by the shard group's
  size, no DDP buckets, and on top one block's full parameters and gradients at a time (the
  largest block's, ``Memory.gathered``; with model chunks the largest of all the stage's blocks:
  one is gathered at a time). A ``--lora`` base is sharded and gathered too, but has no
  gradient: it adds to the parameters and the gathers, not to the reduce-scatters.
- **Time** per micro-batch, with the collectives of ``bundle.plan.cost`` (the bandwidth model of
  the gradient sync): the forward all-gathers each block's parameters (every member receives the
  other members' shards); the backward gathers them again and reduce-scatters each block's
  gradient (half a ring all-reduce of it); with ``hierarchical`` sync each block's gradient shard
  is all-reduced between bundles as well. One collective per block, each with its latency. Where
  communication runs beside compute (GPUs: FSDP2 prefetches the next block's gather) a forward or
  backward takes the longer of its compute and its collectives; where it does not (gloo on a
  CPU), their sum. A split backward gathers with its input half and reduce-scatters with its
  weight half. No gradient sync is left for the end of the step, and the optimizer steps its
  shard only (its time divided by the shard group's size).
- **Not modelled**: the first block's gather, which no prefetch hides; gathers and reductions in
  a lower precision (FSDP2's ``MixedPrecisionPolicy``: counted in fp32, as the master weights);
  the copies into and out of FSDP2's flat buffers; the collectives of the ranks that hold other
  shards between bundles, taken to sit where the stage masters do.
"""

from __future__ import annotations

from dataclasses import replace

from bundle.ir.schedule import Op
from bundle.plan.cost import CostModel, Memory
from bundle.plan.dataparallel import DataParallel
from bundle.topology import Topology

FULL = 3  # --zero 3: parameters, gradients and optimizer state sharded


def shard_group(topo: Topology, s: int, grad_sync: str, bundle: int = 0) -> tuple[int, ...]:
    """The ranks stage ``s``'s state is sharded over under ``--zero 3`` (``bundle``'s own with
    hierarchical sync)."""
    if grad_sync == "hierarchical":
        return topo.bundle_stage_group(bundle, s)
    return topo.stage_group(s)


def between_group(topo: Topology, s: int, grad_sync: str) -> tuple[int, ...]:
    """The ranks that all-reduce one shard of stage ``s`` between bundles: one per bundle with
    hierarchical sync, none to reduce with under flat (the shard group spans the bundles)."""
    if grad_sync == "hierarchical":
        return topo.masters_group(s)
    return (topo.stage_master(0, s),)


def shards(dp: DataParallel, grad_sync: str, topo: Topology, s: int) -> int:
    """The replicas stage ``s``'s optimizer state is divided over: its stage group under
    ``--zero 1``, its shard group under ``--zero 3``, else 1."""
    if dp.zero == FULL:
        return len(shard_group(topo, s, grad_sync))
    return len(topo.stage_group(s)) if dp.zero else 1


def memory(cost: CostModel, mem: Memory, pieces: list[tuple[int, int]], over: int) -> Memory:
    """A replica's memory ``mem`` (its optimizer state already divided by ``over``) with its
    parameters and gradients sharded over ``over`` replicas and one block gathered at a time."""
    if over < 2:
        return mem
    blocks = [j for a, b in pieces for j in range(a, b)]
    # The block's full parameters and its full gradient (none for a frozen one).
    largest = max(
        (cost.param_bytes(j, j + 1) + cost.grad_bytes(j, j + 1) for j in blocks), default=0.0
    )
    return replace(
        mem,
        params=mem.params / over,
        grads=mem.grads / over,
        buckets=0.0,
        gathered=largest,
    )


class Collectives:
    """Seconds of one layout's ZeRO-3 collectives, per stage, piece and compute action."""

    def __init__(self, cost: CostModel, topo: Topology, grad_sync: str, bundle: int = 0) -> None:
        self.cost, self.topo, self.grad_sync, self.bundle = cost, topo, grad_sync, bundle
        self._memo: dict[tuple[int, int, int], tuple[float, float]] = {}

    def groups(self, s: int) -> tuple[list[int], list[int]]:
        """The nodes of stage ``s``'s shard group and of its group between bundles."""
        topo = self.topo
        inner = shard_group(topo, s, self.grad_sync, self.bundle)
        across = between_group(topo, s, self.grad_sync)
        return [topo.node_of(r) for r in inner], [topo.node_of(r) for r in across]

    def over(self, s: int) -> int:
        return len(shard_group(self.topo, s, self.grad_sync, self.bundle))

    def parts(self, s: int, lo: int, hi: int) -> tuple[float, float]:
        """(gather, reduce) seconds of blocks ``lo..hi-1`` of stage ``s`` once: every block's
        all-gather; every block's reduce-scatter and its shard's all-reduce between bundles."""
        key = (s, lo, hi)
        if key not in self._memo:
            inner, across = self.groups(s)
            n, cost = len(inner), self.cost
            params = [cost.param_bytes(j, j + 1) for j in range(lo, hi)]
            grads = [cost.grad_bytes(j, j + 1) for j in range(lo, hi)]
            gather = sum(cost.allgather(b / n, inner) for b in params if b > 0)
            reduce = sum(
                cost.reduce(b, inner) + cost.allreduce(b / n, across) for b in grads if b > 0
            )
            self._memo[key] = (gather, reduce)
        return self._memo[key]

    def seconds(self, s: int, lo: int, hi: int, op: Op) -> float:
        """The collectives of one compute action of stage ``s`` on blocks ``lo..hi-1``."""
        gather, reduce = self.parts(s, lo, hi)
        if op is Op.FORWARD or op is Op.BACKWARD_INPUT:
            return gather
        if op is Op.BACKWARD_WEIGHT:
            return reduce
        return gather + reduce

    def per_micro(self, s: int, lo: int, hi: int) -> float:
        """One micro-batch's collectives on stage ``s``: forward and backward together."""
        gather, reduce = self.parts(s, lo, hi)
        return 2 * gather + reduce


def action_time(compute: float, comm: float, *, overlap: bool) -> float:
    """An action's seconds: its compute beside its collectives, or after them."""
    return max(compute, comm) if overlap else compute + comm
