"""main.py for many command lines at the cost of one interpreter's start: this process imports
what main.py imports, then runs each command line in a process forked from it, as main.py would
run it (``sys.argv[0]`` is main.py, its own stdout and stderr, its exit code).

Reads a JSON list of argument lists on stdin; writes one JSON line per list, in order:
``{"code": int, "stdout": str, "stderr": str}``. A command line that outlives ``--timeout``
seconds is killed and reported with code -9."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _child(argv: list[str], out: int, err: int) -> None:
    """In the forked process: main.py with ``argv``, its output into ``out`` and ``err``."""
    os.dup2(out, 1)
    os.dup2(err, 2)
    code = 1
    try:
        from bundle.cli import main

        sys.argv = ["main.py", *argv]
        code = main(argv)
    except SystemExit as exc:  # argparse's errors, as main.py's sys.exit would end
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported as the interpreter would report it
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -9


def run_mains(cases: list[list[str]], timeout: float = 60.0) -> list[dict]:
    """main.py with each argument list (run from the repository's root), through this module
    in a process of its own: ``{"code", "stdout", "stderr"}`` each, in order."""
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.forked_main", "--timeout", str(timeout)],
        cwd=ROOT,
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=timeout * len(cases) + 60,
    )
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 0 and len(results) == len(cases), proc.stderr[-3000:]
    return results


def _one(argv: list[str], timeout: float) -> dict:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(argv, out.fileno(), err.fileno())
        code = _wait(pid, timeout)
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
    return {"code": code, "stdout": texts[0], "stderr": texts[1]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--timeout", type=float, default=60.0)
    timeout = parser.parse_args().timeout
    cases = json.load(sys.stdin)
    import bundle.cli  # noqa: F401 - imported once, before the forks
    import bundle.preflight  # noqa: F401

    for argv in cases:
        print(json.dumps(_one([str(a) for a in argv], timeout)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
