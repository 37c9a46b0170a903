"""LoRA with tensor parallelism (models.tp, models.tp_layers): adapters split as their layers'
weights (B's rows of a colwise or packed layer, A's columns of a rowwise one), listed in the
specs; GPT and a tiny Llama split over two ranks, each rank a thread of this process summing
through a barrier, give the unsplit adapted model's logits and gradients, and not without the
sum of a colwise layer's A gradient."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bundle.config import LoRASpec
from bundle.models import lora, tp, tp_layers
from bundle.models.gpt import GPT
from bundle.models.tp import ShardSpec, TPError
from tests.support.user_models import llama_tp

TOL = 1e-5
VOCAB, SEQ = 32, 8


class _Group:
    """A tensor-parallel group of ``size`` ranks, each a thread: ``sum_for(rank)`` is its
    in-place all-reduce; every rank must sum tensors of one shape at each call."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=60)
        self.calls: list[list[tuple[int, ...]]] = [[] for _ in range(size)]

    def sum_for(self, rank: int) -> Callable[[torch.Tensor], None]:
        def total(t: torch.Tensor) -> None:
            self.calls[rank].append(tuple(t.shape))
            self.slots[rank] = t.clone()
            self.barrier.wait()
            summed = torch.stack([s for s in self.slots if s is not None]).sum(0)
            self.barrier.wait()
            t.copy_(summed)

        return total

    def run(self, work: Callable[[int], dict]) -> list[dict]:
        """``work(rank)`` on every rank at once; its results in rank order."""
        results: list = [None] * self.size

        def one(rank: int) -> None:
            try:
                results[rank] = work(rank)
            except BaseException as exc:  # noqa: BLE001 - the caller re-raises it
                results[rank] = exc
                self.barrier.abort()

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:  # the cause, before the other ranks' broken barriers
            raise next(
                (r for r in failed if not isinstance(r, threading.BrokenBarrierError)), failed[0]
            )
        return results


def _gpt() -> nn.Module:
    return GPT(vocab=VOCAB, seq_len=SEQ, layers=2, width=32, heads=4)


def _llama() -> nn.Module:
    return llama_tp(VOCAB, (SEQ,))


# GPT: qkv packed colwise, proj rowwise, mlp.0 colwise; mlp.2 (rowwise) trained whole.
# Llama: every linear layer (q, k, v, gate, up colwise; o, down rowwise), lm_head whole.
CASES = {
    "gpt": (_gpt, LoRASpec(r=4, targets=("qkv", "proj", "mlp.0")), ("layers.1.mlp.2",)),
    "llama": (_llama, LoRASpec(r=4, targets=("all-linear",)), ()),
}


def _adapted(name: str) -> nn.Module:
    """The model, adapted, with its B adapters made non-zero (so the update counts)."""
    build, spec, train = CASES[name]
    torch.manual_seed(0)
    model = build()
    lora.apply(model, spec, seed=3, train=train)
    with torch.no_grad():
        for m in model.modules():
            if lora.is_adapted(m):
                m.lora_B.weight.normal_(0.0, 0.2)
    return model


def _loss(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor):
    out = model(ids) if isinstance(model, GPT) else model(input_ids=ids).logits
    F.cross_entropy(out.flatten(0, 1), targets.flatten()).backward()
    return out.detach()


def _errors(name: str, size: int = 2) -> list[dict]:
    """Per rank: max errors of the logits, of the split gradients (against their shards of the
    whole's) and of the whole ones, by kind of parameter."""
    whole = _adapted(name)
    ids, targets = torch.randint(0, VOCAB, (2, 3, SEQ))
    want = _loss(whole, ids, targets)
    ref = {n: p for n, p in whole.named_parameters() if p.requires_grad}
    group = _Group(size)

    def work(rank: int) -> dict:
        split = copy.deepcopy(whole)
        split.zero_grad()
        specs = tp.apply(
            split, tp.plan_of(split), rank=rank, size=size, all_reduce=group.sum_for(rank)
        )
        got = _loss(split, ids, targets)
        errors = {"logits": (got - want).abs().max().item()}
        for n, p in split.named_parameters():
            if not p.requires_grad:
                continue
            spec = specs.get(n)
            expect = spec.local(ref[n].grad, rank, size) if spec else ref[n].grad
            kind = n.rpartition(".")[0].rpartition(".")[2] if "lora_" in n else "trained"
            key = f"{kind} {'split' if spec else 'whole'}"
            errors[key] = max(errors.get(key, 0.0), (p.grad - expect).abs().max().item())
        return errors

    return group.run(work)


