"""Every command-line option, declared once: parser, YAML keys and RunConfig all derive from it."""

from __future__ import annotations

import argparse
from typing import Any

from bundle import config as C
from bundle import lr_schedule
from bundle.config.option import Option, _annotation

PAR, TRAIN, CKPT, MODEL = "parallelism", "training", "checkpoints and restarts", "model and data"
SPEED, LAUNCH, OUT = "speed and memory", "launch", "configuration and output"
SEE = "observing a run"

# fmt: off
OPTIONS: tuple[Option, ...] = (
    Option(None, "data", "data.root", metavar="DATA_DIR",
           help="ImageFolder directory with train/ and val/ (val/ may be missing with --no-eval; "
                "implies --dataset imagefolder)"),

    Option(PAR, "--bundle-shape", "parallel.shape", metavar="W0,W1,...|auto",
           help="replicas per stage of one bundle, e.g. 1,1 (front+rear) or 4,2; auto: the "
                "planner's shape, split, micro-batches, schedule and sync for this job's processes"),
    Option(PAR, "--num-bundle", "parallel.num_bundles", metavar="N", help="bundles in the whole job"),
    Option(PAR, "--DP-ONLY", None, kind=bool,
           help="pure data parallelism: one stage over all processes"),
    Option(PAR, "--num-hp", None, kind=int, metavar="N",
           help="with --DP-ONLY: number of data-parallel processes "
                "(unset: processes per node x nodes, else the shape total)"),
    Option(PAR, "--row-weights", "parallel.row_weights", metavar="W:W,W,...",
           help="each replica's share of a micro-batch's rows, per stage (stages by ',', replicas "
                "by ':'), e.g. 2:1,1 for shape 2,1: a replica twice as fast takes twice the rows"),
    Option(PAR, "--tensor-parallel", "parallel.tensor_parallel", metavar="T|T0,T1,...",
           parse=C.parse_degrees, default="1",
           help="tensor parallelism: each replica of a stage on T processes that split its "
                "layers' matrices (one degree for every stage, or one per stage)"),
    Option(PAR, "--micro-batches", "parallel.micro_batches", metavar="M",
           help="micro-batches per bundle batch"),
    Option(PAR, "--schedule", "parallel.schedule", choices=C.SCHEDULES, help="pipeline schedule"),
    Option(PAR, "--virtual-stages", "parallel.virtual_stages", metavar="V", default=0,
           help="model chunks per stage: 2 or more for interleaved-1f1b (the model is cut into "
                "stages x V pieces, piece j on stage j mod S; 2 by default), exactly 2 for zbv "
                "(placed as a V); 1 for the other schedules (0: the schedule's default)"),
    Option(PAR, "--grad-sync", "parallel.grad_sync", choices=C.GRAD_SYNCS,
           help="flat: DDP allreduce per stage; "
                "hierarchical: reduce in bundle, allreduce masters, broadcast"),
    Option(PAR, "--bucket-mb", "parallel.bucket_mb", metavar="MB",
           help="gradient bucket size; a bucket's sync starts as soon as its gradients are ready"),
    Option(PAR, "--zero", "parallel.zero", metavar="0|1|3",
           help="1: shard each stage's optimizer state over its replicas in every bundle "
                "(ZeRO-1; exact); updated parameters are gathered after the step. 3: shard its "
                "parameters, gradients and optimizer state too (FSDP2), gathered per block in "
                "forward and backward; hierarchical sync shards inside each bundle"),
    Option(PAR, "--grad-compression", "parallel.grad_compression", choices=C.COMPRESSIONS,
           help="compress gradients between replicas (flat) or on the masters' hop between "
                "bundles (hierarchical); inexact, opt-in"),
    Option(PAR, "--powersgd-rank", "parallel.powersgd_rank", metavar="R",
           help="powersgd: rank of each gradient matrix's approximation (error feedback on)"),
    Option(PAR, "--compression-warmup", "parallel.compression_warmup", metavar="STEPS",
           help="--grad-compression: the first STEPS steps sync uncompressed"),
    Option(PAR, "--bundle-sync", "parallel.bundle_sync", metavar="step|local:H|diloco:H",
           help="between bundles: every step (exact); every H steps by parameter averaging "
                "(local SGD); or every H steps with an outer Nesterov step (DiLoCo); inexact"),
    Option(PAR, "--outer-lr", "parallel.outer_lr", metavar="LR",
           help="diloco: the outer optimizer's learning rate"),
    Option(PAR, "--outer-momentum", "parallel.outer_momentum", metavar="MU",
           help="diloco: the outer optimizer's Nesterov momentum"),
    Option(PAR, "--aggregate", "parallel.aggregate", metavar="mean|median|trimmed:K",
           help="how bundles' gradients (or local/diloco updates) combine, coordinate-wise; "
                "median and trimmed:K survive faulty bundles, inexact"),

    Option(TRAIN, "--batch-size", "train.batch_size", metavar="B",
           help="global batch per step, over all bundles"),
    Option(TRAIN, "--itr", "train.steps", metavar="STEPS", aliases=("--steps",),
           help="training steps (0: run --epochs whole epochs)"),
    Option(TRAIN, "--epochs", "train.epochs", help="whole epochs when --itr is 0"),
    Option(TRAIN, "--optimizer", "train.optimizer", choices=C.OPTIMIZERS,
           help="sgd (with --momentum), adamw (decoupled weight decay) or adam (L2 decay)"),
    Option(TRAIN, "--lr", "train.lr", help="learning rate (peak, under a schedule)"),
    Option(TRAIN, "--momentum", "train.momentum", help="SGD momentum"),
    Option(TRAIN, "--weight-decay", "train.weight_decay", aliases=("--wd",),
           help="weight decay, as the optimizer applies it"),
    Option(TRAIN, "--no-decay-norm-bias", "train.no_decay_norm_bias",
           help="no weight decay on 1-d parameters (biases and normalisation scales)"),
    Option(TRAIN, "--nesterov", "train.nesterov", help="SGD with Nesterov momentum"),
    Option(TRAIN, "--betas", "train.betas", metavar="B1,B2", parse=C.parse_betas,
           help="adam/adamw: coefficients of the running averages of the gradient and its square"),
    Option(TRAIN, "--eps", "train.eps", help="adam/adamw: term added to the denominator"),
    Option(TRAIN, "--lr-schedule", "train.lr_schedule", choices=lr_schedule.LR_SCHEDULES,
           help="learning rate per step: constant; step: times --lr-gamma at each of --lr-steps; "
                "cosine: down towards 0 at the end of the run (after any warm-up)"),
    Option(TRAIN, "--lr-steps", "train.lr_steps", metavar="E1,E2,...|S1s,S2s,...",
           parse=lr_schedule.parse_milestones, default=None,
           help="milestones of --lr-schedule step: after these epochs (30,60,80), "
                "or with an s after these steps (500s,900s); those at or after the end of the "
                "run are dropped, with a note"),
    Option(TRAIN, "--lr-gamma", "train.lr_gamma", help="factor of each step of --lr-schedule step"),
    Option(TRAIN, "--warmup-epochs", "train.warmup_epochs", metavar="E",
           help=f"linear warm-up from {lr_schedule.WARMUP_START} x --lr to --lr over the first E "
                "epochs (fractions allowed), before any schedule"),
    Option(TRAIN, "--label-smoothing", "train.label_smoothing", metavar="EPS",
           help="cross-entropy label smoothing"),
    Option(TRAIN, "--seed", "train.seed", help="model init and data order"),
    Option(TRAIN, "--log-every", "train.log_every", metavar="STEPS",
           help="progress line (and metrics record) every this many steps"),
    Option(TRAIN, "--no-eval", "train.eval", negate=True, help="skip validation"),
    Option(TRAIN, "--eval-only", "train.eval_only",
           help="evaluate the model of --resume or --weights and stop (validation loss, "
                "accuracy, perplexity); nothing is trained or saved"),
    Option(TRAIN, "--val-batches", "train.val_batches", metavar="N",
           help="validation's global batches at most (default: the whole validation set)"),
    Option(TRAIN, "--checkpoint", "train.checkpoint", metavar="FILE",
           help="write the trained model's state dict (full-model names) here at the end"),

    Option(CKPT, "--save-dir", "checkpoint.save_dir", metavar="DIR",
           help="write resumable checkpoints to DIR/step-N "
                "(on multi-node jobs: a filesystem every node sees)"),
    Option(CKPT, "--save-every", "checkpoint.save_every", metavar="STEPS",
           help="checkpoint every this many steps (0: at the end of every epoch); always at the end"),
    Option(CKPT, "--keep", "checkpoint.keep", metavar="K", help="newest complete checkpoints kept"),
    Option(CKPT, "--resume", "checkpoint.resume", metavar="auto|DIR/step-N",
           help="auto: the newest complete checkpoint in --save-dir (fresh start if none); "
                "or one checkpoint"),
    Option(CKPT, "--async-save", "checkpoint.async_save",
           help="copy the state to memory and write checkpoints while training goes on"),
    Option(CKPT, "--max-restarts", "launch.max_restarts", metavar="N",
           help="when a process or node fails, "
                "restart the whole job from the newest checkpoint up to N times; under "
                "--fault-tolerance bundle also start a lost bundle again up to N times"),
    Option(CKPT, "--fault-tolerance", "launch.fault_tolerance", choices=C.FAULT_TOLERANCE,
           help="restart: any failure stops the job (then --max-restarts); bundle: a failed "
                "bundle leaves, the others train on, and it rejoins when started again "
                "(--max-restarts); each step's gradient is the mean over the bundles that took "
                "part (not exact while one is missing; docs/fault-tolerance.md)"),
    Option(CKPT, "--min-bundles", "launch.min_bundles", metavar="N",
           help="--fault-tolerance bundle: the job fails when fewer than N bundles remain"),

    Option(MODEL, "--model", "model.name", metavar="NAME|package.module:factory",
           help="digits_cnn, mlp, mlp_wide, skip_mlp, small_resnet, gpt; any torchvision "
                "classification model (resnet18, resnet50, resnet101, vgg16, mobilenet_v3_small, "
                "vit_b_16, ...); a factory "
                "of your own, called with num_classes= and input_shape= (docs/models.md); or "
                "MODEL_SPLIT, the model with partitions/MODEL_SPLIT.yaml (resnet101_trial0..4); "
                "a Hugging Face class, transformers:GPT2LMHeadModel (built from its config)"),
    Option(MODEL, "--model-args", "model.args", metavar="K=V,...",
           help="keyword arguments of the model's builder, e.g. gpt's "
                "layers=6,width=384,heads=6 (Python literals)"),
    Option(MODEL, "--model-config", "model.config_file", metavar="FILE|DIR",
           help="a transformers model's config.json (or the directory holding it); "
                "--model-args set fields on it"),
    Option(MODEL, "--model-output", "model.output", metavar="NAME|N",
           help="which of the forward's outputs the loss takes: a key of a dict or ModelOutput, "
                "or a position in a tuple (default: logits, else the first tensor)"),
    Option(MODEL, "--weights", "model.weights", metavar="FILE",
           help="load this full-model state dict (torch.save of model.state_dict()) before the "
                "model is cut: fine-tuning from a local file"),
    Option(MODEL, "--pretrained", "model.pretrained", metavar="DIR",
           help="a save_pretrained directory (config.json, safetensors weights, sharded or "
                "not): builds its class (config.json's architectures, or --model "
                "transformers:CLASS) with its config and loads its weights, each process only "
                "its own stages'; --model-args override the config (docs/models.md)"),
    Option(MODEL, "--weights-strict", "model.weights_strict",
           help="refuse --weights or --pretrained unless every tensor fits the model (default: "
                "load what fits, initialise the rest, say which in one line)"),
    Option(MODEL, "--lora", "model.lora", metavar="r=R,alpha=A,dropout=P,targets=M1,M2|on",
           help="train LoRA adapters on a frozen model: rank r (8), scale alpha/r (alpha 16), "
                "input dropout (0), on modules whose names end in the targets (or all-linear; "
                "default: the family's usual ones, as PEFT's); docs/finetuning.md"),
    Option(MODEL, "--lora-train", "model.lora_train", metavar="M1,M2",
           help="with --lora: modules trained whole beside the adapters, by name suffix (a "
                "new head), as PEFT's modules_to_save"),
    Option(MODEL, "--lora-init", "model.lora_init", metavar="DIR",
           help="start the adapters from one PEFT saved (adapter_config.json, "
                "adapter_model.safetensors); its r, alpha and targets are --lora's"),
    Option(MODEL, "--base-dtype", "model.base_dtype", choices=C.BASE_DTYPES,
           help="with --lora: the frozen base in nf4 (linear weights; rest bf16), bf16 or fp32"),
    Option(MODEL, "--loss", "model.loss", metavar="package.module:function",
           help="loss(outputs, labels) -> the mean over the micro-batch's rows "
                "(default: cross-entropy over the last dimension, per row or per token)"),
    Option(MODEL, "--partition", "model.partition", metavar="NAME|FILE.yaml|B0,B1,...|auto",
           help="split points from partitions/NAME.yaml, a YAML file or inline (the block where "
                "each stage begins); auto: balanced by the planner's timing "
                "(default: balanced by parameters)"),
    # Unset, the data set follows DATA_DIR (cli.to_config), so the field's default cannot stand.
    Option(MODEL, "--dataset", "data.dataset", default=None,
           metavar="{" + ",".join(C.DATASETS) + "}|package.module:function",
           help="default: imagefolder when DATA_DIR is given, else digits; text: the tokens "
                "of --data-file; tokens: a corpus prepared by python -m bundle.data prepare "
                "(--data-dir); hf: JSON lines or Parquet streamed (--data-files); or a function "
                "of your own, f(split) -> Dataset"),
    Option(MODEL, "--data-file", "data.data_file", metavar="FILE",
           help="--dataset text: any UTF-8 text file (its last tenth is the validation set)"),
    Option(MODEL, "--data-dir", "data.data_dir", metavar="DIR",
           help="--dataset tokens: what python -m bundle.data prepare wrote (memory-mapped)"),
    Option(MODEL, "--data-files", "data.data_files", metavar="GLOB",
           help="--dataset hf: JSON lines (.jsonl, .jsonl.gz) or Parquet files, streamed in "
                "order through the datasets library"),
    Option(MODEL, "--text-field", "data.text_field", metavar="NAME",
           help="--dataset hf: the field holding a document's text"),
    Option(MODEL, "--label-field", "data.label_field", metavar="NAME",
           help="--dataset hf: the field holding a row's class (an index >= 0, or a name: "
                "indexed in sorted order); each row is then one sample, its text cut or padded "
                "to --seq-len tokens with an attention mask, for text classification"),
    Option(MODEL, "--tokenizer", "data.tokenizer", metavar="DIR",
           help="token datasets: a tokenizer saved on disk (tokenizer.json, or what "
                "transformers' save_pretrained writes); default: byte-level tokens, or the "
                "one --dataset tokens was prepared with (which this must match if given)"),
    Option(MODEL, "--seq-len", "data.seq_len", metavar="T",
           help="token datasets: tokens per sample (the model's context)"),
    Option(MODEL, "--image-size", "data.image_size",
           help="input side for imagefolder and synthetic data"),
    Option(MODEL, "--num-classes", "data.num_classes",
           help="classes of synthetic data (default 10); for other data, their own count "
                "(a dataset's num_classes or classes), which this must match if given"),
    Option(MODEL, "--synthetic-size", "data.synthetic_size", help="synthetic samples"),
    Option(MODEL, "--workers", "data.workers",
           help="data-loading worker processes per process that reads inputs"),
    Option(MODEL, "--skip-bad-samples", "data.skip_bad_samples",
           help="a sample that cannot be read (a corrupt image) is replaced by the next one of "
                "its class that can, with a warning naming it, and counted in the summary "
                "(replaced_samples); without it the run stops, naming the sample's path and index"),

    Option(SPEED, "--precision", "compute.precision", choices=C.PRECISIONS,
           help="mixed precision: autocast to bf16 or fp16 (fp16 with dynamic loss scaling), "
                "fp32 master weights and optimizer state; activations cross stages in that dtype"),
    Option(SPEED, "--recompute", "compute.recompute", choices=C.RECOMPUTES,
           help="keep only each stage's inputs per micro-batch and recompute its activations in "
                "backward; except-last keeps the micro-batches whose backward follows their "
                "forward at once (1F1B's last stage), where recompute would save nothing"),
    Option(SPEED, "--channels-last", "compute.channels_last",
           help="CNNs: stages, inputs and boundary tensors in channels-last memory format"),
    Option(SPEED, "--no-tf32", "compute.tf32", negate=True,
           help="CUDA: fp32 matmuls and convolutions use TF32 unless this is given"),
    Option(SPEED, "--compile", "compute.compile",
           help="torch.compile each block of every stage (regional compilation); compile time "
                "is reported apart from step time"),
    Option(SPEED, "--compile-backend", "compute.compile_backend", choices=C.COMPILE_BACKENDS,
           help="inductor generates kernels (C++ on CPUs, Triton on GPUs); aot_eager only "
                "checks that the model compiles"),

    # torchrun's or a Slurm step's environment overrides the node layout (cli.to_config).
    Option(LAUNCH, "--rank", "launch.node_rank", metavar="NODE", aliases=("--node-rank",),
           help="this node's rank"),
    Option(LAUNCH, "--world-size", "launch.num_nodes", metavar="NODES", aliases=("--num-nodes",),
           help="number of nodes"),
    Option(LAUNCH, "--IP", "launch.master_addr", metavar="HOST", aliases=("--master-addr",),
           help="master node address"),
    Option(LAUNCH, "--portNum", "launch.master_port", metavar="PORT", aliases=("--master-port",),
           help=f"the port of the job's store on node 0 (default {C.DEFAULT_PORT}; a single-node "
                "run without this flag takes a free port if that one is busy, and says which)"),
    Option(LAUNCH, "--nproc-per-node", "launch.nproc_per_node", metavar="N",
           help="processes on each node (0: all processes spread evenly over the nodes)"),
    Option(LAUNCH, "--backend", "launch.backend", choices=C.BACKENDS,
           help="auto: nccl with one GPU per process when CUDA is present, else gloo on CPU; "
                "nccl-emu: gloo on CPU under NCCL's ordering (in-order streams, rendezvous "
                "sends), to check that a shape, schedule and sync will run on NCCL"),
    Option(LAUNCH, "--nccl-emu-eager-bytes", "launch.emu_eager_bytes", metavar="N",
           help="nccl-emu: sends of at most N bytes complete without waiting for their "
                "receiver, as NCCL's small messages do (0: every send waits, the strict model)"),
    Option(LAUNCH, "--nccl-emu-strict", "launch.emu_strict",
           help="nccl-emu: a process's communicators run one call at a time, in the order "
                "posted (NCCL does not promise that two communicators progress concurrently)"),
    Option(LAUNCH, "--timeout", "launch.timeout", metavar="S",
           help="seconds any wait on a peer may take before the job fails"),
    Option(LAUNCH, "--init-timeout", "launch.init_timeout", metavar="S",
           help="seconds to wait for every node to join"),
    Option(LAUNCH, "--share-gpus", "launch.share_gpus",
           help="testing: allow more nccl processes per node than GPUs, placed round-robin, "
                "several per GPU (NCCL 2.30+: NCCL_MULTI_RANK_GPU_ENABLE=1; older: a host id per "
                "process)"),

    # A config file naming another would be a second precedence order; it is no YAML key.
    Option(OUT, "--config", None, kind=str, metavar="FILE.yaml", yaml=False,
           help="YAML of option values (keys as the long options, '-' or '_'); "
                "the command line wins"),
    Option(OUT, "--plan", None, kind=str, metavar="FILE.json[:I]", yaml=False,
           help="run plan I (default 0, the best) of scripts/plan.py --json FILE.json exactly as "
                "saved: shape, split, micro-batches, schedule, sync, row weights, placement; on "
                "the data it was made for unless DATA_DIR or --dataset names others"),
    Option(OUT, "--metrics-out", "metrics_out", metavar="FILE.jsonl",
           help="JSON lines of progress; the last line is the run summary"),

    Option(SEE, "--trace", "observe.trace", metavar="FILE.json",
           help="a Chrome/Perfetto trace of every process's actions on one time axis "
                "(open in ui.perfetto.dev or chrome://tracing)"),
    Option(SEE, "--trace-steps", "observe.trace_steps", metavar="A:B",
           help="steps the trace covers (default: the two steps after the first)"),
    Option(SEE, "--profile-steps", "observe.profile_steps", metavar="A:B",
           help="also record torch.profiler traces of these steps, one per process, "
                "in --profile-dir"),
    Option(SEE, "--profile-dir", "observe.profile_dir", metavar="DIR",
           help="where --profile-steps writes rank<N>.json"),
    Option(SEE, "--tensorboard", "observe.tensorboard", metavar="DIR",
           help="TensorBoard scalars (loss, accuracy, samples/s, learning rate, per-stage "
                "time breakdown); view with tensorboard --logdir DIR"),
)
# fmt: on

BY_YAML_KEY: dict[str, Option] = {k: o for o in OPTIONS if o.yaml for k in o.keys}


def add_arguments(parser: argparse.ArgumentParser, *, suppress: bool = False) -> None:
    """Every option, in table order; suppress: unset options stay out of the namespace."""
    groups: dict[str | None, Any] = {None: parser}
    for opt in OPTIONS:
        if opt.group not in groups:
            groups[opt.group] = parser.add_argument_group(opt.group)
        opt.add_to(groups[opt.group], suppress=suppress)


def field_values(args: argparse.Namespace) -> dict[str, Any]:
    """``{"train": {"lr": 0.05, ...}, ..., "metrics_out": None}`` from every option with a field."""
    values: dict[str, Any] = {}
    for opt in OPTIONS:
        if opt.field is not None:
            *section, name = opt.field.split(".")
            target = values.setdefault(section[0], {}) if section else values
            target[name] = opt.to_field(getattr(args, opt.dest))
    return values


def build(values: dict[str, Any]) -> C.RunConfig:
    """RunConfig from field_values' shape: each section's dict becomes its dataclass."""
    return C.RunConfig(
        **{k: _annotation(k)(**v) if isinstance(v, dict) else v for k, v in values.items()}
    )
