"""Gradient sync of one stage across its data-parallel replicas, behind one interface.

Every replica's loss is already scaled to its share of the global-batch mean (``sum / B``), so the
sync must SUM, never average: after it each replica holds exactly the gradient one process would
compute on the whole global batch.

- ``flat``: DistributedDataParallel over the stage group, with a summing comm hook; bucketing and
  overlap with the last backward come from PyTorch.
- ``hierarchical`` (the original Bundle design): reduce to the stage master inside the bundle,
  allreduce among the masters of all bundles, broadcast back inside the bundle.

The hop between bundles (the flat sync's whole allreduce, the hierarchical masters' allreduce) is a
``bundle.engine.hops.Hop``: exact by default, compressed or robustly combined by option. With
``--bundle-sync local:H|diloco:H`` the hierarchical sync runs without the masters' hop (bundles
meet every H steps instead, bundle.engine.outer) and scales each bundle's sum to its own mean.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from bundle.collectives.comm import Collectives, Comm, Started
from bundle.engine.hops import Hop, HopGroups, Wire, done

# Buffers (BatchNorm's statistics) are per replica after the start, as in every pipeline system:
# DDP must not broadcast them before each forward. torch 2.13 renamed the switch; the old name
# (which also skips the start-up broadcast of buffers, harmless: replicas build them alike) is what
# torch 2.10-2.12 accept.
_NO_FORWARD_BUFFER_SYNC: dict[str, Any] = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)


class _Waits:
    """A hop's future, waited for like a collective's work."""

    def __init__(self, fut: torch.futures.Future) -> None:
        self.fut = fut

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.fut.wait()
        return True


class GradSync:
    """Interface: ``module`` runs forwards; ``backward`` runs one micro-batch's backward.

    The engine sets ``step`` (0-based) before a step's first backward; ``wire`` counts the bytes
    the sync sends against the same sync in fp32.
    """

    def __init__(self, module: nn.Module) -> None:
        # Used alone when a stage has no data-parallel peer: nothing to sync, nothing to wrap.
        self.module = module
        self.step = 0
        self.wire = Wire()
        self.hop: Hop | None = None

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def backward(
        self,
        outputs: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor] | None,
        *,
        last: bool,
        run: Callable[[], None] | None = None,
    ) -> None:
        """Micro-batch's backward from ``outputs`` seeded with ``grads`` (None: the loss), or
        ``run``, the weight half of a split backward (bundle.engine.split_backward), which
        accumulates the stage's gradients through the same hooks."""
        if run is not None:
            run()
        else:
            torch.autograd.backward(list(outputs), list(grads) if grads is not None else None)

    def finish(self) -> None:
        """Called after the step's last backward; gradients are synced when it returns."""

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Clear the gradients of this sync's module (a rank with several model chunks has one
        sync per chunk, each clearing its own: the hierarchical sync's are bucket views)."""
        self.module.zero_grad(set_to_none=True)


