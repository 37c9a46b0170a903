"""Sampling after training (``python -m bundle.generate``): from a weights file with its model
named, or a step directory as a run wrote it, deterministic under a seed, the likeliest token at
temperature 0; nothing a checkpoint names runs as code unless trusted; one-line refusals."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from bundle import generate, models
from bundle.checkpoint import format as ckpt

# The step directory is written and read in this one process on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

GPT = ["--model", "gpt", "--model-args", "layers=1,width=16,heads=2", "--seq-len", "16"]
SIZE = {"layers": 1, "width": 16, "heads": 2}
# What a run of that model on byte-level text records in bundle.json (bundle.session).
RECORD = {
    "step": 1,
    "format": ckpt.FORMAT,
    "model": "gpt",
    "model_args": "layers=1,width=16,heads=2",
    "model_output": None,
    "num_classes": 256,
    "input_shape": [16],
    "tokenizer": None,
}


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return models.build("gpt", num_classes=256, input_shape=(16,), args=SIZE)


@pytest.fixture(scope="module")
def weights(model, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("weights") / "w.pt")
    ckpt.save(path, model.state_dict())
    return path


@pytest.fixture(scope="module")
def step(model, tmp_path_factory) -> str:
    """A step-N directory as the engine writes it (one process, no process group)."""
    save_dir = tmp_path_factory.mktemp("save")
    tmp = ckpt.step_dir(str(save_dir), 1) + ".tmp"
    os.makedirs(tmp)
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), no_dist=True)
    final = ckpt.step_dir(str(save_dir), 1)
    ckpt.publish(tmp, final, RECORD)
    return final


def recording(step: str, where, **changes) -> str:
    """A copy of ``step`` whose bundle.json records ``changes``: the one place a test writes a
    bundle.json by hand (were it ever to carry a checksum of itself, this is what adapts)."""
    copy = where / "step-1"
    shutil.copytree(step, copy)
    info = {**json.loads((copy / ckpt.INFO).read_text()), **changes}
    if "digest" in info:  # a bundle.json that carries its own digest: anyone can seal it again
        info["digest"] = ckpt._info_digest(info)
    (copy / ckpt.INFO).write_text(json.dumps(info))
    return str(copy)


def refused(capsys, *argv: str) -> str:
    """The one line ``argv`` is refused with (exit 2)."""
    assert generate.main(list(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m bundle.generate: error:"), lines
    return lines[0]


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


def test_a_factory_named_by_a_checkpoint_runs_only_with_trust_checkpoint_code(
    step, tmp_path, capsys
):
    marker = tmp_path / "ran"
    factory = tmp_path / "payload.py"
    factory.write_text(
        "import pathlib\n"
        "from bundle import models\n\n\n"
        "def build(num_classes, input_shape, **size):\n"
        f"    pathlib.Path({str(marker)!r}).touch()\n"
        "    return models.build('gpt', num_classes=num_classes, input_shape=input_shape, "
        "args=size)\n"
    )
    named = recording(step, tmp_path, model=f"{factory}:build")
    run = ["--prompt", "def f(", "--max-new-tokens", "8"]
    line = refused(capsys, named, *run)
    assert "code named by the checkpoint" in line and "--trust-checkpoint-code" in line
    assert not marker.exists()
    shell = recording(
        step, tmp_path / "b", model="os:system", model_args=f"command='touch {marker}'"
    )
    assert "--trust-checkpoint-code" in refused(capsys, shell, *run)
    assert not marker.exists()
    assert generate.main([named, *run, "--trust-checkpoint-code"]) == 0 and marker.exists()
    trusted = capsys.readouterr().out
    assert generate.main([step, *run]) == 0  # the same weights under their registered name
    assert capsys.readouterr().out == trusted and trusted.startswith("def f(")


@pytest.mark.parametrize(
    "name, is_data",
    [
        ("gpt", True),
        ("resnet18", True),
        ("mobilenet_v3_small", True),
        ("transformers:GPT2LMHeadModel", True),
        ("transformers:AutoConfig", False),  # a class of transformers, not a model
        ("transformers:GPT2LMHeadModel.from_pretrained", False),
        ("transformers:modeling_utils.PreTrainedModel", False),
        ("transformers.models.gpt2:GPT2LMHeadModel", False),
        ("bundle.models:build", False),
        ("/tmp/x.py:build", False),
        ("no_such_model", False),
    ],
)
def test_a_checkpoint_may_name_a_registered_model_or_a_transformers_class_only(name, is_data):
    if is_data:
        assert generate.recorded_model(name, "bundle.json model", trust=False) == name
    else:
        with pytest.raises(generate.ConfigError, match="bundle.json model"):
            generate.recorded_model(name, "bundle.json model", trust=False)


@pytest.mark.parametrize(
    "changes, says",
    [
        ({"num_classes": 10**12}, r"tokens\.weight is \[256, 16\] in the checkpoint"),
        ({"num_classes": "256"}, "num_classes: '256'"),
        ({"num_classes": True}, "num_classes: True"),
        ({"input_shape": [True]}, r"input_shape: \[True\]"),
        ({"input_shape": [-4]}, r"input_shape: \[-4\]"),
        ({"input_shape": [16.0]}, r"input_shape: \[16\.0\]"),
        ({"model_args": ["layers=1"]}, "model_args: \\['layers=1'\\]"),
        ({"tokenizer": 5}, "tokenizer: 5"),
        ({"model_output": "logits[0]"}, "model_output: 'logits\\[0\\]'"),
        ({"model_output": 0}, "model_output: 0"),
    ],
)
@pytest.mark.timeout(60)
def test_what_a_step_directory_records_is_checked_as_data_in_one_line(
    step, tmp_path, capsys, changes, says
):
    line = refused(capsys, recording(step, tmp_path, **changes), "--prompt", "x")
    assert re.search(says, line), line


@pytest.mark.parametrize("part", [0, 0.5], ids=["empty", "truncated"])
def test_a_weights_file_that_cannot_be_read_is_one_line(weights, tmp_path, capsys, part):
    path = tmp_path / "bad.pt"
    with open(weights, "rb") as f:
        data = f.read()
    path.write_bytes(data[: int(len(data) * part)])
    line = refused(capsys, str(path), *GPT, "--prompt", "x")
    assert f"{path}" in line and "cannot read it" in line


@pytest.mark.parametrize(
    "flag, value, says",
    [
        ("--temperature", "nan", "--temperature: nan"),
        ("--temperature", "inf", "--temperature: inf"),
        ("--temperature", "-1", "--temperature: -1.0"),
        ("--seq-len", "0", "--seq-len: 0"),
        ("--seq-len", "17", "--seq-len: 17 is not valid; the model was trained on 16"),
        ("--max-new-tokens", "-1", "--max-new-tokens: -1"),
        ("--top-k", "0", "--top-k: 0"),
    ],
)
def test_a_sampling_flag_out_of_range_is_one_line_naming_it(step, capsys, flag, value, says):
    assert says in refused(capsys, step, "--prompt", "x", flag, value)


def test_a_context_longer_than_a_weights_files_position_table_is_one_line(weights, capsys):
    line = refused(capsys, weights, *GPT[:-1], "32", "--prompt", "x")
    assert "--seq-len: 32" in line and "holds 16 positions" in line
