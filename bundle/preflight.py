"""Every check made before any process starts (check_all), each failure one typed error naming
the flag: the data, the planner's choices, devices, model and partition, paths and the checkpoint."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch
from torch import nn

from bundle import data, models
from bundle.checkpoint import format as ckpt
from bundle.config import RunConfig, parse_steps
from bundle.data import input_spec, named_inputs
from bundle.engine import aggregate, tensor_parallel
from bundle.engine.precision import DTYPES
from bundle.errors import BundleError, ConfigError, DataError, PartitionError
from bundle.launch import throttle
from bundle.lr_schedule import LRSchedule, needs_epoch_length, past_the_run, spell
from bundle.models.cut import Capture, capture_of, cut
from bundle.models.partition import available_specs
from bundle.runtime import control, devices
from bundle.runtime.preemption import parse_fault, parse_heal_fault
from bundle.topology import Topology


@dataclass(frozen=True)
class LaunchPlan:
    """What passed every check: the config with the planner's choices in place of ``auto``, its
    topology, the checkpoint to resume from (None: fresh), the attempt (torchrun's restarts) and
    the model's graph split, made once here for every process (None: not cut by its graph)."""

    cfg: RunConfig
    topo: Topology
    resume: str | None
    attempt: int
    capture: Capture | None = None


def resolve(cfg: RunConfig) -> RunConfig:
    """The planner's choices for ``--bundle-shape auto`` / ``--partition auto`` (bundle.plan.auto),
    else ``cfg``; a prepared corpus's tokenizer, which checkpoints record (generation reads it).
    The planner is imported only when planning: a third of a second of every other launch."""
    if cfg.data.dataset == "tokens":
        from bundle.data import tokens

        cfg = replace(cfg, data=replace(cfg.data, tokenizer=tokens.tokenizer_of(cfg.data)))
    if cfg.data.streams and not cfg.train.steps:
        raise ConfigError("--dataset", "hf", "is a stream without a length: give --itr STEPS")
    if not cfg.planned:
        return cfg
    from bundle.plan import auto

    return auto.resolve(cfg)


def check_all(
    cfg: RunConfig,
    env: Mapping[str, str],
    *,
    before_resume: Callable[[RunConfig], None] | None = None,
) -> LaunchPlan:
    """Every pre-launch check, once each, in order; the first that fails raises.
    ``before_resume``: what must happen once the run is known good and before its checkpoint is
    chosen (the job's first process takes the save directory and puts right what a killed save
    left there, which may be the newest step)."""
    # Before the planner, which reads the data's sample shape; val/ only for a run that evaluates.
    data.check_data(cfg.data, needs_val=cfg.train.eval)
    cfg = resolve(cfg)
    topo = Topology.from_config(cfg)
    devices.check_devices(cfg, topo)
    check_cpu_shares(cfg, topo)
    shapes, capture = check_pieces(cfg, topo.num_stages)
    check_precision(cfg, devices.resolve_backend(cfg))
    check_fault_tolerance(cfg, devices.resolve_backend(cfg))
    check_lr_schedule(cfg)
    check_paths(cfg)
    check_observed_steps(cfg)
    parse_fault(env)
    parse_heal_fault(env)
    aggregate.parse_fault(env.get(aggregate.BYZANTINE_ENV), topo.num_bundles)
    control.read_secret(env)
    attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0")) if cfg.launch.torchrun else 0
    if before_resume is not None:
        before_resume(cfg)
    return LaunchPlan(cfg, topo, check_resume(cfg, shapes, attempt), attempt, capture)


def check_cpu_shares(cfg: RunConfig, topo: Topology) -> None:
    """A placement's ``cpu`` shares (emulated slower devices) need CPU quota cgroups on this node."""
    backend = devices.torch_backend(devices.resolve_backend(cfg))
    shares = throttle.cpu_shares(topo, range(topo.world_size), backend)
    if not shares or (why := throttle.available()) is None:
        return
    ranks = ", ".join(f"{r}: {s:g}" for r, s in shares.items())
    raise ConfigError(
        "placement cpu", ranks, f"emulating slower devices needs CPU quota cgroups ({why})"
    )


def check_pieces(
    cfg: RunConfig, num_stages: int
) -> tuple[dict[str, tuple[int, ...]], Capture | None]:
    """``check_model`` on the pieces the job cuts: stages x ``--virtual-stages`` chunks."""
    V = cfg.parallel.virtual_stages
    if V == 1:
        return check_model(cfg, num_stages)
    try:
        return check_model(cfg, num_stages * V)
    except PartitionError as exc:
        raise ConfigError(
            "--virtual-stages",
            V,
            f"{num_stages} stages x {V} chunks is {num_stages * V} model pieces: "
            + str(exc).replace("stages", "pieces"),
        ) from None


def check_model(
    cfg: RunConfig, num_stages: int
) -> tuple[dict[str, tuple[int, ...]], Capture | None]:
    """Unknown model or partition is an input error: resolve it on the meta device, no memory.

    Returns the shape of every entry of the model's state dict, and the model's graph split for
    the job's processes (None: not cut by its graph), which then need not capture it again."""
    if not models.is_known(cfg.model.name):
        raise ConfigError(
            "--model",
            cfg.model.name,
            f"choose one of: {', '.join(models.available())}, any torchvision classification "
            "model, a factory package.module:function; "
            f"or one cut by its partitions/ file: {', '.join(available_specs())}",
        )
    if cfg.model.loss:
        models.load_callable(cfg.model.loss, "--loss")
    num_classes, input_shape = input_spec(cfg.data)
    inputs = named_inputs(cfg.data)
    if cfg.model.pretrained:  # its files, from their headers: refused before anything is built
        models.pretrained.read(cfg.model.pretrained)
    try:
        model = models.meta_model(cfg.model, num_classes, input_shape)
    except BundleError:
        raise
    except Exception as exc:  # noqa: BLE001 - a model's constructor refused the data: one line
        raise _unbuildable(cfg, num_classes, input_shape, exc) from None
    _check_input_kind(cfg, model)
    with torch.device("meta"):
        if cfg.model.weights:
            note = models.load_weights(
                model, cfg.model.weights, strict=cfg.model.weights_strict, check_only=True
            )
            if note:
                print(f"main.py: note: {note}", file=sys.stderr)
        if cfg.model.pretrained:
            note = models.pretrained.check(
                model, cfg.model.pretrained, strict=cfg.model.weights_strict
            )
            if note:
                print(f"main.py: note: {note}", file=sys.stderr)
        adapted = models.adapt(model, cfg.model, seed=cfg.train.seed)
        at_modules = max(cfg.parallel.tp_degrees, default=1) > 1
        pieces = cut(
            model, cfg.model, num_stages, input_shape, inputs=inputs, at_modules=at_modules
        )
        tensor_parallel.check(model, pieces, cfg.parallel.tp_degrees)
    if cfg.compute.channels_last and not any(isinstance(m, nn.Conv2d) for m in model.modules()):
        raise ConfigError(
            "--channels-last with --model",
            cfg.model.name,
            "needs a CNN (a model with 2-d convolutions)",
        )
    # A LoRA run's checkpoints hold what trains and the buffers; the frozen base is read again.
    frozen = models.lora.frozen_names(model) if adapted is not None else set()
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in frozen}
    return shapes, capture_of(pieces, cfg.model, input_shape, inputs)


