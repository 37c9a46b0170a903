"""--fault-tolerance bundle end to end, as a user runs it: three bundles, a worker of bundle 1
killed (on gloo) or frozen (under nccl-emu) as step 4 begins (``BUNDLE_FAULT``). The other
bundles train on in the same attempt, step 4 is run again without bundle 1 (no step lost): on
gloo in the same processes, under nccl-emu (as on NCCL) each survivor in a new process of its
rank that received its state (bundle.launch.handoff). With ``--max-restarts 2`` (nccl-emu)
bundle 1 is started again, that heal fails as it starts (``BUNDLE_HEAL_FAULT``), and the next one
receives the state from a peer and rejoins. Either way the final weights equal one process that
trained each step on the rows of the bundles that took part in it (the metrics records say
which). On a machine with a GPU and ``BUNDLE_EXPERIMENTAL_NCCL_FT=1`` both also run over NCCL,
every rank on cuda:0 (``--share-gpus``): experimental, see docs/fault-tolerance.md; elsewhere
those skip."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from bundle import cli
from bundle.launch.localworld import free_port
from bundle.preflight import EXPERIMENTAL_NCCL_ENV
from bundle.topology import split_ranges
from tests.support.processes import SMALL, finish, start
from tests.support.reference import reference

FAILS_AT = 4  # 1-based: rank 3 (bundle 1, stage 1) dies as step 4 begins
NCCL = pytest.param(
    "nccl",
    marks=pytest.mark.skipif(
        not (torch.cuda.is_available() and os.environ.get(EXPERIMENTAL_NCCL_ENV) == "1"),
        reason=f"experimental: needs a CUDA device and {EXPERIMENTAL_NCCL_ENV}=1",
    ),
)
ON_GPU = ["--share-gpus", "--no-tf32"]  # fp32 on the GPU matches the CPU reference


def _run(
    tmp_path, backend: str, steps: int, *extra: str, fault: str = "kill", env: dict | None = None
) -> tuple[list[str], str, list[dict]]:
    weights, metrics = tmp_path / "final.pt", tmp_path / "m.jsonl"
    args = [
        *SMALL,
        "--bundle-shape", "1,1", "--num-bundle", "3", "--micro-batches", "2",
        "--itr", str(steps), "--fault-tolerance", "bundle", "--timeout", "10",
        "--backend", backend, "--lr", "0.01", *extra, *(ON_GPU if backend == "nccl" else []),
    ]  # fmt: skip
    run = [*args, "--checkpoint", str(weights), "--metrics-out", str(metrics)]
    port = str(free_port())
    code, _, err = finish(
        start(
            "main.py",
            *run,
            "--portNum",
            port,
            env={
                "BUNDLE_FAULT": f"3:{FAILS_AT}:{fault}",
                EXPERIMENTAL_NCCL_ENV: "1",
                **(env or {}),
            },
        ),
        timeout=180,
    )
    assert code == 0, err
    how = "was killed" if fault == "kill" else "stopped responding"
    assert f"bundle 1 leaves the job: rank 3 (node 0, bundle 1, stage 1, replica 0) {how}" in err
    assert err.count("started ranks") == 1, err  # the job was never restarted
    # On NCCL (and its emulator) each survivor goes on in a new process of its rank with the
    # state it handed over (bundle.launch.handoff); elsewhere in the same process.
    handed = err.count("goes on in a new process with its state")
    assert handed >= 4 if backend in ("nccl", "nccl-emu") else handed == 0, err
    return args, err, [json.loads(line) for line in metrics.read_text().splitlines()]


def _assert_trained_on_the_bundles_present(tmp_path, args, took_part, atol=1e-5) -> None:
    """The final weights equal one process that trained each step on the rows of the bundles
    that took part in it (``took_part``: step -> bundles)."""
    cfg = cli.parse(args, {})
    ranges = split_ranges(cfg.train.batch_size, 3)

    def rows(step: int, batch: torch.Tensor) -> torch.Tensor:
        return torch.cat([batch[slice(*ranges[b])] for b in took_part[step + 1]])

    expected = reference(cfg, rows=rows)
    got = torch.load(tmp_path / "final.pt", weights_only=True)
    for name, value in expected.items():
        torch.testing.assert_close(
            got[name], value, rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize(
    ("backend", "fault"),
    [("gloo", "kill"), ("nccl-emu", "stop"), pytest.param(*NCCL.values, "kill", marks=NCCL.marks)],
)
def test_a_lost_bundle_leaves_and_the_others_train_on_exactly(tmp_path, backend, fault):
    """Killed, or stopped (a slow, not dead, bundle: waited for until its supervisor finds it
    silent for half of --timeout, then dropped)."""
    args, _, records = _run(tmp_path, backend, 8, fault=fault)
    summary = records[-1]
    assert summary["bundle_failures"] == 1 and summary["bundles_in_step"] == [0, 2], summary
    assert summary["attempt"] == 0 and summary["steps"] == 8 and summary["heals"] == 0
    assert summary["lost_steps"] == 0
    took_part = {r["step"]: r["bundles_in_step"] for r in records if "loss" in r and "step" in r}
    assert took_part == {s: [0, 1, 2] if s < FAILS_AT else [0, 2] for s in range(1, 9)}
    _assert_trained_on_the_bundles_present(tmp_path, args, took_part)


@pytest.mark.parametrize("backend", ["nccl-emu", NCCL])
def test_a_lost_bundle_heals_from_a_peer_and_rejoins(tmp_path, backend):
    """Enough steps for the new processes to start (they rejoin after about 90 on a 2-core
    machine); the step they rejoin after is the survivors' decision, which they say. Without
    momentum: with it this small net's training is chaotic past a hundred steps (1e-7 on the
    initial weights makes 2e-2 at step 400), and the sums' order alone would fail the
    comparison; without it the rejoin as said is 3e-8 to 2e-5 off, a step earlier or later 2e-4
    or more. On the GPU the 300 steps' sums differ from the CPU's by more: 1e-3 there (every
    replica is still checked bit for bit at the rejoin)."""
    steps = 300
    extra = ["--max-restarts", "2", "--log-every", "100", "--momentum", "0"]
    # The first heal fails as it starts (rank 3 of heal 1 dies): its rank 2 leaves, the second
    # heal rejoins.
    args, err, records = _run(tmp_path, backend, steps, *extra, env={"BUNDLE_HEAL_FAULT": "3:1"})
    summary = records[-1]
    assert summary["heals"] == 1 and summary["bundles_in_step"] == [0, 1, 2], summary
    assert "bundle 1: ranks 2, 3 started again (heal 1 of 2" in err
    assert "bundle 1: ranks 2, 3 started again (heal 2 of 2" in err
    rejoined = int(re.search(r"bundle\(s\) 1 rejoin after step (\d+)", err).group(1))
    assert FAILS_AT <= rejoined < steps
    took_part = {s: [0, 2] if FAILS_AT <= s <= rejoined else [0, 1, 2] for s in range(1, steps + 1)}
    atol = 1e-3 if backend == "nccl" else 1e-4
    _assert_trained_on_the_bundles_present(tmp_path, args, took_part, atol=atol)
