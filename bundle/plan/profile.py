"""Per-block timings of a model, measured on the local device, and the cache of profiles.

Timings are measured on the local device: per block, forward and backward seconds at a grid of
row counts (warm-up, then the median of repeats), the loss's, and an SGD step's per parameter.
Between grid points a time is interpolated linearly in rows.

A ``--lora`` model is timed as it trains (``ModelSpec.build``): its frozen layers compute their
inputs' gradients only, and the optimizer step is timed on what trains.

A model's timings at a tensor-parallel degree are of one process's part of it, its planned
layers split (``split_for_timing``): what the planner charges a stage at that degree on this
machine (``bundle.plan.tensor``).

Timings and anatomies (``bundle.plan.anatomy``) are cached as JSON under a cache directory
(``bundle.plan.cache``), keyed by (model, input, classes, LoRA) for the anatomy and additionally
by (device, dtype, threads, grid, tensor-parallel degree) for timings.
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TextIO

import numpy as np
import torch
import torch.nn.functional as F

from bundle import models
from bundle.engine.precision import Policy
from bundle.plan.anatomy import Anatomy, BlockAnatomy, Linear, count
from bundle.plan.anatomy import ModelSpec as ModelSpec
from bundle.plan.cache import NOT_CACHED as NOT_CACHED
from bundle.plan.cache import ProfileCache
from bundle.plan.cache import default_cache_dir as default_cache_dir
from bundle.plan.conditions import Conditions, Watch


@dataclass(frozen=True)
class Timings:
    """Seconds measured on one device at a grid of row counts; interpolated in between."""

    device: str
    precision: str
    rows: tuple[int, ...]
    fwd: tuple[tuple[float, ...], ...]  # [grid point][block]
    bwd: tuple[tuple[float, ...], ...]
    loss: tuple[float, ...]  # forward + backward of the loss at each grid point
    optimizer_per_param: float  # one SGD-with-momentum step, seconds per parameter

    def at(self, rows: float) -> tuple[np.ndarray, np.ndarray, float]:
        """(forward per block, backward per block, loss) at ``rows`` rows."""
        grid = np.asarray(self.rows, dtype=float)
        fwd, bwd, loss = np.asarray(self.fwd), np.asarray(self.bwd), np.asarray(self.loss)
        if len(grid) == 1:
            scale = rows / grid[0]
            return fwd[0] * scale, bwd[0] * scale, float(loss[0] * scale)
        # Linear between grid points; beyond the grid, the nearest segment's slope (never < 0).
        i = int(np.clip(np.searchsorted(grid, rows) - 1, 0, len(grid) - 2))
        w = (rows - grid[i]) / (grid[i + 1] - grid[i])
        mix = lambda a: np.maximum(a[i] + w * (a[i + 1] - a[i]), 0.0)  # noqa: E731
        return mix(fwd), mix(bwd), float(mix(loss))


# -- timings, on the local device ------------------------------------------------------------


def device_name(device: torch.device) -> str:
    """What a measured profile is valid for: the device model and, on a CPU, the thread count."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"cpu:{model}:{torch.get_num_threads()} thread(s)"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Progress:
    """Lines on stderr while a profile runs long: none in its first ``quiet_s`` seconds, then one
    at most every ``every_s``. It is asked per block (``tick``), so one slow pass is reported too;
    a tick that says nothing costs one clock reading."""

    def __init__(
        self,
        what: str,
        *,
        quiet_s: float = 3.0,
        every_s: float = 2.0,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.every_s, self.stream, self.clock = what, every_s, stream, clock
        self.start = clock()
        self.next = self.start + quiet_s
        self.at = ""  # the grid point and pass under way, set by the caller
        self.said = False

    def _say(self, line: str) -> None:
        print(f"{self.what}: {line}", file=self.stream or sys.stderr, flush=True)

    def tick(self, phase: str, block: int, blocks: int) -> None:
        now = self.clock()
        if now < self.next:
            return
        self.next = now + self.every_s
        self.said = True
        self._say(f"{self.at}, {phase} block {block}/{blocks}; {now - self.start:.0f}s so far")

    def done(self) -> None:
        if self.said:
            self._say(f"done in {self.clock() - self.start:.0f}s")


def measure_timings(
    spec: ModelSpec,
    *,
    rows: tuple[int, ...],
    precision: str = "fp32",
    device: torch.device | None = None,
    passes: tuple[int, int] = (2, 5),
    progress: Progress | None = None,
    watch: Watch | None = None,
    tp_degree: int = 1,
) -> Timings:
    """Forward and backward seconds of every block of ``spec``'s model at each row count: of
    ``passes`` (warm-up, timed), the median of the timed. At ``tp_degree`` > 1, of one
    process's part of the model split by its tensor-parallel plan (``split_for_timing``): the
    split layers' own work, without their sums.

    A profile that takes more than a few seconds says how far it is on stderr (``Progress``).
    ``watch`` is told the spread of each grid point's repetitions (``bundle.plan.conditions``).
    """
    device = device or torch.device("cpu")
    split = f" split {tp_degree} ways" if tp_degree > 1 else ""
    progress = progress or Progress(f"profiling {spec.name}{split} on {device.type}")
    policy = Policy(precision=precision, device_type=device.type)
    input_shape, num_classes = spec.input_shape, spec.num_classes
    torch.manual_seed(0)
    model = split_for_timing(spec.build(), tp_degree).to(device)
    blocks = models.blocks(model, input_shape)
    dtype = models.input_dtype(model)
    fwd_grid, bwd_grid, loss_grid = [], [], []
    warmup, repeats = passes
    total = warmup + repeats
    for k, r in enumerate(rows, 1):
        runs = []
        for j in range(total):
            progress.at = f"{r} rows (grid point {k}/{len(rows)}), pass {j + 1}/{total}"
            runs.append(
                one_pass(
                    blocks,
                    policy,
                    device,
                    r,
                    input_shape,
                    num_classes,
                    tick=progress.tick,
                    dtype=dtype,
                )  # fmt: skip
            )
        timed = runs[warmup:]
        if watch is not None:
            watch.repeats([sum(t[0]) + sum(t[1]) + t[2] for t in timed])
        fwd_grid.append(
            tuple(statistics.median(t[0][i] for t in timed) for i in range(len(blocks)))
        )
        bwd_grid.append(
            tuple(statistics.median(t[1][i] for t in timed) for i in range(len(blocks)))
        )
        loss_grid.append(statistics.median(t[2] for t in timed))
    found = Timings(
        device=device_name(device),
        precision=precision,
        rows=tuple(rows),
        fwd=tuple(fwd_grid),
        bwd=tuple(bwd_grid),
        loss=tuple(loss_grid),
        optimizer_per_param=optimizer_per_param(model, warmup, repeats, device),
    )
    progress.done()
    return found


def one_pass(
    blocks,
    policy: Policy,
    device,
    rows: int,
    input_shape,
    num_classes: int,
    *,
    tick: Callable[[str, int, int], None] | None = None,
    dtype: torch.dtype = torch.float32,
):
    """One forward and one backward through every block, as a stage runs them, timed per block.

    Forward: a clock reading between blocks. Backward: one ``backward`` call (a stage makes one
    per micro-batch), and a hook on each block's input gradient reads the clock as backward leaves
    that block; a block whose input needs no gradient ends when backward returns. ``tick(phase,
    block, blocks)`` is called after each block's clock reading (``Progress.tick``).
    """
    tick = tick or (lambda phase, block, blocks: None)
    x: tuple[torch.Tensor, ...] = (
        torch.randint(0, num_classes, (rows, *input_shape), device=device)
        if dtype == torch.long
        else torch.randn(rows, *input_shape, device=device),
    )
    n = len(blocks)
    fwd, left = [], [0.0] * (n + 1)  # left[i]: when backward has finished block i (and all after)

    def stamp(i: int):
        def hook(grad: torch.Tensor) -> None:
            _sync(device)
            left[i] = max(left[i], time.perf_counter())
            tick("backward", i, n)

        return hook

    with policy.autocast():
        for i, (_, block) in enumerate(blocks):
            _sync(device)
            t0 = time.perf_counter()
            out = block(*x)
            _sync(device)
            fwd.append(time.perf_counter() - t0)
            tick("forward", i + 1, n)
            x = out if isinstance(out, tuple) else (out,)
            # Hooks go on outside the clock: the engine's forward registers none.
            for t in x if i + 1 < n else ():
                if t.requires_grad:
                    t.register_hook(stamp(i + 1))
    logits = x[0].float()
    logits.register_hook(stamp(n))
    labels = torch.randint(0, num_classes, logits.shape[:-1], device=device)
    t0 = time.perf_counter()
    loss = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="sum")
    loss_fwd = time.perf_counter() - t0
    _sync(device)
    start = time.perf_counter()
    loss.backward()
    _sync(device)
    end = time.perf_counter()
    # A boundary whose tensors need no gradient was never stamped: backward ended there.
    marks = [end if m == 0.0 else m for m in left[:n]] + [left[n] or start]
    bwd = [max(marks[i] - marks[i + 1], 0.0) for i in range(n)]
    return fwd, bwd, loss_fwd + (marks[n] - start)


