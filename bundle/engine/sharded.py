"""``--zero 3``: each stage's parameters, gradients and optimizer state sharded over its replicas
with FSDP2 (torch's ``fully_shard``), one FSDP unit per block of the stage.

- **Where it shards.** Flat sync: over the stage's replicas in every bundle (the stage group, as
  ``--zero 1``). Hierarchical sync: over the stage's replicas inside the bundle, each shard summed
  with the same replica's in every other bundle (a 2-D mesh, torch's HSDP): the original's
  two hops, with shards in place of whole gradients. A stage with one replica in all holds
  everything, as without ``--zero 3``. Stages of different widths shard over their own widths.
- **When it communicates.** A block's parameters are all-gathered before its forward and freed
  after it, gathered again for its backward (and for a recomputed forward), and its gradients
  are reduce-scattered (summed, never averaged: every replica's loss is its share of the global
  mean) as soon as its backward is done, once per micro-batch: a stage holds one block's full
  parameters and gradient at a time on top of its shards.
- **What is exact.** The sum over replicas is the same as the flat sync's, in another order
  (reduce-scatter per micro-batch, then the shards summed over micro-batches): equal to a run
  without ``--zero 3`` within float rounding (the tests check 1e-5 on fp32 parameters).
- **Checkpoints.** Parameters and optimizer state are DTensors; the checkpoint (DCP) writes each
  process's shard and reads into any layout, so a run with ``--zero 3`` resumes under any shape
  or without it, and the other way round.
- **Under tensor parallelism** (after ``bundle.models.tp`` has split the layers, as torchtitan
  orders them): a stage's parameters are its TP shards, and FSDP shards them again over the
  replicas' processes of the same index in their TP groups (they hold the same TP shards; the
  groups are built once per index). A split layer's sum over its TP group runs in its forward
  and backward between FSDP's gathers, as without FSDP. A checkpoint gathers a split
  parameter over the FSDP mesh, then over the TP group, and writes it whole.

Under nccl-emu FSDP's gathers and reduce-scatters go through the emulator (FSDP's custom
collectives): each is one call of its group's in-order stream, so their order against the
engine's other calls is checked as NCCL's, strict mode included, and their buffers are on the
emulated device, which the device audit checks. HSDP's all-reduce between bundles, which FSDP
issues itself, runs on gloo as it is.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from bundle.collectives.comm import Comm
from bundle.engine.grad_sync import GradSync
from bundle.engine.stage import Stage

if TYPE_CHECKING:  # imported when a stage is sharded: DTensor and FSDP take a second to load
    from torch.distributed.device_mesh import DeviceMesh


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (a parameter or optimizer state under ``--zero 3``); DTensor's
    module is not imported for a run without one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def full(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: a DTensor gathered over its mesh (collective: every replica of the stage
    calls it alike), any other tensor as it is."""
    return cast(Any, t).full_tensor() if is_sharded(t) else t


def on_host(state: Mapping[str, torch.Tensor], *, keep: bool) -> dict[str, torch.Tensor] | None:
    """``state`` whole, on the host, where ``keep`` (None elsewhere). Where it holds shards, every
    replica of the stage gathers them (collective), ``keep`` or not."""
    if not keep and not any(is_sharded(v) for v in state.values()):
        return None
    whole = {k: full(v.detach()).cpu() for k, v in state.items()}
    return whole if keep else None


