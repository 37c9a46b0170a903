"""Mixed clusters: cluster files with several device types, costing each process on its own
device, row weights that balance a slower replica, and the search against the uniform plan."""

from __future__ import annotations

import copy
from dataclasses import replace
from fractions import Fraction

import pytest
import yaml

from bundle import cli
from bundle.config.options import BY_YAML_KEY
from bundle.errors import ConfigError
from bundle.plan import planner, report
from bundle.plan.cluster import DeviceType, load_cluster
from bundle.plan.mixed import bundle_devices, mixed_search, natural, uniform_cost, weights_for
from bundle.plan.plans import Plan, evaluate
from bundle.plan.search import Workload
from bundle.plan.simulate import cpu_slowdown
from bundle.topology import Place, Topology
from tests.support.plan_fixtures import literal_cost

INF = float("inf")

A100 = {
    "name": "A100 SXM4 40 GB",
    "memory_gib": 40,
    "speed": {
        "peak_tflops": {"fp32": 156, "bf16": 312, "fp16": 312},
        "memory_bandwidth_gbs": 1555,
        "efficiency": 0.5,
        "kernel_latency_us": 5,
    },
}
V100 = {
    "name": "Tesla V100 SXM2 32 GB",
    "memory_gib": 32,
    "speed": {
        "peak_tflops": {"fp32": 15.7, "fp16": 125},
        "memory_bandwidth_gbs": 900,
        "efficiency": 0.5,
        "kernel_latency_us": 5,
    },
}


def _doc() -> dict:
    return {
        "name": "mixed",
        "device_types": copy.deepcopy({"A100": A100, "V100": V100}),
        "nodes": [{"A100": 2, "V100": 2}, {"V100": 4}],
        "intra_node": {"bandwidth_gbs": 150, "latency_us": 5},
        "inter_node": {"bandwidth_gbs": 12.5, "latency_us": 5},
    }


def _write(tmp_path, doc) -> str:
    path = tmp_path / "mixed.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_a_mixed_cluster_file_lists_each_nodes_devices(tmp_path):
    c = load_cluster(_write(tmp_path, _doc()))
    assert (c.nodes, c.devices_per_node, c.mixed) == (2, 4, True)
    assert c.kinds == (("A100", "A100", "V100", "V100"), ("V100",) * 4)
    assert c.kind_of(0, 1) == "A100" and c.kind_of(1, 0) == "V100"
    assert c.device_type("V100").memory_bytes == 32 * 2**30
    assert c.memory_bytes == 32 * 2**30  # the smallest, where one figure is asked for
    c.check_precision("fp16")


def test_bf16_on_a_v100_is_refused_naming_the_device(tmp_path):
    c = load_cluster(_write(tmp_path, _doc()))
    with pytest.raises(ConfigError) as exc:
        c.check_precision("bf16")
    text = str(exc.value)
    assert "--precision" in text and "Tesla V100 SXM2 32 GB computes in fp16, fp32" in text
    assert "\n" not in text


def test_only_the_devices_planned_on_must_have_the_precision(tmp_path):
    c = load_cluster(_write(tmp_path, {**_doc(), "nodes": [{"A100": 4}, {"V100": 4}]}))
    request = planner.Request(
        model="resnet18",
        batch=64,
        nodes=1,
        per_node=4,
        input_shape=(3, 32, 32),
        num_classes=10,
        precision="bf16",
    )
    planner.check(request, c)  # the A100 node alone
    with pytest.raises(ConfigError, match="Tesla V100 SXM2 32 GB computes in fp16, fp32"):
        planner.check(replace(request, nodes=2), c)


def _edit_nodes(d):
    d["nodes"][1] = {"P100": 4}


def _edit_type_key(d):
    d["device_types"]["A100"]["clock"] = 1


def _edit_cpu_with_speed(d):
    d["device_types"]["A100"]["cpu"] = 0.5


def _edit_uneven(d):
    d["nodes"][1] = {"V100": 3}


