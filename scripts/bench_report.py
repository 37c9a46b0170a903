"""The benchmark's report: per-case summaries, headline ratios, the printed table and the JSON.

Kept apart from ``bench.py`` (which builds and times the cases) so each reads on its own.
"""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import bench_memory
import torch

from bundle.ir.schedule import REGISTRY, SCHEDULES

if TYPE_CHECKING:
    from bench import Sizes


def _rounded(values: list[float]) -> list[float]:
    """Seconds to the microsecond, for the raw lists."""
    return [round(v, 6) for v in values]


def _by_round(values: list[float], rounds: int) -> list[float]:
    """Medians of ``values`` cut into ``rounds`` equal consecutive runs (one per round)."""
    n = len(values) // rounds
    return [statistics.median(values[r * n : (r + 1) * n]) for r in range(rounds)]


def _efficiency(round_ideal: list[float], round_step: list[float]) -> float:
    """Median over rounds of the round's ideal step time / its measured median step time."""
    return statistics.median(i / t for i, t in zip(round_ideal, round_step, strict=True))


def summarize(results: list[dict], rounds: int) -> dict[str, dict]:
    """Per case: rank 0's step times, medians, throughput, per-rank CPU, efficiency if probed."""
    out = {}
    lead = results[0]
    for name, times in lead["wall"].items():
        info = lead["info"][name]
        med = statistics.median(times)
        entry = {
            "micro_batches": info["micro_batches"],
            "global_batch": info["batch"],
            "median_step_s": med,
            "samples_per_s": info["batch"] / med,
            "min_step_s": min(times),
            "round_step_s": _by_round(times, rounds),
            "cpu_step_s": [statistics.median(r["cpu"][name]) for r in results],
            "step_s": _rounded(times),
        }
        if name in lead["stage"]:
            ranks = results[: info["stages"]]
            walls = [[w for w, _ in r["stage"][name]] for r in ranks]
            slots = info["micro_batches"] + info["stages"] - 1
            ideal = slots * max(statistics.median(w) for w in walls)
            per_round = [_by_round(w, rounds) for w in walls]
            round_ideal = [slots * max(t) for t in zip(*per_round, strict=True)]
            entry.update(
                stage_s=[statistics.median(w) for w in walls],
                stage_cpu_s=[statistics.median(c for _, c in r["stage"][name]) for r in ranks],
                stage_raw_s=[_rounded(w) for w in walls],
                stage_blocks=[r["info"][name]["stage_blocks"] for r in ranks],
                ideal_step_s=ideal,
                round_ideal_step_s=round_ideal,
                efficiency=_efficiency(round_ideal, entry["round_step_s"]),
                efficiency_pooled=ideal / med,
            )
        if name in lead["peak"]:
            entry["peak_in_flight_stage0"] = lead["peak"][name]
        out[name] = entry
    return out