class FlatSync(GradSync):
    """DDP over the stage group, its buckets summed by the hop (DDP's comm hook).

    The hook starts each bucket's hop and hands DDP the bucket back at once (gradients are views
    of DDP's buckets), so the step's last backward returns without waiting for the stage's
    all-reduce: the engine posts the last gradient send to the stage before first, and ``finish``
    waits for the sums. Otherwise DDP waits for every bucket at the end of that backward, and
    the stage upstream waits for the cross-bundle all-reduce before its own last backward.
    """

    module: DistributedDataParallel

    def __init__(
        self,
        stage: nn.Module,
        group: dist.ProcessGroup,
        device: torch.device,
        *,
        bucket_mb: float,
        comm: Comm | None = None,
        hop: Hop | None = None,
    ) -> None:
        self.comm = comm or Collectives()
        with self.comm.exclusive(group, "DDP's start-up broadcasts"):
            ddp = DistributedDataParallel(
                stage,
                device_ids=[device] if device.type == "cuda" else None,
                process_group=group,
                bucket_cap_mb=bucket_mb,
                gradient_as_bucket_view=True,
                **_NO_FORWARD_BUFFER_SYNC,
            )
        super().__init__(ddp)
        self.group = group
        self.hop = hop or Hop(group, self.comm, wire=self.wire)
        self.wire = self.hop.wire
        self._pending: list[tuple[torch.Tensor, torch.futures.Future]] = []
        self.defer = True  # False: DDP waits for the sums in the backward (scripts/bench.py)
        self.module.register_comm_hook(self, _deferred_hook)
        self._settle_buckets()

    def _settle_buckets(self) -> None:
        """Fix DDP's bucket layout before the first step (collective over the stage group).

        DDP re-buckets once, in the order gradients arrive in a process's first synced backward.
        A resumed process would sum its first step in the old layout where the uninterrupted run
        used the new one, and a bucket laid out differently is summed in another order over 3 or
        more replicas: not bit-identical. One backward of zeros through every parameter, built so
        that they arrive in reverse registration order (DDP's classic layout, overlapping the
        backward), makes every process re-bucket alike before it trains; the rebuild itself (a
        broadcast DDP would start in the first step's forward) runs here too.
        """
        params = [p for p in self.module.module.parameters() if p.requires_grad]
        if not params:
            return
        zero = torch.zeros((), device=params[0].device)
        for p in params:  # autograd runs the latest-built branch first: the last parameter
            zero = zero + (p * 0).sum()
        self.module.reducer.prepare_for_backward([zero])
        self.step = -1  # no fault, no compression: an exact sum of zeros
        zero.backward()
        self.finish()
        with self.comm.exclusive(self.group, "DDP's bucket rebuild"):
            self.module._has_rebuilt_buckets = self.module.reducer._rebuild_buckets()
        for p in params:
            p.grad = None
        self.wire.sent = self.wire.full = 0

    def finish(self) -> None:
        pending, self._pending = self._pending, []
        for buf, fut in pending:
            fut.wait()
            summed = fut.value()
            if summed.data_ptr() != buf.data_ptr():  # a hop that sums into a tensor of its own
                buf.copy_(summed)

    def no_sync(self) -> contextlib.AbstractContextManager:
        # Forwards never arm the reducer: under 1F1B a later forward precedes earlier backwards,
        # so the reducer is armed explicitly right before the step's last backward instead.
        return self.module.no_sync()

    def backward(self, outputs, grads, *, last: bool, run=None) -> None:
        if last:
            # Same arming torch.distributed.pipelining does for DDP-wrapped stages (the outputs
            # only matter to find unused parameters, which this sync never asks for).
            self.module.reducer.prepare_for_backward(list(outputs))
            super().backward(outputs, grads, last=True, run=run)
        else:
            with self.module.no_sync():
                super().backward(outputs, grads, last=False, run=run)


