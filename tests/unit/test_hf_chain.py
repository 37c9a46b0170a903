"""A Hugging Face causal LM cut at its own modules (``bundle.models.hf_chain``), as a pipeline
with tensor parallelism cuts it: the chain of blocks equals the model's forward (outputs and
gradients, eager and sdpa attention, sliding windows), its parameters keep the model's names,
its layers split as at one stage, and every other model keeps the graph cut."""

from __future__ import annotations

import pytest
import torch

from bundle.config import ModelConfig
from bundle.engine import tensor_parallel
from bundle.engine.precision import Policy
from bundle.engine.stage_engine import build_stages
from bundle.engine.stages import boundary_metas, cut_stages
from bundle.engine.tensor_parallel import Split
from bundle.errors import ConfigError
from bundle.models import apply_blocks, graph, hf_chain
from bundle.models.cut import cut
from bundle.models.graph import Segment
from tests.support.config import make_config

transformers = pytest.importorskip("transformers")

SEQ, VOCAB = 12, 32
TINY = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 3,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
    "use_cache": False,
}
# (config, causal LM, fields): windows shorter than the sequence, so a wrong mask shows.
FAMILIES = [
    ("LlamaConfig", "LlamaForCausalLM", {}),
    ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4}),
    ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 4,
                                         "max_window_layers": 1}),
    ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 4}),
]  # fmt: skip


def _model(config: str, cls: str, fields: dict, attention: str = "eager") -> torch.nn.Module:
    torch.manual_seed(0)
    conf = getattr(transformers, config)(**TINY, **fields)
    conf._attn_implementation = attention
    return getattr(transformers, cls)(conf).eval()


