"""Two network namespaces joined by a veth pair: two "hosts" on one machine, for multi-node tests.

    with NetnsPair() as hosts:
        p = hosts.run_in(hosts.a, [sys.executable, "main.py", ...], env)

Namespace ``a`` holds ``hosts.addr_a`` on ``hosts.if_a``, namespace ``b`` holds ``hosts.addr_b`` on
``hosts.if_b``; each also has ``lo`` up. The veth ends are created directly inside the namespaces,
so nothing appears in the host's own network and no traffic leaves these two namespaces.

On exit every process started through ``run_in`` (its whole process group) and every process
still inside either namespace is killed by pid, then both namespaces are deleted, also when the
body raised. Without root, without ``ip``, or when ``ip netns add`` is refused (no
CAP_SYS_ADMIN), entering skips the calling test.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[2]
# A private /30 that only ever exists on the two veth ends inside the test namespaces.
SUBNET_PREFIX = "10.213.77"
PREFIX_LEN = 30
_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def _skip_reason() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    return None


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the process group ``run_in`` gave ``proc`` (group id = its pid), leader gone or not."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


class NetnsPair:
    """Context manager: namespaces ``a`` and ``b`` with a veth pair between them."""

    def __init__(self) -> None:
        pid, n = os.getpid(), next(_counter)
        self.a = f"bundle-test-{pid}-{n}-a"
        self.b = f"bundle-test-{pid}-{n}-b"
        # Interface names are limited to 15 characters; each lives in its own namespace anyway.
        self.if_a = f"bv{pid % 10_000_000}-{n % 100}a"
        self.if_b = f"bv{pid % 10_000_000}-{n % 100}b"
        self.addr_a = f"{SUBNET_PREFIX}.1"
        self.addr_b = f"{SUBNET_PREFIX}.2"
        self.procs: list[subprocess.Popen] = []
        self._created: list[str] = []

    def ifname(self, ns: str) -> str:
        return {self.a: self.if_a, self.b: self.if_b}[ns]

    def addr(self, ns: str) -> str:
        return {self.a: self.addr_a, self.b: self.addr_b}[ns]

    def __enter__(self) -> NetnsPair:
        reason = _skip_reason()
        if reason:
            pytest.skip(reason)
        try:
            for ns in (self.a, self.b):
                res = _ip("netns", "add", ns, check=False)
                if res.returncode != 0:
                    pytest.skip(f"'ip netns add' failed: {res.stderr.strip() or res.returncode}")
                self._created.append(ns)
            # Both ends are born inside their namespaces: the host's network never sees them.
            res = _ip(
                "link", "add", self.if_a, "netns", self.a, "type", "veth",
                "peer", "name", self.if_b, "netns", self.b,
                check=False,
            )  # fmt: skip
            if res.returncode != 0:
                pytest.skip(f"cannot create a veth pair: {res.stderr.strip() or res.returncode}")
            for ns in (self.a, self.b):
                dev = self.ifname(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(ns)}/{PREFIX_LEN}", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
            self._wait_link_up()
        except BaseException:
            self._cleanup()
            raise
        return self

    def _wait_link_up(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [
                _ip("-n", ns, "-o", "link", "show", self.ifname(ns)).stdout
                for ns in (self.a, self.b)
            ]
            if all("state UP" in s or "LOWER_UP" in s for s in states):
                return
            time.sleep(0.1)
        raise RuntimeError(f"veth pair {self.if_a}/{self.if_b} did not come up within {timeout}s")

    def run_in(
        self,
        ns: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        **popen_kwargs,
    ) -> subprocess.Popen:
        """Start ``ip netns exec NS argv...`` in its own process group; killed on exit."""
        if ns not in (self.a, self.b):
            raise ValueError(f"{ns!r} is not one of this pair's namespaces")
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, *argv],
            env=env,
            start_new_session=True,
            **popen_kwargs,
        )
        self.procs.append(proc)
        return proc

    def __exit__(self, *exc) -> None:
        self._cleanup()

    def _cleanup(self) -> None:
        for proc in self.procs:
            _kill_group(proc)
        for ns in self._created:
            # Anything still inside the namespace was started here (the namespace is ours).
            res = _ip("netns", "pids", ns, check=False)
            for pid in res.stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        for ns in reversed(self._created):
            # Deleting the namespace also destroys the veth end living in it.
            _ip("netns", "del", ns, check=False)
        self._created.clear()


# Variables that would switch main.py to torchrun mode or pin another interface.
_DROP = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "TP_SOCKET_IFNAME",
)


def node_env(ifname: str) -> dict[str, str]:
    """The environment of a main.py node inside a namespace: gloo on ``ifname``, no torchrun
    variables, the repository importable."""
    env = {k: v for k, v in os.environ.items() if k not in _DROP}
    env["GLOO_SOCKET_IFNAME"] = ifname
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), env.get("PYTHONPATH")]))
    return env