class HierarchicalSync(GradSync):
    """Reduce in the bundle, allreduce among masters, broadcast in the bundle, bucket by bucket.

    Gradients live in flat bucket buffers (each ``p.grad`` is a view), so a sync copies nothing
    and loops over buckets, not parameters. During the step's last backward, a bucket whose
    parameters have all accumulated starts its in-bundle reduce at once, overlapping the rest of
    the backward; ``finish`` chains the masters' allreduce and the broadcast per bucket.
    """

    def __init__(
        self,
        stage: nn.Module,
        *,
        groups: HopGroups,
        bucket_mb: float,
        comm: Comm | None = None,
        hop: Hop | None = None,
        scale: float = 1.0,
        counts_masters: bool = False,
    ) -> None:
        """``hop`` is the masters' hop (None: ``groups.masters_group``'s exact allreduce);
        ``scale`` multiplies the synced gradients (a bundle's own mean under local SGD / DiLoCo);
        ``counts_masters``: charge the masters' hop to ``wire``'s fp32 baseline even where it
        does not run every step."""
        super().__init__(stage)
        bundle_group, bundle_master = groups.bundle_group, groups.bundle_master
        masters_group, is_master = groups.masters_group, groups.is_master
        self.comm = comm or Collectives()
        self.scale, self.counts_masters = scale, counts_masters
        if hop is None and masters_group is not None and is_master:
            hop = Hop(masters_group, self.comm, wire=self.wire)
        self.hop = hop
        if hop is not None:
            self.wire = hop.wire
        bucket_bytes = bucket_mb * 2**20
        self.bundle_group, self.bundle_master = bundle_group, bundle_master
        self.masters_group, self.is_master = masters_group, is_master
        # Backward produces gradients roughly in reverse registration order: bucket that way.
        params = [p for p in stage.parameters() if p.requires_grad][::-1]
        buckets: list[list[nn.Parameter]] = []
        size = 0
        for p in params:
            if not buckets or size >= bucket_bytes or buckets[-1][0].dtype != p.dtype:
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.buffers: list[torch.Tensor] = []
        self._bucket_of: dict[nn.Parameter, int] = {}
        self._params = buckets
        for b, group in enumerate(buckets):
            buf = torch.zeros(
                sum(p.numel() for p in group), dtype=group[0].dtype, device=group[0].device
            )
            offset = 0
            for p in group:
                # The parameter's own strides (channels-last kernels too): autograd accumulates
                # into a gradient laid out like its parameter without a strided copy.
                p.grad = buf.as_strided(p.size(), p.stride(), offset)
                offset += p.numel()
                self._bucket_of[p] = b
                p.register_post_accumulate_grad_hook(self._ready)
            self.buffers.append(buf)
        self._sizes = [len(g) for g in buckets]
        self._left: list[int] = []
        self._works: list = []
        self._launched = 0  # buckets whose reduce started this step: always 0..n-1 in order
        self._armed = False

    def backward(self, outputs, grads, *, last: bool, run=None) -> None:
        if last:
            self._armed = True
            self._left = list(self._sizes)
            self._works = [None] * len(self.buffers)
            self._launched = 0
        super().backward(outputs, grads, last=last, run=run)

    def _reduce(self, b: int):
        if self.bundle_group is None:
            return None
        self._count(self.buffers[b])
        return self.comm.reduce(self.buffers[b], self.bundle_master, self.bundle_group)

    def _count(self, buf: torch.Tensor, sent: bool = True) -> None:
        nbytes = buf.numel() * buf.element_size()
        self.wire.add(nbytes if sent else 0, nbytes)

    def _ready(self, p: nn.Parameter) -> None:
        if not self._armed:
            return
        b = self._bucket_of[p]
        self._left[b] -= 1
        if self._left[b] == 0:
            self._launch()

    def _launch(self, *, all_of_them: bool = False) -> None:
        """Start the reduces of the ready buckets that come next in index order (of every bucket
        left, ready or not, with ``all_of_them``). Replicas whose backwards produce gradients in
        different orders (data-dependent branches) still launch alike, as DDP does: on NCCL the
        n-th reduce of every member must be the same bucket's."""
        while self._launched < len(self._works) and (
            all_of_them or self._left[self._launched] == 0
        ):
            self._works[self._launched] = self._reduce(self._launched)
            self._launched += 1

    def finish(self) -> None:
        self._armed = False
        works = self._works
        # Buckets some of whose parameters got no gradient in the last backward start now.
        self._launch(all_of_them=True)
        self._then(works, self._allreduce if self.hop is not None else None)
        if self.counts_masters and self.is_master:
            for buf in self.buffers:  # what the masters' hop would send every step
                self._count(buf, sent=False)
        self._then(works, self._broadcast if self.bundle_group is not None else None)
        for w in works:
            if w is not None:
                w.wait()
        if self.scale != 1.0:
            for buf in self.buffers:
                buf.mul_(self.scale)

    def _then(self, works: list, start: Callable[[int, torch.Tensor], object] | None) -> None:
        """Per bucket: wait for its previous operation, then start ``start(b, buffer)``, if any."""
        for b, buf in enumerate(self.buffers):
            if works[b] is not None:
                works[b].wait()
            works[b] = start(b, buf) if start is not None else None

    def _allreduce(self, b: int, buf: torch.Tensor) -> _Waits:
        assert self.hop is not None  # started only where there is one
        return _Waits(self.hop.start(b, buf, self._params[b], self.step))

    def _broadcast(self, b: int, buf: torch.Tensor) -> Started:
        assert self.bundle_group is not None  # started only where there is one
        self._count(buf)
        return self.comm.broadcast(buf, self.bundle_master, self.bundle_group)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        for buf in self.buffers:
            buf.zero_()


def _deferred_hook(sync: FlatSync, bucket):  # DDP checks real annotations: none here
    """DDP's comm hook for the flat sync: the bucket's hop started, its sum waited for later."""
    buf, hop = bucket.buffer(), sync.hop
    assert hop is not None  # FlatSync always has one
    summed = hop.start(bucket.index(), buf, bucket.parameters(), sync.step)
    if not sync.defer:
        return summed
    sync._pending.append((buf, summed))
    return done(buf)
