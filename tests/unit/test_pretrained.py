"""--pretrained DIR: a save_pretrained directory (sharded safetensors, tied weights saved once,
legacy names as old releases saved them) builds its class and loads its weights exactly, each
stage reading only its own tensors; what the checkpoint lacks is initialised alike at every
shape and noted; what cannot load is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bundle import preflight
from bundle.config import ModelConfig
from bundle.engine.stage_engine import build_stages
from bundle.errors import ConfigError
from bundle.models import pretrained
from bundle.models.hf import current_name
from tests.support.config import make_config

transformers = pytest.importorskip("transformers")

SEQ, VOCAB = 8, 300
TINY = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}


def _gpt2():
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=32, **TINY
        )
    )


def _llama():
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=16,
            intermediate_size=32,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=VOCAB,
            max_position_embeddings=32,
            tie_word_embeddings=True,
            **TINY,
        )
    )


def _bert(labels: int = 3):
    return transformers.BertForSequenceClassification(
        transformers.BertConfig(
            num_hidden_layers=2,
            hidden_size=16,
            intermediate_size=32,
            num_attention_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=32,
            num_labels=labels,
            **TINY,
        )
    )


MAKERS = {"gpt2": _gpt2, "llama": _llama, "bert": _bert}


def _saved(tmp_path: Path, kind: str, **kw) -> tuple[str, dict[str, torch.Tensor]]:
    """The model saved sharded (a handful of files) and its full state dict (tied names too)."""
    torch.manual_seed(1)
    model = MAKERS[kind](**kw)
    out = tmp_path / kind
    model.save_pretrained(out, max_shard_size="20KB")
    return str(out), {k: v.clone() for k, v in model.state_dict().items()}


def _cfg(tmp_path: Path, directory: str, **model):
    text = tmp_path / "corpus.txt"
    text.write_text("pretrained weights, read stage by stage. " * 40)
    return make_config(
        model={"pretrained": directory, **model},
        data={"dataset": "text", "data_file": str(text), "seq_len": SEQ},
        train={"seed": 3},
    )


@pytest.fixture
def counting(monkeypatch) -> list[str]:
    """Every tensor whose bytes were read from the checkpoint, by its saved name."""
    read: list[str] = []
    spans: dict[pretrained.Span, str] = {}
    real_read, real_into = pretrained.read, pretrained.read_into

    def reading(directory):
        ckpt = real_read(directory)
        spans.update({span: name for name, span in ckpt.spans.items()})
        return ckpt

    def into(span, targets):
        read.append(spans[span])
        real_into(span, targets)

    monkeypatch.setattr(pretrained, "read", reading)
    monkeypatch.setattr(pretrained, "read_into", into)
    return read


def _on_disk(directory: str) -> set[str]:
    return {k for f in Path(directory).glob("*.safetensors") for k in load_file(f)}


def test_the_checkpoint_is_sharded_and_saves_a_tied_weight_once(tmp_path):
    directory, state = _saved(tmp_path, "gpt2")
    files = sorted(p.name for p in Path(directory).glob("*.safetensors"))
    assert len(files) > 1 and (Path(directory) / pretrained.INDEX).is_file()
    on_disk = {k for f in files for k in load_file(Path(directory) / f)}
    assert "lm_head.weight" in state and "lm_head.weight" not in on_disk


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_at_shape_1_the_state_dict_equals_the_saved_one(tmp_path, kind, counting):
    directory, state = _saved(tmp_path, kind)
    cfg = _cfg(tmp_path, directory)
    assert cfg.model.name == f"transformers:{type(MAKERS[kind]()).__name__}"
    (stage,) = build_stages(cfg, 1, (SEQ,), 3 if kind == "bert" else 256)
    got = stage.full_state_dict()
    assert set(got) == set(state)
    for name, value in state.items():
        assert torch.equal(got[name], value), name
    assert len(counting) == len(set(counting)) == len(set(state) & set(_on_disk(directory)))
    if kind != "bert":  # tied: one tensor under both names, loaded from the one saved copy
        model = stage.blocks[0]._whole
        assert model.lm_head.weight is model.get_input_embeddings().weight


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_at_shape_1_1_1_each_stage_reads_only_its_own_tensors(tmp_path, kind, counting):
    directory, state = _saved(tmp_path, kind)
    cfg = _cfg(tmp_path, directory)
    _, capture = preflight.check_model(cfg, 3)  # made on the meta device, as the launch does
    assert capture is not None
    on_disk = _on_disk(directory)
    embedding = "transformer.wte.weight" if kind == "gpt2" else "model.embed_tokens.weight"
    for k in range(3):
        counting.clear()
        stages = build_stages(cfg, 3, (SEQ,), 256, capture, keep={k})
        own = stages[k].full_state_dict()
        for name, value in own.items():
            assert not value.is_meta and torch.equal(value, state[name]), (k, name)
        # this stage's tensors, each once; the tied head by its saved name (the embedding's)
        saved_as = {embedding if n == "lm_head.weight" else n for n in own}
        assert sorted(counting) == sorted(saved_as & on_disk), k
        others = {id(v) for j, s in enumerate(stages) if j != k for v in s.parameters()}
        mine = {id(v) for v in stages[k].parameters()}
        unread = [v for j, s in enumerate(stages) if j != k for v in s.parameters()]
        assert all(v.is_meta for v in unread if id(v) not in mine), k
        assert others


def test_a_tied_weight_cut_across_stages_is_one_tensor_in_both(tmp_path):
    directory, _ = _saved(tmp_path, "gpt2")
    cfg = _cfg(tmp_path, directory)
    _, capture = preflight.check_model(cfg, 3)
    first, _, last = build_stages(cfg, 3, (SEQ,), 256, capture, keep={0})
    wte = dict(first.named_parameters())
    head = dict(last.named_parameters())
    shared = {id(p) for p in wte.values()} & {id(p) for p in head.values()}
    assert len(shared) == 1  # found by bundle.engine.ties as a tie, as without --pretrained


def test_a_head_that_does_not_fit_is_noted_and_initialised_alike_at_every_shape(tmp_path):
    directory, state = _saved(tmp_path, "bert", labels=2)
    cfg = _cfg(tmp_path, directory)  # the data has 3 classes: a new head
    with torch.device("meta"):
        meta = pretrained.build(
            cfg.model.name, directory, num_classes=3, input_shape=(SEQ,), args={}
        )
    note = pretrained.check(meta, directory)
    assert note is not None and "\n" not in note
    assert "classifier.bias, classifier.weight" in note and "2 of another shape" in note
    (whole,) = build_stages(cfg, 1, (SEQ,), 3)
    got = whole.full_state_dict()
    assert got["classifier.weight"].shape == (3, 16)
    assert got["classifier.weight"].std() > 0  # the model's own init, not zeros
    for name, value in state.items():
        if not name.startswith("classifier."):
            assert torch.equal(got[name], value), name
    again = build_stages(cfg, 1, (SEQ,), 3)[0].full_state_dict()
    assert torch.equal(again["classifier.weight"], got["classifier.weight"])
    with pytest.raises(ConfigError, match="does not fit the model: 2 of another shape"):
        pretrained.check(meta, directory, strict=True)


def test_a_head_left_fresh_is_the_same_in_a_stage_of_its_own(tmp_path):
    directory, _ = _saved(tmp_path, "bert", labels=2)
    cfg = _cfg(tmp_path, directory)
    (whole,) = build_stages(cfg, 1, (SEQ,), 3)
    _, capture = preflight.check_model(cfg, 2)
    last = build_stages(cfg, 2, (SEQ,), 3, capture, keep={1})[1].full_state_dict()
    for name in ("classifier.weight", "classifier.bias"):
        assert torch.equal(last[name], whole.full_state_dict()[name]), name


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_a_directory_without_config_json_is_refused(tmp_path):
    directory, _ = _saved(tmp_path, "gpt2")
    (Path(directory) / "config.json").unlink()
    with pytest.raises(ConfigError) as exc:
        pretrained.read(directory)
    assert "--pretrained" in _one_line(exc) and "config.json" in _one_line(exc)


def test_a_truncated_shard_is_refused(tmp_path):
    directory, _ = _saved(tmp_path, "gpt2")
    shard = sorted(Path(directory).glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-64])
    with pytest.raises(ConfigError) as exc:
        pretrained.read(directory)
    assert f"cannot read {shard.name}" in _one_line(exc)


def test_an_index_naming_a_missing_shard_is_refused(tmp_path):
    directory, _ = _saved(tmp_path, "gpt2")
    shard = sorted(Path(directory).glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ConfigError) as exc:
        pretrained.read(directory)
    assert f"missing file(s), e.g. {shard.name}" in _one_line(exc)


def test_a_pickled_checkpoint_is_refused_never_unpickled(tmp_path, monkeypatch):
    directory, _ = _saved(tmp_path, "gpt2")
    for f in Path(directory).glob("model*"):
        f.unlink()
    (Path(directory) / "pytorch_model.bin").write_bytes(b"not to be unpickled")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was called"))
    with pytest.raises(ConfigError) as exc:
        pretrained.read(directory)
    assert "pytorch_model.bin" in _one_line(exc) and "never unpickled" in _one_line(exc)


def test_pretrained_with_weights_is_refused(tmp_path):
    with pytest.raises(ConfigError) as exc:
        ModelConfig(pretrained=str(tmp_path), weights="w.pt")
    assert "--weights" in _one_line(exc)


def test_a_vocabulary_larger_than_the_model_s_is_refused_before_launch(tmp_path):
    directory, _ = _saved(tmp_path, "gpt2")
    cfg = _cfg(tmp_path, directory)
    with pytest.raises(ConfigError) as exc, torch.device("meta"):
        pretrained.build(
            cfg.model.name, directory, num_classes=VOCAB + 1, input_shape=(SEQ,), args={}
        )
    assert f"its vocabulary has {VOCAB} tokens, the data {VOCAB + 1}" in _one_line(exc)


def test_model_args_override_the_checkpoint_s_config(tmp_path):
    directory, _ = _saved(tmp_path, "gpt2")
    cfg = _cfg(tmp_path, directory, args="resid_pdrop=0.25")
    (stage,) = build_stages(cfg, 1, (SEQ,), 256)
    assert stage.blocks[0]._whole.config.resid_pdrop == 0.25


def test_the_directory_is_recorded_and_may_differ_between_nodes(tmp_path):
    directory, _ = _saved(tmp_path, "gpt2")
    cfg = _cfg(tmp_path, directory)
    assert cfg.run_settings()["pretrained"] == directory
    assert "pretrained" not in cfg.shared_view()["model"]
    assert cfg.run_settings()["model"] == "transformers:GPT2LMHeadModel"


def test_a_half_precision_checkpoint_loads_into_fp32_master_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(pretrained, "_CHUNK", 256)  # several chunks per tensor
    torch.manual_seed(1)
    model = _gpt2().to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16", max_shard_size="20KB")
    cfg = _cfg(tmp_path, str(tmp_path / "bf16"))
    (stage,) = build_stages(cfg, 1, (SEQ,), 256)
    got = stage.full_state_dict()
    for name, value in model.state_dict().items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], value.float()), name


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_buffers_the_checkpoint_does_not_hold_are_computed_as_the_constructor_does(tmp_path, kind):
    directory, _ = _saved(tmp_path, kind)
    torch.manual_seed(1)
    original = MAKERS[kind]().eval()
    (stage,) = build_stages(_cfg(tmp_path, directory), 1, (SEQ,), 256)
    loaded = stage.blocks[0]._whole.eval()
    for name, buffer in original.named_buffers():  # rotary tables: non-persistent, never saved
        assert torch.equal(dict(loaded.named_buffers())[name], buffer), name
    ids = torch.randint(0, VOCAB, (2, SEQ))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, original(ids).logits)


def test_a_transformers_release_outside_the_range_is_refused_for_pretrained_too(
    tmp_path, monkeypatch
):
    import sys

    directory, _ = _saved(tmp_path, "gpt2")
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.55.4")
    with pytest.raises(ConfigError) as exc:
        pretrained.build(
            "transformers:GPT2LMHeadModel", directory, num_classes=256, input_shape=(8,), args={}
        )
    assert "the releases that work are transformers>=4.56" in _one_line(exc)


def _legacy(name: str) -> str:
    """BERT's LayerNorm parameters as its original checkpoints (old releases) name them."""
    return name.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
        "LayerNorm.bias", "LayerNorm.beta"
    )


