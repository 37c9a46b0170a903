"""scripts/bench.py runs end to end in smoke mode and reports every key with a usable value."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bundle.ir.schedule import SCHEDULES

REPO = Path(__file__).resolve().parents[2]


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench", REPO / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


RATIOS = (
    "pipeline_efficiency",
    "vs_torch_pipelining",
    "dp_vs_ddp",
    "hierarchical_vs_flat",
    "flat_send_first_vs_waited",
)


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.slow
def test_bench_smoke_reports_every_key(tmp_path: Path) -> None:
    """The smoke run writes every headline key: finite positive ratios, exact peaks, both sweeps,
    bf16 and recompute ratios, per-stage activation bytes (recompute=always lowest on stage 0)."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench.py"), "--smoke", "--json", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "pipeline_efficiency" in proc.stdout
    report = json.loads(out.read_text())

    for key in RATIOS:
        assert _positive(report[key]), (key, report[key])
    assert report["peak_inflight_1f1b"] == 2
    assert report["peak_inflight_gpipe"] == 8

    for key in ("sweep_mlp", "sweep_cnn"):
        rows = report[key]
        assert rows, key
        for row in rows:
            assert isinstance(row["micro_batches"], int) and row["micro_batches"] >= 1, row
            assert _positive(row["samples_per_s"]), row
            assert _positive(row["efficiency"]), row
    assert [r["micro_batches"] for r in report["sweep_mlp"]] == [1, 2, 4, 8, 16]

    detail = report["vs_torch_pipelining_detail"]
    assert set(detail["torch_efficiency"]) == set(SCHEDULES)  # torch's run of each, chunks too
    assert report["schedule_best"] in detail["bundle_samples_per_s"]
    assert _positive(report["best_vs_1f1b"]) and _positive(report["vs_torch_pipelining_best"])
    assert _positive(report["zb_h1_vs_1f1b_few_micro"])
    assert _positive(report["best_vs_1f1b_few_micro"])
    chunked = report["chunks_vs_1f1b_few_micro"]
    assert set(chunked) == {"interleaved-1f1b", "zbv"} and all(map(_positive, chunked.values()))
    assert all(_positive(v) for v in detail["torch_efficiency"].values())
    assert detail["ceiling"] == pytest.approx(1 / max(detail["torch_efficiency"].values()))

    bf16 = report["bf16_vs_fp32"]
    assert set(bf16) == {"small_resnet", "mlp"} and all(_positive(v) for v in bf16.values()), bf16
    assert _positive(report["recompute_cost"]), report["recompute_cost"]
    assert isinstance(report["timer_overhead"], float) and report["timer_overhead"] > -1
    assert _positive(report["channels_last_vs_default"]), report["channels_last_vs_default"]
    kept, peak = report["peak_activation_bytes"], report["peak_with_recompute_bytes"]
    cases = {f"{s} recompute={r}" for s, r in _load_bench().bench_memory.CASES}
    assert set(kept) == set(peak) == cases
    for name in cases:
        assert len(kept[name]) == 2 and all(isinstance(b, int) and b > 0 for b in kept[name])
        assert all(p >= k for p, k in zip(peak[name], kept[name], strict=True)), name
    never, always = kept["1f1b recompute=never"], kept["1f1b recompute=always"]
    assert always[0] < never[0] and peak["1f1b recompute=never"] == never  # nothing rebuilt
    # except-last: 1F1B's stage 0 recomputes every micro-batch, its last stage none.
    assert kept["1f1b recompute=except-last"] == [always[0], never[1]]
    assert kept["gpipe recompute=never"][0] > never[0]  # 8 micro-batches held against 2
    assert report["recompute_activation_ratio"] == pytest.approx(always[0] / never[0])
    assert report["recompute_peak_ratio"] > report["recompute_activation_ratio"]
    assert "recompute_activation_ratio" in proc.stdout and "recompute is slower" in proc.stdout

    machine = report["machine"]
    assert machine["cpu_count"] >= 1 and machine["torch"] and machine["platform"]
    assert set(machine["cpu_bf16"]) <= {"avx512_bf16", "amx_bf16"}
    assert "CPU bf16:" in proc.stdout
    assert "bench.py" in report["command"] and "--smoke" in report["command"]
    assert report["raw"], "per-measurement numbers are missing"
    for name, entry in report["raw"].items():
        assert entry["step_s"] and all(_positive(t) for t in entry["step_s"]), name