BROKEN = {
    "unknown type in nodes": (_edit_nodes, r"nodes\[1\]\.P100"),
    "unknown key": (lambda d: d.update(device={}), "key device:"),
    "unknown key of a type": (_edit_type_key, r"device_types\.A100\.clock"),
    "cpu share beside a speed": (_edit_cpu_with_speed, r"device_types\.A100\.cpu"),
    "nodes of different sizes": (_edit_uneven, "key nodes:"),
    "negative count": (lambda d: d["nodes"][0].update(A100=-1), r"nodes\[0\]\.A100"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_broken_mixed_file_is_one_line_naming_the_key(tmp_path, name):
    edit, needle = BROKEN[name]
    doc = _doc()
    edit(doc)
    with pytest.raises(ConfigError, match=needle) as exc:
        load_cluster(_write(tmp_path, doc))
    assert "\n" not in str(exc.value)


def _two_speeds(fast: float = 1.0, slow: float = 0.5, per_node: int = 2, **kwargs):
    """One block of 1 s forward and 2 s backward per row on a whole CPU; devices alternate
    between a whole CPU and a share of one (``slow``)."""
    cost = literal_cost([1.0], [2.0], **kwargs)
    types = (
        DeviceType("fast", "fast", INF, None, fast),
        DeviceType("slow", "slow", INF, None, slow),
    )
    kinds = tuple(("fast", "slow")[i % 2] for i in range(per_node))
    return cost.like(replace(cost.cluster, devices_per_node=per_node, types=types, kinds=(kinds,)))


PLACED = (Place(0, 0, "fast", 1.0), Place(0, 1, "slow", 0.5))


def test_a_slower_replica_costs_more_and_weighted_rows_balance_it():
    cost = _two_speeds()
    even = evaluate(cost, Plan((2,), 1, (0,), 1, 2, placement=PLACED), 6)
    # 3 rows each: 9 s on the whole CPU, 18 s on half of one.
    assert even.sim.busy == pytest.approx([9.0, 18.0])
    assert even.sim.step_time == pytest.approx(18.0)
    weights = weights_for(cost, ["fast", "slow"], 0, 1, 6)
    assert weights == (Fraction(2), Fraction(1))
    balanced = Plan((2,), 1, (0,), 1, 2, row_weights=(weights,), placement=PLACED)
    weighted = evaluate(cost, balanced, 6)
    assert weighted.sim.busy == pytest.approx([12.0, 12.0])  # 4 rows and 2 rows
    assert weighted.sim.step_time == pytest.approx(12.0)


def test_bundles_on_different_devices_are_each_simulated():
    """Two bundles of one replica, one on each device: the slow bundle sets the step (bundle 0
    alone would say 9 s)."""
    cost = _two_speeds()
    plan = Plan((1,), 2, (0,), 1, 2, grad_sync="hierarchical", placement=PLACED)
    e = evaluate(cost, plan, 6)
    assert e.sim.step_time == pytest.approx(18.0)
    assert sorted(e.sim.busy) == pytest.approx([9.0, 18.0])


def test_bundles_get_the_same_mix_of_devices():
    cost = _two_speeds(per_node=4)  # fast, slow, fast, slow
    bundles = bundle_devices(cost.cluster, 1, 4, 2)
    assert [[d.kind for d in b] for b in bundles] == [["fast", "slow"], ["fast", "slow"]]
    assert [[d.index for d in b] for b in bundles] == [[0, 1], [2, 3]]
    assert bundle_devices(cost.cluster, 1, 4, 4) == []  # one device each cannot be alike


def test_the_search_beats_the_plan_chosen_as_if_devices_were_alike():
    cost = _two_speeds(slow=0.4, per_node=4, params=[100])
    result = mixed_search(cost, workload=Workload(nodes=1, per_node=4, batch=28))
    best = result.ranked[0]
    assert best.samples_per_s > 1.2 * result.uniform.samples_per_s
    assert best.samples_per_s > 1.2 * result.data_parallel.samples_per_s
    assert best.samples_per_s >= result.weighted_data_parallel.samples_per_s
    assert best.plan.row_weights  # the slow devices take fewer rows
    # The uniform plan runs on the devices main.py would give its ranks, in node order.
    places = result.uniform.plan.placement
    assert [(p.node, p.device) for p in places] == [(0, i) for i in range(len(places))]


def test_the_uniform_assumption_is_the_average_device():
    """A whole CPU and half of one average to 0.75 of one: 1 s per row becomes 4/3 s."""
    uniform = uniform_cost(_two_speeds(), 1, 2)
    assert not uniform.cluster.mixed
    assert uniform.forward(0, 1, 3) == pytest.approx(3 / 0.75)


def test_plan_rows_carry_run_options_placement_and_row_weights():
    cost = _two_speeds()
    plan = Plan((2,), 1, (0,), 1, 2, row_weights=((Fraction(2), Fraction(1)),), placement=PLACED)
    job = report.Job(model="mlp", batch=6, nodes=1)
    row = report.row(evaluate(cost, plan, 6), job, cost)
    assert row["row_weights"] == "2:1"
    assert row["placement"] == [
        {"node": 0, "device": 0, "type": "fast", "cpu": 1.0},
        {"node": 0, "device": 1, "type": "slow", "cpu": 0.5},
    ]
    run = row["run"]
    assert run == {
        "model": "mlp",
        "batch_size": 6,
        "bundle_shape": "2",
        "num_bundle": 1,
        "micro_batches": 1,
        "schedule": "1f1b",
        "grad_sync": "flat",
        "row_weights": "2:1",
        "nproc_per_node": 2,
        "num_nodes": 1,
    }
    assert set(run) <= set(BY_YAML_KEY)
    assert "--row-weights 2:1" in row["command"]
    cfg = cli.parse(row["command"].split()[2:], {})
    assert cfg.parallel.row_weights == "2:1"


def test_a_homogeneous_plan_row_places_ranks_in_node_order():
    cost = literal_cost([1.0, 1.0], [1.0, 1.0])
    plan = Plan((1, 1), 2, (0, 1), 2, 2)
    row = report.row(evaluate(cost, plan, 8), report.Job(model="mlp", batch=8, nodes=2), cost)
    assert row["row_weights"] == ""
    assert [(p["node"], p["device"], p["type"]) for p in row["placement"]] == [
        (0, 0, "literal"),
        (0, 1, "literal"),
        (1, 0, "literal"),
        (1, 1, "literal"),
    ]
    assert row["run"]["partition"] == "b0,b1" and row["run"]["num_nodes"] == 2
    assert "--row-weights" not in row["command"]
    assert natural(plan, cost.cluster).placement[3] == Place(1, 1, "", None)


def test_communication_goes_at_the_slowest_cpu_share():
    """gloo moves and sums bytes on the processes' own time: a held process slows its links."""
    topo = Topology(
        shape=(3,), num_bundles=1, procs_per_node=3, global_batch=6, micro_batches=1,
        placement=(Place(0, 0, "fast", 1.0), Place(0, 1, "slow", 0.25), Place(0, 2, "gpu")),
    )  # fmt: skip
    assert cpu_slowdown(topo, (0, 1, 2)) == 4.0
    assert cpu_slowdown(topo, (0, 2)) == 1.0
    assert cpu_slowdown(replace(topo, placement=()), (0, 1)) == 1.0
