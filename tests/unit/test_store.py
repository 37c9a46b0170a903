"""bundle/runtime/store.py: which port the job's store takes, in this one process (no workers).

The default port is replaced by a port this test holds, so the checks never touch 29500, which
other jobs on the machine may be using."""

from __future__ import annotations

import socket

import pytest

from bundle import cli, log
from bundle.config import LaunchConfig
from bundle.errors import LaunchError
from bundle.runtime import store as job_store


@pytest.fixture
def busy_default(monkeypatch):
    """A port another process listens on, standing in for DEFAULT_PORT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        monkeypatch.setattr(job_store, "DEFAULT_PORT", port)
        yield port


def launch(*argv: str) -> LaunchConfig:
    return cli.parse(list(argv), {}).launch


def test_a_port_not_given_is_unset_and_one_given_is_kept():
    assert launch().master_port is None
    assert launch("--portNum", "29500").master_port == 29500


def test_a_single_node_run_on_a_busy_default_port_takes_a_free_one_and_says_which(
    busy_default, capsys
):
    log.setup("[node 0]")
    store, port = job_store.open_job_store(launch("--init-timeout", "5"), node=0, nodes=1)
    assert port not in (busy_default, 0) and store.port == port
    store.set("reachable", "yes")  # the workers join at (--IP, port)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert f"port {busy_default} is in use: the job's store listens on port {port}" in lines[0]


def test_a_busy_port_given_explicitly_stays_an_error(busy_default):
    given = launch("--portNum", str(busy_default), "--init-timeout", "5")
    with pytest.raises(LaunchError, match=f"--portNum {busy_default}: cannot listen"):
        job_store.open_job_store(given, node=0, nodes=1)


def test_a_multi_node_job_never_moves_its_port(busy_default, monkeypatch):
    # Every node must know the port beforehand: node 0 cannot choose another alone.
    monkeypatch.setenv(job_store.BIND_ENV, "127.0.0.1")  # the nodes of this test share loopback
    with pytest.raises(LaunchError, match=f"--portNum {busy_default}: cannot listen"):
        job_store.open_job_store(launch("--init-timeout", "5"), node=0, nodes=2)


def test_a_free_default_port_is_taken_as_it_is(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    monkeypatch.setattr(job_store, "DEFAULT_PORT", free)
    store, port = job_store.open_job_store(launch("--init-timeout", "5"), node=0, nodes=1)
    assert port == free == store.port


def _reachable(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, port)) == 0


def test_the_store_of_a_loopback_job_is_not_reachable_at_another_local_address():
    store = job_store.open_store("127.0.0.1", 0, server=True, timeout=5)
    store.set("k", "v")
    assert _reachable("127.0.0.1", store.port)
    # Another address of this machine (every 127/8 address is local): on every interface, the
    # store would answer here too, as it would at the machine's network addresses.
    assert not _reachable("127.0.0.2", store.port)


def test_the_store_listens_everywhere_only_when_asked_to(monkeypatch):
    monkeypatch.setenv(job_store.BIND_ENV, "0.0.0.0")
    store = job_store.open_store("127.0.0.1", 0, server=True, timeout=5)
    assert _reachable("127.0.0.2", store.port)


def test_a_multi_node_job_on_a_loopback_address_says_who_can_join(capsys):
    log.setup("[node 0]")
    store = job_store.open_store("127.0.0.1", 0, server=True, timeout=5, nodes=2)
    assert not _reachable("127.0.0.2", store.port)  # the address asked for, nothing more
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert (
        len(lines) == 1 and "listens on 127.0.0.1 (--IP 127.0.0.1), a loopback address" in lines[0]
    )
    assert job_store.BIND_ENV in lines[0]


def test_an_address_that_is_not_this_machines_is_one_line():
    with pytest.raises(LaunchError, match=r"--IP 198.51.100.7 \(198.51.100.7\) is not an address"):
        job_store.open_store("198.51.100.7", 0, server=True, timeout=5, nodes=2)


def _said(capsys) -> list[str]:
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


AT = {"what": "node", "where": "at 127.0.0.1:1", "say": True}


def test_node_0_says_which_nodes_it_waits_for_then_names_them_at_the_timeout(capsys, monkeypatch):
    monkeypatch.setattr(job_store, "SAY_AFTER_S", 0.05)
    monkeypatch.setattr(job_store, "SAY_EVERY_S", 0.3)
    log.setup("[node 0]")
    store = job_store.open_store("127.0.0.1", 0, server=True, timeout=5)
    store.set("bundle/config/0", "x")
    store.set("bundle/config/2", "x")
    with pytest.raises(LaunchError) as err:
        job_store.wait_joined(store, "bundle/config", 4, 1.0, **AT)
    assert str(err.value) == "node 1, 3 of 4 did not join the job at 127.0.0.1:1 within 1s"
    lines = _said(capsys)
    assert 2 <= len(lines) <= 5, lines  # within the first second, then every 0.3 s
    assert lines[0].startswith("[node 0] waiting for node 1, 3 of 4 to join at 127.0.0.1:1 (0s")
    store.set("bundle/config/1", "x")
    store.set("bundle/config/3", "x")
    job_store.wait_joined(store, "bundle/config", 4, 1.0, **AT)  # all there


def test_a_joining_node_says_it_waits_for_node_0_and_reaches_it_once_it_listens(
    capsys, monkeypatch
):
    monkeypatch.setattr(job_store, "SAY_AFTER_S", 0.05)
    log.setup("[node 1]")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused, as a node 0 not started yet
        with pytest.raises(
            LaunchError, match=f"cannot reach the master at 127.0.0.1:{port} within"
        ):
            job_store.open_store("127.0.0.1", port, server=False, timeout=0.6)
    lines = _said(capsys)
    assert lines and lines[0].startswith(f"[node 1] waiting for node 0's store at 127.0.0.1:{port}")
    assert not any("c10d" in ln for ln in lines)  # no C++ trace of a refused connect
    served = job_store.open_store("127.0.0.1", 0, server=True, timeout=5)
    client = job_store.open_store("127.0.0.1", served.port, server=False, timeout=5)
    client.set("k", "v")
    assert served.get("k") == b"v"


def test_a_harness_port_is_drawn_below_the_ephemeral_range_and_skips_a_busy_one(monkeypatch):
    """bundle.launch.localworld.free_port: outgoing connections take their source port from the
    kernel's ephemeral range, so a port from there can be gone before a store binds it."""
    from bundle.launch import localworld

    low, _ = localworld._ephemeral_range()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        taken = busy.getsockname()[1]
        drawn = iter([taken, low - 7])
        monkeypatch.setattr(localworld._DRAW, "randrange", lambda a, b: next(drawn))
        assert localworld.free_port() == low - 7
    monkeypatch.undo()
    ports = {localworld.free_port() for _ in range(8)}
    assert all(1024 <= p < low for p in ports) and len(ports) > 1
