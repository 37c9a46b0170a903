"""Topology as data: rank layout, groups, masters, row ranges and row plans."""

from __future__ import annotations

import pytest

from bundle.errors import TopologyError
from bundle.topology import (
    Coord,
    Topology,
    Transfer,
    replica_rows,
    row_plan,
    split_ranges,
    split_sizes,
)


def topo(shape, bundles=1, ppn=None, batch=64, micro=1) -> Topology:
    world = sum(shape) * bundles
    return Topology(
        shape=shape,
        num_bundles=bundles,
        procs_per_node=ppn or world,
        global_batch=batch,
        micro_batches=micro,
    )


def test_split_sizes_differ_by_at_most_one():
    assert split_sizes(10, 3) == (4, 3, 3)
    assert split_sizes(9, 3) == (3, 3, 3)
    assert split_ranges(5, 2) == ((0, 3), (3, 5))


def test_rank_layout_is_bundle_major_front_first():
    t = topo((2, 1), bundles=2, ppn=3)
    assert [t.coord(r) for r in range(6)] == [
        Coord(0, 0, 0),
        Coord(0, 0, 1),
        Coord(0, 1, 0),
        Coord(1, 0, 0),
        Coord(1, 0, 1),
        Coord(1, 1, 0),
    ]
    assert [t.node_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert all(t.rank(*t.coord(r).__dict__.values()) == r for r in range(6))


def test_groups_and_masters():
    t = topo((4, 2), bundles=2, ppn=4)
    assert t.stage_group(0) == (0, 1, 2, 3, 6, 7, 8, 9)
    assert t.stage_group(1) == (4, 5, 10, 11)
    assert t.bundle_stage_group(1, 0) == (6, 7, 8, 9)
    assert t.stage_master(1, 1) == 10
    assert t.masters_group(0) == (0, 6)
    assert t.masters_group(1) == (4, 10)


def test_several_bundles_per_node():
    t = topo((1, 1), bundles=4, ppn=4)
    assert t.num_nodes == 2
    assert t.node_ranks(0) == (0, 1, 2, 3)
    assert [t.coord(r).bundle for r in t.node_ranks(1)] == [2, 2, 3, 3]


def test_bundle_spanning_nodes():
    # A 4,2 bundle (6 processes) on nodes of 4: the rear of bundle 0 sits on node 1.
    t = topo((4, 2), bundles=2, ppn=4)
    assert t.num_nodes == 3
    assert [t.node_of(r) for r in t.bundle_stage_group(0, 1)] == [1, 1]
    assert t.node_of(t.stage_master(1, 0)) == 1


def test_row_plan_widths_2_to_3():
    assert row_plan(5, 2, 3) == (
        Transfer(0, 0, 0, 2),
        Transfer(0, 1, 2, 3),
        Transfer(1, 1, 3, 4),
        Transfer(1, 2, 4, 5),
    )


@pytest.mark.parametrize("rows", range(4, 14))
@pytest.mark.parametrize("widths", [(1, 1), (4, 2), (2, 3), (3, 4), (1, 4), (4, 1)])
def test_row_plan_covers_every_row_once_without_padding(rows, widths):
    plan = row_plan(rows, *widths)
    covered = [r for t in plan for r in range(t.start, t.stop)]
    assert covered == list(range(rows))
    src, dst = split_ranges(rows, widths[0]), split_ranges(rows, widths[1])
    for t in plan:
        assert src[t.src][0] <= t.start < t.stop <= src[t.src][1]
        assert dst[t.dst][0] <= t.start < t.stop <= dst[t.dst][1]


def test_sends_and_recvs_are_the_two_sides_of_the_plan():
    t = topo((2, 3), batch=10)
    sent = {(tr.src, tr.dst, tr.start, tr.stop) for r in range(2) for tr in t.sends(0, r, 5)}
    got = {(tr.src, tr.dst, tr.start, tr.stop) for r in range(3) for tr in t.recvs(1, r, 5)}
    assert sent == got
    assert t.sends(1, 0, 5) == () and t.recvs(0, 0, 5) == ()


def test_global_rows_partition_the_global_batch():
    t = topo((2, 3), bundles=2, batch=23, micro=3)
    for stage, width in enumerate(t.shape):
        rows = sorted(
            t.global_rows(b, k, stage, r) for b in range(2) for k in range(3) for r in range(width)
        )
        flat = [i for a, b in rows for i in range(a, b)]
        assert flat == list(range(23))
    assert t.bundle_batches == (12, 11)
    assert t.micro_sizes(1) == (4, 4, 3)
    assert replica_rows(23, 2, 3, 2, 1, 2, 1) == (22, 23)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"shape": (0, 1)}, "--bundle-shape"),
        ({"shape": ()}, "--bundle-shape"),
        ({"num_bundles": 0}, "--num-bundle"),
        ({"procs_per_node": 4}, "--nproc-per-node"),
        ({"micro_batches": 0}, "--micro-batches"),
        ({"global_batch": 7, "micro_batches": 2}, "--batch-size"),
    ],
)
def test_invalid_layouts_name_the_flag(kwargs, key):
    args = {
        "shape": (4, 2),
        "num_bundles": 1,
        "procs_per_node": 6,
        "global_batch": 64,
        "micro_batches": 1,
    }
    args.update(kwargs)
    with pytest.raises(TopologyError) as err:
        Topology(**args)
    assert err.value.key == key
    assert key in str(err.value)


def test_describe_names_node_bundle_stage_and_replica():
    t = topo((4, 2), bundles=2, ppn=4)
    assert t.describe(10) == "rank 10 (node 2, bundle 1, stage 1, replica 0)"
