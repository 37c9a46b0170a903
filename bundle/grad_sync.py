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
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def _sum_hook(group, bucket):  # DDP checks real (not postponed) annotations, so none here

    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


class GradSync:
    """Interface: ``module`` runs forwards; ``backward`` runs one micro-batch's backward."""

    module: nn.Module

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def backward(
        self, outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None, *, last: bool
    ) -> None:
        torch.autograd.backward(list(outputs), list(grads) if grads is not None else None)

    def finish(self) -> None:
        """Called after the step's last backward; gradients are synced when it returns."""


class FlatSync(GradSync):
    def __init__(self, stage: nn.Module, group: dist.ProcessGroup, device: torch.device) -> None:
        self.module = DistributedDataParallel(
            stage,
            device_ids=[device] if device.type == "cuda" else None,
            process_group=group,
            forward_sync_buffers=False,
        )
        self.module.register_comm_hook(group, _sum_hook)

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
    def __init__(
        self,
        stage: nn.Module,
        *,
        bundle_group: dist.ProcessGroup | None,
        bundle_master: int,
        masters_group: dist.ProcessGroup | None,
        is_master: bool,
    ) -> None:
        self.module = stage
        self.bundle_group, self.bundle_master = bundle_group, bundle_master
        self.masters_group, self.is_master = masters_group, is_master
        self.params = [p for p in stage.parameters() if p.requires_grad]

    def finish(self) -> None:
        if not self.params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch._utils._flatten_dense_tensors(grads)
        if self.bundle_group is not None:
            dist.reduce(flat, dst=self.bundle_master, group=self.bundle_group)
        if self.is_master and self.masters_group is not None:
            dist.all_reduce(flat, group=self.masters_group)
        if self.bundle_group is not None:
            dist.broadcast(flat, src=self.bundle_master, group=self.bundle_group)
        for p, synced in zip(
            self.params, torch._utils._unflatten_dense_tensors(flat, grads), strict=True
        ):
            p.grad = synced