class Passes:
    """Warm forward and backward passes of ``model``'s blocks at ``rows`` rows, each timed per
    block as ``measure_timings`` times them, after an untimed one (a step's later micro-batches
    run with the weights in cache): what the calibration's probes and the validation time
    between their steps. ``timings`` is the median per block of the passes so far."""

    def __init__(
        self, model: torch.nn.Module, input_shape, num_classes: int, rows: int, device=None
    ) -> None:
        self.model, self.rows = model, rows
        self.device = device or torch.device("cpu")
        blocks = models.blocks(model, input_shape)
        self._args = (blocks, Policy(), self.device, rows, input_shape, num_classes)
        self._dtype = models.input_dtype(model)
        self.passes: list = []  # (forward per block, backward per block, loss) each

    def __call__(self) -> float:
        """Time one warm pass; its seconds in all."""
        one_pass(*self._args, dtype=self._dtype)
        fwd, bwd, loss = one_pass(*self._args, dtype=self._dtype)
        self.passes.append((fwd, bwd, loss))
        return sum(fwd) + sum(bwd) + loss

    def timings(self) -> Timings:
        """The median per block of the passes so far, with the model's optimizer step."""
        n, med = len(self.passes[0][0]), statistics.median
        return Timings(
            device=device_name(self.device),
            precision="fp32",
            rows=(self.rows,),
            fwd=(tuple(med(p[0][i] for p in self.passes) for i in range(n)),),
            bwd=(tuple(med(p[1][i] for p in self.passes) for i in range(n)),),
            loss=(med(p[2] for p in self.passes),),
            optimizer_per_param=optimizer_per_param(self.model, 2, 5, self.device),
        )


