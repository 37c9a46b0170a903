"""Typed, validated run configuration: built once by bundle.cli, never mutated afterwards.

What is trained (the model, the data, the training's settings) is declared here, with
``RunConfig``, which gathers every section; how the job runs it (parallel layout, compute,
launch, checkpoints, observation) is ``bundle.config.job``'s, and how far each setting reaches
beyond its process ``bundle.config.reach``'s. Every name is importable from here.

The package, from the leaves up:

- ``reach``: how far a setting reaches (node-local, recorded), declared in its field's metadata;
- ``sync``: the data-parallel options' spellings and the combinations refused;
- ``yaml_input``: YAML a user gives, read as data (no alias that expands);
- ``tp``: what ``--tensor-parallel`` does not combine with yet;
- ``lora``: ``--lora``'s spec, and the one of an adapter PEFT saved (``--lora-init``);
- ``job``: the sections of how a job runs (layout, compute, launch, checkpoints, observing);
- this module: what is trained and the frozen ``RunConfig`` gathering every section;
- ``option``: one option of that table: its spelling, field, parsing and help;
- ``options``: the options table ``RunConfig`` is declared in: the parser, ``--help`` and the
  YAML keys follow it (``bundle.cli`` builds the config from it).
"""

from __future__ import annotations

import ast
import importlib.util
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from bundle.config.job import AUTO_SHAPE as AUTO_SHAPE
from bundle.config.job import BACKENDS as BACKENDS
from bundle.config.job import COMPILE_BACKENDS as COMPILE_BACKENDS
from bundle.config.job import DEFAULT_PORT as DEFAULT_PORT
from bundle.config.job import FAULT_TOLERANCE as FAULT_TOLERANCE
from bundle.config.job import GRAD_SYNCS as GRAD_SYNCS
from bundle.config.job import PRECISIONS as PRECISIONS
from bundle.config.job import RECOMPUTES as RECOMPUTES
from bundle.config.job import CheckpointConfig as CheckpointConfig
from bundle.config.job import ComputeConfig as ComputeConfig
from bundle.config.job import LaunchConfig as LaunchConfig
from bundle.config.job import ObserveConfig as ObserveConfig
from bundle.config.job import ParallelConfig as ParallelConfig
from bundle.config.job import parse_degrees as parse_degrees
from bundle.config.job import parse_shape as parse_shape
from bundle.config.job import parse_steps as parse_steps
from bundle.config.lora import LoRASpec as LoRASpec
from bundle.config.lora import parse_lora as parse_lora
from bundle.config.lora import parse_names as parse_names
from bundle.config.lora import resolve_lora
from bundle.config.reach import NODE_LOCAL as NODE_LOCAL
from bundle.config.reach import NODES_AGREE_IF_SET as NODES_AGREE_IF_SET
from bundle.config.reach import RECORDED as RECORDED
from bundle.config.reach import leaves, shared
from bundle.config.reach import recorded as recorded
from bundle.config.sync import COMPRESSIONS as COMPRESSIONS
from bundle.config.sync import ZERO_LEVELS as ZERO_LEVELS
from bundle.config.sync import parse_aggregate as parse_aggregate
from bundle.config.sync import parse_bundle_sync as parse_bundle_sync
from bundle.config.tp import check_tensor_parallel
from bundle.errors import ConfigError, positive
from bundle.ir.schedule import REGISTRY
from bundle.ir.schedule import SCHEDULES as SCHEDULES
from bundle.lr_schedule import LR_SCHEDULES, Milestone, spell

DATASETS = ("digits", "imagefolder", "synthetic", "text", "tokens", "hf")
# The ones made of tokens: --seq-len windows, a tokenizer (bundle.data).
TOKEN_DATASETS = ("text", "tokens", "hf")
OPTIMIZERS = ("sgd", "adamw", "adam")
# How a LoRA run stores its frozen base (models.quant); unset: as the model was built or loaded.
BASE_DTYPES = ("fp32", "bf16", "nf4")


def is_reference(text: str) -> bool:
    """``package.module:function`` (or ``file.py:function``): a user's own callable."""
    where, sep, attr = str(text).rpartition(":")
    return bool(sep and where and attr)


