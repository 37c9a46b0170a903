"""scripts/plan.py: cluster files, bad input (one line, exit 2), the table and JSON, the
validation smoke; and main.py's --bundle-shape auto / --partition auto."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from bundle import cli, models
from bundle.config import AUTO_SHAPE
from bundle.errors import ConfigError
from bundle.launch import throttle
from bundle.launch.localworld import free_port
from bundle.plan import auto
from bundle.plan.cluster import load_cluster
from bundle.row_weights import parse_row_weights

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = [ROOT / "clusters" / name for name in ("h100_2x8_ib.yaml", "v100_4x4_eth.yaml")]
MIXED = [
    ROOT / "clusters" / name
    for name in ("a100_8_v100_8.yaml", "cpu_mixed_emulated.yaml", "h100_4_a10g_8.yaml")
]


def _plan_script():
    spec = importlib.util.spec_from_file_location("plan_script", ROOT / "scripts" / "plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PLAN = _plan_script()


def test_shipped_cluster_files_load():
    shipped = sorted(p.name for p in (ROOT / "clusters").glob("*.yaml"))
    assert shipped == sorted(p.name for p in [*CLUSTERS, *MIXED])
    h100, v100 = (load_cluster(str(p)) for p in CLUSTERS)
    assert (h100.nodes, h100.devices_per_node, h100.devices) == (2, 8, 16)
    assert (v100.nodes, v100.devices_per_node, v100.devices) == (4, 4, 16)
    assert h100.inter.bandwidth == pytest.approx(400e9 / 8)  # 400 Gb/s
    assert v100.inter.bandwidth == pytest.approx(10e9 / 8)  # 10 Gb/s
    assert "bf16" not in v100.speed.peak_flops
    with pytest.raises(ConfigError, match="--precision"):
        v100.check_precision("bf16")


def _broken(tmp_path: Path, edit) -> str:
    doc = yaml.safe_load(CLUSTERS[1].read_text())
    edit(doc)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


BROKEN = {
    "negative memory": (lambda d: d["device"].update(memory_gib=-1), "device.memory_gib"),
    "negative bandwidth": (
        lambda d: d["inter_node"].update(bandwidth_gbs=-1.25),
        "inter_node.bandwidth_gbs",
    ),
    "missing latency": (lambda d: d["intra_node"].pop("latency_us"), "intra_node.latency_us"),
    "unknown key": (lambda d: d.update(gpus=4), "key gpus"),
    "efficiency above 1": (
        lambda d: d["device"]["speed"].update(efficiency=2),
        "device.speed.efficiency",
    ),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_broken_cluster_file_names_the_key(tmp_path, name):
    edit, needle = BROKEN[name]
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_cluster(_broken(tmp_path, edit))


BAD = {
    "unknown model": (["--model", "resnet9000"], "--model"),
    "batch too small for any plan": (
        ["--model", "resnet50", "--batch-size", "4", "--cluster", str(CLUSTERS[0])],
        "--batch-size",
    ),
    "missing cluster file": (["--model", "resnet50", "--cluster", "nope.yaml"], "--cluster"),
    "precision the cluster lacks": (
        ["--model", "resnet50", "--precision", "bf16", "--cluster", str(CLUSTERS[1])],
        "--precision",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_is_one_line_and_exit_2(name, capsys, tmp_path):
    argv, needle = BAD[name]
    assert PLAN.main([*argv, "--profile-cache", str(tmp_path)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("plan.py: error:") and needle in err[0], err


def test_broken_cluster_file_is_exit_2(tmp_path, capsys):
    path = _broken(tmp_path, lambda d: d.pop("devices_per_node"))
    assert PLAN.main(["--model", "vgg16", "--cluster", path]) == 2
    err = capsys.readouterr().err
    assert "--gpus-per-node" in err and "gives no devices_per_node" in err


def test_the_counts_asked_for_widen_a_cluster_file_with_a_note(tmp_path, capsys):
    """The file describes the kind of node and its links; how many is the user's question. A file
    may leave the counts out; more than it lists is planned, with one note."""
    out = tmp_path / "plans.json"
    path = _broken(tmp_path, lambda d: (d.pop("nodes"), d.pop("devices_per_node")))
    assert load_cluster(path).nodes == 1
    argv = ["--model", "resnet18", "--batch-size", "64", "--nodes", "3", "--gpus-per-node", "2"]
    argv += ["--top", "1", "--json", str(out), "--profile-cache", str(tmp_path)]
    assert PLAN.main([*argv, "--cluster", path]) == 0
    assert json.loads(out.read_text())["devices"] == 6
    err = capsys.readouterr().err
    assert "plan.py: --nodes 3 and --gpus-per-node 2 in place of 1 node(s)" in err, err
    assert "1 node(s) of (not given) that the cluster" in err and "stand for every node" in err
    assert "''s" not in err  # a quote doubled: "cluster 'name''s"
    argv[5] = "5"  # --nodes 5 of the shipped file's 4 (of 4 devices; 2 asked for)
    assert PLAN.main([*argv, "--cluster", str(CLUSTERS[1])]) == 0
    assert json.loads(out.read_text())["devices"] == 10
    assert "--nodes 5 in place of 4 node(s) of 4 that the cluster" in capsys.readouterr().err


@pytest.mark.parametrize(
    "model,args,dataset",
    [
        ("gpt", "", "text"),
        ("transformers:GPT2LMHeadModel", "n_layer=1,n_embd=32,n_head=2", "text"),
        (
            "transformers:LlamaForCausalLM",
            "num_hidden_layers=1,hidden_size=32,"
            "intermediate_size=64,num_attention_heads=2,num_key_value_heads=1",
            "text",
        ),
        (
            "transformers:ViTForImageClassification",
            "num_hidden_layers=1,hidden_size=32,"
            "num_attention_heads=2,intermediate_size=64,patch_size=8",
            "synthetic",
        ),
        ("resnet18", "", "synthetic"),
        ("digits_cnn", "", "digits"),
    ],
)
def test_a_model_that_reads_tokens_is_planned_on_text(model, args, dataset):
    # A language model of any origin gets token windows (and main.py's text flags), not images.
    argv = ["--model", model, "--seq-len", "32", "--batch-size", "8"]
    data = PLAN._data(PLAN.parse_args(argv + (["--model-args", args] if args else [])))
    assert data["dataset"] == dataset
    if dataset == "text":
        assert data["input_shape"] == [32] and data["num_classes"] == 256


def test_plans_for_a_cluster_file(tmp_path, capsys):
    out, png = tmp_path / "plans.json", tmp_path / "plans.png"
    argv = [
        "--model",
        "vgg16",
        "--batch-size",
        "256",
        "--nodes",
        "2",
        "--cluster",
        str(CLUSTERS[1]),
    ]
    argv += ["--top", "5", "--json", str(out), "--png", str(png), "--profile-cache", str(tmp_path)]
    assert PLAN.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["devices"] == 8 and len(report["plans"]) == 5
    best = report["plans"][0]
    for key in ("shape", "split", "micro_batches", "schedule", "grad_sync", "bubble", "fits"):
        assert key in best
    assert best["predicted_samples_per_s"] >= report["data_parallel"]["predicted_samples_per_s"]
    assert report["speedup_over_data_parallel"] >= 1.0
    assert best["command"].startswith("python main.py --model vgg16 --batch-size 256")
    assert png.stat().st_size > 10_000
    text = capsys.readouterr().out
    assert "pure data parallelism" in text and best["command"] in text
    # The command's arguments are main.py's own, split points included.
    cmd = best["command"].split()[2:]
    cfg = cli.parse(cmd, {})
    assert cfg.parallel.shape == tuple(best["shape"])
    assert cfg.parallel.micro_batches == best["micro_batches"]


def test_shipped_mixed_cluster_files_load():
    a100_v100, cpu, h100_a10g = (load_cluster(str(p)) for p in MIXED)
    assert a100_v100.kinds == (("A100",) * 8, ("V100",) * 8)
    assert h100_a10g.kinds == (("H100", "H100", "A10G", "A10G", "A10G", "A10G"),) * 2
    assert [cpu.device_type(k).cpu for k in cpu.kinds[0]] == [0.5, 0.5, 0.2, 0.2]
    assert cpu.speed is None  # timed on this machine
    with pytest.raises(ConfigError, match="Tesla V100 SXM2 32 GB computes in fp16, fp32"):
        a100_v100.check_precision("bf16")


def test_bf16_on_a_cluster_with_v100s_is_one_line_and_exit_2(capsys, tmp_path):
    argv = ["--model", "resnet18", "--precision", "bf16", "--cluster", str(MIXED[0])]
    assert PLAN.main([*argv, "--profile-cache", str(tmp_path)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "--precision" in err[0] and "Tesla V100" in err[0], err


def _check_mixed_report(report: dict, devices: int, path: Path) -> dict:
    best = report["plans"][0]
    assert report["devices"] == devices
    assert report["speedup_over_uniform"] >= 1.0
    assert report["speedup_over_data_parallel"] >= 1.0
    assert report["speedup_over_weighted_data_parallel"] >= 1.0
    assert len(report["uniform_plan"]["placement"]) == report["uniform_plan"]["processes"]
    for row in report["plans"]:
        assert len(row["placement"]) == row["processes"]
        assert set(row["placement"][0]) == {"node", "device", "type", "cpu"}
        assert row["run"]["row_weights"] == row["row_weights"]
        assert row["run"]["bundle_shape"] == ",".join(map(str, row["shape"]))
        assert ("--row-weights" in row["command"]) == bool(row["row_weights"])
    # What main.py --plan reads: the run options are main.py's own config keys.
    argv = ["--model", report["model"], "--batch-size", str(report["batch"]), "--plan", str(path)]
    cfg = cli.parse(argv, {})
    assert cfg.parallel.shape == tuple(best["shape"])
    assert cfg.parallel.row_weights == best["row_weights"]
    assert len(cfg.parallel.placement) == best["processes"]
    return best


def test_plans_for_a_mixed_cluster(tmp_path, capsys):
    out = tmp_path / "plans.json"
    argv = ["--model", "resnet18", "--batch-size", "256", "--cluster", str(MIXED[0])]
    assert (
        PLAN.main([*argv, "--top", "3", "--json", str(out), "--profile-cache", str(tmp_path)]) == 0
    )
    report = json.loads(out.read_text())
    best = _check_mixed_report(report, 16, out)
    assert {p["type"] for p in best["placement"]} == {"A100", "V100"}
    said = capsys.readouterr()
    assert "as if every device were alike" in said.out and "stage 0:" in said.out
    # Never silent while it searches: what it searches, then what it simulates.
    lines = [ln for ln in said.err.splitlines() if ln.startswith("plan.py: s")]
    assert (
        lines[0].startswith("plan.py: searching placements x stage widths")
        and "16 devices" in lines[0]
    )
    assert lines[1].startswith("plan.py: simulating the") and "links shared" in lines[1]


@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> tuple[Path, str, Path]:
    """plan.py for emulated CPU devices, measuring everything into a cache of its own that
    main.py's ``--bundle-shape auto`` below reads (``$XDG_CACHE_HOME/bundle/profiles``): the
    report, what plan.py said, the cache's root."""
    import contextlib
    import io

    root = tmp_path_factory.mktemp("xdg")
    out = root / "plans.json"
    argv = ["--model", "digits_cnn", "--batch-size", "64", "--cluster", str(MIXED[1])]
    argv += ["--json", str(out), "--profile-cache", str(root / "bundle" / "profiles")]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert PLAN.main(argv) == 0, err.getvalue()[-3000:]
    return out, err.getvalue(), root


