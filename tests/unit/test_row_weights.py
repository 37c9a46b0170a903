"""Rows by speed and placement as data: weighted row sizes, the row plan between weighted stages,
one-line refusals, and where a plan puts each rank."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from bundle import cli
from bundle.errors import ConfigError, TopologyError
from bundle.row_weights import format_row_weights, parse_row_weights
from bundle.topology import Place, Topology, Transfer, split_sizes, weighted_sizes


def F(*ws) -> tuple[Fraction, ...]:
    return tuple(Fraction(w) for w in ws)


@pytest.mark.parametrize(
    "total,weights,sizes",
    [
        (12, (2, 1), (8, 4)),
        (10, (2, 1), (7, 3)),  # 6.67/3.33: the larger remainder takes the row
        (11, (2, 1), (7, 4)),  # 7.33/3.67
        (3, (3, 1), (2, 1)),  # 2.25/0.75
        (4, (1, 1, 2), (1, 1, 2)),
        (3, (1, 1, 2), (1, 1, 1)),  # 0.75/0.75/1.5: ties go to the earlier replica
        (5, ("0.6", "0.4"), (3, 2)),
        (7, (1, 1, 1), (3, 2, 2)),  # equal weights: the even split, larger first
        (2, (5, 1), (2, 0)),  # 1.67/0.33: a replica can get nothing (refused by Topology)
    ],
)
def test_weighted_sizes_by_largest_remainder(total, weights, sizes):
    assert weighted_sizes(total, F(*weights)) == sizes


@pytest.mark.parametrize("total", range(1, 40))
@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_equal_weights_are_the_even_split(total, parts):
    assert weighted_sizes(total, F(*[1] * parts)) == split_sizes(total, parts)


def weighted(shape, spec, bundles=1, batch=24, micro=1) -> Topology:
    return Topology(
        shape=shape,
        num_bundles=bundles,
        procs_per_node=sum(shape) * bundles,
        global_batch=batch,
        micro_batches=micro,
        row_weights=parse_row_weights(spec, shape),
    )


def test_row_plan_between_weighted_stages():
    t = weighted((2, 3), "2:1,1:1:2", batch=12)
    assert t.stage_sizes(0, 12) == (8, 4) and t.stage_sizes(1, 12) == (3, 3, 6)
    plan = [*t.sends(0, 0, 12), *t.sends(0, 1, 12)]
    assert plan == [Transfer(0, 0, 0, 3), Transfer(0, 1, 3, 6), Transfer(0, 2, 6, 8),
                    Transfer(1, 2, 8, 12)]  # fmt: skip
    assert [*t.recvs(1, 2, 12)] == [Transfer(0, 2, 6, 8), Transfer(1, 2, 8, 12)]


def test_global_rows_follow_the_weights_and_cover_the_batch():
    t = weighted((2, 1), "3:1,1", bundles=2, batch=23, micro=3)
    rows = sorted(t.global_rows(b, k, 0, r) for b in range(2) for k in range(3) for r in range(2))
    assert rows[0] == (0, 3) and rows[1] == (3, 4)  # bundle 0, micro 0: 4 rows at 3:1
    covered = [i for a, b in rows for i in range(a, b)]
    assert covered == list(range(23))


def test_one_number_weighs_a_stage_evenly_and_formats_back():
    w = parse_row_weights("2:1,1", (2, 3))
    assert w == (F(2, 1), F(1, 1, 1))
    assert format_row_weights(w) == "2:1,1"
    assert format_row_weights(((0.6, 0.4), (1.0,))) == "0.6:0.4,1"
    eight = F(*[3.5] * 8, 1, 1, 2)
    assert format_row_weights((eight,)) == "3.5*8:1:1:2"
    assert parse_row_weights("3.5*8:1*2:2", (11,)) == (eight,)


@pytest.mark.parametrize(
    "spec,shape,message",
    [
        ("2:1", (2, 1), "one entry per stage"),
        ("2:1:1,1", (2, 1), "stage 0 has 2 replica(s) and 3 weights"),
        ("2:0,1", (2, 1), "numbers > 0"),
        ("2:x,1", (2, 1), "numbers > 0"),
        ("-1:1,1", (2, 1), "numbers > 0"),
        ("1*0:1,1", (2, 1), "numbers > 0"),
        ("1*x,1", (2, 1), "numbers > 0"),
    ],
)
def test_bad_weights_are_one_line(spec, shape, message):
    with pytest.raises(TopologyError) as err:
        parse_row_weights(spec, shape)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert err.value.key == "--row-weights"


def test_weights_leaving_a_replica_without_rows_are_refused():
    weighted((2, 1), "5:1,1", batch=12)  # 10/2 rows
    with pytest.raises(TopologyError, match="gives replica 1 of stage 0 no row"):
        weighted((2, 1), "5:1,1", batch=4, micro=2)  # 2 rows: 1.67/0.33 -> 2/0


def test_main_refuses_bad_weights_before_starting(capsys):
    assert cli.main(["--bundle-shape", "2,1", "--row-weights", "2:1", "--itr", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("main.py: error: --row-weights") and "\n" not in err


def placed(nodes_devices, shape=(2, 1), ppn=None) -> Topology:
    return Topology(
        shape=shape,
        num_bundles=1,
        procs_per_node=ppn or sum(shape),
        global_batch=12,
        micro_batches=1,
        placement=tuple(Place(n, d) for n, d in nodes_devices),
    )


def test_placement_puts_ranks_on_their_nodes_and_devices():
    t = placed([(1, 0), (0, 1), (1, 1), (0, 0)], shape=(2, 2), ppn=2)
    assert [t.node_of(r) for r in range(4)] == [1, 0, 1, 0]
    assert t.node_ranks(0) == (1, 3) and t.node_ranks(1) == (0, 2)
    assert [t.local_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [t.device_index(r) for r in range(4)] == [0, 1, 1, 0]
    assert "rank 1 (node 0," in t.describe(1)


@pytest.mark.parametrize(
    "rows,message",
    [
        ([(0, 0), (0, 1)], "must place each of the 3 processes"),
        ([(0, 0), (0, 1), (2, 0)], "the job has nodes 0..0"),
        ([(0, 0), (0, 0), (0, 1)], "rank 0 drives that device already"),
    ],
)
def test_impossible_placements_are_refused(rows, message):
    with pytest.raises(TopologyError, match=message):
        placed(rows)


def test_a_node_given_more_processes_than_its_share_is_refused():
    with pytest.raises(TopologyError, match="3 processes on node 0"):
        placed([(0, 0), (0, 1), (0, 2), (1, 0)], shape=(2, 2), ppn=2)


def _plan_file(tmp_path, run, placement) -> str:
    path = tmp_path / "plans.json"
    plans = [{"run": {"bundle_shape": "1,1"}}, {"run": run, "placement": placement}]
    path.write_text(json.dumps({"plans": plans}))
    return str(path)


def test_plan_file_sets_the_options_and_placement(tmp_path):
    run = {"bundle_shape": "2,1", "micro_batches": 2, "schedule": "gpipe", "row_weights": "2:1,1"}
    where = [{"node": 0, "device": d, "type": t, "cpu": c}
             for d, t, c in ((2, "fast", None), (0, "slow", 0.5), (1, "fast", None))]  # fmt: skip
    path = _plan_file(tmp_path, run, where)
    cfg = cli.parse(["--plan", f"{path}:1", "--schedule", "gpipe"], {})
    p = cfg.parallel
    assert (p.shape, p.micro_batches, p.schedule, p.row_weights) == ((2, 1), 2, "gpipe", "2:1,1")
    t = Topology.from_config(cfg)
    assert [t.device_index(r) for r in range(3)] == [2, 0, 1]
    assert [t.cpu_share(r) for r in range(3)] == [None, 0.5, None]
    assert cli.parse(["--plan", path], {}).parallel.shape == (1, 1)  # plan 0 by default


def test_a_flag_disagreeing_with_the_plan_is_refused(tmp_path):
    path = _plan_file(tmp_path, {"bundle_shape": "2,1"}, [])
    with pytest.raises(ConfigError) as err:
        cli.parse(["--plan", f"{path}:1", "--bundle-shape", "1,1"], {})
    assert "--bundle-shape: '1,1' is not valid; disagrees with --plan" in str(err.value)


def test_bad_plan_files_are_one_line(tmp_path):
    path = _plan_file(tmp_path, {"bundle_shape": "2,1"}, [])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"run": {"bundle_shape": "2,1"}, "placement": [{"gpu": 1}]}))
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"run": {"bundle_size": "2,1"}}))
    for spec, text in (
        (f"{path}:5", "holds plans 0..1"),
        (str(tmp_path / "missing.json"), "readable file"),
        (str(bad), "placement of rank 0"),
        (str(unknown), "bundle_size.* is not a main.py option"),
    ):
        with pytest.raises(ConfigError, match=text) as err:
            cli.parse(["--plan", spec], {})
        assert "\n" not in str(err.value)
