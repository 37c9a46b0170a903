"""Tensor parallelism in the engine: a stage's layers split over its replica's TP group
(``bundle.models.tp`` splits them), the group's sums routed through the run's collectives, and
the stage boundaries between TP groups of any degrees.

Every process of a TP group holds the same activations at a stage boundary (a split layer's
output is summed before it leaves), so the pipeline stays as it is for the group's first
process, and each other process mirrors it: process ``j`` of a receiving group of degree ``tr``
takes each message from process ``j mod ts`` of the sending group of degree ``ts``. A sender
therefore sends to every ``j`` with ``j mod ts`` equal to its index (none when its index is
``tr`` or more), and the calls both sides post stay in the schedule's order
(``tensor_parallel_post``): one send per receiving process, no broadcast inside the group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from bundle.collectives.comm import Comm
from bundle.engine import sharded
from bundle.engine.stage import Stage
from bundle.engine.transport import PostCall
from bundle.errors import ConfigError, PartitionError
from bundle.models import Block, hf_chain, tp
from bundle.models.shard_read import ShardRead
from bundle.topology import Coord, Topology


class Reducer:
    """The sum over a TP group that a split layer calls; bound to the group once it exists.

    Unbound, the sum is skipped: the stage boundaries' shapes are found by running the stages
    once before the process groups exist, and a split layer's output has its full shape either
    way.
    """

    def __init__(self) -> None:
        self._sum: Callable[[torch.Tensor], None] | None = None

    def bind(self, comm: Comm, group: dist.ProcessGroup) -> None:
        def total(t: torch.Tensor) -> None:
            comm.all_reduce(t, group).wait()

        self._sum = total

    def __call__(self, t: torch.Tensor) -> None:
        if self._sum is not None:
            self._sum(t)


@dataclass
class Split:
    """One process's part of its replica's TP group: its ``index`` in a group of ``degree``,
    the group's sum (``reducer``) and, once ``apply`` has split the model, each split
    parameter's ``ShardSpec`` by full name."""

    index: int
    degree: int
    reducer: Reducer = field(default_factory=Reducer)
    specs: dict[str, tp.ShardSpec] = field(default_factory=dict)
    group: dist.ProcessGroup | None = None

    def bind(self, comm: Comm, group: dist.ProcessGroup) -> None:
        """The TP group exists: the split layers' sums run over it."""
        self.group = group
        self.reducer.bind(comm, group)

    def whole(self, name: str, shard: torch.Tensor) -> torch.Tensor:
        """The whole tensor of split parameter ``name`` (or of a state shaped like it) from
        every process's ``shard``: collective over the group, every process calls it alike.
        A shard that FSDP shards again (``--zero 3``) is first gathered over its replicas."""
        shard = sharded.full(shard)
        shards = [torch.empty_like(shard) for _ in range(self.degree)]
        dist.all_gather(shards, shard.contiguous(), group=self.group)
        return self.specs[name].full(shards)

    def shard(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """This process's shard of the whole tensor of split parameter ``name``."""
        return self.specs[name].local(whole, self.index, self.degree)

    def apply(self, model: nn.Module, pieces: Sequence[Stage]) -> None:
        """Split ``model``'s planned layers for this process, in place (the ``pieces`` this
        rank runs share its modules).

        A piece captured by ``torch.export`` computes its layers inline rather than calling
        them (a Hugging Face model cut by its graph, which ``models.hf_chain`` does not cut at
        its modules): there the split is refused in one line.
        """
        if self.degree == 1:
            return
        plan = tp.plan_of(model)
        tp.check(model, plan, self.degree)
        self.specs = tp.apply(
            model, plan, rank=self.index, size=self.degree, all_reduce=self.reducer
        )
        inlined = sorted(_inlined(pieces) & set(self.specs))
        if inlined:
            raise PartitionError(
                f"--tensor-parallel {self.degree}: {_inline_reason(model, inlined)}"
            )

    def reads(self) -> dict[str, ShardRead]:
        """How this process reads each split parameter's shard from a file (``--pretrained``)."""
        return {n: ShardRead(spec, self.index, self.degree) for n, spec in self.specs.items()}

    def params(self, stage: Stage) -> list[torch.Tensor]:
        """``stage``'s split parameters (each process holds a shard of them)."""
        return [p for n, p in stage.named_parameters() if stage.full_name(n) in self.specs]


def _inlined(pieces: Sequence[Stage] | Sequence[Sequence[Block]]) -> set[str]:
    """The parameters a graph-split piece reads as attributes rather than through a module call."""
    names: set[str] = set()
    for piece in pieces:
        for block in piece.blocks if isinstance(piece, Stage) else [m for _, m in piece]:
            if isinstance(block, fx.GraphModule):
                names |= {str(n.target) for n in block.graph.nodes if n.op == "get_attr"}
    return names


def check(model: nn.Module, pieces: Sequence[Sequence[Block]], degrees: Sequence[int]) -> None:
    """Before any process starts (the launch's checks, on the meta device): the model has a
    plan, every degree divides what it splits, the pieces call the layers it splits, and a
    weight tied across stages is held by stages of one degree (``bundle.engine.ties`` sums its
    copies' gradients between the processes of the same index in their TP groups)."""
    if max(degrees, default=1) == 1:
        return
    text = ",".join(map(str, degrees))
    try:
        plan = tp.plan_of(model)
        for degree in sorted(set(degrees) - {1}):
            tp.check(model, plan, degree)
        chosen = tp.resolve(model, plan).items()
        planned = {f"{name}.weight" for name, (_, style) in chosen if "replicate" not in style}
    except tp.TPError as exc:
        raise ConfigError("--tensor-parallel", text, str(exc)) from None
    inlined = sorted(_inlined(pieces) & planned) if len(pieces) > 1 else []
    if inlined:
        raise ConfigError("--tensor-parallel", text, _inline_reason(model, inlined))
    tied = _tied_across_degrees(model, pieces, degrees)
    if tied:
        raise ConfigError(
            "--tensor-parallel",
            text,
            f"{tied} is tied across stages of different degrees; the stages holding a tied "
            "weight need one degree",
        )


def _tied_across_degrees(
    model: nn.Module, pieces: Sequence[Sequence[Block]], degrees: Sequence[int]
) -> str | None:
    """The name of a weight several pieces hold whose stages differ in degree (None: none).
    Pieces beyond one per stage (virtual stages) may sit on any stage: all degrees count."""
    held: dict[int, set[int]] = {}
    for i, piece in enumerate(pieces):
        for _, block in piece:
            for p in block.parameters():
                held.setdefault(id(p), set()).add(i)
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    for key, where in held.items():
        stages = where if len(pieces) == len(degrees) else range(len(degrees))
        if len(where) > 1 and len({degrees[s] for s in stages}) > 1:
            return " = ".join(names.get(key, ["a weight"]))
    return None


def _inline_reason(model: nn.Module, inlined: list[str]) -> str:
    return (
        f"{type(model).__name__} was cut into stages by torch.export, which computes its layers "
        f"inline ({inlined[0]}, ...), so they cannot be split; a pipeline splits the layers of "
        f"{hf_chain.names()} (cut at their modules); run this one as one stage (--bundle-shape "
        "N) with tensor parallelism"
    )


def tensor_parallel_post(post: PostCall, topo: Topology, coord: Coord) -> PostCall:
    """``post`` with each operation addressed to the processes of the peer's TP group this
    process exchanges with (module docstring); the operations' order is kept."""
    mine = topo.tp_of(coord.stage)

    def remapped(ops: list, labels: Callable[[], list[str]]) -> list:
        out, named = [], []
        names = None
        for i, op in enumerate(ops):
            degree = topo.tp_of(topo.coord(op.peer).stage)
            if op.op is dist.irecv:
                peers = [coord.tp % degree]
            else:
                peers = [j for j in range(degree) if j % mine == coord.tp]
            for j in peers:
                out.append(dist.P2POp(op.op, op.tensor, op.peer + j, op.group, op.tag))
                named.append(i)
        if not out:
            return []

        def relabelled() -> list[str]:
            nonlocal names
            names = names or labels()
            return [names[i] for i in named]

        return post(out, relabelled)

    return remapped if topo.tp else post
