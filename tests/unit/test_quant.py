"""--base-dtype in one process: the flag's refusals; an NF4 base (a quarter of the bytes or less)
that trains its adapters and never changes, digested as stored; a frozen linear layer that
keeps only its stored weight for the backward; what moves, copies and saves a stored tensor; and
the graph splits of Hugging Face code (``aten.linear`` on non-square weights, GPT-2's
``Conv1D``) computing what the widened base computes."""

from __future__ import annotations

import importlib.util
import io
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bundle import cli, models
from bundle.config import LoRASpec, ModelConfig
from bundle.engine.precision import Policy
from bundle.engine.stages import boundary_metas, cut_stages, store_base
from bundle.errors import ConfigError
from bundle.models import lora, quant
from bundle.models.gpt import GPT

pytest.importorskip("torchao")

LORA = "r=4,alpha=8,targets=qkv,proj"


def _gpt() -> GPT:
    torch.manual_seed(0)
    model = GPT(vocab=64, seq_len=8, layers=2, width=64, heads=2)
    lora.apply(model, LoRASpec(r=4, alpha=8, targets=("qkv", "proj")), seed=0)
    return model


def test_base_dtype_needs_lora_a_known_dtype_torchao_and_no_zero_3(monkeypatch):
    given = cli.parse(["--model", "gpt", "--lora", LORA, "--base-dtype", "nf4"], {})
    assert given.model.base_dtype == "nf4" and "base_dtype" in given.run_settings()
    with pytest.raises(ConfigError, match="--base-dtype: 'bf16' is not valid; .* give --lora"):
        ModelConfig(base_dtype="bf16")
    with pytest.raises(ConfigError, match="choose one of: fp32, bf16, nf4"):
        ModelConfig(lora="on", base_dtype="int8")
    with pytest.raises(ConfigError, match="--zero 3"):
        cli.parse(
            ["--lora", "on", "--base-dtype", "bf16", "--zero", "3", "--bundle-shape", "2"], {}
        )
    find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find(name)
    )
    with pytest.raises(ConfigError, match="needs torchao: pip install torchao"):
        ModelConfig(lora="on", base_dtype="nf4")
    assert ModelConfig(lora="on", base_dtype="bf16").base_dtype == "bf16"


def test_nf4_stores_the_linear_weights_but_the_head_a_tied_weight_and_a_misfit():
    model = _gpt()
    model.odd = nn.Linear(5, 7)  # 35 values: no block of 64
    model.odd.requires_grad_(False)
    fit, misfit = quant.linear_weights(model)
    assert "layers.0.attn.qkv.weight" in fit and "layers.1.mlp.2.weight" in fit
    assert "head.weight" not in fit and misfit == ["odd.weight"]
    assert not any("lora_" in n for n in fit)  # the adapters train
    model.head.weight = model.embed.tokens.weight  # tied: stays bf16 with its embedding
    assert "head.weight" not in quant.linear_weights(model)[0]