def optimizer_per_param(model: torch.nn.Module, warmup: int, repeats: int, device) -> float:
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    times = []
    for _ in range(warmup + repeats):
        _sync(device)
        t0 = time.perf_counter()
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:]) / max(1, sum(p.numel() for p in params))


def row_grid(max_rows: int) -> tuple[int, ...]:
    """Powers of two from 2 up to ``max_rows``, and ``max_rows`` itself: a model with batch
    normalisation after global pooling cannot train on one row (1 row is extrapolated)."""
    grid, r = [], min(2, max_rows)
    while r < max_rows:
        grid.append(r)
        r *= 2
    return (*grid, max_rows)


# -- through the cache (bundle.plan.cache) ----------------------------------------------------


def _anatomy_from(doc: dict) -> Anatomy:
    blocks = tuple(
        BlockAnatomy(
            name=b["name"],
            params=b["params"],
            out_elems=tuple(b["out_elems"]),
            out_other_bytes=b["out_other_bytes"],
            saved=Linear(**b["saved"]),
            saved_shared=Linear(**b["saved_shared"]),
            fwd_ops=tuple(tuple(o) for o in b["fwd_ops"]),
            bwd_ops=tuple(tuple(o) for o in b["bwd_ops"]),
            param_shapes=tuple(tuple(s) for s in b.get("param_shapes", ())),
            frozen=b.get("frozen", 0),
        )
        for b in doc["blocks"]
    )
    return Anatomy(doc["model"], tuple(doc["input_shape"]), doc["num_classes"], blocks)


