"""Two nodes for real: main.py on two "hosts" (network namespaces joined by a veth pair).

Each node is launched with the original flags (``--rank NODE --world-size 2 --IP MASTER``), or
under torchrun, so the store, the config exchange, gloo's interface choice and the point-to-point
and collective traffic all cross a real (virtual) link; each node's GLOO_SOCKET_IFNAME names its
veth end. The checkpoint rank 0 writes after three steps must equal the
parameters of one process training the unsplit model on the same global batches.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bundle import cli
from tests.support.netns import NetnsPair, node_env
from tests.support.reference import reference

REPO = Path(__file__).resolve().parents[2]
MAIN = REPO / "main.py"
PORT = 29531
NODE_TIMEOUT = 120.0
TOL = 1e-5

TRAIN = [
    "--itr", "3", "--no-eval",
    "--dataset", "synthetic", "--image-size", "4", "--num-classes", "5", "--synthetic-size", "128",
    "--model", "mlp",
    "--batch-size", "23", "--lr", "0.1", "--momentum", "0.9", "--weight-decay", "0.01",
    "--seed", "7",
    "--backend", "gloo", "--timeout", "60", "--init-timeout", "60",
]  # fmt: skip

CASES = {
    # one bundle: the front stage on host A (node 0), the rear stage on host B (node 1)
    "pipeline-1,1": ["--bundle-shape", "1,1", "--num-bundle", "1"],
    # two one-stage bundles, one per host
    "bundles-1x2": ["--bundle-shape", "1", "--num-bundle", "2"],
    # pure data parallelism over the two processes
    "dp-only": ["--DP-ONLY"],
    # the pipeline under NCCL's ordering: 1F1B's fused calls across the two hosts
    "pipeline-1,1-nccl-emu": [
        "--bundle-shape", "1,1", "--num-bundle", "1",
        "--backend", "nccl-emu", "--schedule", "1f1b", "--micro-batches", "3",
    ],
}  # fmt: skip


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    deadline = time.monotonic() + timeout
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.1, deadline - time.monotonic()))
    return [p.poll() for p in procs]


def _run_two_nodes(hosts: NetnsPair, node_argv, tmp_path: Path, label: str) -> None:
    """Start ``node_argv(node)`` on host A (node 0) and host B (node 1); both must exit 0."""
    procs, logs = [], []
    for node, ns in enumerate((hosts.a, hosts.b)):
        log = tmp_path / f"node{node}.log"
        logs.append(log)
        with open(log, "wb") as out:
            procs.append(
                hosts.run_in(
                    ns,
                    node_argv(node),
                    env=node_env(hosts.ifname(ns)),
                    cwd=REPO,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    t0 = time.monotonic()
    codes = _wait_all(procs, NODE_TIMEOUT)
    print(f"\n[{label}] nodes exited {codes} after {time.monotonic() - t0:.1f}s")
    if codes != [0, 0]:
        outputs = "\n".join(
            f"----- node {i} (exit {c}) -----\n{log.read_text(errors='replace')}"
            for i, (c, log) in enumerate(zip(codes, logs, strict=True))
        )
        print(outputs)
        pytest.fail(f"nodes did not both exit 0 within {NODE_TIMEOUT:.0f}s:\n{outputs}")


def _original_flags(hosts: NetnsPair, node: int) -> list[str]:
    """The original launch flags of node ``node``, one process per host, master on host A."""
    return [
        "--world-size", "2", "--nproc-per-node", "1",
        "--IP", hosts.addr_a, "--portNum", str(PORT), "--rank", str(node),
    ]  # fmt: skip


def _check_against_reference(ckpt: Path, argv: list[str]) -> None:
    assert ckpt.exists(), "rank 0 wrote no checkpoint"
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    ref = reference(cli.parse(argv, env={}))
    assert set(ref) <= set(state), f"missing from the checkpoint: {sorted(set(ref) - set(state))}"
    errors = {name: (state[name] - value).abs().max().item() for name, value in ref.items()}
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= TOL, f"{worst} differs by {errors[worst]:.2e} (all: {errors})"


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_hosts_match_single_process(case, tmp_path):
    """Self-spawn with the original flags: ``main.py --rank NODE --world-size 2 --IP A ...``."""
    ckpt = tmp_path / "model.pt"
    argv = [*TRAIN, *CASES[case], "--checkpoint", str(ckpt)]
    with NetnsPair() as hosts:
        _run_two_nodes(
            hosts,
            lambda node: [sys.executable, str(MAIN), *argv, *_original_flags(hosts, node)],
            tmp_path,
            case,
        )
    _check_against_reference(ckpt, argv)


@pytest.mark.slow
def test_torchrun_two_hosts_match_single_process(tmp_path):
    """torchrun on each host: one bundle of shape 1,1, front stage on A, rear stage on B."""
    ckpt = tmp_path / "model.pt"
    argv = [*CASES["pipeline-1,1"], *TRAIN, "--checkpoint", str(ckpt)]
    with NetnsPair() as hosts:
        launch = [
            "--nnodes", "2", "--nproc-per-node", "1",
            "--master-addr", hosts.addr_a, "--master-port", str(PORT),
        ]  # fmt: skip
        _run_two_nodes(
            hosts,
            lambda node: [
                sys.executable,
                "-m",
                "torch.distributed.run",
                *launch,
                "--node-rank",
                str(node),
                str(MAIN),
                *argv,
            ],  # fmt: skip
            tmp_path,
            "torchrun",
        )
    _check_against_reference(ckpt, argv)


@pytest.mark.slow
def test_two_hosts_recover_from_a_killed_worker_on_host_b(tmp_path):
    """Rank 1 (host B) is SIGKILLed as step 3 begins; both supervisors restart the job from the
    step-2 checkpoint on the shared --save-dir, and it ends where one process does."""
    ckpt = tmp_path / "model.pt"
    argv = [*CASES["pipeline-1,1"], *TRAIN, "--checkpoint", str(ckpt)]
    recovery = ["--save-dir", str(tmp_path / "ckpt"), "--save-every", "1", "--max-restarts", "1"]
    faulty = ["env", "BUNDLE_FAULT=1:3", sys.executable, str(MAIN), *argv, *recovery]
    with NetnsPair() as hosts:
        _run_two_nodes(
            hosts,
            lambda node: [*faulty, *_original_flags(hosts, node)],
            tmp_path,
            "recovery",
        )
    logs = (tmp_path / "node0.log").read_text() + (tmp_path / "node1.log").read_text()
    assert logs.count("restart 1 of 1") == 2 and "killed by SIGKILL during step 3" in logs, logs
    _check_against_reference(ckpt, argv)
