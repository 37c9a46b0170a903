"""bundle/runtime/control.py: what a stranger who reaches the job's store writes cannot stop the
job or take a bundle out once the job has a secret, and is never printed raw."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from bundle.errors import ConfigError
from bundle.launch.ft.membership import Membership, is_dead, mark_dead
from bundle.runtime import control, keys
from bundle.runtime.store import post_abort, read_abort
from bundle.topology import Topology

SECRET = "s3cret-s3cret-s3cret-0123456789"


@pytest.fixture
def secret(monkeypatch):
    monkeypatch.setenv(control.SECRET_ENV, SECRET)
    control._secret.cache_clear()
    yield
    monkeypatch.delenv(control.SECRET_ENV)
    control._secret.cache_clear()


def test_a_strangers_message_is_one_printable_line():
    store = dist.HashStore()
    store.set(keys.ABORT, "pwned\x1b[2J\x1b]0;title\x07\r\nrank 0 failed\x00" + "x" * 5000)
    got = read_abort(store)
    assert got.startswith("pwned rank 0 failed x") and len(got) == control.MAX_TEXT
    assert got.isprintable()


def test_with_a_secret_a_forged_abort_neither_stops_the_job_nor_blocks_the_real_one(secret):
    store = dist.HashStore()
    store.set(keys.ABORT, "a stranger says stop")
    assert read_abort(store) is None  # the abort watch goes on
    mine = "rank 3 (stage 1, step 5) failed at forward: RuntimeError: boom"
    assert post_abort(store, mine) == mine  # the forged value does not win the compare-and-set
    assert read_abort(store) == mine
    assert post_abort(store, "rank 4 failed later") == mine  # the first real failure stands


def test_with_a_secret_a_forged_or_moved_dead_mark_takes_no_bundle_out(secret):
    store = dist.HashStore()
    store.set(keys.dead(1), "forged")
    assert not is_dead(store, 1, 0)
    mark_dead(store, 2, 0, "rank 5 exited with code -9")
    store.set(keys.dead(1), store.get(keys.dead(2)))  # a real mark copied to another bundle's key
    assert not is_dead(store, 1, 0) and is_dead(store, 2, 0)
    job = Topology(shape=(1, 1), num_bundles=3, procs_per_node=6, global_batch=12, micro_batches=1)
    members = Membership(store, job, rank=0, timeout=1.0)
    assert members.lost() == [2]


def test_without_a_secret_marks_work_as_before_and_a_sealed_value_reads_as_its_text():
    store = dist.HashStore()
    store.set(keys.dead(1), "rank 3 was killed")
    assert is_dead(store, 1, 0) and not is_dead(store, 0, 0)
    store.set(keys.dead(0), "hmac-sha256:abc:rank 1 left")
    assert control.read(store, keys.dead(0)) == "rank 1 left"


def test_numbers_on_control_keys_are_numbers():
    store = dist.HashStore()
    for bad in ("x", "-1", "1e9", "99999999999", ""):
        store.set("ft/healing/0", bad)
        assert control.read_int(store, "ft/healing/0") is None
    store.set("ft/healing/0", "3")
    assert control.read_int(store, "ft/healing/0") == 3


def test_a_job_secret_must_be_long_enough_and_readable(tmp_path):
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        control.read_secret({control.SECRET_ENV: "short"})
    with pytest.raises(ConfigError, match="BUNDLE_JOB_SECRET_FILE.*cannot read it"):
        control.read_secret({control.SECRET_FILE_ENV: str(tmp_path / "none")})
    (tmp_path / "secret").write_text(SECRET + "\n")
    assert control.read_secret({control.SECRET_FILE_ENV: str(tmp_path / "secret")}) == (
        SECRET.encode()
    )
    assert control.read_secret({}) is None


def test_nodes_with_other_secrets_differ_in_their_fingerprint(monkeypatch):
    prints = []
    for value in (SECRET, SECRET + "x"):
        monkeypatch.setenv(control.SECRET_ENV, value)
        control._secret.cache_clear()
        prints.append(control.fingerprint())
    monkeypatch.delenv(control.SECRET_ENV)
    control._secret.cache_clear()
    assert prints[0] != prints[1] and SECRET not in prints[0] and control.fingerprint() is None
