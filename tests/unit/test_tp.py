"""Tensor parallelism (models.tp): shard specs that cut and join back, the plan (GPT's, a
transformers model's, a user's), the refusals before anything changes, layers that keep their
names and classes, and, in one world of two gloo processes, GPT, Llama and Qwen3 split in two
giving the whole model's logits and gradients (and not without rowwise's sum)."""

from __future__ import annotations

import copy
import hashlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bundle.config import LoRASpec
from bundle.models import lora, tp, tp_layers
from bundle.models.gpt import GPT
from bundle.models.tp import ShardSpec, TPError

TOL = 1e-5


def _gpt() -> GPT:
    return GPT(vocab=64, seq_len=16, layers=2, width=32, heads=4)


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        num_hidden_layers=2,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config)


def _qwen3() -> nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        num_hidden_layers=2,
        attn_implementation="eager",
    )
    return Qwen3ForCausalLM(config)


def _on_meta(build):
    with torch.device("meta"):
        return build()


# -- pure ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [ShardSpec(0), ShardSpec(1), ShardSpec(0, parts=3)])
def test_a_shard_spec_cuts_a_tensor_and_joins_its_shards_back(spec):
    full = torch.arange(12 * 6.0).view(12, 6)
    shards = [spec.local(full, r, 2) for r in range(2)]
    half = list(full.shape)
    half[spec.dim] //= 2
    assert all(list(s.shape) == half and s.is_contiguous() for s in shards)
    assert torch.equal(spec.full(shards), full)
    shards[0].fill_(-1)  # a copy: the whole tensor is untouched
    assert full.min() == 0


def test_a_packed_shard_is_each_blocks_share_in_order():
    full = torch.arange(12.0)
    assert ShardSpec(0, parts=3).local(full, 0, 2).tolist() == [0, 1, 4, 5, 8, 9]
    assert ShardSpec(0, parts=3).local(full, 1, 2).tolist() == [2, 3, 6, 7, 10, 11]
    with pytest.raises(TPError, match="not 3 block"):
        ShardSpec(0, parts=3).local(torch.zeros(9), 0, 2)


def test_gpts_own_plan_splits_attention_and_mlp():
    assert tp.plan_of(_gpt()) == {
        "layers.*.attn.qkv": "packed_colwise",
        "layers.*.attn.proj": "rowwise",
        "layers.*.mlp.0": "colwise",
        "layers.*.mlp.2": "rowwise",
    }


def test_a_transformers_plan_is_read_from_the_model_with_its_styles_mapped():
    plan = tp.plan_of(_on_meta(_llama))
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan["lm_head"] == plan["model.embed_tokens"] == "replicate"
    split = {n for n, (_, s) in tp.resolve(_on_meta(_llama), plan).items() if s != "replicate"}
    assert len(split) == 2 * 7 and "model.layers.1.self_attn.o_proj" in split
    qwen = tp.plan_of(_on_meta(_qwen3))
    assert qwen["model.layers.*.self_attn.q_norm"] == "replicate_grad_sum"


def test_a_users_plan_wins_and_matches_by_suffix():
    given = {"layers.*.mlp.down_proj": "rowwise", "up_proj": "colwise_rep"}
    plan = tp.plan_of(_on_meta(_llama), given)
    assert plan == {"layers.*.mlp.down_proj": "rowwise", "up_proj": "replicate"}
    hits = tp.resolve(_on_meta(_llama), plan)
    assert sorted(hits) == [
        f"model.layers.{i}.mlp.{p}" for i in (0, 1) for p in ("down_proj", "up_proj")
    ]


