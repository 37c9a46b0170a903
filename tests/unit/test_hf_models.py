"""The front door for the models people train: forwards with keyword arguments and structured
outputs, Hugging Face ``transformers`` classes by reference, one-stage shapes that never trace,
and transformer code (shape control flow, masks, rotary tables) cut by ``torch.export``."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn as nn

from bundle import models
from bundle.config import ModelConfig
from bundle.engine.stage import split_model
from bundle.engine.stages import cut_stages
from bundle.errors import ConfigError
from bundle.models import graph
from bundle.models.cut import Capture, capture_key, capture_of, cut
from bundle.models.outputs import Whole, check_forward, select
from bundle.models.partition import auto_starts
from tests.support import user_models

transformers = pytest.importorskip("transformers")


def test_the_output_rule():
    a, b = torch.ones(2), torch.zeros(2)
    assert select(a) is a
    assert select({"hidden": b, "logits": a}) is a
    assert select({"hidden": b, "scores": a}) is b  # no logits: the first tensor
    assert select({"hidden": b, "scores": a}, "scores") is a
    assert select((b, a)) is b and select((b, a), "1") is a
    out = transformers.modeling_outputs.CausalLMOutput(loss=None, logits=a)
    assert select(out) is a
    with pytest.raises(ConfigError, match="hidden, scores: name one of them"):
        select({"hidden": b, "scores": a}, "logits")


def test_a_forward_may_take_keyword_arguments_but_one_input_only():
    check_forward(user_models.keyword_net(3, (4,)))
    with pytest.raises(ConfigError, match=r"not 2 \(x, y\)"):
        check_forward(user_models.two_inputs(3, (4,)))


def test_one_stage_never_traces_and_keeps_the_models_names(monkeypatch):
    def no_trace(*args, **kwargs):
        raise AssertionError("traced")

    monkeypatch.setattr(graph, "trace", no_trace)
    model = user_models.keyword_net(3, (4,))
    (stage,) = cut_stages(model, ModelConfig(name="k"), 1, (4,))
    assert isinstance(stage.blocks[0], Whole)
    assert list(stage.full_state_dict()) == list(model.state_dict())
    x = torch.randn(5, 4)
    assert torch.equal(stage(x)[0], model(x)["logits"])
    stage.eval()
    assert not model.training


def _build(name: str, classes: int, shape: tuple[int, ...], **kwargs) -> nn.Module:
    return models.build(f"transformers:{name}", num_classes=classes, input_shape=shape, **kwargs)


def test_hugging_face_classes_are_built_from_their_config_sized_by_the_data(tmp_path):
    tiny = {"n_layer": 1, "n_embd": 8, "n_head": 2}
    gpt = _build("GPT2LMHeadModel", 300, (2048,), args=tiny)
    assert (gpt.config.vocab_size, gpt.config.n_positions, gpt.config.n_layer) == (300, 2048, 1)
    bert = _build(
        "BertForSequenceClassification",
        4,
        (16,),
        args={
            "num_hidden_layers": 1,
            "hidden_size": 8,
            "num_attention_heads": 2,
            "intermediate_size": 16,
        },
    )
    assert bert.config.num_labels == 4
    vit = _build(
        "ViTForImageClassification",
        3,
        (1, 8, 8),
        args={
            "num_hidden_layers": 1,
            "hidden_size": 8,
            "num_attention_heads": 2,
            "intermediate_size": 16,
            "patch_size": 4,
        },
    )
    assert (vit.config.image_size, vit.config.num_channels, vit.config.num_labels) == (8, 1, 3)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", **tiny, "n_layer": 2}))
    assert _build("GPT2LMHeadModel", 300, (16,), config_file=str(config)).config.n_layer == 2
    with pytest.raises(ConfigError, match=r"GPT2Config has no field\(s\) \['layers'\]"):
        _build("GPT2LMHeadModel", 300, (16,), args={"layers": 2})
    with pytest.raises(ConfigError, match="only a transformers model takes one"):
        models.build("mlp", num_classes=3, input_shape=(4,), config_file=str(config))


@pytest.mark.parametrize("factory", ["gpt2", "llama"])
def test_transformer_code_is_cut_by_export_and_equals_the_unsplit_model(factory):
    model = getattr(user_models, factory)(64, (8,))
    blocks = models.blocks(model, (8,))
    assert len(blocks) >= 6  # embeddings, each layer, the final norm, the head
    x = torch.randint(0, 64, (5, 8))  # another batch size than the capture's
    want = model(x).logits
    for stages in (2, 4):
        h: tuple[torch.Tensor, ...] = (x,)
        for stage in split_model(blocks, auto_starts(blocks, stages)):
            h = stage(*h)
            assert all(t.shape[0] == 5 for t in h)  # only batched values cross
        assert torch.allclose(h[0], want, atol=1e-6)


def test_a_captured_dropout_follows_the_segments_mode():
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32, resid_pdrop=0.5)
    )
    seg = dict(models.blocks(model, (8,)))["transformer.h.0"]
    x = torch.randn(3, 8, 8)
    seg.eval()
    assert torch.equal(seg(x), seg(x))
    seg.train()
    assert not torch.equal(seg(x), seg(x))


@pytest.mark.parametrize("factory", ["gpt2", "llama", "skip_net"])
def test_a_split_made_once_on_the_meta_device_serves_every_process(factory, monkeypatch):
    # The launch's checks cut the model on the meta device; each process loads that split into
    # its own instance instead of capturing the forward again, and computes the same function.
    make = getattr(user_models, factory)
    cfg, shape = ModelConfig(name=f"tests.support.user_models:{factory}"), (8,)
    with torch.device("meta"):
        on_meta = make(64, shape)
    capture = capture_of(cut(on_meta, cfg, 3, shape), cfg, shape)
    assert capture is not None
    torch.manual_seed(0)
    model = make(64, shape)
    x = torch.randint(0, 64, (5, 8)) if factory != "skip_net" else torch.randn(5, 8)
    want = models.forward(model, x)
    fresh = cut_stages(model, cfg, 3, shape)

    def no_capture(*args, **kwargs):
        raise AssertionError("captured again")

    monkeypatch.setattr(models, "blocks", no_capture)
    loaded = cut_stages(model, cfg, 3, shape, capture)
    assert [s.names for s in loaded] == [s.names for s in fresh]
    h: tuple[torch.Tensor, ...] = (x,)
    for stage in loaded:
        h = stage(*h)
    assert torch.equal(h[0], want)
    # Another model's split is not taken for this one: it is captured afresh.
    other = Capture(capture_key(replace(cfg, partition="x"), shape), b"")
    with pytest.raises(AssertionError, match="captured again"):
        cut_stages(model, cfg, 3, shape, other)


def test_devices_a_capture_recorded_follow_the_segments_input():
    # export writes torch.arange(n, device=x.device) with the capture's device as a constant: a
    # stage captured on the CPU must still run where it is moved (a GPU; here the meta device).
    blocks = models.blocks(user_models.gpt2(64, (8,)), (8,))
    h: tuple[torch.Tensor, ...] = (torch.zeros(2, 8, dtype=torch.long, device="meta"),)
    for stage in split_model(blocks, auto_starts(blocks, 2)):
        h = stage.to("meta")(*h)
    assert h[0].device.type == "meta" and h[0].shape == (2, 8, 64)


def test_a_split_that_is_not_a_graphs_is_not_handed_on():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    pieces = cut(model, ModelConfig(name="s"), 2, (4,))
    assert capture_of(pieces, ModelConfig(name="s"), (4,)) is None
