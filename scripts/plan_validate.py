"""The planner against the real engine on this machine: predicted and measured samples/s.

Configurations, each a real Bundle run (``scripts/bench.py``'s cases, synthetic data, gloo/CPU, one
thread per process): for ``mlp_wide`` (batch 512) and ``small_resnet`` (batch 64), one process
(shape ``1``), shape ``1,1`` with M = 1, 2, 4, 8, 16 under GPipe and 1F1B (the engine's split:
parameter-balanced for the MLP, ``partitions/small_resnet_2stage.yaml`` for the CNN), and
``--DP-ONLY`` on 2.

Two worlds run them, forked as the benchmark's are: one process for shape ``1``, two for the rest.
Every round, each world first calibrates (``bundle.plan.calibrate``: the engine's overheads on a
tiny model; with two processes the loopback links, the ping-pong of ``bundle.plan.messages`` and
the probe pipelines), then runs each configuration still measured, each step started together on
every rank and preceded by a profile pass of the model at the configuration's rows, on every rank
at once (so the profile sees the cores as busy as a step keeps them, and a burst of load on the
shared machine reaches both; of each pass the slower process's counts, as a synchronous step waits
for its slowest process). The measured step of a round is rank 0's median step.

A configuration is measured in ``Spec.rounds`` rounds at least, and then again each round until
the spread of its rounds' steps (``bundle.plan.conditions.spread``: the quartiles' distance over
the median, which leaves the extremes out from five rounds on) is at most ``Spec.spread``, or
``Spec.max_rounds`` rounds have run: its row then says it did not settle. The planner predicts
each configuration from each of its rounds' profile and calibration with the simulator (the
point-to-point messages fitted at the configuration's own boundary sizes); the predicted and
measured throughputs reported are medians over its rounds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import bench
import torch
import torch.distributed as dist

from bundle.plan import calibrate as cal
from bundle.plan import profile as prof
from bundle.plan.anatomy import count_anatomy
from bundle.plan.conditions import spread
from bundle.plan.messages import boundary_range


@dataclass(frozen=True)
class Config:
    model: str
    shape: tuple[int, ...]
    micro: int
    schedule: str

    @property
    def name(self) -> str:
        shape = ",".join(map(str, self.shape))
        return f"{self.model} shape {shape} M={self.micro} {self.schedule}"

    @property
    def processes(self) -> int:
        return sum(self.shape)


@dataclass(frozen=True)
class Spec:
    """What one validation run does: the sizes of ``bench.Sizes`` and the rounds (``rounds`` at
    least, more until a configuration's spread is at most ``spread``, ``max_rounds`` at most)."""

    sizes: bench.Sizes
    configs: tuple[Config, ...]
    rounds: int
    steps: int
    warmup: int
    profile_repeats: int
    max_rounds: int = 0  # 0: ``rounds``
    spread: float = 0.10

    @property
    def most_rounds(self) -> int:
        return max(self.rounds, self.max_rounds)


def full_configs(sizes: bench.Sizes) -> tuple[Config, ...]:
    out = []
    for model in (sizes.mlp_model, "small_resnet"):
        out.append(Config(model, (1,), 1, "1f1b"))
        for m in (1, 2, 4, 8, 16):
            out += [Config(model, (1, 1), m, s) for s in ("gpipe", "1f1b")]
        out.append(Config(model, (2,), 1, "1f1b"))
    return tuple(out)


FULL = Spec(
    sizes=bench.Sizes(),
    configs=full_configs(bench.Sizes()),
    rounds=5,
    steps=6,
    warmup=1,
    profile_repeats=3,
    max_rounds=11,
)
SMOKE_SIZES = bench.PRESETS["smoke"]
SMOKE = Spec(
    sizes=SMOKE_SIZES,
    configs=(
        Config(SMOKE_SIZES.mlp_model, (1,), 1, "1f1b"),
        Config(SMOKE_SIZES.mlp_model, (1, 1), 2, "1f1b"),
    ),
    rounds=1,
    steps=2,
    warmup=1,
    profile_repeats=1,
)


def model_input(sizes: bench.Sizes, model: str) -> tuple[tuple[int, int, int], int]:
    """(input shape, global batch) of a model in ``bench.make_cfg``."""
    cfg = bench.make_cfg(sizes, model, micro=1)
    return (3, cfg.data.image_size, cfg.data.image_size), cfg.train.batch_size


def case_config(sizes: bench.Sizes, c: Config):
    spec = bench.CNN_PARTITION if c.model == "small_resnet" and len(c.shape) > 1 else None
    return bench.make_cfg(
        sizes, c.model, micro=c.micro, shape=c.shape, schedule=c.schedule, spec=spec
    )


def case_rows(sizes: bench.Sizes, c: Config) -> int:
    """Rows one replica holds of one micro-batch (the largest, where they differ)."""
    _, batch = model_input(sizes, c.model)
    return -(-batch // c.micro // max(c.shape))


def profiler(sizes: bench.Sizes, c: Config) -> prof.Passes:
    """Timed forward and backward passes of a case's model at its rows, as ``profile`` does."""
    from bundle import models

    shape, _ = model_input(sizes, c.model)
    torch.manual_seed(0)
    model = models.build(c.model, num_classes=bench.NUM_CLASSES, input_shape=shape)
    return prof.Passes(model, shape, bench.NUM_CLASSES, case_rows(sizes, c))


def profiled(passes: prof.Passes) -> dict:
    """The timed passes and the SGD step's cost, for ``slowest_timings``."""
    return {
        "rows": passes.rows,
        "passes": [list(p) for p in passes.passes],
        "optimizer_per_param": prof.optimizer_per_param(passes.model, 1, 3, passes.device),
    }


def slowest_timings(
    records: list[dict], starts: tuple[int, ...] = (0,), shape: tuple[int, ...] = (1,)
) -> prof.Timings:
    """A profile from every rank's passes (``records`` in rank order: stage by stage), each
    stage's blocks from the ranks that run that stage: of each pass (taken by all ranks at once)
    the stage's slower rank's, as a synchronous step waits for its slowest replica; then the
    median per block. A pipeline's stage is timed on its own process, not on its peer's."""
    n = len(records[0]["passes"][0][0])
    bounds = list(zip(starts, (*starts[1:], n), strict=True))
    fwd: list[list[float]] = [[] for _ in range(n)]
    bwd: list[list[float]] = [[] for _ in range(n)]
    loss: list[float] = []
    for group in zip(*(r["passes"] for r in records), strict=True):
        for s, (lo, hi) in enumerate(bounds):
            last = s == len(bounds) - 1
            first = sum(shape[:s])
            p = max(
                group[first : first + shape[s]],
                key=lambda p: sum(p[0][lo:hi]) + sum(p[1][lo:hi]) + (p[2] if last else 0.0),
            )
            for i in range(lo, hi):
                fwd[i].append(p[0][i])
                bwd[i].append(p[1][i])
            if last:
                loss.append(p[2])
    med = statistics.median
    return prof.Timings(
        device=prof.device_name(torch.device("cpu")),
        precision="fp32",
        rows=(records[0]["rows"],),
        fwd=(tuple(med(t) for t in fwd),),
        bwd=(tuple(med(t) for t in bwd),),
        loss=(med(loss),),
        optimizer_per_param=records[0]["optimizer_per_param"],
    )


def _calibration(world: int, rank: int, pipeline) -> dict:
    """One process: the engine's overheads on the tiny model; two: the loopback links, the
    messages' ping-pong and the busy probe pipeline (``bundle.plan.calibrate``)."""
    if world == 1:
        return cal.measure_engine()
    return {**cal.measure_links(rank), "pipelines": pipeline.measure()}


def _sync(world: int) -> None:
    if world > 1:
        dist.barrier()


def settled(values: Sequence[float], threshold: float, least: int) -> bool:
    """Whether a configuration's rounds are enough: ``least`` of them at least, their spread
    (``conditions.spread``) at most ``threshold``."""
    s = spread(values)
    return len(values) >= least and s is not None and s <= threshold


def repeat(
    measure: Callable[[int, list[str]], dict[str, float]],
    names: Sequence[str],
    spec: Spec,
    agree: Callable[[list[str]], list[str]] = lambda pending: pending,
) -> dict[str, bool]:
    """Rounds of ``measure(round, names still measured) -> {name: its step}`` until every name has
    ``settled`` or ``spec.most_rounds`` rounds ran; whether each settled. ``agree`` makes every
    process go on with the same names (rank 0's)."""
    values: dict[str, list[float]] = {n: [] for n in names}
    pending = list(names)
    for r in range(spec.most_rounds):
        if not pending:
            break
        got = measure(r, pending)
        for n in pending:
            values[n].append(got[n])
        pending = agree([n for n in pending if not settled(values[n], spec.spread, spec.rounds)])
    return {n: settled(v, spec.spread, spec.rounds) for n, v in values.items()}


def _rank0s(world: int, rank: int) -> Callable[[list[str]], list[str]]:
    """Every process of the world goes on with rank 0's names."""

    def agree(pending: list[str]) -> list[str]:
        if world == 1:
            return pending
        box = [pending if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    return agree


def world_main(rank: int, world: int, spec: Spec) -> dict:
    """Rounds of: calibrate, then per configuration still measured alternate a profile pass
    (every rank at once) with a step of the engine; this rank's rounds (each with its median step
    and its passes per configuration measured) and whether each configuration settled."""
    torch.set_num_threads(1)
    mine = [c for c in spec.configs if c.processes == world]
    cases = {
        c.name: (
            bench.bundle_case(c.name, case_config(spec.sizes, c), rank, probe=False),
            profiler(spec.sizes, c),
        )
        for c in mine
    }
    pipeline = cal.Pipelines(rank) if world > 1 else None
    rounds: list[dict] = []

    def measure(r: int, names: list[str]) -> dict[str, float]:
        record = _calibration(world, rank, pipeline)
        record["cases"] = {}
        for name in names if r % 2 == 0 else names[::-1]:
            case, passes = cases[name]
            passes.passes.clear()
            times = []
            for i in range(spec.warmup + (1 if r == 0 else 0) + spec.steps):
                # The profile and the step meet the same moment of a shared machine; every rank
                # profiles at once, so the profile sees the cores as busy as a step keeps them.
                _sync(world)
                passes()
                _sync(world)
                t0 = time.perf_counter()
                case.step(i)
                times.append(time.perf_counter() - t0)
            warm = len(times) - spec.steps
            del passes.passes[:warm]
            step = statistics.median(times[warm:])
            record["cases"][name] = {"step": step, "profile": profiled(passes)}
        rounds.append(record)
        return {n: record["cases"][n]["step"] for n in names}

    done = repeat(measure, list(cases), spec, agree=_rank0s(world, rank))
    return {"rounds": rounds, "settled": done}


def run(spec: Spec) -> tuple[dict, float]:
    """Both worlds (forked from this process, which has run no torch op); (results, seconds)."""
    start = time.perf_counter()
    worlds = sorted({c.processes for c in spec.configs})
    results = {w: bench.run_world(w, world_main, spec, timeout=1800.0) for w in worlds}
    return results, time.perf_counter() - start


def load(report: dict) -> dict:
    """The measurements of a validation's JSON report (``measurements``: per world, its ranks'
    rounds), as ``run`` returns them."""
    if "measurements" not in report:
        raise ValueError("the report holds no measurements (written before they were kept)")
    return {int(world): ranks for world, ranks in report["measurements"].items()}


def _starts(sizes: bench.Sizes, c: Config) -> tuple[int, ...]:
    """The split the engine runs for ``c`` (as ``bundle.engine.stages.build_stages`` resolves it)."""
    from bundle import models
    from bundle.models import partition

    cfg = case_config(sizes, c)
    shape, _ = model_input(sizes, c.model)
    with torch.device("meta"):
        model = models.build(c.model, num_classes=bench.NUM_CLASSES, input_shape=shape)
    spec = partition.load_spec(cfg.model.partition) if cfg.model.partition else None
    return partition.resolve(spec, models.blocks(model), len(c.shape), c.model)


def _at(rounds: list, r: int):
    """Round ``r`` of a world, or its last where it ran fewer (the worlds repeat on their own)."""
    return rounds[min(r, len(rounds) - 1)]


def _round_calibration(results: dict, r: int) -> cal.Calibration:
    """The engine overheads and links measured in round ``r`` (zero where no world measured them;
    a world's last round where it ran fewer), the messages fitted at the busy probe's boundary."""
    from bundle.plan.cluster import Link
    from bundle.plan.cost import Overheads

    overheads = Overheads()
    if 1 in results:
        one = _at(results[1][0]["rounds"], r)
        runner = {int(m): t for m, t in one["runner"].items()}
        overheads = cal.fit_engine(prof.Timings(**one["tiny"]), runner, one["copy_bandwidth"])
    if 2 in results:
        return cal.fitted(overheads, _at(results[2][0]["rounds"], r))
    free = Link(float("inf"), 0.0)
    return cal.Calibration(overheads, free, free)


def _boundary(spec: Spec, c: Config, anatomy, starts: tuple[int, ...]):
    """The bytes of ``c``'s messages (its rows at its cuts); None for one stage."""
    rows = float(case_rows(spec.sizes, c))
    return boundary_range(anatomy, (rows, rows), cuts=starts[1:])


def _predicted(
    spec: Spec, c: Config, results: dict, anatomy, cals: list
) -> tuple[list, list, list]:
    """(rounds, predicted, measured samples/s) of ``c``, over the rounds it was measured in
    (``cals``: each round's calibration)."""
    from bundle.plan.cost import CostModel, Execution
    from bundle.plan.simulate import Layout, simulate

    _, batch = model_input(spec.sizes, c.model)
    starts = _starts(spec.sizes, c)
    sizes = _boundary(spec, c, anatomy, starts)
    mine = results[c.processes]
    rounds = [r for r, rec in enumerate(mine[0]["rounds"]) if c.name in rec["cases"]]
    predicted, measured = [], []
    for r in rounds:
        ranks = [rank["rounds"][r]["cases"][c.name] for rank in mine]
        calib = cals[r].for_boundary(sizes)
        cluster = cal.loopback(
            calib.p2p, calib.collective, devices=c.processes, memory_bytes=float("inf")
        )
        layout = Layout(c.shape, 1, starts, c.micro, c.schedule, "flat", batch, c.processes)
        profiles = [case["profile"] for case in ranks]
        steps = []
        # Each step simulated from the pass just before it on every rank (the load of that
        # moment, rank by rank), the round's prediction their median as its measurement is.
        for k in range(len(profiles[0]["passes"])):
            cost = CostModel(
                anatomy=anatomy,
                cluster=cluster,
                timings=slowest_timings(
                    [{**p, "passes": [p["passes"][k]]} for p in profiles], starts, c.shape
                ),
                overheads=calib.overheads,
                # Gloo on the CPU: the sync takes the backward's cores.
                execution=Execution(overlap=False),
            )
            steps.append(simulate(layout, cost).step_time)
        predicted.append(batch / statistics.median(steps))
        measured.append(batch / ranks[0]["step"])  # rank 0's clock
    return rounds, predicted, measured


def compare(c: Config, batch: int, predicted: list, measured: list, settled: bool) -> dict:
    """One configuration's row: the medians of its rounds, the error, the measurement's spread."""
    pred, meas = statistics.median(predicted), statistics.median(measured)
    return {
        "name": c.name,
        "model": c.model,
        "shape": list(c.shape),
        "micro_batches": c.micro,
        "schedule": c.schedule,
        "batch": batch,
        "predicted_samples_per_s": round(pred, 1),
        "measured_samples_per_s": round(meas, 1),
        "error": round((pred - meas) / meas, 4),
        "rounds": len(measured),
        "settled": settled,
        # the measurement's own noise, beside its error: the quartiles' spread (what settles a
        # row) and the rounds' (max - min) / median
        "measured_spread": None if (s := spread(measured)) is None else round(s, 4),
        "measured_range": round((max(measured) - min(measured)) / meas, 4),
        "round_predicted": [round(p, 1) for p in predicted],
        "round_measured": [round(m, 1) for m in measured],
    }


def predict(spec: Spec, results: dict) -> dict:
    """Per configuration: predicted and measured samples/s per round, and their medians."""
    anatomies = {}
    for model in {c.model for c in spec.configs}:
        shape, _ = model_input(spec.sizes, model)
        anatomies[model] = count_anatomy(model, shape, bench.NUM_CLASSES)
    most = max(len(w[0]["rounds"]) for w in results.values())
    cals = [_round_calibration(results, r) for r in range(most)]  # fitted once a round
    rows = []
    for c in spec.configs:
        _, batch = model_input(spec.sizes, c.model)
        _, predicted, measured = _predicted(spec, c, results, anatomies[c.model], cals)
        done = results[c.processes][0]["settled"][c.name]
        rows.append(compare(c, batch, predicted, measured, done))
    return summarize(rows, spec, [asdict(one) for one in cals])


def summarize(rows: list[dict], spec: Spec, calibrations: list | None = None) -> dict:
    """The rows with the medians and maxima of their errors, and on which side they fall."""
    errors = [abs(row["error"]) for row in rows]
    return {
        "configurations": rows,
        "median_abs_error": round(statistics.median(errors), 4),
        "max_abs_error": round(max(errors), 4),
        "targets": {"median_abs_error": 0.10, "max_abs_error": 0.20},
        # predicted faster than measured / slower: no more than two thirds on one side
        "optimistic": sum(row["error"] > 0 for row in rows),
        "pessimistic": sum(row["error"] < 0 for row in rows),
        "rounds": {"least": spec.rounds, "most": spec.most_rounds, "spread": spec.spread},
        "unsettled": [row["name"] for row in rows if not row["settled"]],
        "calibration": calibrations or [],
    }


def render(report: dict) -> str:
    head = f"{'configuration':<40} {'predicted':>10} {'measured':>10} {'error':>7}"
    lines = [head + f" {'spread':>7} {'rounds':>7}"]
    for row in report["configurations"]:
        spread_ = row.get("measured_spread")
        shown = f"{spread_:>7.1%}" if spread_ is not None else f"{'-':>7}"
        lines.append(
            f"{row['name']:<40} {row['predicted_samples_per_s']:>10.1f} "
            f"{row['measured_samples_per_s']:>10.1f} {row['error']:>+7.1%} {shown} "
            f"{row.get('rounds', 0):>6}{'' if row.get('settled', True) else '*'}"
        )
    lines.append(
        f"median |error| {report['median_abs_error']:.1%} (target <= 10%), "
        f"max |error| {report['max_abs_error']:.1%} (target <= 20%), samples/s; "
        f"{report['optimistic']} of {len(report['configurations'])} predicted faster than "
        f"measured, {report['pessimistic']} slower"
    )
    rounds = report["rounds"]
    if report["unsettled"]:
        lines.append(
            f"* spread above {rounds['spread']:.0%} after {rounds['most']} rounds: "
            f"{len(report['unsettled'])} configuration(s) (compared at their median all the same)"
        )
    return "\n".join(lines)
