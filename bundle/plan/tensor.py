"""Tensor parallelism per stage costed: what a model splits, and a stage's costs at degree t.

A replica of a stage at degree ``t`` runs on ``t`` processes of one node (its TP group) that
split the stage's planned ``nn.Linear`` layers Megatron-style (``bundle.models.tp``). Which
parameters split comes from the model's own plan (``tp.plan_of``, ``tp.resolve``) on the meta-built
model the planner profiles, each layer put in the block that holds its weight; the degrees the
model takes are those ``tp.check`` passes. At degree ``t`` a stage's cost model (``at``):

- **compute**: where the planner measured this CPU, each block's forward and backward seconds
  of one process's part of the split model, timed (``profile.split_for_timing``: the split
  layers' smaller matrices, and the norms and embeddings each process runs whole); else the
  whole block's / t (the head's loss too: a rough simplification, as the replicated norms' and
  embeddings' work is counted split as well);
- **all-reduces**: per block, one in the forward and one in the backward per ``rowwise`` layer
  (attention's output projection and the MLP's down projection: two each way for a transformer
  block), each of the block's output activation (rows x its output's elements x the wire dtype)
  as a ring over the node's link, ``2(t-1)/t * bytes / bandwidth + 2(t-1) * latency``
  (``CostModel.allreduce`` on one node: the cluster's collective link, else its intra-node one)
  plus ``Overheads.tp_sum`` each, the in-step cost per sum measured here (``calibrate_tp``; 0 on
  the links a cluster file's figures give);
- **memory**: the split parameters, their gradients and optimizer state / t, the rest whole; a
  block that splits holds its output whole (the residual stream and norm inputs every rank
  keeps) and the rest of what its forward saves / t: a rough count of the split layers' outputs.

A cluster of several device types is not planned with tensor parallelism (``mixed``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import cast

import numpy as np
import torch

from bundle import models
from bundle.models import tp
from bundle.plan.anatomy import ModelSpec
from bundle.plan.cost import CostModel
from bundle.plan.dataparallel import EXACT, DataParallel
from bundle.plan.profile import Timings

DEGREES = (1, 2, 4, 8)  # the degrees searched, where the model and the node take them


@dataclass(frozen=True)
class Split:
    """What tensor parallelism splits of a model, per block (``()``: nothing, degree 1 only)."""

    params: tuple[float, ...] = ()  # parameters of the block's split layers
    trained: tuple[float, ...] = ()  # of those, the ones that train
    reduces: tuple[int, ...] = ()  # all-reduces of the block's output per forward (and backward)
    degrees: tuple[int, ...] = (1,)  # degrees ``tp.check`` passes


NONE = Split()


def split_of(spec: ModelSpec, n_blocks: int) -> Split:
    """``spec``'s model's split layers per block and the degrees it takes; ``NONE`` for a model
    without a plan (or one ``tp`` refuses: LoRA-adapted, tied split weights)."""
    if spec.lora is not None:  # LoRA's adapters are not split yet (bundle.config.tp)
        return NONE
    model = spec.build(meta=True)
    try:
        plan = tp.plan_of(model)
        chosen = tp.resolve(model, plan)
        tp.check(model, plan, 1)
    except tp.TPError:
        return NONE
    blocks = models.blocks(model, spec.input_shape)
    if len(blocks) != n_blocks:
        return NONE
    where = {id(p): j for j, (_, m) in enumerate(blocks) for p in m.parameters()}
    params, trained, reduces = np.zeros(n_blocks), np.zeros(n_blocks), [0] * n_blocks
    for m, style in chosen.values():
        if style not in ("colwise", "rowwise", "packed_colwise"):
            continue
        j = where.get(id(m.weight))
        if j is None:
            continue
        # A rowwise layer's bias is added after the sum: whole on every rank.
        bias = m.bias if isinstance(m.bias, torch.Tensor) and style != "rowwise" else None
        whole = [cast(torch.Tensor, m.weight)] + ([bias] if bias is not None else [])
        params[j] += sum(int(p.numel()) for p in whole)
        trained[j] += sum(int(p.numel()) for p in whole if p.requires_grad)
        reduces[j] += style == "rowwise"
    degrees = [1]
    for t in DEGREES[1:]:
        try:
            tp.check(model, plan, t)
        except tp.TPError:
            continue
        degrees.append(t)
    return Split(tuple(params), tuple(trained), tuple(reduces), tuple(degrees))


class Splittable(CostModel):
    """A cost model that knows its model's ``Split`` (the planner's, for one device type)."""

    split: Split
    timed: Mapping[int, Timings]  # per degree, one process's part of the split model, measured

    @classmethod
    def of(
        cls, base: CostModel, split: Split, timed: Mapping[int, Timings] | None = None
    ) -> CostModel:
        """``base`` with ``split`` (and the split model's ``timed`` timings) attached; ``base``
        itself where nothing splits."""
        if split.degrees == (1,):
            return base
        out = copy.copy(base)
        out.__class__ = cls
        out.split = split  # type: ignore[attr-defined]
        out.timed = dict(timed or {})  # type: ignore[attr-defined]
        return out


def split(cost: CostModel) -> Split:
    """The split a cost model carries (``NONE``: a plain cost model)."""
    return cost.split if isinstance(cost, Splittable) else NONE


def without(cost: CostModel) -> CostModel:
    """``cost`` as a plain cost model: for a run that cannot take tensor parallelism."""
    if not isinstance(cost, Splittable):
        return cost
    out = copy.copy(cost)
    out.__class__ = CostModel  # type: ignore[assignment]  # the same fields, no split
    return out


def degrees(cost: CostModel, per_node: int, dp: DataParallel = EXACT) -> tuple[int, ...]:
    """Degrees searched: the model's, dividing a node's devices (a TP group stays in one node);
    only 1 under the data-parallel options ``--tensor-parallel`` refuses (``bundle.config.tp``:
    ``--zero 3``, compression, a bundle sync other than every step, robust aggregation)."""
    if replace(dp, zero=0) != EXACT or dp.zero == 3:
        return (1,)
    return tuple(t for t in split(cost).degrees if t <= per_node and per_node % t == 0)


class _AtDegree(CostModel):
    """A stage's cost model at degree ``t``: compute / t plus the blocks' all-reduces; split
    parameters (their gradients, optimizer state, sync) / t; split blocks' activations ~ / t."""

    degree: int
    _split: Split

    def block_times(self, rows: float) -> tuple[np.ndarray, np.ndarray, float]:
        if rows not in self._times:
            base = self._base  # type: ignore[attr-defined]
            comm = reduce_seconds(base, self._split, self.degree, rows)
            timed = base.timed.get(self.degree) if isinstance(base, Splittable) else None
            if timed is not None:  # the split model measured (a CPU's)
                fwd, bwd, loss = timed.at(rows)
                k = self.compute_scale
                fwd, bwd, loss = fwd * k, bwd * k, loss * k
            else:
                fwd, bwd, loss = CostModel.block_times(base, rows)
                t = self.degree
                fwd, bwd, loss = fwd / t, bwd / t, loss / t
            self._times[rows] = (fwd + comm, bwd + comm, loss)
        return self._times[rows]

    def saved_bytes(self, a: int, b: int, rows: float) -> float:
        whole = CostModel.saved_bytes(self, a, b, rows)
        out = 0.0
        for j in range(a, b):
            if self._split.params[j] > 0:
                kept = self.boundary_bytes(j + 1, rows, grad=True)
                mine = CostModel.saved_bytes(self, j, j + 1, rows)
                out += max(mine - kept, 0.0) * (1 - 1 / self.degree)
        return whole - out


def reduce_seconds(cost: CostModel, sp: Split, degree: int, rows: float) -> np.ndarray:
    """Per block, the seconds of its all-reduces in one forward (or backward) at ``rows`` rows:
    one of its output per rowwise layer, over one node's link among ``degree`` ranks."""
    out = np.zeros(cost.n)
    if degree < 2:
        return out
    for j, count in enumerate(sp.reduces):
        if count:
            nbytes = cost.boundary_bytes(j + 1, rows, grad=True)
            out[j] = count * (cost.allreduce(nbytes, [0] * degree) + cost.overheads.tp_sum)
    return out


_MEMO: dict[tuple[int, int], CostModel] = {}


def at(cost: CostModel, degree: int) -> CostModel:
    """``cost`` for a stage at tensor-parallel ``degree`` (itself at 1), kept per model."""
    if degree == 1:
        return cost
    key = (id(cost), degree)
    if key in _MEMO and _MEMO[key]._base is cost:  # type: ignore[attr-defined]
        return _MEMO[key]
    sp = split(cost)
    if degree not in sp.degrees:
        raise tp.TPError(f"--tensor-parallel {degree} is not one the model takes: {sp.degrees}")
    out = copy.copy(cost)
    out.__class__ = _AtDegree
    shed = 1 - 1 / degree
    out.params = cost.params - np.asarray(sp.params) * shed
    out.trained = cost.trained - np.asarray(sp.trained) * shed
    out._times, out._prefix = {}, {}
    out._types = {}  # one device type: a mixed cluster is not planned with TP
    vars(out).update(degree=degree, _split=sp, _base=cost)
    _MEMO[key] = out
    return out