def test_legacy_layernorm_names_load_as_transformers_renames_them(tmp_path, counting):
    directory, state = _saved(tmp_path, "bert")
    root = Path(directory)
    for shard in root.glob("*.safetensors"):  # rewritten under the old names, index too
        save_file({_legacy(k): v for k, v in load_file(shard).items()}, shard, {"format": "pt"})
    index = json.loads((root / pretrained.INDEX).read_text())
    index["weight_map"] = {_legacy(k): v for k, v in index["weight_map"].items()}
    (root / pretrained.INDEX).write_text(json.dumps(index))
    on_disk = _on_disk(directory)
    assert "bert.embeddings.LayerNorm.gamma" in on_disk and not any(
        "LayerNorm.w" in k for k in on_disk
    )
    cfg = _cfg(tmp_path, directory)
    with torch.device("meta"):
        meta = pretrained.build(
            cfg.model.name, directory, num_classes=3, input_shape=(SEQ,), args={}
        )
    assert pretrained.check(meta, directory, strict=True) is None  # all fit, nothing unused
    (whole,) = build_stages(cfg, 1, (SEQ,), 3)
    got = whole.full_state_dict()
    assert set(got) == set(state)
    for name, value in state.items():
        assert torch.equal(got[name], value), name
    assert sorted(counting) == sorted(on_disk)  # each read once, by the name it is saved under
    reference = transformers.BertForSequenceClassification.from_pretrained(directory)
    for name, value in reference.state_dict().items():  # what transformers loads from it
        assert torch.equal(got[name], value), name
    _, capture = preflight.check_model(cfg, 2)
    for k in range(2):  # and each stage reads only its own, by their old names
        counting.clear()
        own = build_stages(cfg, 2, (SEQ,), 3, capture, keep={k})[k].full_state_dict()
        for name, value in own.items():
            assert torch.equal(value, state[name]), (k, name)
        assert sorted(counting) == sorted({_legacy(n) for n in own} & on_disk), k


