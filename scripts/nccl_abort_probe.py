"""Does aborting NCCL communicators free a process whose peer died? The question behind
``--fault-tolerance bundle`` on NCCL (docs/fault-tolerance.md), asked without Bundle's engine.

    python scripts/nccl_abort_probe.py --json probe.json            # on a machine with a GPU

Three ranks on the machine's first GPU (``--share-gpus``' way: NCCL's multi-rank mode or a host id
per process) train a loop of collectives: an all-reduce over all three, one over ranks 0 and 2
(a second communicator, which rank 0 has in flight behind the first), a point-to-point message
from rank 2 to rank 1, then a CPU all-reduce on gloo. Rank 2 SIGKILLs itself as step 20
begins; this script marks it dead in the store (as a node supervisor would), and a thread of each
survivor aborts its communicators once it sees the mark. Per variant, each survivor reports
whether and when its abort returned, what its main thread raised, how long
``destroy_process_group`` took, and whether the two survivors then formed a new world and
all-reduced in it:

- ``grouped``: torch's ``_abort_process_group()`` (every communicator in one NCCL group);
- ``grouped-nonblocking``: the same on non-blocking communicators
  (``TORCH_NCCL_USE_COMM_NONBLOCKING=1``), as TorchFT and Bundle use them;
- ``one-by-one``: ``ProcessGroupNCCL.abort()`` on each group in turn;
- ``none``: no abort (what NCCL reports by itself);
- ``offload-exit``: no abort: copy a tensor to the host on a fresh stream while the kernels
  still wait, then leave (``os._exit``): can a survivor save its state and end itself?

``-noaeh`` after a variant's name also turns off torch's NCCL watchdog handling
(``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``). Each report also gives the seconds from the mark to
each process's exit, the survivors' NCCL abort log lines (``NCCL_DEBUG=INFO``) and, for a
survivor still running at the limit, its stacks (``py-spy dump --native``, where installed).

Measured on one H200 (torch 2.11.0, NCCL 2.28.9; docs/fault-tolerance.md): every abort variant
left the survivor with two communicators in flight stuck in the abort, while ``offload-exit``'s
survivors copied in 4-9 ms and were gone 0.2 s after the mark: the way
``--fault-tolerance bundle`` takes on NCCL (bundle.launch.ft.handoff).

Each variant gets ``--limit`` seconds; a survivor still running then is killed (its report says
what it reached).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {
    "grouped": {},
    "grouped-nonblocking": {"TORCH_NCCL_USE_COMM_NONBLOCKING": "1"},
    "one-by-one": {},
    "none": {},
    "offload-exit": {"TORCH_NCCL_USE_COMM_NONBLOCKING": "1"},
}
NO_AEH = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
NCCL_LOG = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT"}
KILL_AT = 20
SIZE = 1 << 20


def _say(**fields) -> None:
    print("PROBE " + json.dumps(fields), flush=True)


def _abort(variant: str, device) -> None:
    import torch.distributed as dist

    if variant.startswith("grouped"):
        dist.distributed_c10d._abort_process_group()
        return
    for pg in list(dist.distributed_c10d._world.pg_map):
        try:
            backend = pg._get_backend(device)
        except RuntimeError:
            continue
        if "NCCL" in type(backend).__name__:
            backend.abort()


def _env(variant: str) -> dict[str, str]:
    base = variant.removesuffix("-noaeh")
    return {**VARIANTS[base], **(NO_AEH if base != variant else {}), **NCCL_LOG}


def _offload_exit(x, started: float) -> None:
    import torch

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        host = x.to("cpu")
    side.synchronize()
    _say(
        rank=int(os.environ.get("PROBE_RANK", -1)),
        event="copied",
        seconds=time.monotonic() - started,
        sum=float(host.sum()),
    )
    os._exit(3)


def worker(rank: int, variant: str, port: int) -> None:
    os.environ.update(_env(variant), PROBE_RANK=str(rank))
    os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", "30")
    import torch
    import torch.distributed as dist

    from bundle.runtime.devices import allow_shared_gpu

    allow_shared_gpu()
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timeout=timedelta(seconds=60))
    timeout = timedelta(seconds=40)
    dist.init_process_group(
        "nccl", store=dist.PrefixStore("e0", store), rank=rank, world_size=3, timeout=timeout,
        device_id=device,
    )  # fmt: skip
    control = dist.new_group(backend="gloo", timeout=timeout)
    pair = dist.new_group([0, 2])
    seen: dict[str, float] = {}

    x = torch.ones(SIZE, device=device)

    def watch() -> None:
        while not store.check(["dead"]):
            time.sleep(0.05)
        seen["mark"] = time.monotonic()
        if variant.startswith("offload-exit"):
            _offload_exit(x, seen["mark"])
        _abort(variant, device)
        _say(rank=rank, event="abort returned", after_mark_s=time.monotonic() - seen["mark"])

    if rank != 2 and variant != "none":
        threading.Thread(target=watch, daemon=True).start()
    try:
        for step in range(10_000):
            if rank == 2 and step == KILL_AT:
                os.kill(os.getpid(), signal.SIGKILL)
            y = x.clone()
            dist.all_reduce(y)
            if rank != 1:
                dist.all_reduce(x.clone(), group=pair)
            if rank == 1:
                dist.recv(torch.empty(SIZE // 16, device=device), src=2)
            elif rank == 2:
                dist.send(x[: SIZE // 16].contiguous(), dst=1)
            dist.all_reduce(torch.tensor([y[0].item()]), group=control)
        return
    except Exception as exc:  # noqa: BLE001 - what it raised is the finding
        now = time.monotonic()
        _say(
            rank=rank, event="step raised", error=f"{type(exc).__name__}: {str(exc)[:200]}",
            after_mark_s=now - seen.get("mark", now),
        )  # fmt: skip
    t = time.monotonic()
    if dist.is_initialized():
        dist.destroy_process_group()
    _say(rank=rank, event="destroyed", seconds=time.monotonic() - t)
    t = time.monotonic()
    dist.init_process_group(
        "nccl", store=dist.PrefixStore("e1", store), rank=rank, world_size=2, timeout=timeout,
        device_id=device,
    )  # fmt: skip
    y = torch.full((SIZE,), float(rank + 1), device=device)
    dist.all_reduce(y)
    _say(rank=rank, event="new world", seconds=time.monotonic() - t, value=y[0].item())
    dist.destroy_process_group()


def _stacks(pid: int) -> str:
    """A running process's native and Python stacks (py-spy), or why there are none."""
    spy = shutil.which("py-spy")
    if spy is None:
        return "py-spy is not installed"
    try:
        done = subprocess.run(
            [spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True, timeout=15
        )
    except subprocess.TimeoutExpired:
        return "py-spy timed out"
    return (done.stdout + done.stderr)[-6000:]


def probe(variant: str, port: int, limit: float) -> dict:
    import torch.distributed as dist

    argv = [sys.executable, __file__, "--worker", variant, str(port)]
    procs = [
        subprocess.Popen(
            [*argv, str(rank)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for rank in range(3)
    ]
    deadline, marked = time.monotonic() + limit, 0.0
    exits: list[float | None] = [None, None, None]
    while time.monotonic() < deadline and any(p.poll() is None for p in procs[:2]):
        if not marked and procs[2].poll() is not None:
            client = dist.TCPStore("127.0.0.1", port, 3, False, timeout=timedelta(seconds=10))
            client.set("dead", "rank 2 was killed")
            marked = time.monotonic()
        for i, p in enumerate(procs):
            if marked and exits[i] is None and p.poll() is not None:
                exits[i] = round(time.monotonic() - marked, 3)
        time.sleep(0.02)
    for i, p in enumerate(procs):
        if marked and exits[i] is None and p.poll() is not None:
            exits[i] = round(time.monotonic() - marked, 3)
    stacks = {r: _stacks(p.pid) for r, p in enumerate(procs) if p.poll() is None}
    for p in procs:
        if p.poll() is None:
            p.kill()
    outs = [p.communicate()[0] for p in procs]
    return {
        "exit_codes": [p.returncode for p in procs],
        "exit_after_mark_s": exits,
        "abort_log": [
            [line[-160:] for line in out.splitlines() if "bort" in line or "rror" in line][-12:]
            for out in outs[:2]
        ],
        "stacks": stacks,
        "reports": [
            json.loads(line[len("PROBE ") :])
            for out in outs
            for line in out.splitlines()
            if line.startswith("PROBE ")
        ],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--worker", nargs=3, metavar=("VARIANT", "PORT", "RANK"), help=argparse.SUPPRESS)
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help="which, comma-separated (NAME-noaeh too)"
    )
    p.add_argument("--limit", type=float, default=25.0, help="seconds per variant")
    p.add_argument("--port", type=int, default=29610)
    p.add_argument("--json", help="write the report here too")
    a = p.parse_args(argv)
    if a.worker:
        variant, port, rank = a.worker
        worker(int(rank), variant, int(port))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("nccl_abort_probe: needs a CUDA device", file=sys.stderr)
        return 2
    result = {
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "gpu": torch.cuda.get_device_name(0),
        "variants": {v: probe(v, a.port + i, a.limit) for i, v in enumerate(a.variants.split(","))},
    }
    text = json.dumps(result, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
