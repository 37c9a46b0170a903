"""Activation memory of the benchmark's small_resnet split: exact byte counts, not timings.

Per case (schedule x recompute mode) and stage, over one training step counted with
``bundle.engine.memory.SavedBytes``:

- ``kept``: the most bytes saved for backward alive at once, as the schedule holds them between
  forwards and backwards (what ``saved_tensors_hooks`` see);
- ``peak``: the same with recompute's transient: while a recomputed micro-batch's backward runs,
  the activations it rebuilt exist too (measured as what a plain forward of it saves).

Each case runs one step plain, then one under the counter, on a session of its own after the
timed rounds, so the hooks never slow a timed step.
"""

from __future__ import annotations

from collections.abc import Callable

from bundle.engine.memory import SavedBytes

# (schedule, recompute) of small_resnet at the benchmark's M.
CASES = (
    ("gpipe", "never"),
    ("gpipe", "always"),
    ("1f1b", "never"),
    ("1f1b", "except-last"),
    ("1f1b", "always"),
)
TARGET = 0.5  # recompute_activation_ratio on stage 0 should be at most this


def name(schedule: str, recompute: str) -> str:
    return f"{schedule} recompute={recompute}"


def count(case_for: Callable[[str, str], object]) -> dict[str, dict[str, int]]:
    """This rank's stage, per case: {"kept": bytes, "peak": bytes}.

    ``case_for(schedule, recompute)`` builds the benchmark Case (a session and a step) to count.
    """
    out = {}
    for schedule, recompute in CASES:
        case = case_for(schedule, recompute)
        runner = case.session.engine
        case.step(0)
        runner.saved_bytes = meter = SavedBytes(case.session.stage)
        case.step(1)
        runner.saved_bytes = None
        out[name(schedule, recompute)] = {"kept": meter.kept_peak, "peak": meter.peak}
    return out


def report(per_rank: list[dict[str, dict[str, int]]]) -> dict:
    """Report keys from every rank's counts (rank r = stage r: shape 1,1)."""
    kept = {k: [r[k]["kept"] for r in per_rank] for k in per_rank[0]}
    peak = {k: [r[k]["peak"] for r in per_rank] for k in per_rank[0]}
    always, never = name("1f1b", "always"), name("1f1b", "never")
    return {
        "peak_activation_bytes": kept,
        "peak_with_recompute_bytes": peak,
        "recompute_activation_ratio": kept[always][0] / kept[never][0],
        "recompute_peak_ratio": peak[always][0] / peak[never][0],
    }


def render(r: dict, micro: int) -> list[str]:
    """The report's lines for the memory keys."""
    kept, peak = r["peak_activation_bytes"], r["peak_with_recompute_bytes"]
    return [
        f"  activation memory, small_resnet M={micro}, MiB per stage (stage 0 / stage 1):",
        f"    {'case':<28}{'kept (saved for backward)':<28}with recompute's transient",
        *(
            f"    {k:<28}"
            + f"{' / '.join(f'{b / 2**20:.2f}' for b in kept[k]):<28}"
            + " / ".join(f"{b / 2**20:.2f}" for b in peak[k])
            for k in kept
        ),
        f"  recompute_activation_ratio {r['recompute_activation_ratio']:.3f}  "
        f"(stage 0, 1f1b kept always / never; target <= {TARGET})",
        f"  recompute_peak_ratio       {r['recompute_peak_ratio']:.3f}  "
        "(the same with the rebuilt micro-batch counted: the memory a step needs at its peak)",
    ]