def test_only_the_names_transformers_renames_on_load_are_renamed():
    assert current_name("bert.encoder.layer.0.output.LayerNorm.gamma") == (
        "bert.encoder.layer.0.output.LayerNorm.weight"
    )
    kept = ["encoder.layer_scale.gamma", "norm.beta", "LayerNorm.gammas", "conv.weight_gain"]
    assert [current_name(k) for k in kept] == kept
    try:  # transformers' own renames (5.x; before, PreTrainedModel._fix_state_dict_key_on_load)
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import apply_renamings
    except ImportError:
        pytest.skip("this transformers release renames by _fix_state_dict_key_on_load")
    legacy = get_checkpoint_conversion_mapping("legacy")
    keys = [
        *kept,
        "bert.embeddings.LayerNorm.gamma",
        "bert.embeddings.LayerNorm.beta",
        "roberta.encoder.layer.3.attention.output.LayerNorm.beta",
        "a.final_LayerNorm.gamma",
        "LayerNorm.gamma",
        "encoder.pos_conv_embed.conv.weight_g",
        "encoder.pos_conv_embed.conv.weight_v",
        "encoder.pos_conv_embed.conv.parametrizations.weight.original0",
        "weight_g",
        "model.language_model.model.layers.0.mlp.up_proj.weight",
        "language_model.model.model.norm.weight",
        "x.model.language_model.model.norm.weight",
        "model.language_model.layers.0.mlp.up_proj.weight",
        "transformer.h.0.ln_1.weight",
    ]
    for key in keys:
        assert current_name(key) == apply_renamings(key, legacy), key


@pytest.mark.parametrize("saved", [torch.float32, torch.bfloat16])
def test_under_tensor_parallelism_each_process_reads_only_its_shards(tmp_path, saved, counting):
    """--pretrained at --tensor-parallel 2: each process's split weights are its shards of the
    saved ones (read by byte range, converted where the file's dtype differs), the rest whole."""
    from bundle.engine.tensor_parallel import Split

    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=16,
            intermediate_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=32,
            **TINY,
        )
    ).to(saved)
    model.save_pretrained(tmp_path / "llama", max_shard_size="20KB")
    state = {k: v.float() for k, v in model.state_dict().items()}
    cfg = _cfg(tmp_path, str(tmp_path / "llama"))
    for index in (0, 1):
        counting.clear()
        split = Split(index, 2)
        (stage,) = build_stages(cfg, 1, (SEQ,), 256, split=split)
        got = stage.full_state_dict()
        assert len(split.specs) == 2 * 7 and set(got) == set(state)
        for name, value in state.items():
            want = split.specs[name].local(value, index, 2) if name in split.specs else value
            assert torch.equal(got[name], want), name
        assert not set(counting) & set(split.specs)  # read by shard, never whole
