"""To the Hub and back, end to end: a GPT-2 (its output head tied to its token embedding) trained
at shape 1,1 on byte-level text and saved; its step exported with ``--hf`` loads in
``transformers`` with no missing or unexpected key, and computes the logits Bundle's pipelined
evaluation of the same step computes (fp32, within 1e-5), in one file or several shards;
``bundle.generate`` samples the same text from the save directory and from the export."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from bundle import generate
from bundle.checkpoint import format as ckpt
from bundle.checkpoint.__main__ import main as export_command
from bundle.launch.localworld import run_world
from bundle.session import build_session, make_checkpointer, train_stream
from bundle.topology import Topology
from tests.support.config import make_config

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

STEPS, SEQ, ROWS = 3, 16, 4
ROOT = Path(__file__).resolve().parents[2]
GPT2 = "n_layer=2,n_embd=32,n_head=2,resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0"


def _cfg(save_dir: str):
    return make_config(
        parallel={"shape": (1, 1), "micro_batches": 2},
        model={"name": "transformers:GPT2LMHeadModel", "args": GPT2},
        data={
            "dataset": "text",
            "data_file": str(ROOT / "docs" / "checkpoints.md"),
            "seq_len": SEQ,
        },
        train={"batch_size": 8, "steps": STEPS, "optimizer": "adamw", "lr": 0.01, "eval": False},
        checkpoint={"save_dir": save_dir},
    )


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (ROWS, SEQ), generator=torch.Generator().manual_seed(5))


def _train_save_evaluate(rank: int, world: int, cfg):
    """Train, save the last step, and evaluate it as Bundle does (the pipelined forward): the last
    stage returns the logits it computed for ``_ids()``."""
    topo = Topology.from_config(cfg)
    session = build_session(cfg, topo, rank, torch.device("cpu"))
    saver = make_checkpointer(cfg, topo, rank, session)
    batches = train_stream(session, topo, cfg.train.seed, STEPS, 0)
    for step in range(STEPS):
        session.engine.train_step(step, next(batches))
    saver.save(STEPS)
    seen: list[torch.Tensor] = []
    session.stage.register_forward_hook(lambda m, i, out: seen.append(out[0].detach().clone()))
    ids = _ids()
    last = session.coord.stage == topo.num_stages - 1
    session.engine.eval_batch(
        ROWS, (ids if session.coord.stage == 0 else None, ids.roll(-1, 1) if last else None)
    )
    return saver.last_saved, seen[0] if last else None


def _loads_with_every_key(out: str):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set()), info
    assert info["mismatched_keys"] == set() and not info["error_msgs"], info
    return model.eval()


def _sampled(capsys, checkpoint: str) -> str:
    argv = [checkpoint, "--prompt", "The ", "--max-new-tokens", "12", "--temperature", "0"]
    assert generate.main([*argv, "--seq-len", str(SEQ)]) == 0
    return capsys.readouterr().out


def test_a_trained_step_goes_to_transformers_and_back(tmp_path, capsys):
    save_dir = str(tmp_path / "ckpt")
    results = run_world(2, _train_save_evaluate, _cfg(save_dir))
    step, bundle_logits = results[0][0], results[1][1]
    assert step == ckpt.step_dir(save_dir, STEPS) and bundle_logits.shape == (ROWS, SEQ, 256)
    assert ckpt.read_info(step)["hf_config"]["class"] == "GPT2LMHeadModel"

    out = str(tmp_path / "hf")
    assert export_command(["export", step, "--hf", out]) == 0
    assert "GPT2LMHeadModel, 28 tensors in 1 safetensors file(s)" in capsys.readouterr().out
    model = _loads_with_every_key(out)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, written once
    with torch.no_grad():
        got = model(_ids()).logits
    err = (got - bundle_logits).abs().max().item()
    assert err <= 1e-5, f"the export's logits differ from Bundle's by {err:.2e}"

    shards = str(tmp_path / "hf-shards")
    assert export_command(["export", step, "--hf", shards, "--max-shard-size", "20KB"]) == 0
    capsys.readouterr()
    assert len([f for f in os.listdir(shards) if f.endswith(".safetensors")]) > 1
    with torch.no_grad():
        assert torch.equal(_loads_with_every_key(shards)(_ids()).logits, got)

    text = _sampled(capsys, save_dir)
    assert text.startswith("The ") and len(text) > len("The \n")
    assert _sampled(capsys, out) == text == _sampled(capsys, shards)
