"""check_all: every pre-launch check once, in order, and what it hands the launcher."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bundle import cli, preflight
from bundle.errors import ConfigError, DataError
from bundle.topology import Topology


def cfg(*argv):
    return cli.parse(list(argv), {})


CHECKS = (
    "check_data",
    "resolve",
    "check_devices",
    "check_cpu_shares",
    "check_model",
    "check_precision",
    "check_lr_schedule",
    "check_paths",
    "check_observed_steps",
    "parse_fault",
    "check_resume",
)


@pytest.fixture
def calls(monkeypatch):
    """Every check of check_all, recorded by name as it runs (and then run)."""
    seen: list[str] = []
    owners = {
        "check_data": preflight.data,
        "resolve": preflight.auto,
        "check_devices": preflight.devices,
        "parse_fault": preflight,
    }
    for name in CHECKS:
        owner = owners.get(name, preflight)
        real = getattr(owner, name)

        def record(*args, _name=name, _real=real, **kwargs):
            seen.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, record)
    return seen


def test_a_plain_run_passes_every_check_once_in_order(calls):
    c = cfg("--itr", "2")
    plan = preflight.check_all(c, {})
    assert calls == list(CHECKS)
    assert plan == preflight.LaunchPlan(cfg=c, topo=Topology.from_config(c), resume=None, attempt=0)


def test_the_planners_choice_is_checked_once_and_handed_on(calls, monkeypatch):
    # The planner reads the data before it chooses; the data are not checked again after.
    resolved = cfg("--bundle-shape", "2,1")
    monkeypatch.setattr(preflight.auto, "resolve", lambda c: calls.append("resolve") or resolved)
    plan = preflight.check_all(cfg("--bundle-shape", "auto"), {})
    assert calls == list(CHECKS)
    assert (plan.cfg, plan.topo) == (resolved, Topology.from_config(resolved))


def test_a_bad_data_directory_stops_before_the_planner(calls, tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        preflight.check_all(cfg("--bundle-shape", "auto", str(tmp_path / "nope")), {})
    assert calls == ["check_data"]


def test_a_bad_fault_hook_is_an_input_error():
    with pytest.raises(ConfigError, match="BUNDLE_FAULT"):
        preflight.check_all(cfg("--itr", "2"), {"BUNDLE_FAULT": "soon"})


def test_a_torchrun_restart_is_an_attempt_that_resumes(tmp_path):
    torchrun = {"RANK": "0", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}
    c = cli.parse(["--itr", "2", "--save-dir", str(tmp_path)], torchrun)
    restarted = {**torchrun, "TORCHELASTIC_RESTART_COUNT": "2"}
    plan = preflight.check_all(c, restarted)
    assert (plan.attempt, plan.resume) == (2, None)  # nothing saved yet: from step 0
    # Outside torchrun the count is not this job's.
    plan = preflight.check_all(replace(c, launch=replace(c.launch, torchrun=False)), restarted)
    assert plan.attempt == 0
