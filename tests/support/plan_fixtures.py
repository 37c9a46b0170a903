"""Literal models for the planner's tests: per-row block times and sizes given by hand; and
scripts/plan.py loaded as a module."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from bundle.plan.anatomy import Anatomy, BlockAnatomy, Linear
from bundle.plan.cluster import Cluster, Link
from bundle.plan.cost import CostModel, Overheads
from bundle.plan.profile import Timings

FREE = Link(float("inf"), 0.0)
NO_OVERHEADS = Overheads()


def literal_cost(
    fwd: list[float],
    bwd: list[float],
    *,
    params: list[int] | None = None,
    out_elems: int = 1,
    p2p: Link = FREE,
    collective: Link = FREE,
    saved_per_row: float = 0.0,
    memory_bytes: float = float("inf"),
    overheads: Overheads = NO_OVERHEADS,
    **kwargs,
) -> CostModel:
    """Blocks whose forward and backward take ``fwd[i]`` and ``bwd[i]`` seconds per row, with no
    loss, optimizer or engine overhead (but ``overheads``); one fp32 float per row crosses every
    boundary."""
    n = len(fwd)
    params = params or [0] * n
    blocks = tuple(
        BlockAnatomy(
            name=f"b{i}",
            params=params[i],
            out_elems=(out_elems,),
            out_other_bytes=0,
            saved=Linear(0.0, saved_per_row),
            saved_shared=Linear(0.0, 0.0),
            fwd_ops=(),
            bwd_ops=(),
        )
        for i in range(n)
    )
    anatomy = Anatomy("literal", (1, 1, 1), 2, blocks)
    timings = Timings(
        device="literal",
        precision="fp32",
        rows=(1,),
        fwd=(tuple(fwd),),
        bwd=(tuple(bwd),),
        loss=(0.0,),
        optimizer_per_param=0.0,
    )
    cluster = Cluster(
        name="literal",
        nodes=1,
        devices_per_node=64,
        device_name="literal",
        memory_bytes=memory_bytes,
        speed=None,
        intra=p2p,
        inter=p2p,
        collective=collective,
    )
    return CostModel(
        anatomy=anatomy, cluster=cluster, timings=timings, overheads=overheads, **kwargs
    )


def plan_script() -> ModuleType:
    """scripts/plan.py, loaded as a module (it is a script, not part of the package)."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "plan.py"
    spec = importlib.util.spec_from_file_location("plan_script", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
