"""Every command of the original prototype's README (docs/reference/original-README.md) runs.

The commands are extracted from the file, not restated here: a code block's lines joined where
they end in ``\\``, a ``python main.py`` block as one command (its first line lacks the ``\\``), and
the ``./run-bundle-hp.sh`` example written inline in the text. Placeholders are filled (``--flag
value`` where it shows ``--flag = {...}``; ``--model`` for its ``--modela`` typo; this machine's
data directory for its ImageNet paths) and runs are kept small: ``--image-size 32``, a free port
and, where the command trains whole epochs, ``--epochs 1`` appended (through ``BUNDLE_EXTRA_ARGS``
and ``BUNDLE_PORT`` for the container script). Containers are the image's entrypoint running this
tree's main.py, with Docker faked; the overlay network's name of rank 0's container,
``bundle-rank0``, is this machine.
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

from bundle import cli, preflight
from bundle.launch.localworld import free_port
from tests.support.docker import ENTRYPOINT, FakeDocker, clean_env
from tests.support.processes import finish, image_folder

REPO = Path(__file__).resolve().parents[2]
ORIGINAL = (REPO / "docs" / "reference" / "original-README.md").read_text()
SMALL = ["--image-size", "32"]

# The Docker and NVIDIA set-up of a host, and fetching the prototype itself: not Bundle's to run.
HOST_SET_UP = [
    "git clone https://github.com/EunjuYang/Bundle_HybridParallelism.git",
    "curl -s -L https://nvidia.github.io/nvidia-docker/gpgkey | sudo apt-key add -",
    "distribution=$(. /etc/os-release;echo $ID$VERSION_ID)",
    "curl -s -L https://nvidia.github.io/nvidia-docker/$distribution/nvidia-docker.list | sudo "
    "tee /etc/apt/sources.list.d/nvidia-docker.list",
    "sudo apt-get update",
    "sudo apt-get install -y nvidia-docker2",
    "docker swarm init",
    "docker swarm join --token <your_token> <your_ip_address>:2377",
]
HYBRID, DP_ONLY = "python main.py --batch-size = {batch", "python main.py --batch-size = 32"
BUILD, CHMOD = "docker build -t yejyang/bundlehp:v01 ./", "chmod 777 run-bundle-hp.sh"
USAGE, EXAMPLE = (
    "./run-bundle-hp.sh [batch_size]",
    "./run-bundle-hp.sh 32 1 4,2 1 2 resnet101_trial4",
)
PROMPTED = "./run-bundle-hp.sh"


def commands() -> list[str]:
    found = []
    for block in re.findall(r"```bash\n(.*?)```", ORIGINAL, re.S):
        lines = [re.sub(r"^(\(\w+\))?\$ ", "", ln.strip()) for ln in block.strip().splitlines()]
        if lines[0].startswith("python main.py"):
            lines = [" ".join(ln.rstrip("\\").strip() for ln in lines)]
        text = "\n".join(lines).replace("\\\n", "")
        found += [" ".join(cmd.split()) for cmd in text.splitlines()]
    return found + re.findall(r"`(\./run-bundle-hp\.sh [^`]*)`", ORIGINAL)


def the(prefix: str) -> str:
    (command,) = [c for c in commands() if c == prefix or c.startswith(prefix + " ")]
    return command


def test_every_command_is_covered_here():
    covered = HOST_SET_UP + [the(p) for p in (HYBRID, DP_ONLY, BUILD, CHMOD, USAGE, EXAMPLE)]
    assert sorted(commands()) == sorted([*covered, PROMPTED])


def fill(command: str, values: dict[str, str]) -> list[str]:
    """``--flag = {what}`` -> ``--flag value``; ``[what]`` and ``{what}`` from ``values``."""
    command = re.sub(r"(--[\w-]+) = ", r"\1 ", command).replace("--modela ", "--model ")
    for placeholder, value in values.items():
        command = command.replace(placeholder, value)
    assert not re.search(r"[{}\[\]]", command), command
    return shlex.split(command)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("imagenet")
    image_folder(root)  # 36 training images: one step of 32 per epoch
    return root


def run_main(argv: list[str]) -> dict:
    assert argv[:2] == ["python", "main.py"], argv
    p = subprocess.run(
        [sys.executable, "main.py", *argv[2:], *SMALL],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_hybrid_parallelism_with_bundle(data):
    argv = fill(
        the(HYBRID),
        {
            "{batch size for one bundle}": "32",
            "{rank of this node}": "0",
            "{number of iteration you run}": "1",
            "{shape of bundle, e.g., 1,1 or 4,2 etc.}": "1,1",
            "{number of bundles runnning in this cluster}": "1",
            "{IP address of master node}": "127.0.0.1",
            "{portnumber of master node}": str(free_port()),
            # A partitioned name as the original's resnet101_trialN (run in the container below).
            "{model name - partitioned model name}": "resnet18_2stage",
            "{the number of total nodes running in this cluster}": "1",
            "{PATH for ImageNet Data DIR}": str(data),
        },
    )
    s = run_main(argv)
    assert (s["model"], s["shape"], s["steps"], s["world_size"]) == ("resnet18", [1, 1], 1, 2)


@pytest.mark.slow
def test_pure_data_parallelism(data):
    argv = fill(
        the(DP_ONLY),
        {
            "{rank of this node}": "0",
            "{number of workers for data parallelism}": "2",
            "{IP_address_for_MASTER}": "127.0.0.1",
            "{number of inter-DP servers}": "1",
            "~/Downloads/ImageNet/": str(data),
        },
    )
    s = run_main([*argv, "--portNum", str(free_port()), "--epochs", "1"])
    assert (s["model"], s["shape"], s["world_size"], s["steps"]) == ("resnet101", [2], 2, 1)


def test_the_image_builds_from_the_root_and_the_script_is_executable_there():
    context = shlex.split(the(BUILD))[-1]
    assert (REPO / context / "Dockerfile").is_file()
    assert os.access(REPO / shlex.split(the(CHMOD))[-1], os.X_OK)


def script(docker: FakeDocker, argv: list[str], stdin: str = "", **env: str):
    """Run ``./run-bundle-hp.sh ...`` as written, from the repository root, against fake docker."""
    assert argv[0] == "./run-bundle-hp.sh", argv
    r = subprocess.run(
        argv,
        cwd=REPO,
        input=stdin,
        capture_output=True,
        text=True,
        env=clean_env(docker.bin_dir, FAKE_DOCKER_LOG=str(docker.log), **env),
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    (run,) = [c for c in docker.calls() if c[0] == "run"][-1:]
    return run


def container_args(run: list[str]) -> tuple[list[str], dict[str, str]]:
    """What ``docker run`` hands the image's entrypoint, and its -e variables."""
    image = run.index("-v") + 2  # -v DATA:/data:ro IMAGE
    env = dict(run[i + 1].split("=", 1) for i, a in enumerate(run[:image]) if a == "-e")
    return run[image + 1 :], env


