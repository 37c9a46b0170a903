"""--fault-tolerance bundle end to end, as a user runs it: three bundles, a worker of bundle 1
killed as step 4 begins (``BUNDLE_FAULT``). The other bundles train on in the same processes and
attempt, step 4 is run again without bundle 1 (no step lost), and the final weights equal one
process that trained steps 1-3 on the whole batches and steps 4-8 on bundles 0 and 2's rows."""

from __future__ import annotations

import json

import pytest
import torch

from bundle import cli
from bundle.launch.localworld import free_port
from bundle.topology import split_ranges
from tests.support.processes import SMALL, finish, start
from tests.support.reference import reference

STEPS, FAILS_AT = 8, 4  # 1-based: rank 3 (bundle 1, stage 1) dies as step 4 begins


@pytest.mark.parametrize("backend", ["gloo", "nccl-emu"])
def test_a_lost_bundle_leaves_and_the_others_train_on_exactly(tmp_path, backend):
    weights, metrics = tmp_path / "final.pt", tmp_path / "m.jsonl"
    args = [
        *SMALL,
        "--bundle-shape", "1,1", "--num-bundle", "3", "--micro-batches", "2",
        "--itr", str(STEPS), "--fault-tolerance", "bundle", "--timeout", "10",
        "--backend", backend,
    ]  # fmt: skip
    run = [*args, "--checkpoint", str(weights), "--metrics-out", str(metrics)]
    code, out, err = finish(
        start(
            "main.py", *run, "--portNum", str(free_port()), env={"BUNDLE_FAULT": f"3:{FAILS_AT}"}
        ),
        timeout=150,
    )
    assert code == 0, err
    assert (
        "bundle 1 leaves the job: rank 3 (node 0, bundle 1, stage 1, replica 0) was killed" in err
    )
    assert err.count("started ranks") == 1, err  # the survivors were never restarted
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    summary = records[-1]
    assert summary["bundle_failures"] == 1 and summary["bundles"] == [0, 2], summary
    assert summary["attempt"] == 0 and summary["steps"] == STEPS
    took_part = {r["step"]: r["bundles"] for r in records if "loss" in r and "step" in r}
    assert took_part == {s: [0, 1, 2] if s < FAILS_AT else [0, 2] for s in range(1, STEPS + 1)}, (
        took_part
    )

    cfg = cli.parse(args, {})
    ranges = split_ranges(cfg.train.batch_size, 3)

    def rows(step: int, batch: torch.Tensor) -> torch.Tensor:
        if step + 1 < FAILS_AT:
            return batch
        return torch.cat([batch[slice(*ranges[b])] for b in (0, 2)])

    expected = reference(cfg, rows=rows)
    got = torch.load(weights, weights_only=True)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-5, msg=name)
