"""The job's store (a TCPStore on node 0): rendezvous, the nodes' settings compared field by
field, start-up barriers, and the abort protocol.

The store listens at the address the job names (``--IP``; ``BUNDLE_STORE_BIND`` overrides) and
nowhere else: a single-node job on 127.0.0.1 cannot be reached from the network.

Failure path: a worker that raises writes ``abort`` (rank, stage, step, error) to the store; a
worker that dies is reported by its supervisor; a node that stops heart-beating is reported by
node 0. Every worker polls ``abort`` and exits non-zero; supervisors kill what is left by pid.
The abort is a control key (``bundle.runtime.control``): written sealed, read checked.
Each attempt of a restarted job keeps its keys under its own prefix (``keys.attempt``); under
torchrun, each group of workers the agents start takes a fresh one (``open_generation``).
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import json
import os
import socket
import threading
import time
import uuid
from datetime import timedelta

import torch.distributed as dist

from bundle import log
from bundle.config import DEFAULT_PORT, LaunchConfig, RunConfig
from bundle.errors import ExitCode, LaunchError, PeerFailure
from bundle.runtime import control, keys

BIND_ENV = "BUNDLE_STORE_BIND"  # where the store listens instead of --IP (0.0.0.0: everywhere)
_POLL_S = 0.5
_JOIN_POLL_S = 0.02


def open_store(
    host: str, port: int, *, server: bool, timeout: float, nodes: int = 1
) -> dist.TCPStore:
    """A client of the store at ``host``:``port``, or (``server``) the store itself, listening
    there only (``listen``); ``nodes``: how many nodes must reach it."""
    listening = listen(host, port, nodes=nodes) if server else None
    if not server:
        timeout = _await_server(host, port, timeout)
    try:
        return dist.TCPStore(
            host,
            listening.getsockname()[1] if listening is not None else port,
            is_master=server,
            timeout=timedelta(seconds=timeout),
            wait_for_workers=False,
            master_listen_fd=listening.detach() if listening is not None else None,
        )
    except (RuntimeError, OSError) as exc:
        if server:
            raise LaunchError(f"--portNum {port}: cannot serve the job's store ({exc})") from exc
        raise LaunchError(
            f"cannot reach the master at {host}:{port} within {timeout:.0f}s ({exc})"
        ) from exc


def _await_server(host: str, port: int, timeout: float) -> float:
    """Wait until something accepts connections at ``host``:``port`` (node 0's store), saying
    whom this node waits for after ``SAY_AFTER_S`` and every ``SAY_EVERY_S`` after; returns
    what is left of ``timeout``. Plain connects, so that no refused one prints c10d's traces."""
    start = time.monotonic()
    said = start + SAY_AFTER_S
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return max(1.0, timeout - (time.monotonic() - start))
        except OSError as exc:
            reason = exc.strerror or str(exc)
        now = time.monotonic()
        if now - start > timeout:
            raise LaunchError(
                f"cannot reach the master at {host}:{port} within {timeout:.0f}s ({reason}): "
                "is node 0 started, and --IP its address on a network this node shares?"
            )
        if now >= said:
            log.notice(
                f"waiting for node 0's store at {host}:{port} to answer ({now - start:.0f}s of "
                f"--init-timeout {timeout:.0f}s; {reason})"
            )
            said = now + SAY_EVERY_S
        time.sleep(0.25)


def listen(host: str, port: int, *, nodes: int = 1) -> socket.socket:
    """A socket listening at ``host``:``port`` (or ``BUNDLE_STORE_BIND``) and at no other address
    of this machine (TCPStore's own server listens on every interface, whatever host it is given).
    An address that is not this machine's is refused in one line; a job of several nodes on a
    loopback address is said to be one only nodes on this machine can join."""
    bind = os.environ.get(BIND_ENV) or host
    try:
        family, kind, proto, _, where = socket.getaddrinfo(bind, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise LaunchError(f"--IP {bind}: cannot resolve it on node 0 ({exc})") from None
    address = where[0]
    if nodes > 1 and ipaddress.ip_address(address).is_loopback:
        # Nodes that share this machine (tests, one host with network namespaces) meet there.
        log.notice(
            f"the job's store listens on {address} (--IP {bind}), a loopback address: only "
            f"nodes on this machine can join; give node 0's address on the network the nodes "
            f"share, or set {BIND_ENV}=ADDR"
        )
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT
        sock.bind(where)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRNOTAVAIL:
            raise LaunchError(
                f"--IP {bind} ({address}) is not an address of this machine, where node 0 serves "
                f"the job's store: give node 0's own address, or set {BIND_ENV}=ADDR to listen "
                "there (0.0.0.0: every interface)"
            ) from None
        raise LaunchError(
            f"--portNum {port}: cannot listen on port {port} at {address} ({exc.strerror}); "
            "is it in use?"
        ) from None
    return sock


def open_job_store(launch: LaunchConfig, *, node: int, nodes: int) -> tuple[dist.TCPStore, int]:
    """The job's store and its port: node 0 serves it, every other node joins it.

    A single-node run whose ``--portNum`` was not given takes a free port when ``DEFAULT_PORT``
    is busy, as ``torchrun --standalone`` does, and says which in one line; a port that was given,
    or a job of several nodes (each must know the port beforehand), is held to strictly."""
    given = launch.master_port
    port = DEFAULT_PORT if given is None else given
    try:
        store = open_store(
            launch.master_addr, port, server=node == 0, timeout=launch.init_timeout, nodes=nodes
        )
        return store, port
    except LaunchError:
        if given is not None or nodes > 1:
            raise
    # Port 0: the kernel picks a free one as the store binds it, so no other job can take it
    # between a check and the bind.
    store = open_store(launch.master_addr, 0, server=True, timeout=launch.init_timeout)
    log.notice(
        f"port {port} is in use: the job's store listens on port {store.port} instead "
        "(--portNum PORT chooses one)"
    )
    return store, store.port


def read_abort(store: dist.Store) -> str | None:
    return control.read(store, keys.ABORT)


def post_abort(store: dist.Store, message: str) -> str:
    """Record the job's first failure; returns whichever message won (as one printable line)."""
    return control.put_first(store, keys.ABORT, message)


def _differences(mine: dict, theirs: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key} {a!r} vs {b!r}")
    return out


# When a start-up wait on peers first says who it waits for, and how often it says it again.
SAY_AFTER_S, SAY_EVERY_S = 2.0, 15.0


def wait_joined(
    store: dist.Store,
    prefix: str,
    peers: int,
    timeout: float,
    *,
    what: str = "process",
    where: str = "at the store",
    say: bool = False,
) -> None:
    """Wait until keys ``prefix/0`` .. ``prefix/{peers-1}`` are all set by the ``peers`` (each
    a ``what``, meeting ``where``). ``say``: after ``SAY_AFTER_S`` and every ``SAY_EVERY_S``
    after, one line names the peers not there yet. After ``timeout`` seconds, a LaunchError
    names them."""
    awaited = [f"{prefix}/{i}" for i in range(peers)]
    start = time.monotonic()
    said = start + SAY_AFTER_S
    while not store.check(awaited):
        now = time.monotonic()
        if now - start > timeout or (say and now >= said):
            missing = [i for i, key in enumerate(awaited) if not store.check([key])]
            if not missing:
                return
            who = f"{what} {_listed(missing)} of {peers}"
            if now - start > timeout:
                raise LaunchError(f"{who} did not join the job {where} within {timeout:.0f}s")
            log.notice(
                f"waiting for {who} to join {where} ({now - start:.0f}s of --init-timeout "
                f"{timeout:.0f}s)"
            )
            said = now + SAY_EVERY_S
        time.sleep(0.2 if now - start < SAY_AFTER_S else min(1.0, SAY_EVERY_S / 3))


def _listed(numbers: list[int]) -> str:
    """``[1]`` -> "1"; ``[1, 2, 3, 7]`` -> "1, 2, 3, 7"; more than eight: the first and a count."""
    shown = ", ".join(map(str, numbers[:8]))
    return shown if len(numbers) <= 8 else f"{shown} and {len(numbers) - 8} more"


def exchange_config(
    store: dist.Store, cfg: RunConfig, me: int, peers: int, timeout: float, *, what: str = "node"
) -> None:
    """Every node publishes its config; any difference is reported by field, not left to hang.

    Node 0 hosts the store, so it waits until every node has read the others before it goes on
    (or exits with the error), and every node reports the same mismatch. Node 0 (``what``: the
    peers, "node" or "rank") says which peers it still waits for while it waits.
    """
    # Not the secret: a digest that tells whether two nodes were given the same one.
    mine = {**cfg.shared_view(), "job_secret": control.fingerprint()}
    store.set(keys.config(me), json.dumps(mine))
    where = f"at {cfg.launch.master_addr}:{cfg.launch.master_port or DEFAULT_PORT}"
    joined = functools.partial(wait_joined, store, what=what, where=where, say=me == 0)
    joined(keys.CONFIG, peers, timeout)
    problems = []
    for i in range(peers):
        diff = _differences(mine, json.loads(store.get(keys.config(i))))
        if diff:
            problems.append(f"node {me} vs node {i}: {'; '.join(diff)}")
    store.set(keys.config_read(me), "1")
    if me == 0:
        joined(keys.CONFIG_READ, peers, timeout)
    if problems:
        raise LaunchError(f"the nodes were started with different settings: {problems[0]}")


def store_barrier(store: dist.Store, name: str, world: int, timeout: float) -> None:
    """Wait until ``world`` processes reached ``name``, up to ``timeout`` seconds (start-up only)."""
    key = keys.arrived(name)
    store.add(key, 1)
    deadline = time.monotonic() + timeout
    while (arrived := store.add(key, 0)) < world:
        if time.monotonic() > deadline:
            raise PeerFailure(
                f"only {arrived} of {world} processes reached '{name}' within {timeout:.0f}s"
            )
        time.sleep(0.05)


def start_abort_watch(store: dist.Store, rank: int, me: str) -> None:
    """A daemon thread that ends this process once any other process has recorded a failure."""

    def watch() -> None:
        misses = 0
        while True:
            time.sleep(_POLL_S)
            try:
                msg = read_abort(store)
                misses = 0
            except Exception:  # noqa: BLE001 - the store's host is gone: the job is over
                misses += 1
                if misses < 10:
                    continue
                msg = "lost contact with the job's store (node 0 is gone)"
            if msg is not None and not msg.startswith(me):
                log.get().error(f"stopping rank {rank}: {msg}")
                os._exit(ExitCode.FAILED)

    threading.Thread(target=watch, name="bundle-abort-watch", daemon=True).start()


def open_generation(store: dist.Store, rank: int, world: int, timeout: float) -> int:
    """A number that this group of ``world`` processes shares and no earlier group of the job had.

    Under torchrun the store outlives the groups it served (node 0's agent keeps it across
    restarts and rendezvous rounds), and after a node has joined late the agents' restart counts
    differ, so neither a fixed prefix nor ``TORCHELASTIC_RESTART_COUNT`` names the group. Rank 0
    takes the next number from a counter; every other rank posts a token of its own and waits for
    the number under that token, which no earlier group can have answered. Rank 0 answers whatever
    token it reads for a rank (an earlier group's stale one too) until that rank acknowledges under
    the new number. Every earlier group's workers are gone by then: the agents stop them before
    they rendezvous again.
    """
    if rank != 0:
        token = uuid.uuid4().hex
        store.set(keys.hello(rank), token)
        try:
            store.wait([keys.welcome(token)], timedelta(seconds=timeout))
        except RuntimeError as exc:
            raise PeerFailure(
                f"rank {rank}: rank 0 did not take this process in within {timeout:.0f}s"
            ) from exc
        generation = int(store.get(keys.welcome(token)))
        store.set(keys.generation_joined(generation, rank), "1")
        return generation
    generation = store.add(keys.GENERATION, 1)
    answered: dict[int, str] = {}
    waiting = set(range(1, world))
    deadline = time.monotonic() + timeout
    while waiting:
        for r in sorted(waiting):
            if store.check([keys.generation_joined(generation, r)]):
                waiting.discard(r)
            elif store.check([keys.hello(r)]):
                seen = store.get(keys.hello(r)).decode()
                if answered.get(r) != seen:
                    store.set(keys.welcome(seen), str(generation))
                    answered[r] = seen
        if not waiting:
            break
        if time.monotonic() > deadline:
            missing = ", ".join(map(str, sorted(waiting)))
            raise PeerFailure(
                f"only {world - len(waiting)} of {world} processes joined within "
                f"{timeout:.0f}s (missing ranks: {missing})"
            )
        time.sleep(_JOIN_POLL_S)
    return generation
