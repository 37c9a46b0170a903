"""Profiles: the meta-device anatomy agrees with the real model, timings interpolate, the cache
keys on what a profile depends on, and the roofline follows a device's speed."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bundle import models
from bundle.config import parse_model_args
from bundle.engine.memory import SavedBytes
from bundle.plan import profile as prof
from bundle.plan.anatomy import count_anatomy
from bundle.plan.cluster import Cluster, Link, Speed
from bundle.plan.conditions import Watch
from bundle.plan.cost import CostModel, Execution

SHAPE = (3, 8, 8)


def test_anatomy_counts_what_the_real_model_holds():
    anatomy = count_anatomy("small_resnet", SHAPE, 10)
    torch.manual_seed(0)
    model = models.build("small_resnet", num_classes=10, input_shape=SHAPE)
    blocks = models.blocks(model)
    assert anatomy.names == [n for n, _ in blocks]
    assert sum(b.params for b in anatomy.blocks) == sum(p.numel() for p in model.parameters())
    # What a cut after each block sends, per row: its output's elements.
    x = torch.zeros(3, *SHAPE)
    for (_, block), counted in zip(blocks, anatomy.blocks, strict=True):
        x = block(x)
        assert counted.out_elems == (math.prod(x.shape[1:]),)
    # Saved-for-backward bytes of the whole model at 3 rows, as the engine's meter counts them.
    meter = SavedBytes(model)
    with meter.tracking():
        model(torch.randn(3, *SHAPE))
    cost = _cost(anatomy)
    assert cost.saved_bytes(0, len(blocks), 3) == pytest.approx(meter.peak, rel=0.01)
    # Forward FLOPs: a 3x3 convolution of 3 -> 16 channels on 8x8 is 2 * 27 * 16 * 64 per row.
    stem = sum(op[0] for op in anatomy.blocks[0].fwd_ops)
    assert stem == pytest.approx(2 * 27 * 16 * 64)


def _cost(anatomy, speed=None, precision="fp32") -> CostModel:
    cluster = Cluster(
        name="test",
        nodes=1,
        devices_per_node=1,
        device_name="test",
        memory_bytes=float("inf"),
        speed=speed or Speed({"fp32": 1e12, "bf16": 4e12}, 1e11, 1.0, 0.0),
        intra=Link(1e9, 0.0),
        inter=Link(1e9, 0.0),
    )
    return CostModel(anatomy=anatomy, cluster=cluster, execution=Execution(precision=precision))


def test_roofline_follows_the_device():
    anatomy = count_anatomy("mlp_wide", (3, 18, 18), 10)
    slow, fast = _cost(anatomy), _cost(anatomy, Speed({"fp32": 2e12}, 2e11, 1.0, 0.0))
    f1, b1, _ = slow.block_times(64)
    f2, b2, _ = fast.block_times(64)
    assert np.allclose(f1, 2 * f2) and np.allclose(b1, 2 * b2)
    # Half precision: matmuls at the bf16 peak, half the activation bytes on the wire.
    half = _cost(anatomy, precision="bf16")
    assert half.block_times(64)[0].sum() < f1.sum()
    assert half.boundary_bytes(2, 64) == slow.boundary_bytes(2, 64) / 2 == 1024 * 2 * 64
    # A kernel's latency is a floor under every operator.
    floor = _cost(anatomy, Speed({"fp32": 1e18}, 1e18, 1.0, 1e-3)).block_times(1)[0]
    assert floor[1] == pytest.approx(1e-3 * len(anatomy.blocks[1].fwd_ops))


def test_timings_interpolate_in_rows():
    t = prof.Timings(
        "d", "fp32", (1, 4), ((1.0, 2.0), (4.0, 5.0)), ((2.0,) * 2, (8.0,) * 2), (0.1, 0.4), 0.0
    )
    fwd, bwd, loss = t.at(2)
    assert fwd == pytest.approx([2.0, 3.0]) and bwd == pytest.approx([4.0, 4.0])
    assert loss == pytest.approx(0.2)
    assert t.at(8)[0] == pytest.approx([8.0, 9.0])  # the last segment's slope beyond the grid
    assert prof.row_grid(12) == (2, 4, 8, 12) and prof.row_grid(1) == (1,)


def test_measured_timings_are_cached_by_device_and_grid(tmp_path, monkeypatch):
    # A quiet machine, whatever runs beside the test (test_plan_conditions judges the readings).
    monkeypatch.setattr(prof, "Watch", lambda: Watch(load=lambda: 0.0, sched=lambda: None))
    cache = prof.ProfileCache(tmp_path)
    args = (prof.ModelSpec("mlp", (3, 2, 2), 10), cache)
    first = prof.timings(*args, rows=(1, 2), repeats=1)
    assert len(first.fwd) == 2 and len(first.fwd[0]) == 6
    assert all(t >= 0 for row in first.fwd + first.bwd for t in row)
    assert prof.timings(*args, rows=(1, 2), repeats=1) == first  # from the cache
    assert prof.timings(*args, rows=(1,), repeats=1).rows == (1,)  # another grid: measured
    for path in tmp_path.glob("timings-*.json"):
        path.write_text("{not json")
    again = prof.timings(*args, rows=(1, 2), repeats=1)  # a damaged entry is measured again
    assert again.rows == (1, 2)
    assert prof.anatomy(*args) == prof.anatomy(*args)


def test_progress_is_silent_at_first_then_says_where_it_is_every_few_seconds():
    """A long profile reports on stderr: nothing in its first seconds, then a line at most every
    ``every_s`` naming the grid point, pass and block; a closing line only if it said anything."""
    import io

    now = [0.0]
    out = io.StringIO()
    progress = prof.Progress(
        "profiling resnet101 on cpu", quiet_s=3, every_s=2, stream=out, clock=lambda: now[0]
    )
    progress.at = "64 rows (grid point 4/9), pass 3/7"
    for t in (0.5, 1.0, 2.9):  # quiet
        now[0] = t
        progress.tick("forward", 5, 35)
    assert out.getvalue() == ""
    for t in (3.0, 3.5, 4.9, 5.0, 6.0):
        now[0] = t
        progress.tick("backward", 7, 35)
    lines = out.getvalue().splitlines()
    assert lines == [
        "profiling resnet101 on cpu: 64 rows (grid point 4/9), pass 3/7, backward block 7/35; "
        "3s so far",
        "profiling resnet101 on cpu: 64 rows (grid point 4/9), pass 3/7, backward block 7/35; "
        "5s so far",
    ]
    progress.done()
    assert out.getvalue().splitlines()[-1] == "profiling resnet101 on cpu: done in 6s"
    quiet = prof.Progress("quick", stream=out)
    quiet.done()
    assert "quick" not in out.getvalue()


def test_measure_timings_ticks_every_block_both_ways():
    """The profile asks its progress after every block, forward and backward (the per-block
    check is what bounds the silence of one slow pass)."""
    ticks = []

    class Recorder(prof.Progress):
        def tick(self, phase, block, blocks):
            ticks.append((self.at, phase, block, blocks))

    prof.measure_timings(
        prof.ModelSpec("mlp", (1, 4, 4), 3),
        rows=(2,),
        passes=(0, 1),
        progress=Recorder("mlp"),
    )
    n = ticks[0][3]
    first = [t for t in ticks if t[0] == "2 rows (grid point 1/1), pass 1/1"]
    assert [t[2] for t in first if t[1] == "forward"] == list(range(1, n + 1))
    assert {t[2] for t in first if t[1] == "backward"} >= {n}


@pytest.mark.parametrize(
    ("name", "shape", "classes", "args"),
    [
        ("mobilenet_v3_small", (3, 32, 32), 10, None),  # a graph split, batch norm
        ("regnet_x_400mf", (3, 32, 32), 10, None),  # cannot be built on the meta device
        ("gpt", (16,), 64, "layers=2,width=16,heads=2"),  # token ids in, (rows, T, V) out
    ],
)
def test_the_planner_counts_and_times_any_model(name, shape, classes, args):
    anatomy = count_anatomy(name, shape, classes, args)
    torch.manual_seed(0)
    model = models.build(name, num_classes=classes, input_shape=shape, args=parse_model_args(args))
    blocks = models.blocks(model, shape)
    assert anatomy.names == [n for n, _ in blocks]
    assert sum(b.params for b in anatomy.blocks) == sum(p.numel() for p in model.parameters())
    timings = prof.measure_timings(
        prof.ModelSpec(name, shape, classes, args), rows=(2, 4), passes=(0, 1)
    )
    assert len(timings.fwd[0]) == len(blocks) and all(t >= 0 for t in timings.bwd[1])


def test_a_cache_file_name_stays_in_the_cache_directory_whatever_the_model_is_called(tmp_path):
    cache = prof.ProfileCache(tmp_path / "cache")
    path = cache._path("timings", {"model": "../../etc/x.py:build"})
    assert path is not None and path.parent == tmp_path / "cache"
    assert ":" not in path.name and "/" not in path.name and ".." not in path.name
    assert len(cache._path("anatomy", {"model": "m" * 300}).name) < 80  # type: ignore[union-attr]
    # Two models whose names read alike in a file name are still two entries: the digest differs.
    assert cache._path("timings", {"model": "a:b"}) != cache._path("timings", {"model": "a/b"})
