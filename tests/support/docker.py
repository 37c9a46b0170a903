"""A fake ``docker`` on ``PATH`` that records its calls, for the container scripts' tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN_SCRIPT = REPO / "scripts" / "run-bundle-hp.sh"
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
STACK_FILE = REPO / "docker" / "stack.yml"
TIMEOUT = 30

# Records each invocation as one JSON line of its argv. `network inspect` fails (a missing
# network) until `network create` has run, or succeeds at once when FAKE_DOCKER_NETWORK_EXISTS=1.
FAKE_DOCKER = f"""#!{sys.executable}
import json, os, sys
from pathlib import Path

args = sys.argv[1:]
with open(os.environ["FAKE_DOCKER_LOG"], "a") as log:
    log.write(json.dumps(args) + "\\n")
created = Path(os.environ["FAKE_DOCKER_LOG"] + ".network-created")
if args[:2] == ["network", "inspect"]:
    exists = os.environ.get("FAKE_DOCKER_NETWORK_EXISTS") == "1" or created.exists()
    sys.exit(0 if exists else 1)
if args[:2] == ["network", "create"]:
    created.touch()
"""


def clean_env(bin_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BUNDLE_", "FAKE_DOCKER"))}
    env.pop("NCCL_SOCKET_IFNAME", None)
    env.pop("GLOO_SOCKET_IFNAME", None)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
    env.update(extra)
    return env


class FakeDocker:
    def __init__(self, tmp_path: Path) -> None:
        self.bin_dir = tmp_path / "bin"
        self.bin_dir.mkdir()
        self.log = tmp_path / "docker.log"
        exe = self.bin_dir / "docker"
        exe.write_text(FAKE_DOCKER)
        exe.chmod(0o755)

    def run(
        self, *args: str, stdin: str | None = None, **env: str
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(RUN_SCRIPT), *args],
            input=stdin if stdin is not None else "",
            capture_output=True,
            text=True,
            env=clean_env(self.bin_dir, FAKE_DOCKER_LOG=str(self.log), **env),
            timeout=TIMEOUT,
        )

    def calls(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]