def parse_model_args(text: str | None) -> dict[str, Any]:
    """``"layers=6,width=384"`` -> ``{"layers": 6, "width": 384}`` (Python literals, else text)."""
    out: dict[str, Any] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ConfigError("--model-args", text, "give KEY=VALUE pairs separated by commas")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def parse_betas(text: str) -> tuple[float, ...]:
    """``"0.9,0.95"`` -> ``(0.9, 0.95)``: Adam's two coefficients, each in [0, 1)."""
    try:
        betas = tuple(float(p) for p in str(text).split(","))
    except ValueError:
        betas = ()
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ConfigError("--betas", text, "give two numbers in [0, 1) separated by a comma")
    return betas


def _architecture(directory: str) -> str | None:
    """``transformers:CLASS`` for a save_pretrained directory's config.json (None: unreadable,
    which ``--pretrained``'s checks before launch then say)."""
    try:
        names = json.loads((Path(directory) / "config.json").read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        return None
    ok = isinstance(names, list) and names and isinstance(names[0], str)
    return f"transformers:{names[0]}" if ok else None


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str = field(default="digits_cnn", metadata=recorded("model"))
    partition: str | None = None
    # Keyword arguments of the model's builder (gpt's size, a zoo model's options, a factory's).
    args: str | None = field(default=None, metadata=recorded("model_args"))
    # A full-model state dict loaded before the model is cut (fine-tuning); paths may differ.
    weights: str | None = field(default=None, metadata=NODE_LOCAL)
    # Refuse --weights of which anything does not fit (default: load what fits, note the rest).
    weights_strict: bool = False
    # A user's loss, module:function(outputs, labels) -> the micro-batch's mean; None: cross-entropy.
    loss: str | None = field(default=None, metadata=RECORDED)
    # Which of the forward's outputs the loss takes (models.outputs.select); None: logits, else
    # the first tensor.
    output: str | None = field(default=None, metadata=recorded("model_output"))
    # A transformers model's config (config.json or its directory); --model-args override it.
    config_file: str | None = field(default=None, metadata=NODE_LOCAL)
    # A save_pretrained directory: its class, config and safetensors weights (models.pretrained);
    # recorded, so a checkpoint says what it started from; paths may differ between nodes.
    pretrained: str | None = field(default=None, metadata={**RECORDED, **NODE_LOCAL})
    # LoRA adapters on a frozen base (bundle.config.lora's spec, models.lora); --lora-init's
    # adapter_config.json fills it when only that is given.
    lora: str | None = field(default=None, metadata=RECORDED)
    # Modules trained whole beside the adapters (a new head), as module-name suffixes.
    lora_train: str | None = field(default=None, metadata=RECORDED)
    # A directory PEFT saved an adapter to: the adapters' first values.
    lora_init: str | None = field(default=None, metadata=NODE_LOCAL)
    # The frozen base stored in fewer bytes (models.quant): nf4 (linear weights in 4 bits, the
    # rest bf16), bf16 or fp32; each process converts its own pieces.
    base_dtype: str | None = field(default=None, metadata=RECORDED)

    def __post_init__(self) -> None:
        parse_model_args(self.args)
        object.__setattr__(self, "lora", resolve_lora(self.lora, self.lora_init, self.lora_train))
        self._check_base_dtype()
        if self.pretrained is not None:
            for flag, given, what in (
                ("--weights", self.weights, "weights"),
                ("--model-config", self.config_file, "config"),
            ):
                if given:
                    raise ConfigError(
                        "--pretrained",
                        self.pretrained,
                        f"holds the model's {what}: leave {flag} out",
                    )
            if self.name == fields(self)[0].default:  # no --model: the class config.json names
                object.__setattr__(self, "name", _architecture(self.pretrained) or self.name)
        if self.loss is not None and not is_reference(self.loss):
            raise ConfigError("--loss", self.loss, "name a function as package.module:function")

    def _check_base_dtype(self) -> None:
        flag, value = "--base-dtype", self.base_dtype
        if value is not None and value not in BASE_DTYPES:
            raise ConfigError(flag, value, f"choose one of: {', '.join(BASE_DTYPES)}")
        if value is not None and self.lora is None:
            raise ConfigError(flag, value, "stores the weights that do not train: give --lora")
        if value == "nf4" and importlib.util.find_spec("torchao") is None:
            raise ConfigError(flag, value, "needs torchao: pip install torchao")

    @property
    def kwargs(self) -> dict[str, Any]:
        return parse_model_args(self.args)

    @property
    def lora_spec(self) -> LoRASpec | None:
        return parse_lora(self.lora)

    @property
    def lora_trained(self) -> tuple[str, ...]:
        return parse_names("--lora-train", self.lora_train)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    dataset: str = field(default="digits", metadata=RECORDED)
    root: str | None = None
    workers: int = 0
    image_size: int = 224
    # None: synthetic data's 10, or what a dataset of the user's declares (its classes).
    num_classes: int | None = None
    synthetic_size: int = 4096
    data_file: str | None = field(default=None, metadata=NODE_LOCAL)  # --dataset text
    data_dir: str | None = field(default=None, metadata=NODE_LOCAL)  # --dataset tokens
    data_files: str | None = field(default=None, metadata=NODE_LOCAL)  # --dataset hf: a glob
    text_field: str = field(default="text", metadata=RECORDED)  # --dataset hf: the text field
    # --dataset hf: the field holding a row's class; set, each row is one classification sample.
    label_field: str | None = field(default=None, metadata=RECORDED)
    seq_len: int = field(default=64, metadata=RECORDED)  # token datasets: tokens per sample
    # Token datasets: a tokenizer saved on disk (None: byte-level tokens, or the one --dataset
    # tokens was prepared with); generation reads it back.
    tokenizer: str | None = field(
        default=None, metadata=MappingProxyType({"nodes": "local", "recorded": "tokenizer"})
    )
    # A sample that cannot be read is replaced (bundle.data.samples.Guarded) instead of failing the run.
    skip_bad_samples: bool = False

    @property
    def streams(self) -> bool:
        """``--dataset hf`` packing documents into windows as it reads them: no length, and a
        position to resume from (with ``--label-field`` its rows are samples instead)."""
        return self.dataset == "hf" and not self.label_field

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS and not is_reference(self.dataset):
            raise ConfigError(
                "--dataset",
                self.dataset,
                f"choose one of: {', '.join(DATASETS)}, or package.module:function",
            )
        positive("--seq-len", self.seq_len)
        needs = {"text": (self.data_file, "--data-file FILE (any UTF-8 text)"),
                 "tokens": (self.data_dir, "--data-dir DIR (python -m bundle.data prepare)"),
                 "hf": (self.data_files, "--data-files GLOB (JSON lines or Parquet)")}  # fmt: skip
        if self.dataset in needs and not needs[self.dataset][0]:
            raise ConfigError("--dataset", self.dataset, f"needs {needs[self.dataset][1]}")
        if self.label_field is not None and (self.dataset != "hf" or not self.label_field):
            why = f"it classifies the rows of --dataset hf, not {self.dataset}"
            if self.dataset == "hf":
                why = "name the field holding a row's class"
            raise ConfigError("--label-field", self.label_field, why)
        if self.tokenizer and self.dataset not in TOKEN_DATASETS:
            raise ConfigError(
                "--tokenizer", self.tokenizer, f"tokenizes --dataset {', '.join(TOKEN_DATASETS)}"
            )
        positive("--workers", self.workers, 0)
        positive("--image-size", self.image_size)
        if self.num_classes is not None:
            positive("--num-classes", self.num_classes, 2)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    batch_size: int = field(default=64, metadata=RECORDED)
    steps: int = 0  # 0: run whole epochs
    epochs: int = 5
    lr: float = field(default=0.05, metadata=RECORDED)
    momentum: float = field(default=0.9, metadata=RECORDED)
    weight_decay: float = field(default=0.0, metadata=RECORDED)
    nesterov: bool = field(default=False, metadata=RECORDED)
    optimizer: str = field(default="sgd", metadata=RECORDED)
    betas: tuple[float, ...] = field(default=(0.9, 0.999), metadata=RECORDED)  # adam, adamw
    eps: float = field(default=1e-8, metadata=RECORDED)  # adam, adamw
    # No weight decay on 1-d parameters (biases, norm scales); default: decay applies to all.
    no_decay_norm_bias: bool = field(default=False, metadata=RECORDED)
    # The learning-rate schedule is a function of the step: these settings and the step are all
    # of its state, so a checkpoint records them.
    lr_schedule: str = field(default="constant", metadata=RECORDED)  # bundle/lr_schedule.py
    # step schedule: epochs, or steps ("500s")
    lr_steps: tuple[Milestone, ...] = field(default=(), metadata=RECORDED)
    lr_gamma: float = field(default=0.1, metadata=RECORDED)
    warmup_epochs: float = field(default=0.0, metadata=RECORDED)
    label_smoothing: float = field(default=0.0, metadata=RECORDED)
    seed: int = field(default=0, metadata=RECORDED)
    log_every: int = 10
    eval: bool = True
    # Evaluate the model of --resume or --weights and stop: validation loss, accuracy, perplexity.
    eval_only: bool = False
    val_batches: int = 0  # validation's global batches at most; 0: the whole validation set
    checkpoint: str | None = field(default=None, metadata=NODE_LOCAL)

    def __post_init__(self) -> None:
        positive("--batch-size", self.batch_size)
        positive("--itr", self.steps, 0)
        positive("--epochs", self.epochs)
        positive("--log-every", self.log_every)
        positive("--val-batches", self.val_batches, 0)
        if self.lr <= 0:
            raise ConfigError("--lr", self.lr, "must be > 0")
        if not 0 <= self.momentum < 1:
            raise ConfigError("--momentum", self.momentum, "must be in [0, 1)")
        if self.weight_decay < 0:
            raise ConfigError("--weight-decay", self.weight_decay, "must be >= 0")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                "--optimizer", self.optimizer, f"choose one of: {', '.join(OPTIMIZERS)}"
            )
        if self.eps <= 0:
            raise ConfigError("--eps", self.eps, "must be > 0")
        if self.nesterov and self.optimizer != "sgd":
            raise ConfigError("--nesterov with --optimizer", self.optimizer, "needs sgd")
        if self.nesterov and not self.momentum:
            raise ConfigError("--nesterov with --momentum", self.momentum, "needs a momentum > 0")
        if not 0 <= self.label_smoothing < 1:
            raise ConfigError("--label-smoothing", self.label_smoothing, "must be in [0, 1)")
        self._check_lr_schedule()

    def _check_lr_schedule(self) -> None:
        """What the schedule's flags say alone, and against a run counted in the same unit; a
        run counted in the other unit is checked with the data's size (preflight)."""
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(
                "--lr-schedule", self.lr_schedule, f"choose one of: {', '.join(LR_SCHEDULES)}"
            )
        if self.lr_schedule == "step" and not self.lr_steps:
            raise ConfigError("--lr-steps", "", "--lr-schedule step needs its milestones")
        if self.lr_steps and self.lr_schedule != "step":
            raise ConfigError(
                "--lr-steps", spell(self.lr_steps), "only --lr-schedule step takes milestones"
            )
        if self.lr_gamma <= 0:
            raise ConfigError("--lr-gamma", self.lr_gamma, "must be > 0")
        if self.warmup_epochs < 0:
            raise ConfigError("--warmup-epochs", self.warmup_epochs, "must be >= 0")
        # A milestone the run ends before is no error: it changes no step's rate, and is dropped
        # with a note before start (bundle.preflight.check_lr_schedule).
        run = f"--itr {self.steps}" if self.steps else f"--epochs {self.epochs}"
        if not self.steps and self.warmup_epochs >= self.epochs:
            raise ConfigError(
                "--warmup-epochs",
                self.warmup_epochs,
                f"the warm-up must end before the run does ({run})",
            )


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    metrics_out: str | None = field(default=None, metadata=NODE_LOCAL)
    # Set by bundle.plan.auto when the planner chose the shape or split: reported beside the
    # measured throughput in the run's summary.
    predicted_samples_per_s: float | None = None

    def __post_init__(self) -> None:
        given = self.checkpoint.resume or self.model.weights or self.model.pretrained
        if self.train.eval_only and not given:
            raise ConfigError(
                "--eval-only",
                True,
                "needs a model to evaluate: --resume, --weights or --pretrained",
            )
        if self.train.eval_only and not self.train.eval:
            raise ConfigError("--eval-only", True, "evaluates: leave --no-eval out")
        if self.launch.fault_tolerance == "bundle":
            _check_bundle_fault_tolerance(self)
        check_tensor_parallel(self.parallel, self.compute, self.launch, self.model.base_dtype)
        if self.parallel.zero == 3 and self.compute.channels_last:
            raise ConfigError(
                "--channels-last",
                True,
                "keeps convolution weights in a non-contiguous layout, which --zero 3 (FSDP2) "
                "cannot shard; use one of them",
            )
        if self.parallel.zero == 3 and self.model.base_dtype is not None:
            why = "keeps each process's frozen base whole, which --zero 3 (FSDP2) would shard"
            raise ConfigError("--base-dtype", self.model.base_dtype, f"{why}; use --zero 1")
        if self.compute.compile and REGISTRY[self.parallel.schedule].split_backward:
            raise ConfigError(
                "--schedule",
                self.parallel.schedule,
                "splits each backward into input and weight halves, which a compiled block's "
                "one backward graph computes together: use 1f1b, gpipe or interleaved with "
                "--compile",
            )

    @property
    def planned(self) -> bool:
        """Whether the planner chooses the shape or the split (``auto``; bundle.plan.auto)."""
        return self.parallel.shape == AUTO_SHAPE or self.model.partition == "auto"

    @property
    def procs_per_node(self) -> int:
        if self.launch.nproc_per_node:
            return self.launch.nproc_per_node
        total, nodes = self.parallel.world_size, self.launch.num_nodes
        if total % nodes:
            raise ConfigError(
                "--world-size",
                nodes,
                f"the {total} processes (shape {','.join(map(str, self.parallel.shape))} x "
                f"{self.parallel.num_bundles} bundles) do not spread evenly; set --nproc-per-node",
            )
        return total // nodes

    def shared_view(self) -> dict[str, Any]:
        """Everything that must agree between nodes, as plain JSON types."""
        view: dict[str, Any] = json.loads(json.dumps(shared(self)))
        return view

    def run_settings(self) -> dict[str, Any]:
        """The recorded settings by key; a tuple as its flag spells it (``--lr-steps 30,60``)."""
        return {
            f.metadata["recorded"] or f.name: ",".join(map(str, v)) if isinstance(v, tuple) else v
            for f, v in leaves(self)
            if "recorded" in f.metadata
        }