def _unbuildable(
    cfg: RunConfig, num_classes: int, input_shape: tuple[int, ...], exc: Exception
) -> ConfigError:
    """A model whose constructor fails on the data's shape (a CNN given token ids): the flag
    that chose the data, the shape, and the constructor's own reason, in one line."""
    text = str(exc).strip()
    reason = f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
    if cfg.data.dataset == "text":
        return ConfigError(
            "--dataset",
            "text",
            f"gives token ids (input shape {input_shape}), for which --model {cfg.model.name} "
            f"cannot be built ({reason}); train a language model on text, e.g. --model gpt",
        )
    return ConfigError(
        "--model",
        cfg.model.name,
        f"cannot be built for --dataset {cfg.data.dataset} (input shape {input_shape}, "
        f"{num_classes} classes): {reason}",
    )


def _check_input_kind(cfg: RunConfig, model: nn.Module) -> None:
    """Token ids for a model that takes them, and only for one (the shipped datasets)."""
    if cfg.data.dataset not in ("digits", "synthetic", "imagefolder", "text"):
        return  # a user's dataset: its samples are what its model takes
    takes_tokens = models.input_dtype(model) == torch.long
    if takes_tokens and cfg.data.dataset != "text":
        raise ConfigError(
            "--model", cfg.model.name, "takes token ids: give it --dataset text --data-file FILE"
        )
    if cfg.data.dataset == "text" and not takes_tokens:
        raise ConfigError(
            "--dataset",
            "text",
            f"gives token ids, which --model {cfg.model.name} does not take (its first layer "
            "is no nn.Embedding and it declares no input_dtype = torch.long)",
        )


# Turns --fault-tolerance bundle off on NCCL (``0``): a site whose GPUs or NCCL release misbehave
# when a peer is lost keeps ``restart`` (docs/fault-tolerance.md says what was measured where).
NCCL_FT_ENV = "BUNDLE_NCCL_FT"


def check_fault_tolerance(
    cfg: RunConfig, backend: str, environ: Mapping[str, str] = os.environ
) -> None:
    """--fault-tolerance bundle on NCCL is refused where it is turned off (``environ``)."""
    if cfg.launch.fault_tolerance != "bundle" or backend != "nccl":
        return
    if environ.get(NCCL_FT_ENV) == "0":
        raise ConfigError(
            "--fault-tolerance",
            "bundle",
            f"is turned off on NCCL here ({NCCL_FT_ENV}=0): use --fault-tolerance restart, "
            "or --backend gloo (docs/fault-tolerance.md)",
        )


