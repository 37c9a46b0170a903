"""How a job runs, as frozen, validated sections: its parallel layout and schedule (with
``--bundle-shape``'s spelling), the compute policy, its processes, its checkpoints and what it
records; ``bundle.config`` gathers them, with what is trained, into ``RunConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field

from bundle.config.reach import NODE_LOCAL, NODES_AGREE_IF_SET, RECORDED
from bundle.config.sync import check as check_sync_options
from bundle.errors import ConfigError, ScheduleError, positive
from bundle.ir.schedule import REGISTRY, SCHEDULES, actions

BACKENDS = ("auto", "nccl", "gloo", "nccl-emu")
GRAD_SYNCS = ("flat", "hierarchical")
PRECISIONS = ("fp32", "bf16", "fp16")
RECOMPUTES = ("never", "except-last", "always")
AUTO_SHAPE: tuple[int, ...] = ()  # --bundle-shape auto, until bundle.plan.auto resolves it


def parse_shape(text: str) -> tuple[int, ...]:
    """``"4,2"`` -> ``(4, 2)``; every width a positive integer; ``"auto"`` -> ``AUTO_SHAPE``."""
    if str(text).strip() == "auto":
        return AUTO_SHAPE
    parts = [p.strip() for p in str(text).split(",")]
    if not text or not all(p.isdigit() for p in parts) or any(int(p) < 1 for p in parts):
        raise ConfigError(
            "--bundle-shape",
            text,
            "give stage widths as positive integers separated by commas, e.g. 1,1 or 4,2, or auto",
        )
    return tuple(int(p) for p in parts)


def _text(values: tuple[int, ...]) -> str:
    return ",".join(map(str, values))


def parse_degrees(text: str) -> tuple[int, ...]:
    """``--tensor-parallel``: ``"2"`` -> ``(2,)``, ``"2,1"`` -> ``(2, 1)``; positive integers."""
    parts = [p.strip() for p in str(text).split(",")]
    if str(text).strip() in ("", "1"):
        return ()
    if not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ConfigError(
            "--tensor-parallel", text, "give one positive degree, or one per stage, e.g. 2 or 2,1"
        )
    return tuple(int(p) for p in parts)


def parse_steps(key: str, text: str | None) -> tuple[int, int] | None:
    """``"3:4"`` -> ``(3, 4)``: steps A to B, 1-based and inclusive (``"3"`` is ``3:3``)."""
    if text is None:
        return None
    first, sep, last = str(text).partition(":")
    try:
        a, b = int(first), int(last if sep else first)
    except ValueError:
        raise ConfigError(key, text, "give steps as A:B, e.g. 3:4") from None
    if not 1 <= a <= b:
        raise ConfigError(key, text, "steps A:B need 1 <= A <= B")
    return a, b


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    shape: tuple[int, ...] = (1, 1)
    num_bundles: int = 1
    micro_batches: int = field(default=1, metadata=RECORDED)
    schedule: str = "1f1b"
    # Model chunks per stage (interleaved schedules): the model is cut into stages x V pieces;
    # 0: the schedule's own (2 for the schedules that interleave, else 1).
    virtual_stages: int = 0
    grad_sync: str = "flat"
    bucket_mb: float = 25.0  # gradient bucket size of either sync strategy (DDP's default)
    # The data-parallel side (docs/data-parallel.md): all opt-in, the defaults are exact.
    # 1: optimizer state sharded per stage group; 3: parameters and gradients too (FSDP2)
    zero: int = field(default=0, metadata=RECORDED)
    grad_compression: str = field(default="none", metadata=RECORDED)
    powersgd_rank: int = field(default=4, metadata=RECORDED)
    compression_warmup: int = field(default=10, metadata=RECORDED)  # uncompressed first steps
    bundle_sync: str = field(default="step", metadata=RECORDED)  # step | local:H | diloco:H
    outer_lr: float = field(default=0.7, metadata=RECORDED)  # diloco (DiLoCo's defaults)
    outer_momentum: float = field(default=0.9, metadata=RECORDED)
    aggregate: str = field(default="mean", metadata=RECORDED)  # mean | median | trimmed:K
    # Mixed devices (docs/mixed-devices.md): each replica's share of a micro-batch's rows, per
    # stage ("2:1,1"; "" even), and where each rank runs (a --plan file's placement; () in order).
    row_weights: str = ""
    placement: tuple[tuple[int, int | None, str, float | None], ...] = ()  # node, device, type, cpu
    # Tensor parallelism (docs/tensor-parallel.md): each stage's degree, () or (T,) for all alike;
    # a replica of stage s runs on that many processes, which split its layers' matrices.
    tensor_parallel: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.bucket_mb <= 0:
            raise ConfigError("--bucket-mb", self.bucket_mb, "must be > 0")
        positive("--num-bundle", self.num_bundles)
        positive("--micro-batches", self.micro_batches)
        if self.schedule not in SCHEDULES:
            raise ConfigError("--schedule", self.schedule, f"choose one of: {', '.join(SCHEDULES)}")
        self._check_chunks()
        if self.grad_sync not in GRAD_SYNCS:
            raise ConfigError(
                "--grad-sync", self.grad_sync, f"choose one of: {', '.join(GRAD_SYNCS)}"
            )
        check_sync_options(self)
        self._check_tensor_parallel()

    @property
    def tp_degrees(self) -> tuple[int, ...]:
        """Each stage's tensor-parallel degree (1: none)."""
        t = self.tensor_parallel or (1,)
        return t * len(self.shape) if len(t) == 1 else t

    def _check_tensor_parallel(self) -> None:
        t = self.tensor_parallel
        if not t or t == (1,):
            return
        if self.shape == AUTO_SHAPE:
            raise ConfigError(
                "--tensor-parallel", _text(t), "--bundle-shape auto chooses the degrees itself"
            )
        if len(t) not in (1, len(self.shape)):
            raise ConfigError(
                "--tensor-parallel",
                _text(t),
                f"give one degree, or one per stage of shape {_text(self.shape)}",
            )

    @property
    def loss_on_first(self) -> bool:
        """Whether the model's last piece runs on the first stage (a V placement of chunks)."""
        return REGISTRY[self.schedule].placement == "v"

    def _check_chunks(self) -> None:
        """What --virtual-stages needs: a schedule that interleaves, stages to interleave over,
        micro-batches in whole rounds, and one gradient state per chunk that a checkpoint holds."""
        if self.virtual_stages == 0:
            own = REGISTRY[self.schedule]
            object.__setattr__(self, "virtual_stages", own.fixed_chunks or (2 if own.chunks else 1))
        V = self.virtual_stages
        positive("--virtual-stages", V)
        try:
            REGISTRY[self.schedule].check_chunks(V)
        except ScheduleError as exc:
            raise ConfigError("--virtual-stages", V, str(exc)) from None
        try:  # with the chunks right, what is left to refuse is the number of micro-batches
            if V > 1 and len(self.shape) > 1:
                actions(self.schedule, 0, len(self.shape), self.micro_batches, V)
        except ScheduleError as exc:
            raise ConfigError("--micro-batches", self.micro_batches, str(exc)) from None
        if V == 1:
            return
        if self.shape != AUTO_SHAPE and len(self.shape) < 2:
            raise ConfigError(
                "--virtual-stages", V, "interleaving needs a pipeline of 2 or more stages"
            )
        if self.grad_compression != "none":
            raise ConfigError("--virtual-stages", V, "is not yet combined with --grad-compression")

    @property
    def world_size(self) -> int:
        widths = zip(self.shape, self.tp_degrees, strict=True)
        return sum(w * t for w, t in widths) * self.num_bundles


