"""An elastic torchrun job (``--nnodes 1:2``) that loses a node goes on at the shape planned for
the processes left, from the newest checkpoint, to the end.

Two torchrun agents on loopback, one process each. The second node's worker kills itself as step
7 begins (``BUNDLE_FAULT=1:7``); its agent, whose monitor is set to look only once a minute, is
then killed with its process group, as a lost machine would be. The first agent re-forms the group
alone, ``--bundle-shape auto`` plans for one process, and training resumes from step-6. Its final
weights must equal those of a run started at that shape from that checkpoint (``torch.equal``).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from bundle.launch.localworld import free_port
from bundle.runtime import keys
from bundle.runtime.store import open_generation
from tests.integration.test_resume import assert_identical
from tests.support.processes import SMALL, finish, start

STEPS, SAVE_EVERY, FAULT_STEP = 12, 3, 7
RUN = [*SMALL, "--itr", str(STEPS), "--save-every", str(SAVE_EVERY), "--keep", "10"]
RUN += ["--backend", "gloo", "--timeout", "20", "--init-timeout", "30"]
# A lost node is found after keep_alive_interval x keep_alive_max_attempt s; the survivors wait
# last_call_timeout s for others, all within join_timeout (docs: failures, elastic runs).
RDZV_CONF = "join_timeout=60,last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3"
_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def _agent(port: int, local_addr: str, monitor_s: float, save_dir: Path, out: Path, **env):
    """One node's torchrun agent; its address orders the nodes (127.0.0.1 is node 0)."""
    environ = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    # The agents serve no store: each rendezvous round's rank 0 serves a fresh one.
    environ.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONUNBUFFERED="1", **env)
    return start(
        "-m", "torch.distributed.run",
        "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", "elastic-test", "--rdzv-conf", RDZV_CONF,
        "--local-addr", local_addr, "--monitor-interval", str(monitor_s),
        "main.py", *RUN, "--bundle-shape", "auto", "--resume", "auto",
        "--save-dir", str(save_dir), "--checkpoint", str(out),
        env=environ,
    )  # fmt: skip


def _wait_for(what: str, ready, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout:.0f}s")
        time.sleep(0.05)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _children(pid: int) -> dict[int, str]:
    """pid -> state letter of each child of ``pid`` (Z: exited, not yet reaped)."""
    out = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid:
            out[int(entry.name)] = state
    return out


def _join_all(store: dist.Store, world: int) -> list[int]:
    got = [0] * world

    def join(rank: int) -> None:
        got[rank] = open_generation(store, rank, world, timeout=10)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    return got


def test_each_group_of_workers_gets_a_fresh_key_space_whatever_an_earlier_one_left():
    """The store outlives the groups: stale tokens and acknowledgements of an earlier group of
    another size are passed over, and every rank of the new group agrees on a new number."""
    store = dist.HashStore()
    first = _join_all(store, 3)
    assert len(set(first)) == 1
    # An earlier group's worker left a token that nobody answered (it died before rank 0 saw it).
    store.set("bundle/hello/1", "stale")
    second = _join_all(store, 2)
    assert len(set(second)) == 1 and second[0] > first[0]
    assert not store.check([keys.generation_joined(second[0], 2)])


@pytest.mark.slow
def test_a_lost_node_leaves_the_survivor_training_at_a_replanned_shape(tmp_path):
    port = free_port()
    save_dir = tmp_path / "ckpt"
    survivor = _agent(port, "127.0.0.1", 0.2, save_dir, tmp_path / "elastic.pt")
    lost = None
    try:
        # The survivor serves the rendezvous (it binds the endpoint first), as node 0 would.
        _wait_for("the first agent listened", lambda: _listening(port))
        lost = _agent(port, "127.0.0.2", 60, save_dir, tmp_path / "lost.pt", BUNDLE_FAULT="1:7")
        # Rank 1 (on the second node) kills itself as step 7 begins; its agent looks again only
        # in a minute, so the dead worker stays its unreaped child until the node goes.
        _wait_for(
            "the second node's worker died",
            lambda: "Z" in _children(lost.pid).values(),
            timeout=120,
        )
        os.killpg(lost.pid, signal.SIGKILL)
        code, out, err = finish(survivor, timeout=180)
    finally:
        for p in (survivor, lost):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert code == 0, err
    resumed = re.search(r"resumed from (\S+) \(step (\d+)", out + err)
    assert resumed and int(resumed.group(2)) == FAULT_STEP - 1, err
    plans = re.findall(r"main\.py: plan: (.*?);", err)
    assert plans[-1].startswith("--bundle-shape 1 --num-bundle 1"), plans

    # The same shape from the same checkpoint, one process started directly.
    ref = start(
        "main.py", *RUN, *plans[-1].split(),
        "--resume", resumed.group(1), "--checkpoint", str(tmp_path / "ref.pt"),
        "--portNum", str(free_port()),
    )  # fmt: skip
    rcode, _, rerr = finish(ref)
    assert rcode == 0, rerr
    assert_identical(tmp_path / "ref.pt", tmp_path / "elastic.pt")