@pytest.mark.parametrize("name", sorted(CASES))
def test_split_adapted_layers_give_the_whole_adapted_models_logits_and_gradients(name):
    for rank, errors in enumerate(_errors(name)):
        assert all(e <= TOL for e in errors.values()), (name, rank, errors)
        # every kind was seen: B split (colwise), A split (rowwise), A and B whole
        assert {"lora_A split", "lora_A whole", "lora_B split", "lora_B whole"} <= set(errors)
    if name == "gpt":
        assert "trained split" in errors


def test_a_colwise_adapters_a_gradient_is_wrong_without_its_sum(monkeypatch):
    monkeypatch.setattr(tp_layers, "grad_summed", lambda p, all_reduce: p)
    for errors in _errors("gpt"):
        assert errors["lora_A whole"] > 1e-3, errors
        assert errors["logits"] <= TOL and errors["lora_B split"] <= TOL


def test_adapters_are_split_as_their_layers_weights_and_listed_in_the_specs():
    model = _adapted("gpt")
    whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    specs = tp.apply(model, tp.plan_of(model), rank=1, size=2, all_reduce=lambda t: None)
    attn = "layers.0.attn"
    assert specs[f"{attn}.qkv.lora_B.weight"] == ShardSpec(0, parts=3)
    assert specs[f"{attn}.proj.lora_A.weight"] == ShardSpec(1)
    assert specs["layers.0.mlp.0.lora_B.weight"] == ShardSpec(0)
    for whole_one in (f"{attn}.qkv.lora_A.weight", f"{attn}.proj.lora_B.weight"):
        assert whole_one not in specs
    qkv, proj = model.layers[0].attn.qkv, model.layers[0].attn.proj
    assert tuple(qkv.lora_B.weight.shape) == (48, 4) and qkv.lora_B.out_features == 48
    assert tuple(proj.lora_A.weight.shape) == (4, 16) and proj.lora_A.in_features == 16
    params = dict(model.named_parameters())
    for name, spec in specs.items():
        assert torch.equal(params[name], spec.local(whole[name], 1, 2)), name
    assert type(qkv).__name__ == "LoRALinear" and lora.is_adapted(qkv)


def test_adapters_on_a_meta_base_start_as_their_shard_of_the_one_process_adapters():
    """``--pretrained``: the base is built on the meta device and read later, the adapters are
    made whole at once (seeded by their names) and cut: the shard one process would hold."""
    spec, seed = LoRASpec(r=4, targets=("qkv", "proj")), 5
    alone = _gpt()
    lora.apply(alone, spec, seed=seed)
    with torch.device("meta"):
        meta = _gpt()
    lora.apply(meta, spec, seed=seed)
    specs = tp.apply(meta, tp.plan_of(meta), rank=1, size=2, all_reduce=lambda t: None)
    ones = dict(alone.named_parameters())
    adapters = [n for n in specs if ".lora_" in n]
    assert len(adapters) == 4  # per block: qkv's B, proj's A
    for n, p in meta.named_parameters():
        if ".lora_" in n:
            assert not p.is_meta
            want = specs[n].local(ones[n], 1, 2) if n in specs else ones[n]
            assert torch.equal(p, want), n


def test_an_adapted_layer_whose_gradient_would_be_summed_whole_is_refused():
    model = _adapted("gpt")
    with pytest.raises(TPError, match="is LoRA-adapted: replicate_grad_sum does not sum") as err:
        tp.check(model, {"layers.*.mlp.0": "replicate_grad_sum"}, 2)
    assert "\n" not in str(err.value)


def test_pretrained_split_weights_and_adapters_are_the_shards_of_one_processes(tmp_path):
    """``--pretrained`` + ``--lora`` at TP 2: each process's base weights are its shards of the
    saved ones and its adapters its shards of those one process starts with."""
    from bundle.engine.stages import build_stages
    from bundle.engine.tensor_parallel import Split
    from tests.support.config import make_config

    llama_tp(VOCAB, (SEQ,)).save_pretrained(tmp_path / "llama")
    text = tmp_path / "corpus.txt"
    text.write_text("adapters split as their layers. " * 40)
    cfg = make_config(
        model={"pretrained": str(tmp_path / "llama"), "lora": "r=4,targets=q_proj,o_proj,up_proj"},
        data={"dataset": "text", "data_file": str(text), "seq_len": SEQ},
        train={"seed": 3},
    )
    (alone,) = build_stages(cfg, 1, (SEQ,), VOCAB)
    want = alone.full_state_dict()
    for index in (0, 1):
        split = Split(index, 2)
        (stage,) = build_stages(cfg, 1, (SEQ,), VOCAB, split=split)
        got = stage.full_state_dict()
        assert set(got) == set(want)
        adapters = {n for n in split.specs if ".lora_" in n}
        assert len(adapters) == 2 * 3  # per layer: q_proj's B, o_proj's A, up_proj's B
        for name, value in want.items():
            shard = split.specs[name].local(value, index, 2) if name in split.specs else value
            assert torch.equal(got[name], shard), name
