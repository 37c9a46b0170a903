"""The engine's own overheads and this machine's loopback links, measured once and cached.

- ``compute_action`` and ``step``: the engine's ``StageEngine`` runs a tiny model as one stage in
  this process at 1 and 16 micro-batches of one row; what its steps take beyond the model's own
  forward and backward (as ``profile`` measures them) is the overhead per compute action and per
  step.
- ``messages`` and ``collective``: two gloo processes time a ping-pong over a grid of sizes
  (``bundle.plan.messages``: each message's call on either side and its one-way time) and an
  all-reduce at a small and a large size (latency from the small one, bandwidth from the large
  one). ``p2p`` and the calls are the messages fitted at the busy probe's boundary;
  ``for_boundary`` fits them at a plan's own.
- ``comm_action``: the same two processes run a small MLP as a ``1,1`` pipeline at 16
  micro-batches of 64 rows under each schedule, both cores busy about a millisecond per stage and
  micro-batch; the engine's own cost per send and receive action, beyond the calls the messages
  measured, is what makes the simulator, given the links, the calls, the compute overheads and
  the MLP's profile (timed between the steps), match those steps. On a shared CPU it is far from
  free: a gloo call waits for gloo's own threads, which wait for a core.
- ``tp_sum``: the same two processes run a small GPT at tensor-parallel degree 2
  (``bundle.plan.calibrate_tp``): the cost of each of its sums inside a step, beyond the
  all-reduce.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist

from bundle import models
from bundle.config import DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from bundle.engine.grad_sync import GradSync
from bundle.engine.parts import Chunk, EngineParts, StepOptions
from bundle.engine.stage import split_model
from bundle.engine.stage_engine import StageEngine
from bundle.engine.transport import Boundaries, Transport
from bundle.ir.schedule import ONE_CHUNK
from bundle.launch import localworld
from bundle.plan import calibrate_tp, messages
from bundle.plan import profile as prof
from bundle.plan.anatomy import count_anatomy
from bundle.plan.cluster import Cluster, Link
from bundle.plan.conditions import Watch
from bundle.plan.cost import CostModel, Overheads
from bundle.plan.simulate import Layout, simulate
from bundle.topology import Coord, Topology


@dataclass(frozen=True)
class Probe:
    """A model the calibration runs: its input, its rows per micro-batch, its micro-batch counts."""

    model: str
    input_shape: tuple[int, int, int]
    classes: int
    rows: int
    micro: tuple[int, ...]


TINY = Probe("mlp", (3, 2, 2), 10, 1, (1, 16))  # compute far below the overheads
BUSY = Probe("mlp", (3, 16, 16), 10, 64, (16,))  # about 1 ms per stage and micro-batch
MICRO = TINY.micro
_SMALL, _LARGE = 4, 8 * 2**20  # bytes of the latency and the bandwidth probes
_FITTED = ("comm_action", "tp_sum")  # what the busy probes fit (cached with the links)
_CPU = torch.device("cpu")


@dataclass(frozen=True)
class Calibration:
    overheads: Overheads
    p2p: Link
    collective: Link
    points: tuple[messages.Point, ...] = ()  # the ping-pong's (bundle.plan.messages)

    def for_boundary(self, sizes: tuple[float, float] | None) -> Calibration:
        """The messages fitted at ``sizes`` (fewest, most bytes of a message; None: as measured
        at the busy probe's): the point-to-point link and each side's call."""
        if sizes is None or not self.points:
            return self
        cost = messages.fit(self.points, *sizes)
        return replace(self, overheads=cost.overheads(self.overheads), p2p=cost.link)


def probe_passes(probe: Probe) -> prof.Passes:
    """Timed passes of a probe model's blocks: what the engine's steps on it are compared with."""
    torch.manual_seed(0)
    model = models.build(probe.model, num_classes=probe.classes, input_shape=probe.input_shape)
    return prof.Passes(model, probe.input_shape, probe.classes, probe.rows, _CPU)


def interleaved(steps: dict, tiny: prof.Passes, reps: int, warmup: int, barrier=None) -> dict:
    """Per micro-batch count, step times taken alternately with tiny profile passes (so a burst
    of load on a shared machine reaches both); ``barrier`` starts every step together."""
    times: dict[int, list[float]] = {m: [] for m in steps}
    for i in range(warmup + reps):
        tiny()
        for m, step in steps.items():
            if barrier is not None:
                barrier()
            t0 = time.perf_counter()
            step(i)
            times[m].append(time.perf_counter() - t0)
    del tiny.passes[:warmup]
    return {m: t[warmup:] for m, t in times.items()}


# -- one process -----------------------------------------------------------------------------


class TinyStage:
    """The engine's StageEngine on the tiny model as one stage, at each of ``MICRO`` (no peers)."""

    def __init__(self) -> None:
        name, shape, classes = TINY.model, TINY.input_shape, TINY.classes
        self.steps = {}
        for m in MICRO:
            torch.manual_seed(0)
            model = models.build(name, num_classes=classes, input_shape=shape)
            stage = split_model(model, (0,))[0]
            topo = Topology(
                shape=(1,), num_bundles=1, procs_per_node=1, global_batch=m, micro_batches=m
            )
            coord = Coord(0, 0, 0)
            transport = Transport(
                topo=topo, coord=coord, boundaries=Boundaries(), device=_CPU, timeout=30.0
            )
            runner = StageEngine(
                topo=topo,
                coord=coord,
                parts=EngineParts(
                    chunks=(Chunk(stage, GradSync(stage), transport),),
                    optimizer=torch.optim.SGD(stage.parameters(), lr=1e-3, momentum=0.9),
                ),
                options=StepOptions(schedule="1f1b"),
                device=_CPU,
            )
            data = [(torch.randn(1, *shape), torch.randint(0, classes, (1,))) for _ in range(m)]
            self.steps[m] = lambda i, runner=runner, data=data: runner.train_step(i, data)


def copy_bandwidth(nbytes: int = _LARGE, reps: int = 10) -> float:
    """Bytes per second of one tensor copy of ``nbytes`` on the CPU."""
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[2:])