def cpu_bf16() -> list[str]:
    """The native bf16 flags of this CPU (avx512_bf16, amx_bf16) in /proc/cpuinfo; [] if none."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []
    flags = {f for line in lines if line.startswith("flags") for f in line.split(":", 1)[1].split()}
    return [f for f in ("avx512_bf16", "amx_bf16") if f in flags]


def machine(load_start: tuple[float, ...]) -> dict:
    """Where the numbers were taken, with the load average of the shared machine around them."""
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_bf16": cpu_bf16(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads_per_process": 1,
        "backend": "gloo",
        "loadavg_start": list(load_start),
        "loadavg_end": list(os.getloadavg()),
    }


def _ms(values: list[float]) -> str:
    """Seconds per rank as milliseconds: ``a/b`` for two ranks, the largest for more."""
    if len(values) > 2:
        return f"max {max(values) * 1e3:.1f}"
    return "/".join(f"{v * 1e3:.1f}" for v in values) or "-"


def _row(name: str, e: dict) -> str:
    """One table row of a case."""
    ideal = f"{e['ideal_step_s'] * 1e3:.1f}" if "ideal_step_s" in e else "-"
    eff = f"{e['efficiency']:.3f}" if "efficiency" in e else "-"
    return (
        f"{name:<26}{e['micro_batches']:>3}{e['median_step_s'] * 1e3:>9.1f}"
        f"{_ms(e['cpu_step_s']):>13}{_ms(e.get('stage_s', [])):>13}{ideal:>9}"
        f"{e['samples_per_s']:>10.0f}{eff:>7}"
    )


def render(report: dict, cases: dict[str, dict]) -> str:
    """The human-readable table."""
    m, s, r = report["machine"], report["sizes"], report
    cm = s["compare_micro"]
    header = (
        f"{'case':<26}{'M':>3}{'step ms':>9}{'cpu ms':>13}{'t_s ms':>13}{'ideal ms':>9}"
        f"{'samples/s':>10}{'eff':>7}"
    )

    def split(name: str) -> str:
        """A case's stage blocks, ``a,b | c,d``."""
        return " | ".join(",".join(b) for b in cases[name]["stage_blocks"])

    pipeline = [
        *(f"mlp bundle 1f1b M={k}" for k in s["mlp_micro"]),
        *(f"mlp bundle {k} M={cm}" for k in SCHEDULES if k != "1f1b"),
        f"mlp bundle zb-h1 M={s['few_micro']}",
        *(f"mlp bundle {k} M={s['few_micro']}" for k in SCHEDULES if REGISTRY[k].chunks),
        *(f"mlp torch {k} M={cm}" for k in SCHEDULES),
        *(f"cnn bundle 1f1b M={k}" for k in s["cnn_micro"]),
    ]
    cnn_first = f"cnn bundle 1f1b M={s['cnn_micro'][0]}"
    others = ["bundle dp", "torch ddp", f"bundle flat M={cm}", f"bundle hierarchical M={cm}"]
    others.append(f"bundle flat waited M={cm}")
    compute = [
        *(f"cnn bundle {k} M={cm}" for k in ("fp32", "bf16", "recompute", "channels-last")),
        *(f"mlp bundle {k} M={cm}" for k in ("fp32", "bf16", "timers on", "timers off")),
    ]
    detail = r["vs_torch_pipelining_detail"]
    lines = [
        f"Bundle benchmark ({r['mode']}): gloo over loopback, 1 thread per process, "
        f"{m['cpu_count']} CPUs, torch {m['torch']}, {m['platform']}, "
        f"CPU bf16: {', '.join(m['cpu_bf16']) or 'none'}",
        f"{s['mlp_model']} 3x{s['mlp_image']}x{s['mlp_image']}, global batch {s['mlp_batch']}, "
        f"split [{split(f'mlp bundle 1f1b M={cm}')}]",
        f"small_resnet 3x32x32, global batch {s['cnn_batch']}, split [{split(cnn_first)}]",
        f"{s['rounds']} interleaved rounds x {s['steps']} timed steps per case; medians. "
        "step: rank 0 wall; cpu: process CPU per step and rank;",
        "t_s: one micro-batch fwd+bwd of each stage alone; eff = (M+S-1) max t_s / step. "
        f"load average {m['loadavg_start'][0]:.1f} at start, {m['loadavg_end'][0]:.1f} at end",
        "",
        "pipeline, shape 1,1 (2 processes)",
        header,
        *(_row(name, cases[name]) for name in pipeline),
        "",
        "data parallel, shape 2 (2 processes); two bundles of shape 1,1 (4 processes)",
        header,
        *(_row(name, cases[name]) for name in others),
        "",
        "ratios (> 1: Bundle faster)",
        f"  pipeline_efficiency   {r['pipeline_efficiency']:.3f}  (mlp bundle 1f1b M={cm})",
        f"  vs_torch_pipelining   {r['vs_torch_pipelining']:.3f}  (bundle {detail['bundle_best']}"
        f" / torch {detail['torch_best']}; same schedule: "
        + ", ".join(f"{k} {v:.3f}" for k, v in detail["same_schedule"].items())
        + ")",
        "                        torch's efficiency against the same ideal: "
        + ", ".join(f"{k} {v:.3f}" for k, v in detail["torch_efficiency"].items())
        + f" (a step at the ideal would lead it {detail['ceiling']:.2f}x)",
        f"  best_vs_1f1b          {r['best_vs_1f1b']:.3f}  (bundle {r['schedule_best']} / bundle 1f1b)",
        f"  zb_h1_vs_1f1b_few_micro  {r['zb_h1_vs_1f1b_few_micro']:.3f}  (M={s['few_micro']})",
        f"  best_vs_1f1b_few_micro  {r['best_vs_1f1b_few_micro']:.3f}  (the best schedule at "
        f"M={s['few_micro']} / bundle 1f1b)",
        "  chunks_vs_1f1b_few_micro  "
        + ", ".join(f"{k} {v:.3f}" for k, v in r["chunks_vs_1f1b_few_micro"].items())
        + f"  (two chunks per stage / 1F1B, M={s['few_micro']})",
        f"  dp_vs_ddp             {r['dp_vs_ddp']:.3f}",
        f"  hierarchical_vs_flat  {r['hierarchical_vs_flat']:.3f}",
        f"  flat_send_first_vs_waited  {r['flat_send_first_vs_waited']:.3f}",
        f"  peak in flight on stage 0, M={cm}: 1f1b {r['peak_inflight_1f1b']}, "
        f"gpipe {r['peak_inflight_gpipe']}",
        "",
        f"precision, recompute, layout: shape 1,1, 1f1b, M={cm} (2 processes; cnn = "
        "small_resnet; recompute = always, fp32)",
        header,
        *(_row(name, cases[name]) for name in compute),
        "",
        "  bf16_vs_fp32          "
        + ", ".join(f"{k} {v:.3f}" for k, v in r["bf16_vs_fp32"].items())
        + "  (throughput bf16 / fp32; > 1: bf16 faster)",
        f"  timer_overhead        {r['timer_overhead']:+.3f}  (step time with / without the "
        "per-action timers - 1)",
        f"  recompute_cost        {r['recompute_cost']:.3f}  (step time always / never: "
        "> 1 means recompute is slower; not the '> 1: Bundle faster' direction)",
        f"  channels_last_vs_default {r['channels_last_vs_default']:.3f}  (small_resnet "
        "throughput channels-last / default layout, fp32)",
        *bench_memory.render(r, cm),
    ]
    return "\n".join(lines)