def test_plans_for_emulated_cpu_devices_carry_cpu_shares(emulated):
    out, err, _ = emulated  # what it measures before it measures it
    assert "plan.py: profiling digits_cnn on this machine's cpu: each block's forward" in err
    report = json.loads(out.read_text())
    best = _check_mixed_report(report, 4, out)
    assert sorted(p["cpu"] for p in best["placement"]) == [0.2, 0.2, 0.5, 0.5]
    # With rows weighted by speed, the 0.2-CPU processes take fewer rows than the 0.5 ones.
    weighted = report["data_parallel_weighted"]
    weights = parse_row_weights(weighted["row_weights"], tuple(weighted["shape"]))[0]
    shares = [p["cpu"] for p in weighted["placement"]]
    fast = {w for w, c in zip(weights, shares, strict=True) if c == 0.5}
    slow = {w for w, c in zip(weights, shares, strict=True) if c == 0.2}
    assert min(fast) > max(slow)
    # The plan names each profile it measured, with the conditions it was measured under (a
    # profile read back from the cache is named so too: tests/unit/test_plan_conditions.py). The
    # CPU shares' slowdown is measured where cgroups can be written (root), else a note says it
    # was not.
    notes = report["profiles"]
    unmeasured = [n for n in notes if n.startswith("CPU shares' slowdown not measured")]
    kinds = {n.split(" profile")[0] for n in notes if n not in unmeasured}
    shares = {"cpu_shares"} if throttle.available() is None else set()
    assert kinds == {"timings", "engine", "links"} | shares, notes
    assert len(unmeasured) == (0 if shares else 1), notes
    assert all("measured now" in n for n in notes if n not in unmeasured), notes


