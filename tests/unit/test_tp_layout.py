"""--tensor-parallel as data: its spelling, what it is refused with, where each process of a TP
group sits, the groups built from it, and the boundary's messages between groups of different
degrees (bundle.engine.tensor_parallel.tensor_parallel_post)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bundle import cli
from bundle.engine.tensor_parallel import tensor_parallel_post
from bundle.errors import ConfigError, TopologyError
from bundle.topology import Coord, Topology


def parse(*argv: str):
    return cli.parse(list(argv), {})


def test_one_degree_or_one_per_stage_and_the_processes_they_take():
    cfg = parse("--bundle-shape", "2,1", "--tensor-parallel", "2,1", "--num-bundle", "2")
    assert cfg.parallel.tp_degrees == (2, 1) and cfg.parallel.world_size == 10
    cfg = parse("--bundle-shape", "1,1", "--tensor-parallel", "2")
    assert cfg.parallel.tp_degrees == (2, 2) and cfg.parallel.world_size == 4
    assert parse().parallel.tp_degrees == (1, 1) and parse().parallel.world_size == 2


@pytest.mark.parametrize(
    "argv,names",
    [
        (["--tensor-parallel", "0"], "positive degree"),
        (["--tensor-parallel", "2,1,1"], "one per stage of shape 1,1"),
        (["--tensor-parallel", "2", "--bundle-shape", "auto"], "chooses the degrees itself"),
        (["--tensor-parallel", "2", "--row-weights", "1,1"], "--row-weights"),
        (["--tensor-parallel", "2", "--num-bundle", "2", "--grad-compression", "fp16"], "combine"),
        (["--tensor-parallel", "2", "--lora", "r=4", "--base-dtype", "bf16"], "--base-dtype"),
    ],
)
def test_what_it_is_refused_with_is_named_in_one_line(argv, names):
    with pytest.raises(ConfigError, match=names) as err:
        parse(*argv)
    assert "\n" not in str(err.value)


def test_lora_is_taken_beside_it():
    cfg = parse("--tensor-parallel", "2", "--lora", "r=4", "--lora-train", "ln_f")
    assert cfg.model.lora_spec is not None and cfg.parallel.tp_degrees == (2, 2)


def test_zero_3_and_zero_1_are_taken_beside_it():
    for level in ("1", "3"):
        cfg = parse("--tensor-parallel", "2", "--num-bundle", "2", "--zero", level)
        assert cfg.parallel.zero == int(level) and cfg.parallel.tp_degrees == (2, 2)


def test_a_tp_group_is_consecutive_processes_and_the_groups_shift_by_its_index():
    topo = Topology(
        shape=(2, 1), num_bundles=2, procs_per_node=5, global_batch=8, micro_batches=1, tp=(2, 1)
    )
    assert topo.world_size == 10 and topo.bundle_width == 5
    coords = [topo.coord(r) for r in range(10)]
    assert coords[:5] == [
        Coord(0, 0, 0, 0),
        Coord(0, 0, 0, 1),
        Coord(0, 0, 1, 0),
        Coord(0, 0, 1, 1),
        Coord(0, 1, 0, 0),
    ]
    assert all(topo.rank(c.bundle, c.stage, c.replica, c.tp) == r for r, c in enumerate(coords))
    assert topo.tp_group(1, 0, 1) == (7, 8) and topo.tp_group(1, 1, 0) == (9,)
    assert topo.stage_group(0) == (0, 2, 5, 7) and topo.shifted(topo.stage_group(0), 1) == (
        1,
        3,
        6,
        8,
    )
    assert topo.bundle_stage_group(1, 0) == (5, 7) and topo.masters_group(1) == (4, 9)
    assert "tp 1" in topo.describe(8) and "tp" not in topo.describe(9)
    assert all(topo.node_of(r) == topo.node_of(topo.tp_group(0, 0, 1)[0]) for r in (2, 3))


def _posted(topo: Topology, rank: int, ops: list) -> list[tuple[str, int]]:
    seen: list = []

    def post(out, labels):
        seen.extend((("send" if o.op is dist.isend else "recv"), o.peer) for o in out)
        assert len(labels()) == len(out)
        return ["work"] * len(out)

    works = tensor_parallel_post(post, topo, topo.coord(rank))(ops, lambda: ["x"] * len(ops))
    assert len(works) == len(seen)
    return seen


@pytest.fixture
def one_process_group():
    """A process group of one (a P2POp names its group when it is made); nothing is sent."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_boundary_between_groups_of_one_and_two_pairs_every_process(one_process_group):
    # shape 1,1, degrees 1 then 2: rank 0 is stage 0; ranks 1, 2 are stage 1's TP group.
    topo = Topology(
        shape=(1, 1), num_bundles=1, procs_per_node=3, global_batch=4, micro_batches=1, tp=(1, 2)
    )
    t = torch.zeros(1)
    # Forward: the group of one sends to both; each of the two receives from it.
    assert _posted(topo, 0, [dist.P2POp(dist.isend, t, 1)]) == [("send", 1), ("send", 2)]
    assert _posted(topo, 2, [dist.P2POp(dist.irecv, t, 0)]) == [("recv", 0)]
    # Backward: only the first of the two sends the (equal) gradient; the other posts nothing.
    assert _posted(topo, 1, [dist.P2POp(dist.isend, t, 0)]) == [("send", 0)]
    assert _posted(topo, 2, [dist.P2POp(dist.isend, t, 0)]) == []
    assert _posted(topo, 0, [dist.P2POp(dist.irecv, t, 1)]) == [("recv", 1)]


def test_a_tp_group_that_would_span_two_nodes_is_refused():
    # shape 1,1 at degrees 1,2, 2 bundles: stage 1's group is ranks 1, 2 (and 4, 5).
    layout = dict(shape=(1, 1), num_bundles=2, global_batch=8, micro_batches=1, tp=(1, 2))
    with pytest.raises(TopologyError, match="ranks 1..2 would span two nodes"):
        Topology(procs_per_node=2, **layout)
    assert Topology(procs_per_node=3, **layout).world_size == 6
