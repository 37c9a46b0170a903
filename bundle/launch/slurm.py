"""A Slurm job step as the node layout: ``srun`` starts one ``main.py`` per node, which reads the rest.

Inside ``srun --ntasks-per-node=1 python main.py ...`` every task finds in its environment:

    SLURM_STEP_ID                          set in a job step (not in the batch script itself)
    SLURM_NODEID                           this node, 0 .. nodes-1        -> --rank
    SLURM_STEP_NUM_NODES | SLURM_NNODES    the step's nodes               -> --world-size
    SLURM_STEP_NODELIST | SLURM_JOB_NODELIST
                                           e.g. gpu[07-08]; the first host -> --IP
    SLURM_STEP_NUM_TASKS | SLURM_NTASKS    must equal the nodes: one main.py per node
    SLURM_GPUS_ON_NODE                     GPUs per node -> --nproc-per-node (unless given)

main.py stays each node's supervisor, as with the original flags, so failure reports, restarts
and the SIGTERM checkpoint work unchanged. The first host comes from ``scontrol show hostnames``
(Slurm's own expansion) where scontrol is on PATH, else from ``first_host``, which reads the
compressed syntax itself (containers started by srun often lack scontrol).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

from bundle.config import RunConfig
from bundle.errors import ConfigError

# Not steps that srun launched: the batch script's own and the "extern" step of every job.
_NOT_SRUN_STEPS = {"4294967294", "batch", "4294967295", "extern"}


@dataclass(frozen=True)
class Allocation:
    """The part of a Slurm job step that decides where this node's processes run."""

    node_rank: int
    num_nodes: int
    tasks: int
    master: str
    gpus_per_node: int  # 0: no GPUs allocated

    def launch_fields(self, nproc_per_node: int) -> dict:
        """LaunchConfig values; an explicit ``--nproc-per-node`` beats the GPUs on the node."""
        if self.tasks != self.num_nodes:
            raise ConfigError(
                "SLURM_NTASKS",
                self.tasks,
                f"run one task per node (srun --ntasks-per-node=1; this step has "
                f"{self.num_nodes} node(s)): main.py starts each node's processes itself",
            )
        return {
            "node_rank": self.node_rank,
            "num_nodes": self.num_nodes,
            "master_addr": self.master,
            "nproc_per_node": nproc_per_node or self.gpus_per_node,
        }

    def check_fits(self, cfg: RunConfig) -> None:
        """The allocation must hold exactly the processes the bundle shape needs."""
        nodes, nproc_per_node = self.num_nodes, cfg.launch.nproc_per_node
        shape, world_size = cfg.parallel.shape, cfg.parallel.world_size
        what = f"shape {','.join(map(str, shape))} x {cfg.parallel.num_bundles} bundle(s)"
        if nproc_per_node == 0:
            if world_size % nodes:
                raise ConfigError(
                    "the Slurm allocation",
                    f"{nodes} nodes",
                    f"{what} needs {world_size} processes, which do not spread evenly over "
                    f"{nodes} nodes; allocate other nodes or set --nproc-per-node",
                )
            return
        if nproc_per_node * nodes != world_size:
            per_node = (
                f"{self.gpus_per_node} GPUs (SLURM_GPUS_ON_NODE)"
                if nproc_per_node == self.gpus_per_node
                else f"{nproc_per_node} processes (--nproc-per-node)"
            )
            raise ConfigError(
                "the Slurm allocation",
                f"{nodes} node(s) x {per_node}",
                f"{what} needs {world_size} processes, not {nodes * nproc_per_node}; change "
                "--bundle-shape/--num-bundle, the allocation, or --nproc-per-node",
            )


def allocation(env: dict[str, str]) -> Allocation | None:
    """The Slurm job step this process is a task of; None outside one (or in the batch script)."""
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    if step is None or step in _NOT_SRUN_STEPS or "SLURM_NODEID" not in env:
        return None
    nodelist = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    nodes = int(_first(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"))
    return Allocation(
        node_rank=int(env["SLURM_NODEID"]),
        num_nodes=nodes,
        tasks=int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", nodes))),
        master=master_host(nodelist, env),
        gpus_per_node=int(env.get("SLURM_GPUS_ON_NODE") or 0),
    )


def _first(env: dict[str, str], *keys: str) -> str:
    for key in keys:
        if env.get(key):
            return env[key]
    raise ConfigError(keys[0], None, f"a Slurm job step sets one of {', '.join(keys)}")


def master_host(nodelist: str, env: dict[str, str]) -> str:
    """The first host of ``nodelist``: node 0, which hosts the job's store."""
    scontrol = shutil.which("scontrol", path=env.get("PATH"))
    if scontrol:
        try:
            out = subprocess.run(
                [scontrol, "show", "hostnames", nodelist],
                env=env,
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout.split()
            if out:
                return out[0]
        except (OSError, subprocess.SubprocessError):
            pass  # the syntax is read below
    return first_host(nodelist)


_BRACKETS = re.compile(r"\[([^\]]*)\]")


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: ``gpu[07-08,11],cpu1`` -> ``gpu07``.

    Hosts are separated by commas outside brackets; a bracket holds numbers and ranges (zero
    padding kept) and the list expands in the order written, so the first host takes the first
    number of every bracket of the first entry.
    """
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            end = i
            break
    entry = nodelist[:end].strip()
    host = _BRACKETS.sub(lambda m: m.group(1).split(",")[0].split("-")[0].strip(), entry)
    if not entry or depth < 0 or not host or any(c in host for c in "[], "):
        raise ConfigError("SLURM_JOB_NODELIST", nodelist, "must be a Slurm host list")
    return host
