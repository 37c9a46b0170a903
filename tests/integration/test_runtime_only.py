"""main.py on a machine that has only what requirements.txt installs, whatever this one has: its
help, and a Hugging Face feature asked for without its package, which names the package to
install in one line before any process starts (the default job itself runs so in test_e2e)."""

from __future__ import annotations

import json

import pytest

from bundle.models import hf
from tests.support.processes import finish, runtime_only, start

pytestmark = pytest.mark.slow

GUARD = (
    "import importlib.util, json;"
    "print(json.dumps({m: importlib.util.find_spec(m) is not None for m in "
    "('pytest', 'transformers', 'datasets', 'torch', 'safetensors', 'yaml')}))"
)


def test_help_and_each_hugging_face_feature_without_its_package(tmp_path):
    hub = tmp_path / "hub"  # a save_pretrained directory, as far as a check before the build reads
    hub.mkdir()
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 1}
    (hub / "config.json").write_text(json.dumps(config))
    (hub / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "hello"}\n')
    install_transformers = f"({hf.install_command()})"
    asks = {
        ("--model", "transformers:GPT2LMHeadModel"): install_transformers,
        ("--pretrained", str(hub)): install_transformers,
        ("--model", "gpt", "--dataset", "hf", "--data-files", str(rows)): "(pip install datasets)",
        (
            "--model",
            "gpt",
            "--dataset",
            "text",
            "--data-file",
            str(rows),
            "--tokenizer",
            str(hub),
        ): install_transformers,
    }
    env = runtime_only()
    guard = start("-c", GUARD, env=env)
    helped = start("main.py", "--help", env=env)
    refused = {argv: start("main.py", *argv, "--itr", "1", env=env) for argv in asks}

    code, out, err = finish(guard, timeout=60)
    # The guard hides what the suite itself runs with: the checks below cannot pass by luck.
    assert code == 0 and json.loads(out) == {
        "pytest": False,
        "transformers": False,
        "datasets": False,
        "torch": True,
        "safetensors": True,
        "yaml": True,
    }, err
    code, out, err = finish(helped, timeout=60)
    assert code == 0 and "--bundle-shape" in out and not err, err
    for argv, says in asks.items():
        code, out, err = finish(refused[argv], timeout=60)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and says in lines[0], (argv, err)
