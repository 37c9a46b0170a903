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