# torch.compile's backends --compile-backend offers: inductor generates kernels (C++ on the CPU,
# Triton on GPUs); aot_eager traces forward and backward without generating code (a check that a
# model compiles, quickly, not a speed-up).
COMPILE_BACKENDS = ("inductor", "aot_eager")


@dataclass(frozen=True, kw_only=True)
class ComputeConfig:
    """How each stage computes: precision, activation recompute, memory format, TF32."""

    # bf16/fp16: autocast with fp32 master weights and optimizer state
    precision: str = field(default="fp32", metadata=RECORDED)
    # activation checkpointing of each stage's blocks
    recompute: str = field(default="never", metadata=RECORDED)
    channels_last: bool = field(default=False, metadata=RECORDED)
    tf32: bool = True  # CUDA only: fp32 matmuls and convolutions in TF32
    # torch.compile per block (bundle.engine.compiled); not recorded: a checkpoint saved with it
    # resumes without it and the other way round
    compile: bool = False
    compile_backend: str = "inductor"

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(
                "--precision", self.precision, f"choose one of: {', '.join(PRECISIONS)}"
            )
        if self.recompute not in RECOMPUTES:
            raise ConfigError(
                "--recompute", self.recompute, f"choose one of: {', '.join(RECOMPUTES)}"
            )
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ConfigError(
                "--compile-backend",
                self.compile_backend,
                f"choose one of: {', '.join(COMPILE_BACKENDS)}",
            )


# What a failure costs: the whole job restarts, or only the failed bundle leaves.
FAULT_TOLERANCE = ("restart", "bundle")