def _check_bundle_fault_tolerance(cfg: RunConfig) -> None:
    """What --fault-tolerance bundle needs: bundles enough that one may fail, launched by
    main.py's supervisors (the backend, known once ``auto`` is resolved, is preflight's to
    check). Every sync composes with it; --zero 1 then shards inside each bundle."""
    par, launch = cfg.parallel, cfg.launch
    need = max(2, launch.min_bundles)
    if par.num_bundles < need:
        raise ConfigError(
            "--num-bundle",
            par.num_bundles,
            f"--fault-tolerance bundle needs at least {need} bundles "
            f"(--min-bundles {launch.min_bundles} and one that may fail)"
            if launch.min_bundles >= 2
            else "--fault-tolerance bundle needs at least 2 bundles (one trains on when another fails)",
        )
    trim = parse_aggregate(par.aggregate)
    if trim is not None and launch.min_bundles < max(3, 2 * trim + 1):
        raise ConfigError(
            "--min-bundles",
            launch.min_bundles,
            f"--aggregate {par.aggregate} combines at least {max(3, 2 * trim + 1)} bundles: under "
            "--fault-tolerance bundle the job must not train on with fewer",
        )
    if par.zero == 3:
        raise ConfigError(
            "--zero",
            3,
            "a bundle that heals would need every stage's parameter shards of its peers; "
            "use --zero 1 under --fault-tolerance bundle",
        )
    if launch.torchrun:
        raise ConfigError(
            "--torchrun",
            True,
            "--fault-tolerance bundle supports main.py's own supervisors (docs/fault-tolerance.md)",
        )
