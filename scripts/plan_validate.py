"""The planner against the real engine on this machine: predicted and measured samples/s.

Configurations, each a real Bundle run (``scripts/bench.py``'s cases, synthetic data, gloo/CPU, one
thread per process): for ``mlp_wide`` (batch 512) and ``small_resnet`` (batch 64), one process
(shape ``1``), shape ``1,1`` with M = 1, 2, 4, 8, 16 under GPipe and 1F1B (the engine's split:
parameter-balanced for the MLP, ``partitions/small_resnet_2stage.yaml`` for the CNN), and
``--DP-ONLY`` on 2.

Two worlds run them, forked as the benchmark's are: one process for shape ``1``, two for the rest.
Every round, each world first calibrates (``bundle.plan.calibrate``: the engine's overheads on a
tiny model; with two processes the loopback links and the probe pipelines), then runs each
configuration's steps, each step started together on every rank and preceded by a profile pass
of the model at the configuration's rows, on every rank at once (so the profile sees the cores as
busy as a step keeps them, and a burst of load on the shared machine reaches both; of each pass
the slower process's counts, as a synchronous step waits for its slowest process). The planner
predicts each configuration from its round's profile and calibration with the simulator; the
measured step is rank 0's; the predicted and measured throughputs reported are medians over the
rounds.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import bench
import torch
import torch.distributed as dist

from bundle.engine.precision import Policy
from bundle.plan import calibrate as cal
from bundle.plan import profile as prof
from bundle.plan.anatomy import count_anatomy


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
    """What one validation run does: the sizes of ``bench.Sizes`` and the rounds."""

    sizes: bench.Sizes
    configs: tuple[Config, ...]
    rounds: int
    steps: int
    warmup: int
    profile_repeats: int


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


class Profiler:
    """One timed forward and backward of a model's blocks at a case's rows, as ``profile`` does."""

    def __init__(self, sizes: bench.Sizes, c: Config) -> None:
        from bundle import models

        self.shape, _ = model_input(sizes, c.model)
        self.rows = case_rows(sizes, c)
        torch.manual_seed(0)
        model = models.build(c.model, num_classes=bench.NUM_CLASSES, input_shape=self.shape)
        self.model, self.blocks = model, models.blocks(model)
        self.passes: list = []

    def once(self) -> None:
        """One warm pass (after an untimed one), as the micro-batches of a step mostly run."""
        args = (
            self.blocks,
            Policy(),
            torch.device("cpu"),
            self.rows,
            self.shape,
            bench.NUM_CLASSES,
        )
        prof.one_pass(*args)
        self.passes.append(prof.one_pass(*args))

    def record(self) -> dict:
        """The timed passes and the SGD step's cost, for ``slowest_timings``."""
        cpu = torch.device("cpu")
        return {
            "rows": self.rows,
            "passes": [list(p) for p in self.passes],
            "optimizer_per_param": prof.optimizer_per_param(self.model, 1, 3, cpu),
        }


def slowest_timings(records: list[dict]) -> prof.Timings:
    """A profile from every rank's passes: of each pass (taken by all ranks at once) the slower
    rank's, as a synchronous step waits for its slowest process; then the median per block."""
    passes = [
        max(group, key=lambda p: sum(p[0]) + sum(p[1]) + p[2])
        for group in zip(*(r["passes"] for r in records), strict=True)
    ]
    n, med = len(passes[0][0]), statistics.median
    return prof.Timings(
        device=prof.device_name(torch.device("cpu")),
        precision="fp32",
        rows=(records[0]["rows"],),
        fwd=(tuple(med(p[0][i] for p in passes) for i in range(n)),),
        bwd=(tuple(med(p[1][i] for p in passes) for i in range(n)),),
        loss=(med(p[2] for p in passes),),
        optimizer_per_param=records[0]["optimizer_per_param"],
    )


def _calibration(world: int, rank: int, pipeline) -> dict:
    """One process: the engine's overheads on the tiny model; two: the loopback links and the
    busy probe pipeline (``bundle.plan.calibrate``)."""
    if world == 1:
        return cal.measure_engine()
    p2p, collective = cal.measure_links(rank)
    return {"p2p": asdict(p2p), "collective": asdict(collective), "pipelines": pipeline.measure()}


def _sync(world: int) -> None:
    if world > 1:
        dist.barrier()


def world_main(rank: int, world: int, spec: Spec) -> dict:
    """Every round: calibrate, then per configuration alternate a profile pass (every rank at
    once) with a step of the engine; this rank's median step and its passes per configuration."""
    torch.set_num_threads(1)
    mine = [c for c in spec.configs if c.processes == world]
    cases = [
        (
            c,
            bench.bundle_case(c.name, case_config(spec.sizes, c), rank, probe=False),
            Profiler(spec.sizes, c),
        )
        for c in mine
    ]
    pipeline = cal.Pipelines(rank) if world > 1 else None
    rounds = []
    for r in range(spec.rounds):
        record = _calibration(world, rank, pipeline)
        record["cases"] = {}
        for c, case, profiler in cases if r % 2 == 0 else cases[::-1]:
            profiler.passes.clear()
            times = []
            for i in range(spec.warmup + (1 if r == 0 else 0) + spec.steps):
                # The profile and the step meet the same moment of a shared machine; every rank
                # profiles at once, so the profile sees the cores as busy as a step keeps them.
                _sync(world)
                profiler.once()
                _sync(world)
                t0 = time.perf_counter()
                case.step(i)
                times.append(time.perf_counter() - t0)
            warm = len(times) - spec.steps
            del profiler.passes[:warm]
            record["cases"][c.name] = {
                "step": statistics.median(times[warm:]),
                "profile": profiler.record(),
            }
        rounds.append(record)
    return {"rounds": rounds}


