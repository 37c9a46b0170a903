"""Sampling after training (``python -m bundle.generate``): from a weights file with its model
named, deterministic under a seed, the likeliest token at temperature 0, one-line refusals."""

from __future__ import annotations

import pytest
import torch

from bundle import generate, models
from bundle.checkpoint import format as ckpt

GPT = ["--model", "gpt", "--model-args", "layers=1,width=16,heads=2", "--seq-len", "16"]


@pytest.fixture
def weights(tmp_path) -> str:
    torch.manual_seed(0)
    model = models.build(
        "gpt", num_classes=256, input_shape=(16,), args={"layers": 1, "width": 16, "heads": 2}
    )
    path = str(tmp_path / "w.pt")
    ckpt.save(path, model.state_dict())
    return path


def _text(capsys, *argv: str) -> str:
    assert generate.main(list(argv)) == 0
    return capsys.readouterr().out


def test_the_same_seed_gives_the_same_text_and_another_seed_another(weights, capsys):
    run = [weights, *GPT, "--prompt", "def f(", "--max-new-tokens", "40"]
    a, b = _text(capsys, *run, "--seed", "1"), _text(capsys, *run, "--seed", "1")
    assert a == b and a.startswith("def f(")
    assert _text(capsys, *run, "--seed", "2") != a
    greedy = _text(capsys, *run, "--temperature", "0", "--seed", "5")
    assert greedy == _text(capsys, *run, "--temperature", "0", "--seed", "6")
    assert _text(capsys, *run, "--top-k", "1") == greedy  # the likeliest token only


def test_a_weights_file_without_its_model_or_a_missing_checkpoint_is_one_line(weights, capsys):
    assert generate.main([weights, "--prompt", "x"]) == 2
    assert generate.main(["/nonexistent/step-3", "--prompt", "x"]) == 2
    assert generate.main([weights, "--model", "mlp", "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(
        line.startswith("python -m bundle.generate: error:") for line in err
    )
    assert "needs --model" in err[0] and "no such step directory" in err[1]