def test_bench_gpu_script_runs_on_cpu(tmp_path: Path) -> None:
    """bench_gpu.py's CPU smoke: both sides train the same model, so their first losses agree."""
    out = tmp_path / "gpu.json"
    args = ["--device", "cpu", "--model", "resnet18", "--batch", "2", "--image", "32"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_gpu.py"), *args, "--rounds", "2"]
        + ["--steps", "1", "--warmup", "0", "--json", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    loss = report["first_step_loss"]
    assert loss["bundle"] == pytest.approx(loss["plain"], rel=1e-6), loss
    assert set(report["images_per_s"]) == {"bundle", "plain"}
    assert all(_positive(v) for v in report["images_per_s"].values())
    assert _positive(report["ratio"])
    assert [len(report["step_s"][k]) for k in ("bundle", "plain")] == [2, 2]
    assert report["machine"]["device"] == "cpu" and "bench_gpu.py" in report["command"]


def test_bench_gpu_script_refuses_missing_cuda() -> None:
    """Without a GPU the default device is refused in one line, exit 2, not a traceback."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_gpu.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_gpu_gives_the_default_cuda_device_an_index(monkeypatch) -> None:
    """``--device cuda`` (the default) reaches set_device and init_process_group as
    ``cuda:<current index>``: both raise on a CUDA device without one. Faked CUDA, no GPU needed."""
    import torch

    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "scripts" / "bench_gpu.py")
    bench_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_gpu)
    seen: dict[str, object] = {}

    class Stop(Exception):
        pass

    def init_process_group(backend, **kwargs):
        seen["backend"], seen["device_id"] = backend, kwargs.get("device_id")
        raise Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.setdefault("set_device", d))
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    monkeypatch.setattr(bench_gpu, "set_tf32", lambda enabled: None)
    monkeypatch.setattr(bench_gpu.dist, "init_process_group", init_process_group)
    with pytest.raises(Stop):
        bench_gpu.main([])
    assert seen == {
        "set_device": torch.device("cuda", 3),
        "backend": "nccl",
        "device_id": torch.device("cuda", 3),
    }
    assert bench_gpu.with_index(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert bench_gpu.with_index(torch.device("cpu")) == torch.device("cpu")


def test_paired_ratio_compares_steps_run_side_by_side() -> None:
    """A slow moment that hits both sides of a pair cancels; the pooled medians would not."""
    _load_bench()
    bench = sys.modules["bench_report"]  # imported by bench.py from beside it
    # Bundle is 10 % faster at every moment; the machine slows down 3x for the last three pairs.
    torch_steps = [1.0, 1.0, 3.0, 3.0, 3.0]
    cases = {
        "ours": {"global_batch": 64, "step_s": [t / 1.1 for t in torch_steps]},
        "theirs": {"global_batch": 64, "step_s": torch_steps},
    }
    assert bench.paired(cases, "ours", "theirs") == pytest.approx(1.1)
    cases["ours"]["global_batch"] = 128  # twice the samples per step: twice the throughput
    assert bench.paired(cases, "ours", "theirs") == pytest.approx(2.2)
    assert bench._by_round([1, 2, 3, 10, 20, 30], 2) == [2, 20]


def test_bench_dp_names_its_parts() -> None:
    """scripts/bench_dp.py starts and offers its four measurements (each runs main.py jobs for
    minutes; tests/integration/test_data_parallel.py runs the faulty-bundle job end to end)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_dp.py"), "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    for part in ("zero", "compression", "sync", "robust", "--quick"):
        assert part in proc.stdout, part
