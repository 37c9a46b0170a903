"""LoRA in one process: --lora's spec and its errors, adapters that keep the base's names, start
as PEFT's (B = 0: the model is unchanged) from (seed, name) alone, merge into the weights exactly,
and the refusals before anything starts."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from bundle.config import LoRASpec, ModelConfig, parse_lora
from bundle.config.lora import resolve_lora
from bundle.errors import ConfigError
from bundle.models import lora
from bundle.models.gpt import GPT


def test_the_spec_reads_every_key_and_targets_to_the_end():
    spec = parse_lora("r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj")
    assert spec == LoRASpec(r=16, alpha=32.0, dropout=0.05, targets=("q_proj", "v_proj"))
    assert spec.scaling == 2.0
    assert parse_lora(spec.text()) == spec
    assert parse_lora("on") == LoRASpec() and parse_lora(None) is None
    assert parse_lora("targets=a,b,r=4") == LoRASpec(r=4, targets=("a", "b"))
    assert parse_lora("r=4,rslora=true").scaling == 16.0 / 2.0


@pytest.mark.parametrize(
    "text,says",
    [
        ("r=0", "r must be a positive integer, not 0"),
        ("r=1.5", "r must be a positive integer"),
        ("alpha=-1", "alpha must be a positive number"),
        ("dropout=1", "dropout must be a probability in [0, 1)"),
        ("rank=4", "unknown key 'rank'"),
        ("q_proj", "'q_proj' is not key=value"),
        ("targets=", "targets= names no module"),
        ("rslora=maybe", "rslora must be true or false"),
    ],
)
def test_a_bad_spec_is_one_line_naming_the_flag(text, says):
    with pytest.raises(ConfigError, match="--lora") as err:
        parse_lora(text)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_lora_train_needs_lora():
    with pytest.raises(ConfigError, match="--lora-train.*give --lora"):
        ModelConfig(lora_train="head")
    assert ModelConfig(lora="on", lora_train="head").lora_trained == ("head",)


def _adapter_dir(tmp_path, **changes):
    doc = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["v", "q"]}
    doc.update(changes)
    (tmp_path / "adapter_config.json").write_text(json.dumps(doc))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    return str(tmp_path)


def test_lora_init_gives_the_spec_and_refuses_what_it_cannot_take(tmp_path):
    d = _adapter_dir(tmp_path)
    assert resolve_lora(None, d, None) == "r=4,alpha=8,dropout=0.0,targets=q,v"
    assert resolve_lora("r=4,alpha=8,targets=v,q", d, None) == "r=4,alpha=8,dropout=0.0,targets=q,v"
    with pytest.raises(ConfigError, match="--lora-init.*--lora asks for r=8"):
        resolve_lora("r=8,alpha=8,targets=q,v", d, None)
    for change, says in (
        ({"use_dora": True}, "use_dora"),
        ({"target_modules": ".*proj"}, "give a list of names"),
        ({"peft_type": "IA3"}, "IA3 adapter, not LORA"),
    ):
        with pytest.raises(ConfigError, match=says):
            resolve_lora(None, _adapter_dir(tmp_path, **change), None)
    _adapter_dir(tmp_path)
    (tmp_path / "adapter_model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no adapter_model.safetensors"):
        resolve_lora(None, d, None)


def _gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(vocab=32, seq_len=8, layers=2, width=16, heads=2)


def test_adapters_keep_the_base_names_and_only_they_train():
    model, x = _gpt(), torch.randint(0, 32, (3, 8))
    before = model(x)
    names = set(dict(model.named_parameters()))
    adapted = lora.apply(model, LoRASpec(r=2), seed=5)
    assert adapted.modules == {"layers.0.attn.qkv": "linear", "layers.1.attn.qkv": "linear"}
    after = dict(model.named_parameters())
    assert names <= set(after)  # the base's names are unchanged (--pretrained reads them)
    assert {n for n, p in after.items() if p.requires_grad} == lora.adapter_names(model)
    assert after["layers.0.attn.qkv.lora_A.weight"].shape == (2, 16)
    assert after["layers.0.attn.qkv.lora_B.weight"].shape == (48, 2)
    assert isinstance(model.layers[0].attn.qkv, nn.Linear)
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)  # B = 0: nothing changed yet


def test_the_first_adapters_follow_seed_and_name_alone():
    a, b, c = _gpt(0), _gpt(1), _gpt(0)
    for m, seed in ((a, 5), (b, 5), (c, 6)):
        lora.apply(m, LoRASpec(r=2), seed=seed)

    def first(m, layer):
        return dict(m.named_parameters())[f"layers.{layer}.attn.qkv.lora_A.weight"]

    assert torch.equal(first(a, 0), first(b, 0))  # another base, the same seed: equal
    assert not torch.equal(first(a, 0), first(a, 1))  # another module: different
    assert not torch.equal(first(a, 0), first(c, 0))  # another seed: different


def test_train_keeps_named_modules_trainable_and_all_linear_leaves_the_head():
    model = _gpt()
    adapted = lora.apply(model, LoRASpec(targets=("all-linear",)), seed=0, train=("ln_f",))
    assert "head" not in adapted.modules and "layers.1.mlp.2" in adapted.modules
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {"ln_f.weight", "ln_f.bias"} <= trains
    assert "head.weight" not in trains and "embed.tokens.weight" not in trains


def test_merging_folds_each_adapter_into_its_weight_linear_and_conv1d():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), Conv1D(4, 5), nn.Linear(4, 3))
    adapted = lora.apply(model, LoRASpec(r=2, alpha=3, targets=("0", "1")), seed=1)
    assert adapted.modules == {"0": "linear", "1": "conv1d"}
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    x = torch.randn(7, 6)
    merged = nn.Sequential(nn.Linear(6, 5), Conv1D(4, 5), nn.Linear(4, 3))
    merged.load_state_dict(lora.merge_state(model.state_dict(), adapted.record()))
    torch.testing.assert_close(merged(x), model(x), rtol=1e-5, atol=1e-6)
    plain = nn.Sequential(nn.Linear(6, 5), Conv1D(4, 5), nn.Linear(4, 3))
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if "lora" not in k})
    assert not torch.allclose(plain(x), model(x), atol=1e-3)  # the adapters do change it


@pytest.mark.parametrize(
    "spec,train,says",
    [
        (
            LoRASpec(targets=("qkvv",)),
            (),
            "target 'qkvv' matches no module of GPT; nearest names: qkv",
        ),
        (LoRASpec(targets=("tokens",)), (), "matches embed.tokens (Embedding): LoRA adapts Linear"),
        (LoRASpec(), ("heads",), "--lora-train: 'heads' is not valid; matches no module"),
    ],
)
def test_a_target_that_matches_nothing_or_no_linear_is_refused(spec, train, says):
    with pytest.raises(ConfigError) as err:
        lora.apply(_gpt(), spec, seed=0, train=train)
    assert says in str(err.value)


def test_a_model_without_linears_or_without_a_default_says_what_to_give():
    with pytest.raises(ConfigError, match="has no linear layer"):
        lora.apply(nn.Sequential(nn.Conv2d(1, 1, 3)), LoRASpec(), seed=0)
    with pytest.raises(ConfigError, match="no default target for Sequential.*targets=all-linear"):
        lora.apply(nn.Sequential(nn.Linear(2, 2)), LoRASpec(), seed=0)
    model = _gpt()
    lora.apply(model, LoRASpec(), seed=0)
    with pytest.raises(ConfigError, match="adapted already"):
        lora.apply(model, LoRASpec(), seed=0)


def test_an_adapted_model_pickles_as_its_base_does(tmp_path):
    model = _gpt()
    lora.apply(model, LoRASpec(r=2), seed=0)
    path = tmp_path / "m.pt"
    torch.save(model, path)
    again = torch.load(path, weights_only=False)
    x = torch.randint(0, 32, (2, 8))
    torch.testing.assert_close(again(x), model(x), rtol=0, atol=0)