def test_auto_is_parsed_and_refused_beside_dp_only():
    cfg = cli.parse(["--bundle-shape", "auto"], {})
    assert cfg.parallel.shape == AUTO_SHAPE and cfg.planned
    assert cli.parse(["--partition", "auto"], {}).planned
    assert not cli.parse([], {}).planned
    with pytest.raises(ConfigError, match="--DP-ONLY"):
        cli.parse(["--bundle-shape", "auto", "--DP-ONLY"], {})


def test_auto_under_torchrun_plans_the_same_from_counts_alone():
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    argv = ["--bundle-shape", "auto", "--model", "resnet18", "--dataset", "synthetic"]
    argv += ["--image-size", "32", "--batch-size", "64"]
    first = auto.resolve(cli.parse(argv, env))
    again = auto.resolve(cli.parse(argv, env))
    assert first == again  # every process plans alike: the configs they compare agree
    assert first.parallel.world_size == 4 and first.launch.nproc_per_node == 2
    assert first.predicted_samples_per_s > 0
    # The resolved config is an ordinary one: its split parses and fits the model.
    main_cfg = cli.parse(argv, env)
    assert main_cfg.parallel.shape == AUTO_SHAPE
    if len(first.parallel.shape) > 1:
        assert "," in first.model.partition


@pytest.mark.slow
def test_validate_smoke_reports_every_key(tmp_path):
    out = tmp_path / "validation.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "plan.py"),
            "--validate",
            "--smoke",
            "--json",
            str(out),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert len(report["configurations"]) == 2
    for row in report["configurations"]:
        for key in ("predicted_samples_per_s", "measured_samples_per_s", "error"):
            assert isinstance(row[key], float) and row[key] == row[key], (key, row)
        assert row["predicted_samples_per_s"] > 0 and row["measured_samples_per_s"] > 0
    assert report["median_abs_error"] >= 0 and report["max_abs_error"] >= report["median_abs_error"]
    assert "median |error|" in proc.stdout