def _trains(spec: ModelSpec) -> dict[str, str | None]:
    """What of the model trains, in a cache key: nothing for a model trained whole (the keys of
    entries made before ``--lora`` stay as they were)."""
    return {"lora": spec.lora, "lora_train": spec.lora_train} if spec.lora is not None else {}


def anatomy(spec: ModelSpec, cache: ProfileCache) -> Anatomy:
    """The model's anatomy, from the cache or counted now (well under a second)."""
    key = {
        "model": spec.name,
        "model_args": spec.args,
        "input": list(spec.input_shape),
        "classes": spec.num_classes,
        "torch": torch.__version__,
        "shapes": True,  # entries from before parameter shapes were counted are counted again
        **_trains(spec),
    }
    doc = cache.get("anatomy", key)
    if doc is None:
        found = count(spec)
        cache.put("anatomy", key, asdict(found))
        return found
    return _anatomy_from(doc)


def split_for_timing(model: torch.nn.Module, degree: int) -> torch.nn.Module:
    """``model`` as process 0 of a tensor-parallel group of ``degree`` holds it
    (``bundle.models.tp``), its layers' sums skipped: what each process computes between them."""
    if degree > 1:
        from bundle.models import tp

        tp.apply(model, tp.plan_of(model), rank=0, size=degree, all_reduce=_no_sum)
    return model


def _no_sum(_: torch.Tensor) -> None:
    """The sum of a split layer's output, not taken: its time is costed apart (``plan.tensor``)."""


def timings(
    spec: ModelSpec,
    cache: ProfileCache,
    *,
    rows: tuple[int, ...],
    precision: str = "fp32",
    device: torch.device | None = None,
    repeats: int = 5,
    tp_degree: int = 1,
) -> Timings:
    """Measured timings, from the cache when this device, dtype, thread count and grid were seen
    (and the tensor-parallel degree split for, ``measure_timings``)."""
    device = device or torch.device("cpu")
    key = {
        "model": spec.name,
        "model_args": spec.args,
        "input": list(spec.input_shape),
        "classes": spec.num_classes,
        "device": device_name(device),
        "precision": precision,
        "rows": list(rows),
        "torch": torch.__version__,
        **_trains(spec),
        **({"tensor_parallel": tp_degree} if tp_degree > 1 else {}),
    }
    doc = cache.get("timings", key)
    if doc is not None:
        return Timings(
            device=doc["device"],
            precision=doc["precision"],
            rows=tuple(doc["rows"]),
            fwd=tuple(tuple(r) for r in doc["fwd"]),
            bwd=tuple(tuple(r) for r in doc["bwd"]),
            loss=tuple(doc["loss"]),
            optimizer_per_param=doc["optimizer_per_param"],
        )
    with Watch() as watch:
        found = measure_timings(
            spec,
            rows=rows,
            precision=precision,
            device=device,
            passes=(2, repeats),
            watch=watch,
            tp_degree=tp_degree,
        )
    cache.put("timings", key, asdict(found), watched(watch, device))
    return found


def watched(watch: Watch, device: torch.device) -> Conditions:
    """The conditions ``watch`` saw, for a measurement on ``device`` in this process."""
    return watch.conditions(device_name(device), torch.get_num_threads(), torch.__version__)