def run(spec: Spec) -> tuple[dict, float]:
    """Both worlds (forked from this process, which has run no torch op); (results, seconds)."""
    start = time.perf_counter()
    worlds = sorted({c.processes for c in spec.configs})
    results = {w: bench.run_world(w, world_main, spec, timeout=1800.0) for w in worlds}
    return results, time.perf_counter() - start


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


def _round_calibration(results: dict, r: int):
    """The engine overheads and links measured in round ``r`` (zero where no world measured them)."""
    from bundle.plan.cluster import Link
    from bundle.plan.cost import Overheads

    overheads = Overheads()
    if 1 in results:
        one = results[1][0]["rounds"][r]
        runner = {int(m): t for m, t in one["runner"].items()}
        overheads = cal.fit_engine(prof.Timings(**one["tiny"]), runner, one["copy_bandwidth"])
    p2p = collective = Link(float("inf"), 0.0)
    if 2 in results:
        two = results[2][0]["rounds"][r]
        p2p, collective = Link(**two["p2p"]), Link(**two["collective"])
        overheads = cal.fit_comm_action(overheads, p2p, collective, two["pipelines"])
    return overheads, p2p, collective


def predict(spec: Spec, results: dict) -> dict:
    """Per configuration: predicted and measured samples/s per round, and their medians."""
    from bundle.plan.cost import CostModel, Execution
    from bundle.plan.simulate import Layout, simulate

    anatomies = {}
    for model in {c.model for c in spec.configs}:
        shape, _ = model_input(spec.sizes, model)
        anatomies[model] = count_anatomy(model, shape, bench.NUM_CLASSES)
    rows, calibrations = [], []
    for r in range(spec.rounds):
        overheads, p2p, collective = _round_calibration(results, r)
        calibrations.append(
            {"overheads": asdict(overheads), "p2p": asdict(p2p), "collective": asdict(collective)}
        )
    for c in spec.configs:
        _, batch = model_input(spec.sizes, c.model)
        starts = _starts(spec.sizes, c)
        predicted, measured = [], []
        for r in range(spec.rounds):
            ranks = [rank["rounds"][r]["cases"][c.name] for rank in results[c.processes]]
            overheads, p2p, collective = _round_calibration(results, r)
            cost = CostModel(
                anatomy=anatomies[c.model],
                cluster=cal.loopback(
                    p2p, collective, devices=c.processes, memory_bytes=float("inf")
                ),
                timings=slowest_timings([case["profile"] for case in ranks]),
                overheads=overheads,
                # Gloo on the CPU: the sync takes the backward's cores.
                execution=Execution(overlap=False),
            )
            layout = Layout(c.shape, 1, starts, c.micro, c.schedule, "flat", batch, c.processes)
            predicted.append(batch / simulate(layout, cost).step_time)
            measured.append(batch / ranks[0]["step"])  # rank 0's clock
        pred, meas = statistics.median(predicted), statistics.median(measured)
        rows.append(
            {
                "name": c.name,
                "model": c.model,
                "shape": list(c.shape),
                "micro_batches": c.micro,
                "schedule": c.schedule,
                "batch": batch,
                "predicted_samples_per_s": round(pred, 1),
                "measured_samples_per_s": round(meas, 1),
                "error": round((pred - meas) / meas, 4),
                # the rounds' (max - min) / median: the measurement's own noise, beside its error
                "measured_spread": round((max(measured) - min(measured)) / meas, 4),
                "round_predicted": [round(p, 1) for p in predicted],
                "round_measured": [round(m, 1) for m in measured],
            }
        )
    errors = [abs(row["error"]) for row in rows]
    return {
        "configurations": rows,
        "median_abs_error": round(statistics.median(errors), 4),
        "max_abs_error": round(max(errors), 4),
        "targets": {"median_abs_error": 0.10, "max_abs_error": 0.20},
        "rounds": spec.rounds,
        "calibration": calibrations,
    }


def render(report: dict) -> str:
    lines = [f"{'configuration':<40} {'predicted':>10} {'measured':>10} {'error':>7} {'spread':>7}"]
    for row in report["configurations"]:
        lines.append(
            f"{row['name']:<40} {row['predicted_samples_per_s']:>10.1f} "
            f"{row['measured_samples_per_s']:>10.1f} {row['error']:>+7.1%} "
            f"{row.get('measured_spread', 0.0):>7.1%}"
        )
    lines.append(
        f"median |error| {report['median_abs_error']:.1%} (target <= 10%), "
        f"max |error| {report['max_abs_error']:.1%} (target <= 20%), samples/s"
    )
    return "\n".join(lines)
