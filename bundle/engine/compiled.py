"""``--compile``: ``torch.compile`` applied to each block of a stage (regional compilation).

Each block is compiled in place (``nn.Module.compile``), so its parameters keep their names (a
checkpoint saved with ``--compile`` resumes without it and the other way round), and a stage cut
anywhere compiles the blocks it holds: blocks of one kind (a GPT's layers) share one compiled
graph, so compile time does not grow with depth. What runs between blocks stays eager: the
stage's recompute (a checkpoint around its blocks, which recomputes through the compiled ones),
the point-to-point calls, the gradient sync and, under ``--zero 3``, FSDP's gathers, whose
hooks run around each compiled block.

Compilation happens when a block first runs (the first step, and the first evaluation, which
runs without gradients); ``seconds()`` is the time spent compiling so far, reported apart from
step time. A zero-bubble schedule's split backward needs a block's input and weight gradients
apart, which one compiled backward computes together: the pair is refused before start.
"""

from __future__ import annotations

from bundle.engine.stage import Stage


def compile_blocks(stage: Stage, backend: str) -> Stage:
    """``stage`` with each of its blocks compiled in place by ``backend``."""
    import torch._dynamo

    # A block is far smaller than a gradient bucket: dynamo's splitting of graphs at DDP's
    # bucket boundaries has nothing to split (and asserts on the first bucket's size).
    torch._dynamo.config.optimize_ddp = False
    for block in stage.blocks:
        block.compile(backend=backend)
    return stage


def seconds() -> float:
    """Seconds this process spent compiling so far (torch's own count; 0.0 where none)."""
    from torch._dynamo import utils

    spent = utils.calculate_time_spent()
    if "total_wall_time" in spent:
        return round(float(spent["total_wall_time"]), 3)
    return round(
        float(spent.get("entire_frame_compile", 0.0) + spent.get("entire_backward_compile", 0.0)),
        3,
    )
