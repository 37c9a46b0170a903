"""main.py and the scripts started as a user starts them, in a process group of their own, and
a small ImageFolder to train on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = [
    "--model",
    "mlp",
    "--dataset",
    "synthetic",
    "--image-size",
    "4",
    "--num-classes",
    "5",
    "--synthetic-size",
    "256",
    "--batch-size",
    "16",
    "--no-eval",
    "--log-every",
    "1",
]


def runtime_only() -> dict[str, str]:
    """The environment of a process (and of those it starts) that can import only what
    ``pip install -r requirements.txt`` installs (tests/support/runtime_only)."""
    guard = os.path.join(ROOT, "tests", "support", "runtime_only")
    path = os.pathsep.join(p for p in (guard, os.environ.get("PYTHONPATH")) if p)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "BUNDLE_RUNTIME_ONLY": os.path.join(ROOT, "requirements.txt"),
    }


def start(*args, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kw,
    )


def start_logged(log, *args, **kw) -> subprocess.Popen:
    """A long run: stderr goes to the file ``log`` (a pipe nobody reads would fill and block it)."""
    with open(log, "w") as err_file:
        return subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err_file,
            start_new_session=True,
            **kw,
        )


def finish(p: subprocess.Popen, timeout: float = 180) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"timed out after {timeout}s\nstdout:\n{out}\nstderr:\n{err}")
    return p.returncode, out, err


def image_folder(root) -> None:
    """Three classes of plain-coloured JPEGs of varied sizes: 12 per class to train, 4 to validate."""
    from PIL import Image

    for split, count in (("train", 12), ("val", 4)):
        for c, color in enumerate(((200, 30, 30), (30, 200, 30), (30, 30, 200))):
            d = root / split / f"class{c}"
            d.mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (40 + i, 36), color).save(d / f"{i}.jpg")