@pytest.mark.slow
def test_main_runs_the_planned_shape_and_reports_its_prediction(emulated):
    """--bundle-shape auto on two CPU processes: the plan is logged, run, and its prediction
    sits beside the measured throughput in the summary. The machine's engine and links profiles
    are the ones plan.py measured and cached; the model's block timings are measured here."""
    _, planned, cache = emulated
    args = ["--bundle-shape", "auto", "--nproc-per-node", "2", "--model", "mlp"]
    args += ["--dataset", "synthetic", "--image-size", "4", "--synthetic-size", "128"]
    args += ["--batch-size", "16", "--itr", "4", "--no-eval", "--portNum", str(free_port())]
    env = {"XDG_CACHE_HOME": str(cache), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "main.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "main.py: plan: --bundle-shape" in proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["world_size"] == 2
    assert summary["predicted_samples_per_s"] > 0 and summary["samples_per_s"] > 0
    for kind in ("engine", "links"):  # cached by plan.py unless its machine was too busy
        said = next(ln for ln in planned.splitlines() if f"plan.py: {kind} profile" in ln)
        read = f"main.py: {kind} profile from the cache" in proc.stderr
        assert read == ("not cached" not in said), (said, proc.stderr[-3000:])
    assert "main.py: timings profile measured now" in proc.stderr, proc.stderr[-3000:]


def test_partition_auto_splits_the_given_shape_by_time():
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"}
    argv = ["--bundle-shape", "2,1", "--partition", "auto", "--model", "vgg16"]
    argv += [
        "--dataset",
        "synthetic",
        "--image-size",
        "32",
        "--batch-size",
        "32",
        "--micro-batches",
        "4",
    ]
    cfg = auto.resolve(cli.parse(argv, env))
    assert cfg.parallel.shape == (2, 1) and cfg.parallel.micro_batches == 4
    first, second = cfg.model.partition.split(",")
    assert first == "features.0" and second != first
    assert cfg.predicted_samples_per_s > 0
    # The time-balanced split puts the wide front on the convolutions, unlike the
    # parameter-balanced one (VGG's parameters sit in its classifier).
    from bundle.models import partition

    with torch.device("meta"):
        model = models.build("vgg16", num_classes=10, input_shape=(3, 32, 32))
    by_params = partition.auto_starts(models.blocks(model), 2)
    assert models.blocks(model)[by_params[1]][0] != second


def test_gpu_counts_without_a_cluster_plan_from_nominal_gpus(tmp_path, capsys, monkeypatch):
    """GPU counts and no --cluster: nominal GPU figures, said in one stderr line with the way to
    give a cluster file; nothing is timed on this machine (it took minutes on a CPU)."""
    from bundle.plan import planner

    monkeypatch.setattr(planner.isolate, "run_in_child", pytest.fail)
    argv = ["--model", "resnet101", "--nodes", "2", "--gpus-per-node", "4"]
    argv += ["--batch-size", "256", "--top", "3", "--profile-cache", str(tmp_path)]
    start = time.monotonic()
    assert PLAN.main(argv) == 0
    assert time.monotonic() - start < 60
    captured = capsys.readouterr()
    err = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert "nominal cuda device" in err[0] and "--cluster" in err[0], err
    # Its progress: the search, the plans simulated under 1F1B, the leaders under the others.
    assert [ln.split()[1] for ln in err[1:]] == ["searching", "simulating", "simulating"], err
    assert "under 1f1b" in err[2] and "under the other schedules" in err[3], err
    assert "8 devices on nominal cuda" in captured.out


def test_auto_measures_in_a_child_process(monkeypatch, tmp_path):
    """One self-spawned node plans from a profile measured in a child process (the supervisor
    never initialises CUDA); the child's measurement is canned here."""
    from bundle.plan import calibrate, planner
    from bundle.plan import profile as prof
    from bundle.plan.cluster import Link
    from bundle.plan.cost import Overheads

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    argv = ["--bundle-shape", "auto", "--nproc-per-node", "2", "--model", "mlp"]
    argv += ["--dataset", "synthetic", "--image-size", "4", "--batch-size", "16"]
    cfg = cli.parse(argv, {})
    calls = []

    def run_in_child(fn, request, **kwargs):
        calls.append((fn, kwargs["device_type"], kwargs["what"]))
        n = len(prof.anatomy(request.spec, kwargs["cache"]).blocks)
        link = Link(1e9, 1e-5)
        timings = prof.Timings(
            "cpu:canned",
            "fp32",
            (1, 16),
            ((1e-5,) * n, (1e-4,) * n),
            ((2e-5,) * n, (2e-4,) * n),
            (1e-6, 1e-5),
            1e-9,
        )
        cluster = calibrate.loopback(link, link, devices=2, memory_bytes=2**30)
        return planner.Measured(timings, Overheads(), cluster)

    monkeypatch.setattr(planner.isolate, "run_in_child", run_in_child)
    resolved = auto.resolve(cfg)
    assert calls == [(planner.measure, "cpu", "profiling mlp on cpu")]
    assert resolved.parallel.world_size == 2 and resolved.predicted_samples_per_s > 0
    assert not torch.cuda.is_initialized()


def test_plan_scale_writes_the_search_time_by_gpus(tmp_path):
    out = tmp_path / "scale.json"
    argv = [sys.executable, "scripts/plan_scale.py", "--gpus", "2,16", "--depths", ""]
    done = subprocess.run(
        [*argv, "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert list(doc["seconds_by_gpus"]) == ["2", "16"] and doc["seconds_by_depth"] == {}
    assert all(s > 0 for s in doc["seconds_by_gpus"].values())
    assert doc["plans_by_gpus"]["16"]["best"]["samples_per_s"] > 0
    assert doc["conditions"]["cpus"] >= 1 and "load" in doc["conditions"]
