"""A process's device and backend: which backend a run uses, whether this node has the devices
for it, and the per-process settings made before any process group exists."""

from __future__ import annotations

import os
import socket
import sys

import torch

from bundle.config import RunConfig
from bundle.errors import ConfigError
from bundle.topology import Topology

MULTI_RANK_GPU_ENV = "NCCL_MULTI_RANK_GPU_ENABLE"
HOSTID_ENV = "NCCL_HOSTID"
MULTI_RANK_NCCL = (2, 30, 0)  # the first NCCL with a multi-rank mode


def resolve_backend(cfg: RunConfig) -> str:
    if cfg.launch.backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return cfg.launch.backend


def torch_backend(backend: str) -> str:
    """The torch.distributed backend under ours: nccl-emu is gloo with NCCL's ordering on top."""
    return "gloo" if backend == "nccl-emu" else backend


def check_devices(cfg: RunConfig, topo: Topology) -> None:
    """More processes per node than devices is an input error, found before anything starts,
    unless ``--share-gpus`` asks for several processes on one device (for testing). A plan
    made for GPUs run on a node without any is said to run on its CPUs instead."""
    if resolve_backend(cfg) != "nccl":
        gpus = sorted({p[2] for p in cfg.parallel.placement if p[1] is not None})
        if gpus and not torch.cuda.is_available():
            print(
                f"main.py: note: --plan was made for {topo.num_nodes} node(s) of "
                f"{topo.procs_per_node} {'/'.join(gpus)} GPU(s); this node has no CUDA device, "
                f"so its {topo.procs_per_node} processes run on its CPUs (backend "
                f"{resolve_backend(cfg)})",
                file=sys.stderr,
            )
        return
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found == 0 or (topo.procs_per_node > found and not cfg.launch.share_gpus):
        allowed = f"the nccl backend drives one CUDA device per process and this node has {found}"
        if found:
            allowed += "; --share-gpus runs several processes per GPU (to test with fewer GPUs)"
        raise ConfigError("--nproc-per-node", topo.procs_per_node, allowed)
    mine = topo.node_ranks(cfg.launch.node_rank) if cfg.launch.node_rank < topo.num_nodes else ()
    for rank in mine:
        index = topo.device_index(rank)
        if index >= found and not cfg.launch.share_gpus:
            raise ConfigError(
                "--plan",
                f"{topo.describe(rank)} on cuda:{index}",
                f"this node has {found} CUDA device(s)",
            )
        check_precision(cfg.compute.precision, rank, index % found, topo)


def check_precision(precision: str, rank: int, index: int, topo: Topology) -> None:
    """bf16 needs compute capability 8.0 (A100 and later); a V100 or T4 is refused, by name."""
    if precision != "bf16":
        return
    major, minor = torch.cuda.get_device_capability(index)
    if major < 8:
        name = torch.cuda.get_device_name(index)
        raise ConfigError(
            "--precision",
            precision,
            f"{topo.describe(rank)} runs on cuda:{index}, a {name} (compute capability "
            f"{major}.{minor}) without bf16 arithmetic; use fp16 or fp32 there",
        )


def _interface_of(address: str) -> str | None:
    """The name of the local interface holding IPv4 ``address`` (Linux ioctl, no packets sent)."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                got = socket.inet_ntoa(fcntl.ioctl(s.fileno(), siocgifaddr, req)[20:24])
            except OSError:
                continue
            if got == address:
                return name
    return None


def pin_gloo_interface(master: str, port: int) -> None:
    """Unless set, point GLOO_SOCKET_IFNAME at the interface that routes to the master.

    Gloo otherwise binds to whatever the hostname resolves to, often 127.0.1.1 or a container
    bridge, and peers on other hosts cannot connect back.
    """
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(master), port))  # UDP connect: a route lookup only
            local = s.getsockname()[0]
    except OSError:
        return
    name = _interface_of(local)
    if name and not local.startswith("127."):
        os.environ["GLOO_SOCKET_IFNAME"] = name


def prepare_backend_env(
    backend: str, host: str, port: int, procs_per_node: int, *, cpu_share: float | None = None
) -> None:
    """Per-process settings made before any process group exists.

    The CPU threads are shared out only on gloo (the process computes on the CPU); a process
    limited to ``cpu_share`` of one CPU (an emulated slower device) keeps a thread per whole CPU
    of its share, at least one: more threads than that only wait on the quota together. The gloo
    interface is pinned whatever the backend: an NCCL job creates gloo groups too (the control
    and async groups), and those fail to connect across nodes the same way.
    """
    if backend == "gloo":
        threads = max(1, (os.cpu_count() or 1) // procs_per_node)
        if cpu_share is not None:
            threads = max(1, min(threads, int(cpu_share)))
        torch.set_num_threads(threads)
    pin_gloo_interface(host, port)


def allow_shared_gpu(nccl: tuple[int, ...] | None = None) -> str:
    """Let NCCL place several ranks of one communicator on one GPU; returns the variable set.

    NCCL otherwise refuses two ranks on one device at communicator creation ("Duplicate GPU
    detected"). From 2.30, NCCL_MULTI_RANK_GPU_ENABLE=1 lets them share it, point-to-point
    through CUDA IPC (not compatible with NCCL_NVLS_ENABLE=1). Before 2.30 (torch 2.11 ships
    2.28) the way is a distinct NCCL_HOSTID per process: NCCL then takes every peer for another
    host and moves data over its network transport, staged through host memory. ``nccl``: the
    version to plan for (default: this torch's). NCCL reads its environment when it first
    initialises, so this must run in the worker before the process group is created; a value the
    user set is kept.
    """
    found = nccl if nccl is not None else torch.cuda.nccl.version()
    if tuple(found) >= MULTI_RANK_NCCL:
        os.environ.setdefault(MULTI_RANK_GPU_ENV, "1")
        return MULTI_RANK_GPU_ENV
    os.environ.setdefault(HOSTID_ENV, f"{socket.gethostname()}-pid{os.getpid()}")
    return HOSTID_ENV


ASYNC_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def survivable_nccl() -> None:
    """Under --fault-tolerance bundle: NCCL's own watchdog must not take a survivor down when a
    peer of another bundle is lost (by default it ends the process on such an error, which
    would take the survivor's bundle out too); the loss watch and the step watchdog act instead.
    Must run before the process group is created; a value the user set is kept."""
    os.environ.setdefault(ASYNC_ERROR_HANDLING_ENV, "0")


def device_for(backend: str, local_rank: int, *, share_gpus: bool = False) -> torch.device:
    """This process's device, made current: ``cuda:local_rank`` with nccl; with ``share_gpus``,
    ``cuda:(local_rank % devices)`` (round-robin, several ranks per GPU allowed); else the CPU.
    """
    if backend != "nccl":
        return torch.device("cpu")
    index = local_rank
    if share_gpus:
        allow_shared_gpu()
        index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
