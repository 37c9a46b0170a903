"""The command line: flags and YAML -> one frozen RunConfig; then the checks and the launch."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn

import yaml  # type: ignore[import-untyped,unused-ignore]

from bundle import config as C
from bundle.config import options, yaml_input
from bundle.errors import BundleError, ConfigError, ExitCode

# main.py's first docstring line: the command's --help says what it is.
DESCRIPTION = (
    "Bundle: train a model with bundle-based hybrid parallelism "
    "(pipeline stages x data-parallel bundles)."
)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        # "(default: None)" and "(default: False)" say nothing; the help text says what unset means.
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, like every other input error; the full usage is one --help away.
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(suppress: bool = False) -> argparse.ArgumentParser:
    """The parser of bundle.config.options' table; suppress: only what the command line gives is set."""
    p = _Parser(
        prog="main.py",
        description=DESCRIPTION,
        formatter_class=_Formatter,
        argument_default=argparse.SUPPRESS if suppress else None,
    )
    options.add_arguments(p, suppress=suppress)
    return p


def _merge_yaml(args: argparse.Namespace, explicit: set[str]) -> set[str]:
    """--config: the file's values where the command line gives none; returns the dests it names."""
    try:
        with open(args.config) as f:
            values = yaml_input.load_yaml(f) or {}
    except yaml_input.ExpandingAlias as exc:
        raise ConfigError("--config", args.config, str(exc)) from None
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ConfigError(
            "--config", args.config, f"must be a readable YAML file ({_one_line(exc)})"
        ) from None
    if not isinstance(values, dict):
        raise ConfigError("--config", args.config, "must hold a mapping of option: value")
    named = set()
    for key, value in values.items():
        opt = options.BY_YAML_KEY.get(str(key).replace("-", "_"))
        if opt is None:
            allowed = ", ".join(sorted(options.BY_YAML_KEY))
            raise ConfigError(f"--config {args.config} key", key, f"allowed keys: {allowed}")
        named.add(opt.dest)
        if opt.dest not in explicit:
            setattr(args, opt.dest, opt.from_yaml(value, f"{key} (in --config {args.config})"))
    return named


def _one_line(exc: Exception) -> str:
    """A YAML parser's complaint without the quoted snippet it spreads over several lines."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is not None and problem:
        return f"line {mark.line + 1}: {problem}"
    return " ".join(str(exc).split())


# The options that choose the data: where either is given, a plan's data are not used.
_DATA_CHOICE = {"data", "dataset"}


def _merge_plan(args: argparse.Namespace, explicit: set[str], given: set[str]) -> None:
    """--plan: the plan's options beat a --config file's; the command line must agree with them.
    The plan's data are used where neither the command line nor --config (``given``) names data."""
    from bundle import plan_file

    run, args.placement, data = plan_file.load(args.plan)
    if not given & _DATA_CHOICE:
        for key, value in data.items():
            opt = options.BY_YAML_KEY.get(str(key).replace("-", "_"))
            if opt is None:
                raise ConfigError(
                    f"--plan {args.plan}: data option", key, "is not a main.py option"
                )
            if opt.dest not in given:
                setattr(args, opt.dest, opt.from_yaml(value, f"{key} (in --plan {args.plan})"))
    for key, value in run.items():
        opt = options.BY_YAML_KEY.get(str(key).replace("-", "_"))
        if opt is None:
            raise ConfigError(f"--plan {args.plan}: option", key, "is not a main.py option")
        planned = opt.from_yaml(value, f"{key} (in --plan {args.plan})")
        if opt.dest in explicit and getattr(args, opt.dest) != planned:
            raise ConfigError(
                opt.flag, getattr(args, opt.dest), f"disagrees with --plan {args.plan} ({value})"
            )
        setattr(args, opt.dest, planned)