def measure_engine(reps: int = 40, warmup: int = 5) -> dict:
    """The tiny one-stage runner's steps at each of ``MICRO``, the tiny model's timings, and the
    copy bandwidth."""
    tiny = probe_passes(TINY)
    times = interleaved(TinyStage().steps, tiny, reps, warmup)
    return {
        "runner": {m: statistics.median(t) for m, t in times.items()},
        "tiny": asdict(tiny.timings()),
        "copy_bandwidth": copy_bandwidth(),
    }


def fit_engine(tiny: prof.Timings, runner: dict[int, float], copy: float) -> Overheads:
    """Per compute action and per step: the runner's steps less the model's own work."""
    lo, hi = MICRO
    fwd, bwd, loss = tiny.at(1)
    compute = float(fwd.sum() + bwd.sum()) + loss
    action = max(0.0, ((runner[hi] - runner[lo]) / (hi - lo) - compute) / 2)
    params = sum(b.params for b in count_anatomy(TINY.model, TINY.input_shape, TINY.classes).blocks)
    step = runner[lo] - lo * (compute + 2 * action) - params * tiny.optimizer_per_param
    return Overheads(compute_action=action, step=max(0.0, step), copy_bandwidth=copy)


# -- two processes ---------------------------------------------------------------------------


def _allreduce(nbytes: int, reps: int) -> float:
    buf = torch.zeros(max(1, nbytes // 4))
    times = []
    for _ in range(reps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def measure_links(rank: int, reps: int = 15) -> dict:
    """Between ranks 0 and 1 of gloo (call on both): the ping-pong's points over
    ``messages.GRID`` and the collective link."""
    points = messages.ping_pong(rank)
    # A two-process ring all-reduce: bytes / bandwidth + 2 latencies.
    small, large = _allreduce(_SMALL, reps), _allreduce(_LARGE, reps)
    return {
        "messages": points,
        "collective": asdict(Link(_LARGE / max(large - small, 1e-9), small / 2)),
    }


def busy_boundary() -> tuple[float, float] | None:
    """The bytes of the busy probe's messages (its ``1,1`` split, as ``fit_comm_action`` cuts it)."""
    anatomy = count_anatomy(BUSY.model, BUSY.input_shape, BUSY.classes)
    rows = (BUSY.rows, BUSY.rows)
    return messages.boundary_range(anatomy, rows, cuts=(len(anatomy.blocks) // 2,))


def fitted(overheads: Overheads, measured: dict) -> Calibration:
    """The calibration of one two-process measurement (``_world``'s): the messages fitted at the
    busy probe's boundary, the collective link, and the cost per send and receive action that is
    left (``fit_comm_action``)."""
    points = tuple(measured["messages"])
    at_probe = messages.fit(points, *(busy_boundary() or (1.0, 1.0)))
    collective = Link(**measured["collective"])
    base = at_probe.overheads(overheads)
    found = fit_comm_action(base, at_probe.link, collective, measured["pipelines"])
    if "tensor" in measured:  # the TP probe (validation rounds leave it out)
        pair = loopback(at_probe.link, collective, devices=2, memory_bytes=float("inf"))
        found = calibrate_tp.fit_tp_sum(found, pair, measured["tensor"])
    return Calibration(found, at_probe.link, collective, points)


class Pipelines:
    """The engine running the busy probe as a ``1,1`` pipeline under each schedule; on ranks 0
    and 1."""

    def __init__(self, rank: int) -> None:
        from bundle.session import build_session, train_stream

        probe, (m,) = BUSY, BUSY.micro
        self.steps = {}
        for schedule in ONE_CHUNK:
            cfg = RunConfig(
                parallel=ParallelConfig(shape=(1, 1), micro_batches=m, schedule=schedule),
                model=ModelConfig(name=probe.model),
                data=DataConfig(
                    dataset="synthetic",
                    image_size=probe.input_shape[1],
                    num_classes=probe.classes,
                    synthetic_size=2 * m * probe.rows,
                ),
                train=TrainConfig(batch_size=m * probe.rows, steps=2, eval=False),
            )
            topo = Topology.from_config(cfg)
            session = build_session(cfg, topo, rank, _CPU)
            stream = train_stream(session, topo, cfg.train.seed, cfg.train.steps, 0)
            batches = [next(stream) for _ in range(cfg.train.steps)]
            runner = session.engine
            self.steps[schedule] = lambda i, r=runner, b=batches: r.train_step(i, b[i % len(b)])

    def measure(self, reps: int = 15, warmup: int = 3) -> dict:
        """Steps from a common start per schedule, alternating with the probe's profile passes."""
        passes = probe_passes(BUSY)
        times = interleaved(self.steps, passes, reps, warmup, barrier=dist.barrier)
        return {
            "steps": {s: statistics.median(t) for s, t in times.items()},
            "timings": asdict(passes.timings()),
        }


def fit_comm_action(overheads: Overheads, p2p: Link, collective: Link, measured: dict) -> Overheads:
    """The overheads with the cost per send and receive that makes the simulated busy pipeline
    (mean over the schedules) as slow as ``measured`` (``Pipelines.measure``'s result)."""
    anatomy = count_anatomy(BUSY.model, BUSY.input_shape, BUSY.classes)
    cluster = loopback(p2p, collective, devices=2, memory_bytes=float("inf"))
    timings = prof.Timings(**measured["timings"])
    (m,) = BUSY.micro
    starts = (0, len(anatomy.blocks) // 2)

    def mean_step(comm: float) -> float:
        cost = CostModel(
            anatomy=anatomy,
            cluster=cluster,
            timings=timings,
            overheads=replace(overheads, comm_action=comm),
        )
        steps = [
            simulate(Layout((1, 1), 1, starts, m, s, "flat", m * BUSY.rows, 2), cost).step_time
            for s in measured["steps"]
        ]
        return statistics.mean(steps)

    target = statistics.mean(measured["steps"].values())
    return replace(overheads, comm_action=calibrate_tp.matching(mean_step, target, 0.01))


def loopback(p2p: Link, collective: Link, *, devices: int, memory_bytes: float) -> Cluster:
    """This machine as one node of ``devices`` processes talking gloo over loopback."""
    return Cluster(
        name=f"this machine ({prof.device_name(torch.device('cpu'))})",
        nodes=1,
        devices_per_node=devices,
        device_name="cpu",
        memory_bytes=memory_bytes,
        speed=None,
        intra=p2p,
        inter=p2p,
        collective=collective,
    )


def _world(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return {
        **measure_links(rank),
        "pipelines": Pipelines(rank).measure(),
        "tensor": calibrate_tp.TensorSteps(rank).measure(),
    }


def _key() -> dict:
    return {"device": prof.device_name(torch.device("cpu")), "torch": torch.__version__}


def _links_key() -> dict:
    """The links' entry depends on the ping-pong's sizes and on what is fitted of the busy
    pipelines too (older entries, without them, are measured again)."""
    return {**_key(), "messages": list(messages.GRID), "fitted": list(_FITTED)}


def engine(cache: prof.ProfileCache) -> Overheads:
    """The engine's overheads per compute action and per step: cached, or measured in this
    process now (a second or two)."""
    doc = cache.get("engine", _key())
    if doc is not None:
        return Overheads(**doc)
    with Watch() as watch:
        measured = measure_engine()
    found = fit_engine(
        prof.Timings(**measured["tiny"]), measured["runner"], measured["copy_bandwidth"]
    )
    cache.put("engine", _key(), asdict(found), prof.watched(watch, torch.device("cpu")))
    return found


def calibrate(
    cache: prof.ProfileCache, overheads: Overheads, *, start_method: str = "spawn"
) -> Calibration:
    """The loopback links on top of the engine's ``overheads`` (``engine``): cached, or measured
    now (two processes)."""
    doc = cache.get("links", _links_key())
    if doc is None:
        # Timed in two child processes whose threads contend with each other by design (gloo's
        # I/O threads beside the timing loops): the load as they start is what is judged (each
        # point keeps its own round trips' spread).
        with Watch(sched=lambda: None) as watch:
            world = localworld.run_world(2, _world, timeout=300.0, start_method=start_method)[0]
        seen = prof.watched(watch, torch.device("cpu"))
        found = fitted(overheads, world)
        doc = {
            "messages": list(found.points),
            "collective": world["collective"],
            **{k: getattr(found.overheads, k) for k in _FITTED},
        }
        cache.put("links", _links_key(), doc, seen)
    points = tuple(doc["messages"])
    at_probe = messages.fit(points, *(busy_boundary() or (1.0, 1.0)))
    return Calibration(
        at_probe.overheads(replace(overheads, **{k: doc[k] for k in _FITTED})),
        at_probe.link,
        Link(**doc["collective"]),
        points,
    )
