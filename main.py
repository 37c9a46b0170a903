"""Bundle: train a model with bundle-based hybrid parallelism (pipeline stages x data-parallel bundles).

With no arguments it trains a small CNN on scikit-learn's 8x8 digit images as one bundle of shape
1,1 on two CPU processes. See README.md for multi-node, torchrun and container launches.
"""

from __future__ import annotations

import argparse
import os
import sys

import yaml

from bundle import config as C
from bundle.errors import BundleError, ConfigError

DEFAULTS = C.RunConfig()


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        # "(default: None)" and "(default: False)" say nothing; the help text says what unset means.
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # One line, like every other input error; the full usage is one --help away.
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(suppress: bool = False) -> argparse.ArgumentParser:
    p = _Parser(
        prog="main.py",
        description=__doc__.splitlines()[0],
        formatter_class=_Formatter,
        argument_default=argparse.SUPPRESS if suppress else None,
    )
    d = (lambda v: argparse.SUPPRESS) if suppress else (lambda v: v)
    p.add_argument(
        "data",
        nargs="?",
        default=d(None),
        metavar="DATA_DIR",
        help="ImageFolder directory with train/ and val/ (implies --dataset imagefolder)",
    )

    g = p.add_argument_group("parallelism")
    g.add_argument(
        "--bundle-shape",
        default=d("1,1"),
        metavar="W0,W1,...",
        help="replicas per stage of one bundle, e.g. 1,1 (front+rear) or 4,2",
    )
    g.add_argument(
        "--num-bundle", type=int, default=d(1), metavar="N", help="bundles in the whole job"
    )
    g.add_argument(
        "--DP-ONLY",
        action="store_true",
        default=d(False),
        help="pure data parallelism: one stage over all processes",
    )
    g.add_argument(
        "--num-hp",
        type=int,
        default=d(None),
        metavar="N",
        help="with --DP-ONLY: number of data-parallel processes (unset: processes per node x nodes, else the shape total)",
    )
    g.add_argument(
        "--micro-batches",
        type=int,
        default=d(DEFAULTS.parallel.micro_batches),
        metavar="M",
        help="micro-batches per bundle batch",
    )
    g.add_argument(
        "--schedule",
        choices=C.SCHEDULES if not suppress else None,
        default=d(DEFAULTS.parallel.schedule),
        help="pipeline schedule",
    )
    g.add_argument(
        "--grad-sync",
        choices=C.GRAD_SYNCS if not suppress else None,
        default=d(DEFAULTS.parallel.grad_sync),
        help="flat: DDP allreduce per stage; hierarchical: reduce in bundle, allreduce masters, broadcast",
    )

    g.add_argument(
        "--bucket-mb",
        type=float,
        default=d(DEFAULTS.parallel.bucket_mb),
        metavar="MB",
        help="gradient bucket size; a bucket's sync starts as soon as its gradients are ready",
    )

    g = p.add_argument_group("training")
    g.add_argument(
        "--batch-size",
        type=int,
        default=d(DEFAULTS.train.batch_size),
        metavar="B",
        help="global batch per step, over all bundles",
    )
    g.add_argument(
        "--itr",
        type=int,
        default=d(DEFAULTS.train.steps),
        metavar="STEPS",
        help="training steps (0: run --epochs whole epochs)",
    )
    g.add_argument(
        "--epochs", type=int, default=d(DEFAULTS.train.epochs), help="whole epochs when --itr is 0"
    )
    g.add_argument("--lr", type=float, default=d(DEFAULTS.train.lr), help="SGD learning rate")
    g.add_argument(
        "--momentum", type=float, default=d(DEFAULTS.train.momentum), help="SGD momentum"
    )
    g.add_argument(
        "--weight-decay",
        type=float,
        default=d(DEFAULTS.train.weight_decay),
        help="SGD weight decay",
    )
    g.add_argument(
        "--seed", type=int, default=d(DEFAULTS.train.seed), help="model init and data order"
    )
    g.add_argument(
        "--log-every",
        type=int,
        default=d(DEFAULTS.train.log_every),
        metavar="STEPS",
        help="progress line (and metrics record) every this many steps",
    )
    g.add_argument("--no-eval", action="store_true", default=d(False), help="skip validation")
    g.add_argument(
        "--checkpoint",
        default=d(None),
        metavar="FILE",
        help="write the trained model's state dict (full-model names) here at the end",
    )

    g = p.add_argument_group("checkpoints and restarts")
    ck = DEFAULTS.checkpoint
    g.add_argument(
        "--save-dir",
        default=d(None),
        metavar="DIR",
        help="write resumable checkpoints to DIR/step-N (on multi-node jobs: a filesystem every node sees)",
    )
    g.add_argument(
        "--save-every",
        type=int,
        default=d(ck.save_every),
        metavar="STEPS",
        help="checkpoint every this many steps (0: at the end of every epoch); always at the end",
    )
    g.add_argument(
        "--keep", type=int, default=d(ck.keep), metavar="K", help="newest complete checkpoints kept"
    )
    g.add_argument(
        "--resume",
        default=d(None),
        metavar="auto|DIR/step-N",
        help="auto: the newest complete checkpoint in --save-dir (fresh start if none); or one checkpoint",
    )
    g.add_argument(
        "--async-save",
        action="store_true",
        default=d(False),
        help="copy the state to memory and write checkpoints while training goes on",
    )
    g.add_argument(
        "--max-restarts",
        type=int,
        default=d(DEFAULTS.launch.max_restarts),
        metavar="N",
        help="when a process or node fails, restart the whole job from the newest checkpoint up to N times",
    )

    g = p.add_argument_group("model and data")
    g.add_argument(
        "--model",
        default=d(DEFAULTS.model.name),
        help="digits_cnn, mlp, mlp_wide, skip_mlp, small_resnet, resnet18, resnet50, resnet101, vgg16",
    )
    g.add_argument(
        "--partition",
        default=d(None),
        metavar="NAME|FILE.yaml",
        help="split points from partitions/NAME.yaml or a YAML file (default: balanced by parameters)",
    )
    g.add_argument(
        "--dataset",
        choices=C.DATASETS if not suppress else None,
        default=d(None),
        help="default: imagefolder when DATA_DIR is given, else digits",
    )
    g.add_argument(
        "--image-size",
        type=int,
        default=d(DEFAULTS.data.image_size),
        help="input side for imagefolder and synthetic data",
    )
    g.add_argument(
        "--num-classes",
        type=int,
        default=d(DEFAULTS.data.num_classes),
        help="classes of synthetic data",
    )
    g.add_argument(
        "--synthetic-size",
        type=int,
        default=d(DEFAULTS.data.synthetic_size),
        help="synthetic samples",
    )
    g.add_argument(
        "--workers",
        type=int,
        default=d(DEFAULTS.data.workers),
        help="data-loading worker processes per process that reads inputs",
    )

    g = p.add_argument_group("launch")
    g.add_argument("--rank", type=int, default=d(0), metavar="NODE", help="this node's rank")
    g.add_argument("--world-size", type=int, default=d(1), metavar="NODES", help="number of nodes")
    g.add_argument(
        "--IP", default=d(DEFAULTS.launch.master_addr), metavar="HOST", help="master node address"
    )
    g.add_argument(
        "--portNum",
        type=int,
        default=d(DEFAULTS.launch.master_port),
        metavar="PORT",
        help="master port",
    )
    g.add_argument(
        "--nproc-per-node",
        type=int,
        default=d(0),
        metavar="N",
        help="processes on each node (0: all processes spread evenly over the nodes)",
    )
    g.add_argument(
        "--backend",
        choices=C.BACKENDS if not suppress else None,
        default=d("auto"),
        help="auto: nccl with one GPU per process when CUDA is present, else gloo on CPU",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=d(DEFAULTS.launch.timeout),
        metavar="S",
        help="seconds any wait on a peer may take before the job fails",
    )
    g.add_argument(
        "--init-timeout",
        type=float,
        default=d(DEFAULTS.launch.init_timeout),
        metavar="S",
        help="seconds to wait for every node to join",
    )

    g = p.add_argument_group("configuration and output")
    g.add_argument(
        "--config",
        default=d(None),
        metavar="FILE.yaml",
        help="YAML of option values (keys as the long options, '-' or '_'); the command line wins",
    )
    g.add_argument(
        "--metrics-out",
        default=d(None),
        metavar="FILE.jsonl",
        help="JSON lines of progress; the last line is the run summary",
    )
    return p


