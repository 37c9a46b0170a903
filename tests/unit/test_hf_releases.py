"""Hugging Face models are cut into exact stages under every supported ``transformers`` release:
the oldest (``make test`` installs it into ``.venv/transformers-OLDEST``) and the installed one,
each checked in a process of its own by tests/support/hf_release_check.py (eight classes, a
user's wrapper, and two classes fed masked named inputs, at shapes 1, 1,1 and 1,1,1: outputs and
gradients against the unsplit model); a
release outside the range is refused in one line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bundle import models
from bundle.config import ModelConfig
from bundle.engine.stage import Stage, split_model
from bundle.errors import ConfigError
from bundle.models import hf, split_io
from bundle.models.cut import capture_of, cut
from bundle.models.graph import Segment
from bundle.models.partition import auto_starts
from tests.support import hf_release_check as check

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
OLDEST = re.search(r"^HF_OLDEST := (\S+)$", (REPO / "Makefile").read_text(), re.M)[1]
# Where the Makefile installs it: beside the environment running the tests ($(VENV)).
OLDEST_DIR = Path(sys.prefix) / f"transformers-{OLDEST}"
CASES = len(check.SHAPES) * (len(check.CASES) + 1 + len(check.MASKED))


def _run_check(pythonpath: str | None) -> list[dict]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.hf_release_check"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == CASES, f"the check gave {len(results)} results:\n{proc.stderr[-3000:]}"
    return results


def _failures(results: list[dict]) -> list[str]:
    return [
        f"{r['class']} at shape {r['shape']} on transformers {r['transformers']}: {r['error']}"
        for r in results
        if not r["ok"]
    ]


@pytest.mark.slow
def test_every_class_is_cut_exactly_under_the_oldest_supported_release():
    assert (OLDEST_DIR / ".installed").is_file(), (
        f"transformers {OLDEST} is not installed in {OLDEST_DIR}: `make test` installs it"
    )
    results = _run_check(str(OLDEST_DIR))
    assert {r["transformers"] for r in results} == {OLDEST}
    assert not _failures(results), "\n".join(_failures(results))


@pytest.mark.slow
def test_every_class_is_cut_exactly_under_the_installed_release():
    results = _run_check(None)
    assert {r["transformers"] for r in results} == {transformers.__version__}
    assert not _failures(results), "\n".join(_failures(results))


def test_the_oldest_release_tested_is_the_oldest_supported():
    assert tuple(int(p) for p in OLDEST.split(".")[:2]) == hf.SUPPORTED[0]
    hf.check_release(OLDEST)
    hf.check_release(transformers.__version__)


@pytest.mark.parametrize("version", ["4.55.4", "6.0.0", "unknown"])
def test_a_release_outside_the_range_is_refused_in_one_line(version, monkeypatch):
    assert transformers.GPT2LMHeadModel  # transformers replaces its module once it is loaded
    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
    with pytest.raises(ConfigError) as info:
        models.build("transformers:GPT2LMHeadModel", num_classes=64, input_shape=(8,))
    message = str(info.value)
    assert "\n" not in message and version in message
    assert "transformers>=4.56,<6" in message


def test_tensors_a_capture_lifted_are_carried_by_its_graph_and_handed_on_as_data():
    # GPT-2 with its cache on makes tensors in its forward that export lifts out
    # (lifted_tensor_0): the segments hold them, not the model's state, and a capture dumped on
    # one process and loaded on another gives the same stages.
    model = check.WrappedGPT2().eval()
    cfg, shape = ModelConfig(name="wrapped"), (check.SEQ,)
    pieces = cut(model, cfg, 2, shape)
    stages = [Stage(piece) for piece in pieces]
    segments = [m for s in stages for m in s.blocks if isinstance(m, Segment)]
    assert any(m._bundle_constants for m in segments)
    # nothing a checkpoint would hold (state dicts, buffers) under a name the model lacks
    names = set(model.state_dict()) | {n for n, _ in model.named_buffers()}
    assert all(set(s.full_state_dict()) <= names for s in stages)
    assert all(s.full_name(n) in names for s in stages for n, _ in s.named_buffers())
    capture = capture_of(pieces, cfg, shape)
    assert capture is not None
    blocks = split_io.load(model, capture.blocks)
    loaded = split_model(blocks, auto_starts(blocks, 3))
    x = torch.randint(0, check.VOCAB, (2, check.SEQ))
    h: tuple[torch.Tensor, ...] = (x,)
    for stage in loaded:
        h = stage.eval()(*h)
    assert torch.allclose(h[0], model(x), atol=1e-6)
    # a constant follows its segment where it is moved
    moved = next(m for _, m in blocks if isinstance(m, Segment) and m._bundle_constants).to("meta")
    assert all(getattr(moved, c).device.type == "meta" for c in moved._bundle_constants)
