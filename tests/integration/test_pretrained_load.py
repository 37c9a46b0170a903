"""--pretrained end to end: a sharded tiny GPT-2 with tied embeddings, loaded at shape 1,1,1 (three
processes, cut across its tied embedding from the capture the launch's checks make on the meta
device), trains two steps at a learning rate too small to move a weight; the weights gathered
from the stages are the saved ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bundle import preflight
from bundle.config import RunConfig
from bundle.launch.localworld import run_world
from bundle.session import build_session, train_stream
from bundle.topology import Topology
from tests.support.config import make_config

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

STEPS, SEQ = 2, 8


def _saved(tmp_path: Path) -> tuple[str, dict[str, torch.Tensor]]:
    torch.manual_seed(5)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=16,
        n_head=2,
        vocab_size=300,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(tmp_path / "gpt2", max_shard_size="20KB")
    return str(tmp_path / "gpt2"), {k: v.clone() for k, v in model.state_dict().items()}


def _run(rank: int, world: int, cfg: RunConfig, capture) -> dict[str, torch.Tensor]:
    topo = Topology.from_config(cfg)
    session = build_session(cfg, topo, rank, torch.device("cpu"), capture=capture)
    batches = train_stream(session, topo, cfg.train.seed, STEPS, 0)
    for step in range(STEPS):
        session.engine.train_step(step, next(batches))
    stage = session.stage
    return {stage.full_name(n): p.detach().clone() for n, p in stage.named_parameters()}


def test_a_sharded_tied_gpt2_loads_across_three_stages_and_keeps_its_weights(tmp_path):
    directory, saved = _saved(tmp_path)
    assert len(list(Path(directory).glob("model-*.safetensors"))) > 1
    text = tmp_path / "corpus.txt"
    text.write_text("a pretrained model, cut into three stages, reads its own weights. " * 30)
    cfg = make_config(
        parallel={"shape": (1, 1, 1), "micro_batches": 2},
        model={"pretrained": directory},
        data={"dataset": "text", "data_file": str(text), "seq_len": SEQ},
        train={"steps": STEPS, "batch_size": 4, "lr": 1e-30, "seed": 2, "eval": False},
    )
    assert cfg.model.name == "transformers:GPT2LMHeadModel"
    _, capture = preflight.check_model(cfg, 3)  # once, on the meta device, as the launch does
    assert capture is not None
    gathered: dict[str, torch.Tensor] = {}
    for part in run_world(3, _run, cfg, capture):
        gathered.update(part)
    # every parameter: the tied head from the last stage, the embedding from the first
    assert set(gathered) == set(saved)
    for name, value in gathered.items():
        assert (value - saved[name]).abs().max().item() <= 1e-12, name