@pytest.fixture
def docker(tmp_path) -> FakeDocker:
    return FakeDocker(tmp_path)


def check_container(args: list[str], rank: int, master: str, data: Path) -> None:
    """main.py in the container accepts them: the original's model name and its split."""
    assert args[-1] == "/data"  # the mount of the data directory
    cfg = cli.parse([*args[:-1], str(data)], {})
    assert (cfg.model.name, cfg.model.partition) == ("resnet101", "resnet101_trial4")
    assert (cfg.launch.node_rank, cfg.launch.master_addr) == (rank, master)
    preflight.check_model(cfg, len(cfg.parallel.shape))


def test_the_usage_line_with_ip_and_port(docker, data):
    filled = {
        "[batch_size]": "32",
        "[rank]": "0",
        "[shape]": "4,2",
        "[num_bundle]": "1",
        "[IP]": "10.10.0.2",
        "[portNum]": "29500",
        "[world_size]": "2",
        "[model]": "resnet101_trial4",
        "[data_path-absolute path]": str(data),
        "[itr]": "2",
    }
    args, _ = container_args(script(docker, fill(the(USAGE), filled)))
    check_container(args, 0, "10.10.0.2", data)
    assert args[args.index("--portNum") + 1] == "29500"


def test_the_script_asks_for_each_value(docker, data):
    answers = f"32\n1\n4,2\n1\n2\nresnet101_trial4\n{data}\n2\n"
    args, _ = container_args(script(docker, [PROMPTED], stdin=answers))
    check_container(args, 1, "bundle-rank0", data)


@pytest.mark.slow
def test_run_the_bundle_container(docker, data, tmp_path):
    """`./run-bundle-hp.sh 32 1 4,2 1 2 resnet101_trial4 DATA 2` on the node of rank 1, the same
    with rank 0 on the other: both containers train shape 4,2 over the two "nodes"."""
    example = shlex.split(the(EXAMPLE))
    env = {"BUNDLE_EXTRA_ARGS": " ".join(SMALL), "BUNDLE_PORT": str(free_port())}
    procs = []
    for rank in (1, 0):
        argv = [a.replace("/home/yejyang/Downloads/ImageNet", str(data)) for a in example]
        argv[2] = str(rank)
        run = script(docker, argv, **env)
        args, container_env = container_args(run)
        volume = run[run.index("-v") + 1].split(":")
        host_args = [{"bundle-rank0": "127.0.0.1", volume[1]: volume[0]}.get(a, a) for a in args]
        log = tmp_path / f"rank{rank}.log"
        with open(log, "w") as err:
            procs.append(
                subprocess.Popen(
                    ["bash", str(ENTRYPOINT), *host_args],
                    cwd=REPO,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                    start_new_session=True,
                    env=clean_env(
                        docker.bin_dir,
                        **container_env,
                        # The image's python is the entrypoint's: here, this test's own.
                        PATH=os.pathsep.join(
                            (
                                str(docker.bin_dir),
                                str(Path(sys.executable).parent),
                                os.environ["PATH"],
                            )
                        ),
                        # The two containers' shared network is this machine's loopback.
                        GLOO_SOCKET_IFNAME="lo",
                        NCCL_SOCKET_IFNAME="lo",
                    ),
                )
            )
    results = [finish(p, 300) for p in procs]
    errors = [(tmp_path / f"rank{r}.log").read_text() for r in (1, 0)]
    assert [code for code, _, _ in results] == [0, 0], errors
    # The reporting rank (bundle 0's first rear replica, rank 4) lives on node 1.
    summary = json.loads(results[0][1].strip().splitlines()[-1])
    assert (summary["model"], summary["shape"], summary["world_size"]) == ("resnet101", [4, 2], 6)
    assert summary["steps"] == 2