def _torchrun_layout(env: dict[str, str]) -> dict[str, Any]:
    # torchrun has laid out the nodes already; its environment beats the node flags.
    nproc = int(env["LOCAL_WORLD_SIZE"])
    return {
        "torchrun": True,
        "nproc_per_node": nproc,
        "num_nodes": max(1, int(env["WORLD_SIZE"]) // nproc),
        "node_rank": int(env.get("GROUP_RANK", int(env["RANK"]) // nproc)),
    }


def _dp_only(args: argparse.Namespace, parallel: dict[str, Any], launch: dict[str, Any]) -> None:
    """--DP-ONLY: one stage over every process of the job."""
    if parallel["shape"] == C.AUTO_SHAPE:
        raise ConfigError("--DP-ONLY", True, "fixes the shape: drop it or --bundle-shape auto")
    nproc, nodes = launch["nproc_per_node"], launch["num_nodes"]
    total = sum(parallel["shape"]) * parallel["num_bundles"]
    procs = args.num_hp or (nproc * nodes if nproc else total)
    parallel.update(shape=(procs,), num_bundles=1)


def to_config(args: argparse.Namespace, env: dict[str, str]) -> C.RunConfig:
    """The one place flags become the typed, frozen RunConfig.

    The table fills every field; what follows are the rules between options that no one entry
    can state.
    """
    from bundle.launch import slurm
    from bundle.models.partition import split_model_name

    values = options.field_values(args)
    parallel, data, launch, model = (values[k] for k in ("parallel", "data", "launch", "model"))
    model["name"], model["partition"] = split_model_name(model["name"], model["partition"])
    torchrun = "LOCAL_WORLD_SIZE" in env and "RANK" in env
    allocation = None if torchrun else slurm.allocation(env)  # srun torchrun ...: torchrun's
    if torchrun:
        launch.update(_torchrun_layout(env))
    elif allocation is not None:
        # srun started one main.py per node: the job step's layout beats the node flags.
        launch.update(allocation.launch_fields(launch["nproc_per_node"]))
    if args.DP_ONLY:
        _dp_only(args, parallel, launch)
    parallel["placement"] = getattr(args, "placement", ())
    data["dataset"] = data["dataset"] or ("imagefolder" if data["root"] else "digits")
    cfg = options.build(values)
    moved = [r for r, p in enumerate(cfg.parallel.placement) if p[0] != r // cfg.procs_per_node]
    if torchrun and moved:
        raise ConfigError(
            "--plan",
            args.plan,
            f"places rank {moved[0]} off the node torchrun gives it (ranks "
            "fill nodes in order there); start main.py on each node instead (docs/mixed-devices.md)",
        )
    if allocation is not None:
        allocation.check_fits(cfg)
    return cfg


def parse(argv: list[str] | None, env: dict[str, str]) -> C.RunConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    explicit = set(vars(build_parser(suppress=True).parse_args(argv)))
    given = set(explicit)
    if args.config:
        given |= _merge_yaml(args, explicit)
    if args.plan:
        _merge_plan(args, explicit, given)
    return to_config(args, env)


def main(argv: list[str] | None = None) -> int:
    """main.py: parse, check everything before any process starts, then launch; the exit code."""
    # Imported here: parsing needs none of the engine (tests and tools parse without it).
    from bundle import preflight
    from bundle.launch import process
    from bundle.launch.supervisor import supervise

    env = dict(os.environ)
    lock = None

    def take_save_dir(cfg: C.RunConfig) -> None:
        nonlocal lock
        lock = _lock_save_dir(cfg, env)

    try:
        plan = preflight.check_all(parse(argv, env), env, before_resume=take_save_dir)
        torchrun = process.torchrun_env() if plan.cfg.launch.torchrun else None
        if torchrun is not None:
            return process.run_torchrun(plan.cfg, plan.topo, torchrun, plan.resume, plan.capture)
        return supervise(plan.cfg, plan.topo, plan.resume, plan.capture)
    except BundleError as exc:
        print(f"main.py: error: {exc}", file=sys.stderr)
        return ExitCode.INPUT
    finally:
        if lock is not None:
            lock.release()


def _lock_save_dir(cfg: C.RunConfig, env: dict[str, str]) -> Any:
    """The job's first process (node 0's supervisor, torchrun's rank 0) takes the save directory
    before anything is written, and puts right what an interrupted save of an earlier job left."""
    from bundle.checkpoint import format as ckpt
    from bundle.checkpoint.lock import DirLock, job_id

    first = int(env["RANK"]) == 0 if cfg.launch.torchrun else cfg.launch.node_rank == 0
    save_dir = cfg.checkpoint.save_dir
    if not save_dir or not first:
        return None
    lock = DirLock(save_dir, job_id(env))
    note = lock.acquire()
    for line in ([note] if note else []) + ckpt.recover(save_dir):
        print(f"main.py: note: {line}", file=sys.stderr)
    return lock
