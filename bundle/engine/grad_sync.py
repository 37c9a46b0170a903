"""Gradient sync of one stage across its data-parallel replicas, behind one interface.

Every replica's loss is already scaled to its share of the global-batch mean (``sum / B``), so the
sync must SUM, never average: after it each replica holds exactly the gradient one process would
compute on the whole global batch.

- ``flat``: DistributedDataParallel over the stage group, with a summing comm hook; bucketing and
  overlap with the last backward come from PyTorch.
- ``hierarchical`` (the original Bundle design): reduce to the stage master inside the bundle,
  allreduce among the masters of all bundles, broadcast back inside the bundle.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class Started(Protocol):
    """A collective in flight: torch's ``Work``, or the emulator's."""

    def wait(self, timeout: timedelta = ...) -> bool: ...

    def get_future(self) -> torch.futures.Future[Any]: ...


class Comm(Protocol):
    """What a sync needs to start its collectives asynchronously."""

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> Started: ...

    def reduce(self, tensor: torch.Tensor, dst: int, group: dist.ProcessGroup) -> Started: ...

    def broadcast(self, tensor: torch.Tensor, src: int, group: dist.ProcessGroup) -> Started: ...


class Collectives:
    """The sync's collectives on torch.distributed; ``bundle.engine.nccl_emu.Emulator`` has the
    same methods and runs them on per-group in-order streams, as NCCL does."""

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
        return _started(dist.all_reduce(tensor, group=group, async_op=True))

    def reduce(self, tensor: torch.Tensor, dst: int, group: dist.ProcessGroup) -> dist.Work:
        return _started(dist.reduce(tensor, dst=dst, group=group, async_op=True))

    def broadcast(self, tensor: torch.Tensor, src: int, group: dist.ProcessGroup) -> dist.Work:
        return _started(dist.broadcast(tensor, src=src, group=group, async_op=True))


def _started(work: dist.Work | None) -> dist.Work:
    if work is None:  # async_op=True in a group this rank belongs to always returns its work
        raise RuntimeError("a collective started in a group this rank is not in")
    return work


def _sum_hook(state, bucket):  # DDP checks real (not postponed) annotations, so none here
    group, comm = state
    fut = comm.all_reduce(bucket.buffer(), group).get_future()
    return fut.then(lambda f: f.value()[0])


class GradSync:
    """Interface: ``module`` runs forwards; ``backward`` runs one micro-batch's backward."""

    def __init__(self, module: nn.Module) -> None:
        # Used alone when a stage has no data-parallel peer: nothing to sync, nothing to wrap.
        self.module = module

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def backward(
        self, outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None, *, last: bool
    ) -> None:
        torch.autograd.backward(list(outputs), list(grads) if grads is not None else None)

    def finish(self) -> None:
        """Called after the step's last backward; gradients are synced when it returns."""

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)


class FlatSync(GradSync):
    module: DistributedDataParallel

    def __init__(
        self,
        stage: nn.Module,
        group: dist.ProcessGroup,
        device: torch.device,
        *,
        bucket_mb: float,
        comm: Comm | None = None,
    ) -> None:
        super().__init__(
            DistributedDataParallel(
                stage,
                device_ids=[device] if device.type == "cuda" else None,
                process_group=group,
                forward_sync_buffers=False,
                bucket_cap_mb=bucket_mb,
            )
        )
        self.module.register_comm_hook((group, comm or Collectives()), _sum_hook)

    def no_sync(self) -> contextlib.AbstractContextManager:
        # Forwards never arm the reducer: under 1F1B a later forward precedes earlier backwards,
        # so the reducer is armed explicitly right before the step's last backward instead.
        return self.module.no_sync()

    def backward(
        self, outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None, *, last: bool
    ) -> None:
        if last:
            # Same arming torch.distributed.pipelining does for DDP-wrapped stages.
            self.module.reducer.prepare_for_backward(list(outputs))
            super().backward(outputs, grads, last=True)
        else:
            with self.module.no_sync():
                super().backward(outputs, grads, last=False)


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
        bundle_group: dist.ProcessGroup | None,
        bundle_master: int,
        masters_group: dist.ProcessGroup | None,
        is_master: bool,
        bucket_mb: float,
        comm: Comm | None = None,
    ) -> None:
        super().__init__(stage)
        self.comm = comm or Collectives()
        bucket_bytes = bucket_mb * 2**20
        self.bundle_group, self.bundle_master = bundle_group, bundle_master
        self.masters_group, self.is_master = masters_group, is_master
        # Backward produces gradients roughly in reverse registration order: bucket that way.
        params = [p for p in stage.parameters() if p.requires_grad][::-1]
        groups: list[list[nn.Parameter]] = []
        size = 0
        for p in params:
            if not groups or size >= bucket_bytes or groups[-1][0].dtype != p.dtype:
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += p.numel() * p.element_size()
        self.buffers: list[torch.Tensor] = []
        self._bucket_of: dict[nn.Parameter, int] = {}
        for b, group in enumerate(groups):
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
        self._sizes = [len(g) for g in groups]
        self._left: list[int] = []
        self._works: list = []
        self._armed = False

    def backward(self, outputs, grads, *, last: bool) -> None:
        if last:
            self._armed = True
            self._left = list(self._sizes)
            self._works = [None] * len(self.buffers)
        super().backward(outputs, grads, last=last)

    def _reduce(self, b: int):
        if self.bundle_group is None:
            return None
        return self.comm.reduce(self.buffers[b], self.bundle_master, self.bundle_group)

    def _ready(self, p: nn.Parameter) -> None:
        if not self._armed:
            return
        b = self._bucket_of[p]
        self._left[b] -= 1
        if self._left[b] == 0:
            self._works[b] = self._reduce(b)

    def finish(self) -> None:
        self._armed = False
        works = self._works
        for b, left in enumerate(self._left):
            if left > 0:  # some parameters got no gradient in the last backward
                works[b] = self._reduce(b)
        master = self.is_master and self.masters_group is not None
        self._then(works, self._allreduce if master else None)
        self._then(works, self._broadcast if self.bundle_group is not None else None)
        for w in works:
            if w is not None:
                w.wait()

    def _then(self, works: list, start: Callable[[torch.Tensor], object] | None) -> None:
        """Per bucket: wait for its previous operation, then start ``start(buffer)``, if any."""
        for b, buf in enumerate(self.buffers):
            if works[b] is not None:
                works[b].wait()
            works[b] = start(buf) if start is not None else None

    def _allreduce(self, buf: torch.Tensor) -> Started:
        assert self.masters_group is not None  # started only where there is one
        return self.comm.all_reduce(buf, self.masters_group)

    def _broadcast(self, buf: torch.Tensor) -> Started:
        assert self.bundle_group is not None  # started only where there is one
        return self.comm.broadcast(buf, self.bundle_master, self.bundle_group)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        for buf in self.buffers:
            buf.zero_()