def like(p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """``whole`` (a full-size value of ``p``) as ``p`` holds it: of a sharded parameter, this
    process's shard, cut as FSDP cuts the parameter (no communication); else ``whole``."""
    if not is_sharded(p):
        return whole
    from torch.distributed.tensor import DTensor, distribute_tensor

    dt = cast(DTensor, p)
    return distribute_tensor(whole, dt.device_mesh, dt.placements, src_data_rank=None)


def assign(t: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy ``whole`` (its full-size value) into ``t`` in place: of a sharded tensor, its own
    shard (no communication)."""
    if is_sharded(t):
        cast(Any, t).to_local().copy_(cast(Any, like(t, whole)).to_local())
    else:
        t.copy_(whole)


def set_grad(p: torch.Tensor, whole: torch.Tensor) -> None:
    """Set ``p``'s gradient to ``whole`` (its full-size value): a sharded parameter keeps its
    own shard of it, cut as FSDP cuts the parameter (no communication)."""
    if not is_sharded(p):
        p.grad = whole.clone() if p.grad is None else p.grad.copy_(whole)
        return
    from torch.distributed.tensor import DTensor

    mine = like(p, whole)
    if p.grad is None:
        p.grad = mine.clone()
    else:
        cast(DTensor, p.grad).to_local().copy_(cast(DTensor, mine).to_local())


def mesh(
    device: torch.device,
    shards: dist.ProcessGroup,
    layout: Sequence[Sequence[int]],
    peers: dist.ProcessGroup | None = None,
) -> DeviceMesh:
    """The device mesh FSDP shards over, ``layout`` its global ranks: ``shards`` alone (1-D, one
    row), or with ``peers`` (the same replica of the stage in every bundle) as the replicated
    dimension (a row per bundle, its replicas of the stage)."""
    from torch.distributed.device_mesh import DeviceMesh

    if peers is None:
        (ranks,) = layout
        return DeviceMesh.from_group(shards, device.type, mesh=list(ranks))
    return DeviceMesh.from_group(
        [peers, shards],
        device.type,
        mesh=torch.tensor([list(row) for row in layout], dtype=torch.int),
        mesh_dim_names=("bundles", "replicas"),
    )


def shard_stage(
    stage: Stage, device_mesh: DeviceMesh, *, emulated: tuple[Comm, torch.device] | None = None
) -> nn.Module:
    """``stage`` sharded in place: each block with parameters is one FSDP unit, the stage the
    root (it gathers nothing of its own). Gradients are summed over the mesh, never averaged.
    ``emulated``: under nccl-emu, the emulator, whose streams FSDP's gathers and reduce-scatters
    then go through (``_through``), and the rank's emulated device."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for block in stage.blocks:
        if any(True for _ in block.parameters()):
            # Registered before FSDP's own hook, so it runs first (see _unviewed).
            block.register_forward_hook(_unviewed)
            fully_shard(block, mesh=device_mesh)
    stage.register_forward_hook(_unviewed)
    fully_shard(stage, mesh=device_mesh)
    for m in stage.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            # A plain sum on the wire (gloo has no pre-multiplied sum, and nothing is divided).
            m.set_force_sum_reduction_for_comms(True)
            if emulated is not None:
                gather, scatter = _through(*emulated)
                m.set_custom_all_gather(gather)
                m.set_custom_reduce_scatter(scatter)
    return stage


def _through(comm: Comm, rank_device: torch.device) -> tuple[Any, Any]:
    """FSDP's all-gather and reduce-scatter, each run as one call of its group's stream of the
    NCCL emulation (``Comm.exclusive``), in the order FSDP issues them among the engine's other
    calls, their buffers on the rank's (emulated) device. (HSDP's all-reduce between bundles is
    issued by FSDP directly, on gloo.)"""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    class Gather(AllGather):
        def allocate(
            self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device
        ) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=rank_device)

        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: dist.ProcessGroup,
            async_op: bool = False,
        ) -> None:
            with comm.exclusive(group, "FSDP's all-gather"):
                dist.all_gather_into_tensor(output_tensor, input_tensor, group=group)

    class Scatter(ReduceScatter):
        allocate = Gather.allocate

        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: dist.ProcessGroup,
            op: Any,
            async_op: bool = False,
        ) -> None:
            with comm.exclusive(group, "FSDP's reduce-scatter"):
                dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)

    return Gather(), Scatter()


def _unviewed(module: nn.Module, inputs: Any, output: Any) -> Any:
    """A block's output that is a view (a flatten, a reshape), copied: FSDP hooks its backward
    gather onto the output, and an in-place operation of the next block on a view would drop
    that hook, so the block's backward would run on its shards."""
    if isinstance(output, torch.Tensor):
        return output.clone() if output._is_view() else output
    if isinstance(output, tuple):
        return tuple(_unviewed(module, inputs, o) for o in output)
    return output


class ShardedSync(GradSync):
    """The gradient sync of a stage sharded by FSDP: FSDP's own hooks reduce-scatter each
    block's gradients (and all-reduce the shards across bundles, hierarchical) in every
    micro-batch's backward; nothing is left to do after the last one. (A split backward is
    refused before start: FSDP would reduce-scatter before the weight half.)"""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__(stage)
        # What FSDP reduce-scatters in each backward: the whole gradient of every parameter that
        # trains (a DTensor's numel is the whole tensor's); a frozen base sends nothing.
        self.per_backward = sum(
            p.numel() * p.element_size() for p in stage.parameters() if p.requires_grad
        )

    def backward(self, outputs, grads, *, last: bool, run=None) -> None:
        super().backward(outputs, grads, last=last, run=run)
        self.wire.add(self.per_backward, self.per_backward)
