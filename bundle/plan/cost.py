"""Seconds and bytes of a plan's pieces: stage compute, transfers, gradient sync, memory.

- **Compute**: per block, forward and backward seconds at the rows a replica holds, measured
  (``profile.Timings``) or estimated by a roofline over the block's operators against the
  cluster's device; the engine's own per-action overhead (``Overheads``, measured once by
  ``calibrate``) on top. Recompute adds the stage's forward to each recomputed backward.
- **Mixed devices**: a cluster of several device types has one cost model per type (``on``): its
  roofline against that type's speed, or the measured timings divided by the type's CPU share
  (an emulated slower device); a process is costed on its own device's model.
- **Transfers**: bytes of the boundary tensors in their wire dtype / bandwidth + latency, over the
  intra- or inter-node link by where the two ranks sit; each send's and receive's call on its side.
- **Collectives**: ring all-reduce ``2(n-1)/n * bytes / bandwidth + 2(n-1) * latency`` over the
  slowest link of the group; reduce and broadcast ``(n-1)/n * bytes / bandwidth + (n-1) * latency``;
  all-gather of every member's ``bytes`` ``(n-1) * bytes / bandwidth + (n-1) * latency``.
  Gradients are synced in buckets (the engine's ``--bucket-mb``; DDP's first bucket is 1 MiB),
  each ready when the last backward has passed its parameters where communication runs beside
  compute (GPUs), and when the backward is over where it takes the same cores (gloo on a CPU: its
  reductions and copies compete with the backward, so nothing is hidden).
- **What trains**: with ``--lora`` only what trains has gradients, optimizer state and sync; the
  frozen base takes memory (and ZeRO-3's gathers), and its backward has no weight half.
- **Memory** per device: fp32 parameters, the gradients of those that train (and DDP's bucket
  copies), their optimizer state (its bytes per parameter from ``bundle.engine.optim.STATE_BYTES``:
  none for plain SGD, a momentum buffer, Adam's two moments; ZeRO-1 shares it out:
  ``bundle.plan.dataparallel``; ZeRO-3 the parameters and gradients too, one block gathered at a
  time: ``bundle.plan.zero``), the activations the schedule holds (``--recompute`` keeps only
  stage inputs, plus the micro-batch a backward rebuilds) and the receive buffers (the
  data-parallel options' state: ``bundle.plan.dataparallel``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from bundle.config import TrainConfig
from bundle.engine.optim import state_bytes_per_param
from bundle.ir.p2p import COMM
from bundle.ir.schedule import Action, Op, unknown
from bundle.plan.anatomy import Anatomy
from bundle.plan.cluster import Cluster, DeviceType, Link, Speed
from bundle.plan.profile import Timings

DDP_FIRST_BUCKET = 2**20  # torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES
_MASTER_BYTES = 4  # fp32 master weights and gradients
_OPTIMIZER_BYTES = 20  # an SGD-with-momentum step reads param, grad, momentum; writes two


@dataclass(frozen=True)
class Overheads:
    """The engine's own time beyond the model's arithmetic, measured on this machine."""

    compute_action: float = 0.0  # per forward or backward action of a stage
    comm_action: float = 0.0  # per send or receive action, beyond the calls it posts
    tp_sum: float = 0.0  # per tensor-parallel sum in a step, beyond its all-reduce
    send_call: float = 0.0  # per message, posting it (bundle.plan.messages): a send's call
    send_call_per_byte: float = 0.0  # grows with its bytes (gloo writes what the socket takes)
    recv_call: float = 0.0  # and a receive's does not
    step: float = 0.0  # per step: bookkeeping, sync hand-off, zero_grad
    copy_bandwidth: float = float("inf")  # bytes/s of a tensor copy (DDP's bucket copies)


@dataclass(frozen=True, kw_only=True)
class Execution:
    """How the job runs the model, as far as its costs go: the compute precision, what backward
    recomputes, the gradient buckets' size, whether the gradient sync runs beside the backward
    (not with gloo on a CPU, which reduces on the cores the backward runs on), and the optimizer
    whose state each device holds."""

    precision: str = "fp32"
    recompute: str = "never"
    bucket_mb: float = 25.0
    overlap: bool = True
    optimizer: str = TrainConfig.optimizer  # --optimizer: the state it keeps per parameter
    momentum: float = TrainConfig.momentum  # --momentum: SGD keeps a buffer only with one

    @property
    def state_bytes(self) -> int:
        """Bytes of optimizer state per parameter, unsharded (``bundle.engine.optim``'s table);
        an unknown optimizer or a momentum out of range is a ConfigError naming the flag."""
        train = TrainConfig(optimizer=self.optimizer, momentum=self.momentum)
        return state_bytes_per_param(train)


@dataclass(frozen=True)
class Memory:
    """Bytes one device holds at its peak."""

    params: float
    grads: float
    optimizer: float
    buckets: float
    activations: float
    buffers: float
    data_parallel: float = 0.0  # what --grad-compression, --bundle-sync, --aggregate keep
    gathered: float = 0.0  # --zero 3: one block's full parameters and gradients (bundle.plan.zero)

    @property
    def total(self) -> float:
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.buckets
            + self.activations
            + self.buffers
            + self.data_parallel
            + self.gathered
        )


# Per operator of every block: its block, FLOPs, fixed bytes, bytes per row, half precision.
_OpArrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _speed(cluster: Cluster) -> Speed:
    """The device's speeds, where the cluster file gives them (else the timings are measured)."""
    if cluster.speed is None:
        raise ValueError("a cost model without measured timings needs the device's speeds")
    return cluster.speed


class _Roofline:
    """Per-block seconds from operator counts: each operator takes the slowest of its FLOPs,
    its bytes and one kernel's latency."""

    def __init__(self, anatomy: Anatomy, speed: Speed, precision: str) -> None:
        self.speed, self.precision = speed, precision
        self.half = precision != "fp32"
        self.n = len(anatomy.blocks)
        self.fwd = self._arrays([b.fwd_ops for b in anatomy.blocks])
        self.bwd = self._arrays([b.bwd_ops for b in anatomy.blocks])
        self.classes = anatomy.num_classes

    @staticmethod
    def _arrays(per_block: list[tuple[tuple[float, float, float, int], ...]]) -> _OpArrays:
        rows = [(i, *op) for i, ops in enumerate(per_block) for op in ops]
        a = np.asarray(rows, dtype=float).reshape(-1, 5)
        return a[:, 0].astype(int), a[:, 1], a[:, 2], a[:, 3], a[:, 4]

    def _blocks(self, ops: _OpArrays, rows: float) -> np.ndarray:
        s = self.speed
        index, flops, fixed, per_row, half = ops
        peak = np.where(half > 0, s.peak_flops[self.precision], s.peak_flops.get("fp32", 0.0))
        peak = np.where(peak > 0, peak, s.peak_flops[self.precision])
        scale = 0.5 if self.half else 1.0
        t = np.maximum(
            flops * rows / (peak * s.efficiency),
            (fixed + per_row * rows * scale) / (s.memory_bandwidth * s.efficiency),
        )
        t = np.maximum(t, s.kernel_latency)
        return np.bincount(index, weights=t, minlength=self.n)

    def at(self, rows: float) -> tuple[np.ndarray, np.ndarray, float]:
        s = self.speed
        loss_bytes = 4 * rows * self.classes * 4  # logits read, softmax, gradient written
        loss = 4 * s.kernel_latency + loss_bytes / (s.memory_bandwidth * s.efficiency)
        return self._blocks(self.fwd, rows), self._blocks(self.bwd, rows), loss


class CostModel:
    """Every cost the simulator and the search ask for, for one model on one cluster."""

    def __init__(
        self,
        *,
        anatomy: Anatomy,
        cluster: Cluster,
        timings: Timings | None = None,
        overheads: Overheads | None = None,
        execution: Execution | None = None,
        compute_scale: float = 1.0,
    ) -> None:
        if timings is None and cluster.speed is None:
            raise ValueError("a cluster whose device speed is 'measure' needs measured timings")
        self.anatomy, self.cluster = anatomy, cluster
        self.timings = timings
        self.compute_scale = compute_scale  # compute seconds x this (1 / a CPU share)
        self.overheads = overheads or Overheads()
        self.execution = execution = execution or Execution()
        self.precision, self.recompute = execution.precision, execution.recompute
        self.bucket_bytes = execution.bucket_mb * 2**20
        self.overlap = execution.overlap
        self.state_bytes = execution.state_bytes
        self.n = len(anatomy.blocks)
        self._source = (
            timings
            if timings is not None
            else _Roofline(anatomy, _speed(cluster), execution.precision)
        )
        self._times: dict[float, tuple[np.ndarray, np.ndarray, float]] = {}
        self._prefix: dict[float, np.ndarray] = {}
        self.params = np.array([b.params for b in anatomy.blocks], dtype=float)
        self.trained = np.array([b.trained for b in anatomy.blocks], dtype=float)
        self._act_scale = 0.5 if self.precision != "fp32" else 1.0
        self._types = {t.key: self._for_type(t) for t in cluster.types}

    def like(self, cluster: Cluster, *, compute_scale: float = 1.0) -> CostModel:
        """This model's settings on another cluster (or device type)."""
        return CostModel(
            anatomy=self.anatomy,
            cluster=cluster,
            timings=self.timings if cluster.speed is None else None,
            overheads=self.overheads,
            execution=self.execution,
            compute_scale=compute_scale,
        )

    def _for_type(self, t: DeviceType) -> CostModel:
        one = replace(
            self.cluster,
            device_name=t.name,
            memory_bytes=t.memory_bytes,
            speed=t.speed,
            types=(),
            kinds=(),
        )
        return self.like(one, compute_scale=t.penalty / t.cpu if t.cpu else 1.0)

    def host(self, seconds: float) -> float:
        """Work of the process itself (engine overheads, copies): slowed, as compute, by a share."""
        return seconds * self.compute_scale

    def on(self, kind: str) -> CostModel:
        """The cost model of one device type ("" or a single-type cluster: this one)."""
        return self._types.get(kind, self)

    # -- compute ---------------------------------------------------------------------------------

    def block_times(self, rows: float) -> tuple[np.ndarray, np.ndarray, float]:
        if rows not in self._times:
            fwd, bwd, loss = self._source.at(rows)
            k = self.compute_scale
            self._times[rows] = (fwd * k, bwd * k, loss * k) if k != 1.0 else (fwd, bwd, loss)
        return self._times[rows]

    def prefix(self, rows: float) -> np.ndarray:
        """Cumulative forward + backward seconds of blocks ``[0, i)`` at ``rows`` rows."""
        if rows not in self._prefix:
            fwd, bwd, _ = self.block_times(rows)
            both = fwd + bwd + (fwd if self.recompute != "never" else 0.0)
            self._prefix[rows] = np.concatenate(([0.0], np.cumsum(both)))
        return self._prefix[rows]

    def forward(self, a: int, b: int, rows: float) -> float:
        fwd, _, loss = self.block_times(rows)
        last = b == self.n
        # The loss's forward and backward run where the last stage's forward does.
        return (
            float(fwd[a:b].sum())
            + (loss if last else 0.0)
            + self.host(self.overheads.compute_action)
        )

    def backward(self, a: int, b: int, rows: float, *, recompute: bool) -> float:
        fwd, bwd, _ = self.block_times(rows)
        again = float(fwd[a:b].sum()) if recompute else 0.0
        return float(bwd[a:b].sum()) + again + self.host(self.overheads.compute_action)

    # Of a block's backward, the share that computes its weights' gradients (dW beside dX: about
    # half for matrix products and convolutions); a block without weights has none.
    WEIGHT_SHARE = 0.5

    def weight_share(self, a: int, b: int) -> np.ndarray:
        """Per block ``a..b-1``, the share of its backward that computes weight gradients. Every
        parameter costs dX work, only one that trains dW work (``WEIGHT_SHARE`` of a block that
        trains whole): a frozen block's backward is all dX, a LoRA block's nearly so."""
        dw = self.WEIGHT_SHARE / (1.0 - self.WEIGHT_SHARE) * self.trained[a:b]
        whole = self.params[a:b] + dw
        return np.divide(dw, whole, out=np.zeros_like(dw), where=whole > 0)

    def backward_input(self, a: int, b: int, rows: float, *, recompute: bool) -> float:
        """A split backward's input half (bundle.engine.split_backward); nothing on the first
        stage, whose inputs need no gradient."""
        if a == 0:
            return self.host(self.overheads.compute_action)
        return self._half(a, b, rows, recompute, weights=False)

    def backward_weight(self, a: int, b: int, rows: float, *, recompute: bool) -> float:
        """A split backward's weight half; the whole backward on the first stage. A recomputed
        stage recomputes its forward again for it."""
        if a == 0:
            return self.backward(a, b, rows, recompute=recompute)
        return self._half(a, b, rows, recompute, weights=True)

    def _half(self, a: int, b: int, rows: float, recompute: bool, *, weights: bool) -> float:
        fwd, bwd, _ = self.block_times(rows)
        share = self.weight_share(a, b)
        part = bwd[a:b] * (share if weights else 1.0 - share)
        again = float(fwd[a:b].sum()) if recompute else 0.0
        return float(part.sum()) + again + self.host(self.overheads.compute_action)

    def backward_share(self, a: int, b: int, rows: float) -> np.ndarray:
        """Fraction of a stage's backward done when each block's gradients are complete
        (blocks ``a..b-1``, in block order; backward runs them in reverse); all 1 without overlap."""
        _, bwd, _ = self.block_times(rows)
        part = bwd[a:b]
        if not self.overlap:
            return np.ones_like(part)
        total = part.sum()
        done_from_end = np.cumsum(part[::-1])[::-1]  # backward of blocks j..b-1
        return done_from_end / total if total > 0 else np.ones_like(part)

    # -- transfers ---------------------------------------------------------------------------------

    def _wire(self) -> int:
        return 2 if self.precision != "fp32" else 4

    def boundary_bytes(self, cut: int, rows: float, *, grad: bool = False) -> float:
        """Bytes of ``rows`` rows of what block ``cut - 1`` hands block ``cut``."""
        if cut == 0:
            return self.anatomy.input_elems * 4 * rows
        block = self.anatomy.blocks[cut - 1]
        floats = sum(block.out_elems) * self._wire() * rows
        return floats if grad else floats + block.out_other_bytes * rows

    def link(self, node_a: int, node_b: int) -> Link:
        return self.cluster.intra if node_a == node_b else self.cluster.inter

    def _group_link(self, nodes: Sequence[int]) -> Link:
        if len(set(nodes)) > 1:
            return self.cluster.inter
        return self.cluster.collective or self.cluster.intra

    def allreduce(self, nbytes: float, nodes: Sequence[int]) -> float:
        n = len(nodes)
        if n < 2:
            return 0.0
        link = self._group_link(nodes)
        return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency

    def reduce(self, nbytes: float, nodes: Sequence[int]) -> float:
        """Reduce to one member, or broadcast from one: half a ring all-reduce."""
        n = len(nodes)
        if n < 2:
            return 0.0
        link = self._group_link(nodes)
        return (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency

    def allgather(self, nbytes: float, nodes: Sequence[int]) -> float:
        """Every member receives the other members' ``nbytes`` (a ring all-gather)."""
        n = len(nodes)
        if n < 2:
            return 0.0
        link = self._group_link(nodes)
        return (n - 1) * nbytes / link.bandwidth + (n - 1) * link.latency

    def copy_time(self, nbytes: float) -> float:
        """One copy of ``nbytes`` in device memory (each byte read and written)."""
        speed = self.cluster.speed
        if speed is not None:
            return 2 * nbytes / (speed.memory_bandwidth * speed.efficiency)
        return self.host(nbytes / self.overheads.copy_bandwidth)

    def bucket_copies(self, nbytes: float) -> float:
        """DDP copies each gradient into its bucket and back (no gradient-as-bucket views)."""
        speed = self.cluster.speed
        if speed is not None:  # a copy reads and writes every byte
            return 2 * 2 * nbytes / (speed.memory_bandwidth * speed.efficiency)
        return self.host(2 * nbytes / self.overheads.copy_bandwidth)

    def param_bytes(self, a: int, b: int) -> float:
        """Bytes of the fp32 parameters of blocks ``a..b-1``, frozen ones too."""
        return float(self.params[a:b].sum()) * _MASTER_BYTES

    def grad_bytes(self, a: int, b: int) -> float:
        """Bytes of the fp32 gradients of blocks ``a..b-1`` (of the parameters that train: what
        the sync sums, the optimizer steps and the options keep a copy of)."""
        return float(self.trained[a:b].sum()) * _MASTER_BYTES

    def buckets(self, a: int, b: int, *, ddp: bool) -> list[tuple[int, float]]:
        """Gradient buckets of a stage as (index of the block whose backward completes it,
        bytes), in the order backward fills them (parameters in reverse)."""
        out: list[tuple[int, float]] = []
        size, cap = 0.0, DDP_FIRST_BUCKET if ddp else self.bucket_bytes
        for j in range(b - 1, a - 1, -1):
            nbytes = self.trained[j] * _MASTER_BYTES
            if nbytes == 0:
                continue
            size += nbytes
            if size >= cap:
                out.append((j, size))
                size, cap = 0.0, self.bucket_bytes
        if size:
            out.append((a, size))
        return out

    def optimizer(self, a: int, b: int) -> float:
        params = float(self.trained[a:b].sum())
        if isinstance(self._source, Timings):
            return params * self._source.optimizer_per_param * self.compute_scale
        speed = _speed(self.cluster)
        return params * _OPTIMIZER_BYTES / (speed.memory_bandwidth * speed.efficiency)

    # -- memory ----------------------------------------------------------------------------------

    def saved_bytes(self, a: int, b: int, rows: float) -> float:
        blocks = self.anatomy.blocks
        kept = sum(blocks[j].saved.at(rows) for j in range(a, b))
        kept -= sum(blocks[j].saved_shared.at(rows) for j in range(a + 1, b))
        return max(kept, 0.0) * self._act_scale

    def memory(
        self,
        a: int,
        b: int,
        *,
        acts: Sequence[Action],
        rows: Sequence[int],
        recomputed: Sequence[bool],
        synced: bool,
        ddp: bool,
        shards: int = 1,
    ) -> Memory:
        """Peak bytes of one replica running blocks ``a..b-1`` through ``acts``; ``shards``: the
        replicas its optimizer state is sharded over (``--zero 1``: its stage group; ``--zero 3``: its
        shard group, whose parameters and gradients ``bundle.plan.zero.memory`` shares out)."""
        count = float(self.trained[a:b].sum())
        params, grads = self.param_bytes(a, b), self.grad_bytes(a, b)
        live = peak = in_flight = peak_in_flight = 0.0
        for act in acts:
            k = act.micro
            full = self.saved_bytes(a, b, rows[k])
            kept = self.boundary_bytes(a, rows[k]) if recomputed[k] else full
            if act.op is Op.FORWARD:
                live += kept
                in_flight += 1
                peak = max(peak, live)
                peak_in_flight = max(peak_in_flight, in_flight)
            elif act.op in (Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT):
                if recomputed[k]:
                    peak = max(peak, live + full)
                if act.op is not Op.BACKWARD_INPUT:  # a split backward holds them until W
                    live -= kept
                    in_flight -= 1
            elif act.op not in COMM:
                raise unknown(act, "the planner's memory model")
        top = max(rows)
        buffers = (peak_in_flight + 1) * (self.boundary_bytes(a, top) if a > 0 else 0.0)
        buffers += 2 * (self.boundary_bytes(b, top, grad=True) if b < self.n else 0.0)
        return Memory(
            params=params,
            grads=grads,
            optimizer=count * self.state_bytes / shards,
            buckets=grads if synced and ddp else 0.0,
            activations=peak,
            buffers=buffers,
        )