# The job store's port when --portNum is not given (torchrun's default too).
DEFAULT_PORT = 29500


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    node_rank: int = field(default=0, metadata=NODE_LOCAL)
    num_nodes: int = 1
    nproc_per_node: int = 0  # 0: all processes spread evenly over the nodes
    master_addr: str = "127.0.0.1"
    # None: not given, DEFAULT_PORT; a single-node run then takes a free port if that one is busy
    # (bundle.runtime.store.open_job_store). Nodes that meet at one store agree on its port.
    master_port: int | None = field(default=None, metadata=NODE_LOCAL)
    backend: str = "auto"
    timeout: float = 30.0
    init_timeout: float = 300.0
    torchrun: bool = False
    max_restarts: int = 0
    # "restart": any failure restarts the job; "bundle": a failed bundle leaves, the others train
    # on (docs/fault-tolerance.md), while at least min_bundles remain.
    fault_tolerance: str = "restart"
    min_bundles: int = 1
    share_gpus: bool = False  # testing: several nccl processes per GPU (round-robin)
    emu_eager_bytes: int = 0  # nccl-emu: sends of at most this many bytes need no receiver
    emu_strict: bool = False  # nccl-emu: a process's communicators run one call at a time

    def __post_init__(self) -> None:
        positive("--world-size", self.num_nodes)
        positive("--rank", self.node_rank, 0)
        positive("--nproc-per-node", self.nproc_per_node, 0)
        if self.node_rank >= self.num_nodes:
            raise ConfigError(
                "--rank", self.node_rank, f"must be < --world-size ({self.num_nodes} node(s))"
            )
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise ConfigError("--portNum", self.master_port, "must be a TCP port in 1..65535")
        if self.backend not in BACKENDS:
            raise ConfigError("--backend", self.backend, f"choose one of: {', '.join(BACKENDS)}")
        positive("--nccl-emu-eager-bytes", self.emu_eager_bytes, 0)
        if self.emu_strict and self.backend != "nccl-emu":
            raise ConfigError("--nccl-emu-strict", True, "needs --backend nccl-emu")
        if self.timeout <= 0:
            raise ConfigError("--timeout", self.timeout, "must be > 0 seconds")
        if self.init_timeout <= 0:
            raise ConfigError("--init-timeout", self.init_timeout, "must be > 0 seconds")
        positive("--max-restarts", self.max_restarts, 0)
        if self.fault_tolerance not in FAULT_TOLERANCE:
            raise ConfigError(
                "--fault-tolerance",
                self.fault_tolerance,
                f"choose one of: {', '.join(FAULT_TOLERANCE)}",
            )
        positive("--min-bundles", self.min_bundles)
        if self.torchrun and self.max_restarts:
            raise ConfigError(
                "--max-restarts",
                self.max_restarts,
                "under torchrun, restarts are torchrun's: torchrun --max-restarts N ... main.py "
                "--save-dir DIR --resume auto",
            )


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Resumable checkpoints: where, how often, how many, and where to resume from."""

    # Paths may differ between nodes (mount points); the checkpoint each node resumes from is
    # compared by step when training starts.
    save_dir: str | None = field(default=None, metadata=NODE_LOCAL)
    save_every: int = 0  # 0: at the end of every epoch
    keep: int = 3
    # "auto", a step-N directory, or None: start fresh
    resume: str | None = field(default=None, metadata=NODE_LOCAL)
    async_save: bool = False

    def __post_init__(self) -> None:
        positive("--save-every", self.save_every, 0)
        positive("--keep", self.keep)
        if self.resume == "auto" and not self.save_dir:
            raise ConfigError(
                "--resume", "auto", "needs --save-dir (where to look for checkpoints)"
            )


@dataclass(frozen=True, kw_only=True)
class ObserveConfig:
    """What a run records beyond its progress lines: trace, kernel profile, TensorBoard."""

    # A Chrome/Perfetto trace of every rank: whether to trace must agree (every rank records and
    # sends its slices); where to write is rank 0's business, as is where TensorBoard and
    # profiles go.
    trace: str | None = field(default=None, metadata=NODES_AGREE_IF_SET)
    trace_steps: str | None = None  # "A:B"; None: the two steps after the first
    profile_steps: str | None = None  # "A:B": torch.profiler traces per rank
    profile_dir: str = field(default="profile", metadata=NODE_LOCAL)
    tensorboard: str | None = field(default=None, metadata=NODE_LOCAL)

    def __post_init__(self) -> None:
        parse_steps("--trace-steps", self.trace_steps)
        parse_steps("--profile-steps", self.profile_steps)

    def trace_range(self, start: int, total: int) -> tuple[int, int] | None:
        """The traced steps (1-based) of a run doing steps ``start + 1 .. total``; None: no trace."""
        if not self.trace:
            return None
        # By default the two steps after the first of this attempt (start-up is no steady state).
        return parse_steps("--trace-steps", self.trace_steps) or (
            min(start + 2, total),
            min(start + 3, total),
        )
