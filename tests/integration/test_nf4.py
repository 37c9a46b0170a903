"""An NF4 base end to end: main.py trains LoRA adapters on a gpt whose frozen linear weights each
process stores in 4 bits, and a run resumed from its step-4 checkpoint (the base's digests
checked) lands bit for bit where the uninterrupted run lands: every step's loss, the adapters,
the base as it computes."""

from __future__ import annotations

import pytest
import torch

from bundle.launch.localworld import free_port
from tests.integration.test_resume import assert_identical, losses
from tests.support.processes import finish, start

pytestmark = pytest.mark.slow
pytest.importorskip("torchao")


def test_an_nf4_base_trains_and_resumes_bit_identical(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"word{i % 37} of line {i % 11}." for i in range(3000)))
    run = [
        "main.py", "--bundle-shape", "1,1", "--backend", "gloo",
        "--model", "gpt", "--model-args", "layers=2,width=64,heads=2",
        "--dataset", "text", "--data-file", str(corpus), "--seq-len", "16",
        "--batch-size", "8", "--micro-batches", "2", "--itr", "6", "--save-every", "4",
        "--optimizer", "adamw", "--lr", "0.01", "--no-eval", "--log-every", "1",
        "--lora", "r=4,alpha=8,targets=qkv,proj",
    ]  # fmt: skip
    for name, resume in (
        ("straight", []),
        ("resumed", ["--resume", str(tmp_path / "straight" / "step-4")]),
    ):
        code, _, err = finish(
            start(
                *run, "--base-dtype", "nf4", "--save-dir", str(tmp_path / name),
                "--checkpoint", str(tmp_path / f"{name}.pt"),
                "--metrics-out", str(tmp_path / f"{name}.jsonl"),
                "--portNum", str(free_port()), *resume,
            ),
            timeout=120,
        )  # fmt: skip
        assert code == 0, err
        assert "--base-dtype nf4: this process's frozen base" in err, err
    straight = losses(tmp_path / "straight.jsonl")
    assert len(straight) == 6 and straight[6] < straight[1], straight
    assert losses(tmp_path / "resumed.jsonl") == {5: straight[5], 6: straight[6]}
    assert_identical(tmp_path / "straight.pt", tmp_path / "resumed.pt")
    final = torch.load(tmp_path / "straight.pt", weights_only=True)
    assert "layers.0.attn.qkv.lora_A.weight" in final  # what trains: the adapters, not the base
    assert not any(k.endswith("qkv.weight") for k in final), sorted(final)[:4]