@pytest.mark.parametrize(
    "build,plan,degree,says",
    [
        (_llama, None, 3, "--tensor-parallel 3 does not divide num_attention_heads 4 of LlamaForCausalLM"),
        (_gpt, None, 8, "--tensor-parallel 8 does not divide heads 4 of layers.0.attn"),
        (_llama, {"layers.*.self_attn.q_prj": "colwise"}, 2, "nearest names: layers.*.self_attn.q_proj"),
        (_llama, {"layers.*.mlp.experts": "grouped_gemm"}, 2, "'grouped_gemm' shards mixture-of-experts"),
        (_llama, {"layers.*.mlp": "moe_tp_experts"}, 2, "layers.*.mlp: style 'moe_tp_experts'"),
        (_llama, {"layers.*.mlp.up_proj": "diagonal"}, 2, "'diagonal' is not one of colwise, rowwise"),
        (_llama, {"layers.*.input_layernorm": "colwise"}, 2, "is a LlamaRMSNorm: colwise splits nn.Linear"),
        (_gpt, {"mlp.0": "colwise", "layers.0.mlp.0": "rowwise"}, 2, "planned both colwise and rowwise"),
    ],
)  # fmt: skip
def test_a_plan_the_model_cannot_take_is_refused_in_one_line(build, plan, degree, says):
    model = _on_meta(build)
    with pytest.raises(TPError) as err:
        tp.check(model, tp.plan_of(model, plan), degree)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_model_without_a_plan_is_told_to_give_one():
    with pytest.raises(TPError) as err:
        tp.plan_of(nn.Sequential(nn.Linear(4, 4)))
    assert str(err.value) == (
        "Sequential has no tensor-parallel plan: give the model a tp_plan attribute (module-name "
        "patterns -> colwise, rowwise, packed_colwise or replicate; docs/tensor-parallel.md)"
    )


def test_a_users_module_brings_its_plan_as_a_tp_plan_attribute():
    class Net(nn.Sequential):
        tp_plan = {"0": "colwise", "2": "rowwise"}

    net = Net(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    assert tp.plan_of(net) == {"0": "colwise", "2": "rowwise"}
    specs = tp.apply(net, tp.plan_of(net), rank=1, size=2, all_reduce=lambda t: None)
    assert net[0].weight.shape == (4, 4) and net[2].weight.shape == (4, 4)
    assert set(specs) == {"0.weight", "0.bias", "2.weight"}


def test_a_split_dimension_a_tied_weight_and_a_summed_adapted_layer_are_refused_before_anything_changes():
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4))
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(TPError, match="does not divide out_features 6 of 0 \\(colwise\\)"):
        tp.apply(model, {"0": "colwise", "2": "rowwise"}, rank=0, size=4, all_reduce=print)
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())
    assert type(model[0]) is nn.Linear
    packed = {"0": "packed_colwise"}
    with pytest.raises(TPError, match="out_features 7 is not 2 equal blocks"):
        tp.check(nn.Sequential(nn.Linear(4, 7)), packed, 2)
    model[2].weight = nn.Parameter(torch.zeros(4, 6))
    model.add_module("3", nn.Linear(6, 4))
    model[3].weight = model[2].weight
    with pytest.raises(TPError, match="2.weight is tied to 3.weight"):
        tp.check(model, {"2": "rowwise"}, 2)
    gpt = _gpt()
    lora.apply(gpt, LoRASpec(targets=("qkv",)), seed=0)
    tp.check(gpt, tp.plan_of(gpt), 2)  # split with its adapters (tests/unit/test_tp_lora.py)
    with pytest.raises(TPError, match="qkv is LoRA-adapted: replicate_grad_sum does not sum"):
        tp.check(gpt, {"layers.0.attn.qkv": "replicate_grad_sum"}, 2)


def test_split_layers_keep_their_names_classes_and_local_sizes():
    model = _gpt()
    names = [n for n, _ in model.named_parameters()]
    specs = tp.apply(model, tp.plan_of(model), rank=1, size=2, all_reduce=lambda t: None)
    assert [n for n, _ in model.named_parameters()] == names
    qkv, proj = model.layers[0].attn.qkv, model.layers[0].attn.proj
    assert type(qkv).__name__ == "Linear" and isinstance(qkv, nn.Linear)
    assert (qkv.in_features, qkv.out_features, tuple(qkv.bias.shape)) == (32, 48, (48,))
    assert (proj.in_features, proj.out_features, tuple(proj.bias.shape)) == (16, 32, (32,))
    assert specs["layers.0.attn.qkv.weight"] == ShardSpec(0, parts=3)
    assert specs["layers.0.attn.proj.weight"] == ShardSpec(1)
    assert "layers.0.attn.proj.bias" not in specs and "head.weight" not in specs
    assert len(specs) == 2 * 6  # per block: qkv w+b, proj w, mlp.0 w+b, mlp.2 w
    alone = _gpt()
    assert tp.apply(alone, tp.plan_of(alone), rank=0, size=1, all_reduce=print) == {}
    assert type(alone.layers[0].attn.qkv) is nn.Linear