def _merge_yaml(
    args: argparse.Namespace, explicit: set[str], parser: argparse.ArgumentParser
) -> None:
    try:
        with open(args.config) as f:
            values = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError("--config", args.config, f"must be a readable YAML file ({exc})") from exc
    if not isinstance(values, dict):
        raise ConfigError("--config", args.config, "must hold a mapping of option: value")
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    for key, value in values.items():
        dest = str(key).replace("-", "_")
        if dest not in actions:
            raise ConfigError(
                f"--config {args.config} key", key, f"allowed keys: {', '.join(sorted(actions))}"
            )
        if dest in explicit:
            continue
        action = actions[dest]
        if dest == "bundle_shape" and isinstance(value, list):
            value = ",".join(map(str, value))
        if action.type is not None and value is not None:
            try:
                value = action.type(value)
            except (TypeError, ValueError) as exc:
                raise ConfigError(
                    f"{key} (in --config {args.config})", value, f"must be {action.type.__name__}"
                ) from exc
        if action.choices and value not in action.choices:
            raise ConfigError(
                f"{key} (in --config {args.config})",
                value,
                f"choose one of: {', '.join(action.choices)}",
            )
        setattr(args, dest, value)


def to_config(args: argparse.Namespace, env: dict[str, str]) -> C.RunConfig:
    """The one place flags become the typed, frozen RunConfig."""
    shape = C.parse_shape(args.bundle_shape)
    num_bundles, nproc = args.num_bundle, args.nproc_per_node
    node_rank, nodes, torchrun = args.rank, args.world_size, False
    if "LOCAL_WORLD_SIZE" in env and "RANK" in env:
        torchrun = True
        nproc = int(env["LOCAL_WORLD_SIZE"])
        nodes = max(1, int(env["WORLD_SIZE"]) // nproc)
        node_rank = int(env.get("GROUP_RANK", int(env["RANK"]) // nproc))
    if args.DP_ONLY:
        procs = args.num_hp or (nproc * nodes if nproc else sum(shape) * num_bundles)
        shape, num_bundles = (procs,), 1
    dataset = args.dataset or ("imagefolder" if args.data else "digits")
    return C.RunConfig(
        parallel=C.ParallelConfig(
            shape=shape,
            num_bundles=num_bundles,
            micro_batches=args.micro_batches,
            schedule=args.schedule,
            grad_sync=args.grad_sync,
            bucket_mb=args.bucket_mb,
        ),
        model=C.ModelConfig(name=args.model, partition=args.partition),
        data=C.DataConfig(
            dataset=dataset,
            root=args.data,
            workers=args.workers,
            image_size=args.image_size,
            num_classes=args.num_classes,
            synthetic_size=args.synthetic_size,
        ),
        train=C.TrainConfig(
            batch_size=args.batch_size,
            steps=args.itr,
            epochs=args.epochs,
            lr=args.lr,
            momentum=args.momentum,
            weight_decay=args.weight_decay,
            seed=args.seed,
            log_every=args.log_every,
            eval=not args.no_eval,
            checkpoint=args.checkpoint,
        ),
        launch=C.LaunchConfig(
            node_rank=node_rank,
            num_nodes=nodes,
            nproc_per_node=nproc,
            master_addr=args.IP,
            master_port=args.portNum,
            backend=args.backend,
            timeout=args.timeout,
            init_timeout=args.init_timeout,
            torchrun=torchrun,
            max_restarts=args.max_restarts,
        ),
        checkpoint=C.CheckpointConfig(
            save_dir=args.save_dir,
            save_every=args.save_every,
            keep=args.keep,
            resume=args.resume,
            async_save=args.async_save,
        ),
        metrics_out=args.metrics_out,
    )


def parse(argv: list[str] | None, env: dict[str, str]) -> C.RunConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config:
        explicit = set(vars(build_parser(suppress=True).parse_args(argv)))
        _merge_yaml(args, explicit, parser)
    return to_config(args, env)


def main(argv: list[str] | None = None) -> int:
    from bundle import data, launch, preflight
    from bundle.preemption import parse_fault
    from bundle.supervisor import supervise
    from bundle.worker import make_topology

    env = dict(os.environ)
    try:
        cfg = parse(argv, env)
        topo = make_topology(cfg)
        launch.check_devices(cfg, topo)
        data.check_data(cfg.data)
        shapes = preflight.check_model(cfg, topo.num_stages)
        preflight.check_paths(cfg)
        parse_fault(env)
        attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0")) if cfg.launch.torchrun else 0
        resume = preflight.check_resume(cfg, shapes, attempt)
        torchrun = launch.torchrun_env() if cfg.launch.torchrun else None
        if torchrun is not None:
            return launch.run_torchrun(cfg, topo, torchrun, resume)
        return supervise(cfg, topo, resume)
    except BundleError as exc:
        print(f"main.py: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