def check_precision(cfg: RunConfig, backend: str) -> None:
    """bf16/fp16 must run on the devices the backend trains on: tried on one small op here."""
    precision = cfg.compute.precision
    if precision == "fp32":
        return
    dtype = DTYPES[precision]
    if backend == "nccl":
        if precision == "bf16" and not torch.cuda.is_bf16_supported():
            raise ConfigError("--precision", precision, "this GPU has no bf16; use fp16")
        return
    try:
        with torch.autocast("cpu", dtype=dtype):
            out = nn.functional.conv2d(torch.ones(1, 2, 3, 3), torch.ones(2, 2, 1, 1))
        if out.dtype != dtype:
            raise RuntimeError(f"autocast computed in {out.dtype}")
    except RuntimeError as exc:
        raise ConfigError(
            "--precision", precision, f"the CPU (gloo backend) cannot run it ({exc}); use fp32"
        ) from exc


def check_lr_schedule(cfg: RunConfig) -> None:
    """A warm-up in epochs against a run in steps, or the other way round, must end inside the
    run (in one unit, TrainConfig has checked it already). Milestones the run ends before are
    dropped, in one note: they change no step's rate, so a short run of a recipe just runs."""
    train = cfg.train
    if needs_epoch_length(train):
        batch = train.batch_size
        # A stream's one epoch is the run (bundle.data.epoch_steps).
        n = train.steps * batch if cfg.data.streams else data.train_size(cfg.data)
        spe = data.steps_per_epoch(n, batch)
        if spe == 0:
            raise DataError(f"the training set has {n} samples, fewer than one batch of {batch}")
        total = train.steps or train.epochs * spe
        LRSchedule.of(train, steps_per_epoch=spe, total=total)
    else:  # the run and its milestones count in one unit: compare in it (an epoch as a step)
        spe, total = 1, train.steps or train.epochs
    late = past_the_run(train, steps_per_epoch=spe, total=total)
    if late:
        run = f"--itr {train.steps}" if train.steps else f"--epochs {train.epochs}"
        which = f"milestones {spell(late)} come" if len(late) > 1 else f"milestone {late[0]} comes"
        print(
            f"main.py: note: --lr-steps {spell(train.lr_steps)}: {which} at or after the end of "
            f"the run ({run}): dropped",
            file=sys.stderr,
        )


def check_paths(cfg: RunConfig) -> None:
    """Every directory the run writes to exists (created if missing) and takes a file."""
    dirs = [("--save-dir", cfg.checkpoint.save_dir), ("--tensorboard", cfg.observe.tensorboard)]
    if cfg.observe.profile_steps:
        dirs.append(("--profile-dir", cfg.observe.profile_dir))
    files = (
        ("--checkpoint", cfg.train.checkpoint),
        ("--metrics-out", cfg.metrics_out),
        ("--trace", cfg.observe.trace),
    )
    for flag, path in files:
        if path:
            dirs.append((flag, os.path.dirname(os.path.abspath(path))))
    for flag, directory in dirs:
        if not directory:
            continue
        try:
            os.makedirs(directory, exist_ok=True)
            with tempfile.TemporaryFile(dir=directory):
                pass
        except OSError as exc:
            raise ConfigError(
                flag, directory, f"must be a writable directory ({exc.strerror})"
            ) from exc


def check_observed_steps(cfg: RunConfig) -> None:
    """Traced or profiled steps lie inside a run of ``--itr`` steps (epochs are counted later)."""
    steps = cfg.train.steps
    for flag, text in (
        ("--trace-steps", cfg.observe.trace_steps),
        ("--profile-steps", cfg.observe.profile_steps),
    ):
        span = parse_steps(flag, text)
        if steps and span and span[1] > steps:
            raise ConfigError(flag, text, f"goes beyond the run's {steps} steps (--itr)")


def check_resume(cfg: RunConfig, shapes: dict, attempt: int) -> str | None:
    """The checkpoint this run starts from (None: fresh), refused before start if it does not fit."""
    ck = cfg.checkpoint
    # A restarted attempt (torchrun's restarts) resumes from the newest checkpoint.
    resume = "auto" if attempt > 0 and ck.save_dir else ck.resume
    path, notes = ckpt.resolve(resume, ck.save_dir)
    for note in notes:
        print(f"main.py: note: {note}", file=sys.stderr)
    if path is None:
        return None
    info = ckpt.check_fits(path, cfg.model.name, shapes)
    for note in data.check_resume(cfg.data, info):
        print(f"main.py: note: {note}", file=sys.stderr)
    # Training settings may change on resume; say which did.
    for key, value in ckpt.run_settings(cfg).items():
        # (A setting older checkpoints did not record is not reported.)
        if key in info and info[key] != value:
            print(
                f"main.py: note: resuming with --{key.replace('_', '-')} {value} "
                f"(the checkpoint was written with {info.get(key)})",
                file=sys.stderr,
            )
    return path