# -- two processes -------------------------------------------------------------------------------


def _forward(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids) if isinstance(model, GPT) else model(input_ids=ids).logits


def _compare(build, rank: int, world: int, changes: dict | None = None) -> dict:
    """The whole model and its split copy (its own plan, with ``changes``) on one batch: max
    errors of the logits and of every gradient (a split one against its share of the whole's),
    and a digest of the replicated gradients (every rank must hold the same)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    whole = build()
    split = copy.deepcopy(whole)
    plan = tp.plan_of(split)
    for key in plan:  # ``changes``: styles by the end of their pattern
        plan[key] = next((v for end, v in (changes or {}).items() if key.endswith(end)), plan[key])
    specs = tp.apply(split, plan, rank=rank, size=world, all_reduce=lambda t: dist.all_reduce(t))
    vocab = whole.get_output_embeddings().out_features if not isinstance(whole, GPT) else 64
    ids = torch.randint(0, vocab, (3, 16))
    targets = torch.randint(0, vocab, (3, 16))
    logits = [_forward(m, ids) for m in (whole, split)]
    for out in logits:
        F.cross_entropy(out.flatten(0, 1), targets.flatten()).backward()
    reference = dict(whole.named_parameters())
    errors = {"logits": (logits[0] - logits[1]).abs().max().item()}
    errors.update(split=0.0, whole=0.0, joined=0.0)
    kept = []
    for name, p in split.named_parameters():
        ref, spec = reference[name], specs.get(name)
        if spec is None:
            errors["whole"] = max(errors["whole"], (p.grad - ref.grad).abs().max().item())
            kept.append(p.grad.flatten())
            continue
        want = spec.local(ref.grad, rank, world)
        errors["split"] = max(errors["split"], (p.grad - want).abs().max().item())
        shards = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(shards, p.detach())
        errors["joined"] = max(errors["joined"], (spec.full(shards) - ref).abs().max().item())
    digest = hashlib.sha256(torch.cat(kept).numpy().tobytes()).hexdigest()
    return {"errors": errors, "digest": digest, "split": len(specs)}


def _without_rowwise_sum(rank: int, world: int) -> float:
    """The logits' error when rowwise layers skip their forward sum."""
    kept = tp_layers.reduce_from_tp
    tp_layers.reduce_from_tp = lambda x, all_reduce: x  # type: ignore[assignment]
    try:
        return _compare(_gpt, rank, world)["errors"]["logits"]
    finally:
        tp_layers.reduce_from_tp = kept


MODELS = {"gpt": _gpt, "llama": _llama, "qwen3": _qwen3}


def _world(rank: int, world: int) -> dict:
    found = {name: _compare(build, rank, world) for name, build in MODELS.items()}
    found["no rowwise sum"] = _without_rowwise_sum(rank, world)
    # Qwen3's per-head norms see this rank's heads only: left plainly whole, their gradients
    # are this rank's part alone.
    whole = dict.fromkeys(("self_attn.q_norm", "self_attn.k_norm"), "replicate")
    found["norms not summed"] = _compare(_qwen3, rank, world, whole)
    return found


def test_split_models_give_the_whole_models_logits_and_gradients_on_two_processes():
    from bundle.launch.localworld import run_world

    ranks = run_world(2, _world, timeout=120)
    for name in MODELS:
        results = [r[name] for r in ranks]
        for rank, got in enumerate(results):
            assert got["split"] > 0
            assert all(e <= TOL for e in got["errors"].values()), (name, rank, got["errors"])
        assert results[0]["digest"] == results[1]["digest"], name
    assert all(r["no rowwise sum"] > 1e-3 for r in ranks)
    assert all(r["norms not summed"]["errors"]["whole"] > 1e-4 for r in ranks)
    assert ranks[0]["norms not summed"]["digest"] != ranks[1]["norms not summed"]["digest"]
