"""The collectives of training's NCCL groups, behind one interface: straight onto
torch.distributed (``Collectives``), or through the NCCL emulation
(``bundle.collectives.nccl_emu``), which runs each as one call of its communicator's in-order
stream.

On GPUs the world group (which also carries the point-to-point calls) and the stage, bundle and
masters groups are NCCL communicators: every collective on them goes through a ``Comm``, so that
under ``--backend nccl-emu`` its order against the calls pending on the same communicator is
NCCL's. The job's gloo groups (``control``, ``async_save``) are gloo on GPUs too and are used
directly. Code of torch's own that starts collectives on an NCCL group (DDP's start-up and bucket
rebuild, ZeRO-1's broadcasts, PowerSGD's rounds) runs inside ``comm.exclusive(group, what)``,
which the emulator turns into one call of that group's stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist


class Started(Protocol):
    """A collective in flight: torch's ``Work``, or the emulator's."""

    def wait(self, timeout: timedelta = ...) -> bool: ...

    def get_future(self) -> torch.futures.Future[Any]: ...


class Comm(Protocol):
    """What training needs of its NCCL groups (``group=None``: the world group)."""

    def all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup | None, op: Any = ...
    ) -> Started: ...

    def reduce(self, tensor: torch.Tensor, dst: int, group: dist.ProcessGroup) -> Started: ...

    def broadcast(self, tensor: torch.Tensor, src: int, group: dist.ProcessGroup) -> Started: ...

    def all_gather(
        self, parts: list[torch.Tensor], tensor: torch.Tensor, group: dist.ProcessGroup
    ) -> Started: ...

    def barrier(self, group: dist.ProcessGroup | None = None) -> None: ...

    def exclusive(
        self, group: dist.ProcessGroup | None, what: str
    ) -> contextlib.AbstractContextManager[None]: ...


class Collectives:
    """The collectives on torch.distributed, asynchronous where torch allows it."""

    def all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup | None, op: Any = dist.ReduceOp.SUM
    ) -> dist.Work:
        return _started(dist.all_reduce(tensor, op=op, group=group, async_op=True))

    def reduce(self, tensor: torch.Tensor, dst: int, group: dist.ProcessGroup) -> dist.Work:
        return _started(dist.reduce(tensor, dst=dst, group=group, async_op=True))

    def broadcast(self, tensor: torch.Tensor, src: int, group: dist.ProcessGroup) -> dist.Work:
        return _started(dist.broadcast(tensor, src=src, group=group, async_op=True))

    def all_gather(
        self, parts: list[torch.Tensor], tensor: torch.Tensor, group: dist.ProcessGroup
    ) -> dist.Work:
        return _started(dist.all_gather(parts, tensor, group=group, async_op=True))

    def barrier(self, group: dist.ProcessGroup | None = None) -> None:
        dist.barrier(group=group)

    @contextlib.contextmanager
    def exclusive(self, group: dist.ProcessGroup | None, what: str) -> Iterator[None]:
        yield


def _started(work: dist.Work | None) -> dist.Work:
    if work is None:  # async_op=True in a group this rank belongs to always returns its work
        raise RuntimeError("a collective started in a group this rank is not in")
    return work