def _steps(stages, steps: int = 6) -> tuple[list[float], list[bool]]:
    """Losses of AdamW steps on one batch, and whether every adapter had a gradient."""
    torch.manual_seed(1)
    x, y = torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8))
    params = [p for s in stages for p in s.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses, graded = [], []
    for _ in range(steps):
        h = (x,)
        for s in stages:
            h = s(*h)
        loss = F.cross_entropy(h[0].reshape(-1, 64), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        losses.append(loss.item())
        graded.append(all(p.grad is not None and p.grad.abs().sum() > 0 for p in params))
        opt.step()
    return losses, graded


def test_an_nf4_base_in_a_quarter_of_the_bytes_trains_its_adapters_and_never_changes():
    model = _gpt()
    cfg = ModelConfig(name="gpt", lora=LORA, base_dtype="nf4")
    stages = cut_stages(model, cfg, 2, (8,))
    plain = boundary_metas(stages, (8,), Policy())
    linear = quant.linear_weights(model)[0]
    fp32 = sum(p.numel() * 4 for n, p in model.named_parameters() if n in linear)
    store_base(model, stages, cfg)
    held = dict(model.named_parameters()) | {
        s.full_name(n): p for s in stages for n, p in s.named_parameters()
    }
    nf4 = [p for n, p in held.items() if n in linear]
    assert all(isinstance(p, quant.Frozen) and not p.requires_grad for p in nf4)
    assert sum(p.stored_bytes for p in nf4) <= fp32 / 4
    assert held["head.weight"].stored.dtype == torch.bfloat16
    assert held["embed.tokens.weight"].stored.dtype == torch.bfloat16
    adapters = [p for p in held.values() if p.requires_grad]
    assert adapters and all(type(p) is nn.Parameter and p.dtype == torch.float32 for p in adapters)
    # Everything else sees the model it saw: the same names, dtypes and boundaries.
    assert boundary_metas(stages, (8,), Policy()) == plain
    assert all(p.dtype == torch.float32 for p in held.values())
    before = {n: (p.stored, p.widened().clone()) for n, p in held.items() if not p.requires_grad}
    for s in stages:
        assert quant.stored_bytes(s) < sum(p.numel() * 4 for p in s.parameters()) / 4
    losses, graded = _steps(stages)
    # Every adapter has a gradient once B has left zero (A's first one is zero, as in PEFT).
    assert losses[-1] < losses[0] - 0.1 and all(graded[1:]), (losses, graded)
    for n, p in held.items():
        if n in before:
            assert p.stored is before[n][0] and torch.equal(p.widened(), before[n][1]), n
    # Within 4 bits' reach of the model it stores: the first loss as the fp32 base's.
    assert losses[0] == pytest.approx(_steps(cut_stages(_gpt(), cfg, 2, (8,)), 1)[0][0], abs=0.02)


def test_a_checkpoint_digests_each_base_tensor_as_it_was_before_it_was_stored():
    # What an export's merge builds again in full (and a resume under any --base-dtype) is
    # checked against the same digests as a base that was never stored in fewer bytes.
    from bundle.checkpoint.parts import RankParts

    def digests(kind: str | None) -> dict[str, torch.Tensor]:
        model = _gpt()
        cfg = ModelConfig(name="gpt", lora=LORA, base_dtype=kind)
        (stage,) = store_base(model, cut_stages(model, cfg, 1, (8,)), cfg)
        stage.to("cpu")  # moved as a session moves it: what it was stored from goes along
        opt = torch.optim.SGD([p for p in stage.parameters() if p.requires_grad], lr=0.1)
        return RankParts(stage=stage, optimizer=opt, frozen_base=True).base_digests()

    plain = digests(None)
    assert "layers.0.attn.qkv.weight" in plain and "head.weight" in plain
    for kind in ("nf4", "bf16"):
        stored = digests(kind)
        assert stored.keys() == plain.keys()
        assert all(torch.equal(d, plain[n]) for n, d in stored.items()), kind


@pytest.mark.parametrize("kind", ["nf4", "bf16"])
@pytest.mark.parametrize("autocast", [False, True])
def test_a_frozen_linear_computes_as_its_widened_weight_and_keeps_only_what_it_stores(
    kind, autocast
):
    torch.manual_seed(0)
    layer = nn.Linear(64, 128)
    conv = nn.Module()  # transformers' Conv1D: y = b + x @ W, W [in, out]
    conv.weight = nn.Parameter(torch.randn(64, 128) * 0.02)
    for m in (layer, conv):
        m.requires_grad_(False)
        quant.convert([m], kind, {"weight"})
    w, b, c = layer.weight, layer.bias, conv.weight
    assert all(isinstance(t, quant.Frozen) for t in (w, b, c))
    x, x2 = torch.randn(3, 5, 64, requires_grad=True), torch.randn(15, 64, requires_grad=True)
    xr, x2r = x.detach().requires_grad_(), x2.detach().requires_grad_()
    weight, conv_weight, bias = w.widened(), c.widened(), b.widened()
    saved: list[torch.Tensor] = []
    ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with ctx, torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        got = [layer(x), torch.ops.aten.linear.default(x, w, b)]
        got += [torch.addmm(b, x2, c), torch.ops.aten.addmm.default(b, x2, c)]
    assert not any(t.shape in (w.shape, c.shape) for t in saved)  # no widened weight waits
    with ctx:
        want = [F.linear(xr, weight, bias)] * 2 + [torch.addmm(bias, x2r, conv_weight)] * 2
    for g, v in zip(got, want, strict=True):
        assert g.dtype == v.dtype and torch.equal(g, v)
    sum(g.float().sum() for g in got).backward()
    sum(v.float().sum() for v in want).backward()
    tol = 1e-2 if autocast else 1e-6
    assert torch.allclose(x.grad, xr.grad, atol=tol) and torch.allclose(x2.grad, x2r.grad, atol=tol)


def test_a_stored_tensor_moves_copies_and_saves_as_its_values():
    from bundle.checkpoint.parts import digest_of

    torch.manual_seed(0)
    layer = nn.Linear(64, 64)
    layer.requires_grad_(False)
    layer_values = layer.weight.detach().clone()
    quant.convert([layer], "nf4", {"weight"})
    w = layer.weight
    stored, values = w.stored, w.widened().clone()
    audited = weakref.ref(w)  # as nccl-emu's device audit keeps one: Module.to swaps nothing
    layer.to("cpu")
    assert audited() is layer.weight
    assert isinstance(layer.weight, quant.Frozen) and torch.equal(layer.weight.widened(), values)
    on_meta = w.to("meta")
    assert isinstance(on_meta, quant.Frozen) and on_meta.is_meta
    assert F.linear(torch.zeros(2, 64, device="meta"), on_meta).shape == (2, 64)
    buf = io.BytesIO()
    torch.save(layer.state_dict(), buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert type(back["weight"]) is torch.Tensor and torch.equal(back["weight"], values)
    w = layer.weight
    w.copy_(values)  # the same values (a replica's broadcast at start): nothing stored again
    assert w.stored is stored or torch.equal(w.widened(), values)
    source = w.source
    assert torch.equal(source, digest_of(layer_values))
    other = torch.randn(64, 64)
    w.copy_(other)  # other values: stored again, and digested as given
    assert w.stored is not stored and torch.allclose(w.widened(), other, atol=0.5)
    assert torch.equal(w.source, digest_of(other)) and torch.equal(digest_of(w), w.source)
    with pytest.raises(ConfigError, match="converted already"):
        quant.convert([layer], "nf4", {"weight"})


@pytest.mark.parametrize("factory", ["llama", "gpt2"])
def test_a_graph_split_of_hugging_face_code_computes_what_the_widened_base_computes(factory):
    pytest.importorskip("transformers")
    from tests.support import user_models

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = getattr(user_models, factory)(64, (8,))
        models.adapt(model, cfg, seed=0)
        return model

    targets = {"llama": "q_proj,k_proj,down_proj", "gpt2": "c_attn,c_proj"}[factory]
    cfg = ModelConfig(name=factory, lora=f"r=4,alpha=8,targets={targets}", base_dtype="nf4")
    model = build()
    stages = store_base(model, cut_stages(model, cfg, 2, (8,)), cfg)
    held = {s.full_name(n): p for s in stages for n, p in s.named_parameters()}
    assert any(
        isinstance(p, quant.Frozen) and p.stored.dtype != torch.bfloat16 for p in held.values()
    )
    reference = build()  # the plain model holding the values the stored base widens to
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if isinstance(held.get(name), quant.Frozen):
                p.copy_(held[name].widened())
    x = torch.randint(0, 64, (3, 8))
    h: tuple[torch.Tensor, ...] = (x,)
    for s in stages:
        h = s(*h)
    assert torch.allclose(h[0], models.forward(reference, x), atol=1e-5)
    h[0].sum().backward()
    assert all(p.grad is not None for p in held.values() if p.requires_grad)