def test_the_layers_make_their_mask_and_rotary_table_once_per_shape(monkeypatch):
    """As the base model's forward: once for all its layers (per kind of mask), not per layer;
    again for another shape, whose result is the forward's too."""
    model = _model(*FAMILIES[3])  # Qwen2: one full-attention layer, then two sliding ones
    chain = hf_chain.blocks(model)
    assert chain is not None
    made = []
    real = hf_chain.DecoderLayer._mask
    monkeypatch.setattr(
        hf_chain.DecoderLayer,
        "_mask",
        lambda self, *a: made.append(self.mask_name) or real(self, *a),
    )
    for rows, seq in [(2, SEQ), (2, SEQ), (3, SEQ - 4)]:
        x = torch.randint(0, VOCAB, (rows, seq))
        torch.testing.assert_close(apply_blocks(chain, x), model(x).logits, rtol=0, atol=1e-6)
    kinds = ["create_causal_mask", "create_sliding_window_causal_mask"]
    assert made == kinds * 2, made


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("config,cls,fields", FAMILIES, ids=lambda v: str(v)[:24])
def test_the_chain_of_a_models_own_modules_equals_its_forward(config, cls, fields, attention):
    model = _model(config, cls, fields, attention)
    chain = hf_chain.blocks(model)
    assert chain is not None
    layers = [f"model.layers.{i}" for i in range(3)]
    assert [n for n, _ in chain] == ["model.embed_tokens", *layers, "model.norm", "lm_head"]
    x = torch.randint(0, VOCAB, (2, SEQ))
    want = model(x, use_cache=False).logits
    got = apply_blocks(chain, x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    grads = torch.autograd.grad(want.square().sum(), list(model.parameters()))
    again = torch.autograd.grad(got.square().sum(), list(model.parameters()))
    for a, b in zip(grads, again, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a_sliding_window_is_the_mask_the_forward_gives_each_layer():
    """Without its window the chain is off: the test above would see a wrong mask."""
    model = _model(*FAMILIES[2])
    chain = hf_chain.blocks(model)
    assert chain is not None
    assert {m.mask_name for _, m in chain if isinstance(m, hf_chain.DecoderLayer)} == {
        "create_sliding_window_causal_mask"
    }
    qwen2 = hf_chain.blocks(_model(*FAMILIES[3]))
    assert qwen2 is not None
    kinds = [m.mask_name for _, m in qwen2 if isinstance(m, hf_chain.DecoderLayer)]
    assert kinds == ["create_causal_mask", *["create_sliding_window_causal_mask"] * 2]
    for _, m in chain:
        if isinstance(m, hf_chain.DecoderLayer):
            m.mask_name = "create_causal_mask"
    x = torch.randint(0, VOCAB, (2, SEQ))
    assert (apply_blocks(chain, x) - model(x).logits).abs().max() > 1e-3


def test_a_pipeline_with_tensor_parallelism_cuts_at_modules_keeping_the_models_names(
    monkeypatch,
):
    def no_trace(*args, **kwargs):
        raise AssertionError("traced")

    model = _model(*FAMILIES[1])  # tied: lm_head.weight is model.embed_tokens.weight
    monkeypatch.setattr(graph, "trace", no_trace)
    stages = cut_stages(model, ModelConfig(name="llama"), 3, (SEQ,), at_modules=True)
    names = [n for s in stages for n in s.full_state_dict()]
    assert set(names) == set(model.state_dict())
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert stages[0].names[0] == "model.embed_tokens" and stages[-1].names[-1] == "lm_head"
    # A stage the graph cut (the planner's) begins at its rotary block begins at layer 0 here.
    at = ModelConfig(name="llama", partition="model.rotary_emb,model.layers.2")
    cuts = cut_stages(model, at, 3, (SEQ,), at_modules=True)
    assert [s.names[0] for s in cuts] == ["model.embed_tokens", "model.layers.0", "model.layers.2"]
    first, last = dict(stages[0].named_parameters()), dict(stages[-1].named_parameters())
    assert any(p is q for p in first.values() for q in last.values())  # the tie, held by both
    x = torch.randint(0, VOCAB, (2, SEQ))
    out = (x,)
    for s in stages:
        out = s(*out)
    torch.testing.assert_close(out[0], model(x).logits, rtol=0, atol=1e-6)


def test_the_layers_of_a_module_cut_split_where_a_graph_cut_refuses():
    model = _model(*FAMILIES[0])
    stages = cut_stages(model, ModelConfig(name="llama"), 2, (SEQ,), at_modules=True)
    split = Split(index=1, degree=2)
    split.apply(model, stages)  # refused for a graph cut: its layers are inline
    assert split.specs["model.layers.0.self_attn.q_proj.weight"].dim == 0
    assert split.specs["model.layers.2.mlp.down_proj.weight"].dim == 1
    q = model.model.layers[0].self_attn.q_proj
    assert q.weight.shape == (8, 16)
    assert not any(isinstance(m, Segment) for s in stages for m in s.blocks)


def test_other_models_and_outputs_keep_the_graph_cut():
    gemma = transformers.GemmaForCausalLM(
        transformers.GemmaConfig(**TINY, head_dim=4)
    )  # scales its embeddings in its forward
    assert hf_chain.blocks(gemma) is None
    llama = _model(*FAMILIES[0])
    assert hf_chain.blocks(llama, "hidden_states") is None
    assert hf_chain.blocks(llama.model) is None  # the base model: no head

    class Mine(transformers.LlamaForCausalLM):  # a subclass may change the forward
        pass

    assert hf_chain.blocks(Mine(llama.config)) is None
    stages = cut_stages(llama, ModelConfig(name="llama"), 2, (SEQ,))  # no TP: graph, as before
    assert all(isinstance(m, Segment) for s in stages for m in s.blocks)


def _pieces(model: torch.nn.Module, n: int, at_modules: bool) -> list:
    return cut(model, ModelConfig(name="llama"), n, (SEQ,), at_modules=at_modules)


def test_the_launch_takes_a_module_cut_and_refuses_a_graph_cut_or_a_tie_across_degrees():
    with torch.device("meta"):
        model = _model(*FAMILIES[0])
        tied = _model(*FAMILIES[1])
    tensor_parallel.check(model, _pieces(model, 2, True), (2, 2))
    tensor_parallel.check(model, _pieces(model, 2, True), (1, 2))
    tensor_parallel.check(tied, _pieces(tied, 2, True), (2, 2))
    with pytest.raises(
        ConfigError, match="embed_tokens.weight = lm_head.weight is tied across stages of"
    ):
        tensor_parallel.check(tied, _pieces(tied, 2, True), (2, 1))
    with pytest.raises(ConfigError, match="the layers of LlamaForCausalLM, MistralForCausalLM"):
        tensor_parallel.check(model, _pieces(model, 2, False), (2, 2))


def test_pretrained_each_process_reads_its_own_stage_and_only_its_shards(tmp_path):
    """--pretrained in a pipeline at TP 2: stage ``k`` of a process holds the saved tensors of
    its own blocks (its split layers' shards, by their full names), the other stage none."""
    torch.manual_seed(1)
    model = _model(*FAMILIES[1])
    model.save_pretrained(tmp_path / "llama")
    state = model.state_dict()
    text = tmp_path / "corpus.txt"
    text.write_text("pretrained weights, read stage by stage. " * 40)
    cfg = make_config(
        model={"pretrained": str(tmp_path / "llama")},
        data={"dataset": "text", "data_file": str(text), "seq_len": SEQ},
        parallel={"shape": (1, 1), "tensor_parallel": (2,)},
    )
    for k in (0, 1):
        split = Split(1, 2)
        stages = build_stages(cfg, 2, (SEQ,), VOCAB, keep={k}, split=split)
        got = stages[k].full_state_dict()
        assert len(split.specs) == 3 * 7 and set(split.specs) & set(got)
        for name, value in got.items():
            whole = state[name]
            want = split.specs[name].local(whole, 1, 2) if name in split.specs else whole
            assert torch.equal(value, want), name
        # The other stage holds no memory, but the tied weight (one tensor, this stage's).
        other = stages[1 - k].full_state_dict()
        real = {n: t for n, t in other.items() if not t.is_meta}
        assert set(real) == {"model.embed_tokens.weight", "lm_head.weight"} - set(got)
        (tied,) = real.values()
        # What crosses the boundary, found on the meta device (no mask there: no values).
        assert [m.tail for (m,) in boundary_metas(stages, (SEQ,), Policy())] == [(SEQ, 16)]
        assert tied.data_ptr() == got[("model.embed_tokens.weight", "lm_head.weight")[k]].data_ptr()