def _sweep(cases: dict[str, dict], prefix: str, micro: tuple[int, ...]) -> list[dict]:
    """One row per micro-batch count of a sweep."""
    return [
        {
            "micro_batches": m,
            "samples_per_s": cases[f"{prefix} M={m}"]["samples_per_s"],
            "efficiency": cases[f"{prefix} M={m}"]["efficiency"],
            "median_step_s": cases[f"{prefix} M={m}"]["median_step_s"],
            "ideal_step_s": cases[f"{prefix} M={m}"]["ideal_step_s"],
        }
        for m in micro
    ]


def paired(cases: dict[str, dict], ours: str, theirs: str) -> float:
    """Throughput of ``ours`` / ``theirs``: the median of the ratios of steps run side by side."""
    a, b = cases[ours], cases[theirs]
    scale = a["global_batch"] / b["global_batch"]
    return statistics.median(
        scale * tb / ta for ta, tb in zip(a["step_s"], b["step_s"], strict=True)
    )


def build_report(
    mode: str,
    sizes: Sizes,
    cases: dict[str, dict],
    activation: dict,
    wall: float,
    load_start: tuple[float, ...],
) -> dict:
    """The JSON document: headline ratios, sweeps, and every raw number behind them."""
    cm, fm = sizes.compare_micro, sizes.few_micro
    tput = {name: e["samples_per_s"] for name, e in cases.items()}
    ours = {s: tput[f"mlp bundle {s} M={cm}"] for s in SCHEDULES}
    theirs = {s: tput[f"mlp torch {s} M={cm}"] for s in SCHEDULES}
    ours_best = max(ours, key=ours.get)
    few = [f"mlp bundle {k} M={fm}" for k in SCHEDULES if k == "zb-h1" or REGISTRY[k].chunks]
    few_best = max([f"mlp bundle 1f1b M={fm}", *few], key=tput.get)
    theirs_best = max(theirs, key=theirs.get)

    def vs(s_ours: str, s_theirs: str) -> float:
        return paired(cases, f"mlp bundle {s_ours} M={cm}", f"mlp torch {s_theirs} M={cm}")

    # torch.distributed.pipelining against the same bubble-bound ideal (same split, same
    # micro-batch size, stage times from the Bundle 1F1B case of the same round): no schedule
    # of the same split can beat torch by more than 1 / this.
    ideal = cases[f"mlp bundle 1f1b M={cm}"]["round_ideal_step_s"]
    torch_eff = {
        s: _efficiency(ideal, cases[f"mlp torch {s} M={cm}"]["round_step_s"]) for s in SCHEDULES
    }

    return {
        "command": shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv])),
        "mode": mode,
        "machine": machine(load_start),
        "sizes": asdict(sizes),
        "pipeline_efficiency": cases[f"mlp bundle 1f1b M={cm}"]["efficiency"],
        "vs_torch_pipelining": vs(ours_best, theirs_best),
        # The same, named for what it compares; and our best schedule against our own 1F1B.
        "vs_torch_pipelining_best": vs(ours_best, theirs_best),
        "schedule_best": ours_best,
        "best_vs_1f1b": paired(cases, f"mlp bundle {ours_best} M={cm}", f"mlp bundle 1f1b M={cm}"),
        # ZB-H1 / 1F1B where the bubble is larger (paired in the sweep's rounds).
        "zb_h1_vs_1f1b_few_micro": paired(
            cases, f"mlp bundle zb-h1 M={fm}", f"mlp bundle 1f1b M={fm}"
        ),
        # The best schedule at few micro-batches / 1F1B there (paired in the sweep's rounds).
        "best_vs_1f1b_few_micro": paired(cases, few_best, f"mlp bundle 1f1b M={fm}"),
        # The schedules with two chunks per stage / 1F1B there (paired in the same rounds).
        "chunks_vs_1f1b_few_micro": {
            k: paired(cases, f"mlp bundle {k} M={fm}", f"mlp bundle 1f1b M={fm}")
            for k in SCHEDULES
            if REGISTRY[k].chunks
        },
        "vs_torch_pipelining_detail": {
            "bundle_samples_per_s": ours,
            "torch_samples_per_s": theirs,
            "bundle_best": ours_best,
            "torch_best": theirs_best,
            "same_schedule": {s: vs(s, s) for s in ours},
            "pooled": ours[ours_best] / theirs[theirs_best],
            "torch_efficiency": torch_eff,
            "ceiling": 1 / max(torch_eff.values()),
        },
        "dp_vs_ddp": paired(cases, "bundle dp", "torch ddp"),
        "peak_inflight_1f1b": cases[f"mlp bundle 1f1b M={cm}"]["peak_in_flight_stage0"],
        "peak_inflight_gpipe": cases[f"mlp bundle gpipe M={cm}"]["peak_in_flight_stage0"],
        "hierarchical_vs_flat": paired(cases, f"bundle hierarchical M={cm}", f"bundle flat M={cm}"),
        "flat_send_first_vs_waited": paired(
            cases, f"bundle flat M={cm}", f"bundle flat waited M={cm}"
        ),
        "bf16_vs_fp32": {
            model: paired(cases, f"{prefix} bundle bf16 M={cm}", f"{prefix} bundle fp32 M={cm}")
            for model, prefix in (("small_resnet", "cnn"), (sizes.mlp_model, "mlp"))
        },
        "recompute_cost": paired(cases, f"cnn bundle fp32 M={cm}", f"cnn bundle recompute M={cm}"),
        "channels_last_vs_default": paired(
            cases, f"cnn bundle channels-last M={cm}", f"cnn bundle fp32 M={cm}"
        ),
        # Step time with the per-action timer every run has over the same steps without it, - 1.
        "timer_overhead": paired(
            cases, f"mlp bundle timers off M={cm}", f"mlp bundle timers on M={cm}"
        )
        - 1,
        **activation,
        "sweep_mlp": _sweep(cases, "mlp bundle 1f1b", sizes.mlp_micro),
        "sweep_cnn": _sweep(cases, "cnn bundle 1f1b", sizes.cnn_micro),
        "raw": cases,
        "wall_s": wall,
    }
