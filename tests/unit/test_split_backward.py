"""A backward split into its input half and its weight half (zero-bubble schedules) gives the
whole backward's gradients, bit for bit, on every stage of the models users bring, and its weight
half accumulates through autograd, so gradient hooks (the syncs') fire as in a whole backward."""

from __future__ import annotations

import pytest
import torch

from bundle import models
from bundle.config import ModelConfig
from bundle.engine.split_backward import input_half, weight_half
from bundle.engine.stages import cut_stages
from tests.support import user_models

CASES = {
    "mlp": lambda: (models.build("mlp", num_classes=5, input_shape=(12,)), (12,), False),
    "small_resnet": lambda: (
        models.build("small_resnet", num_classes=5, input_shape=(3, 8, 8)),
        (3, 8, 8),
        False,
    ),
    "gpt": lambda: (
        models.build("gpt", num_classes=50, input_shape=(8,), args={"layers": 2, "width": 16}),
        (8,),
        True,
    ),
    "gpt2": lambda: (user_models.gpt2(50, (8,)), (8,), True),
}


def _stages(name: str, num: int):
    model, shape, tokens = CASES[name]()
    return cut_stages(model, ModelConfig(name=name), num, shape), shape, tokens


def _batch(shape, tokens: bool, rows: int = 3):
    g = torch.Generator().manual_seed(0)
    if tokens:
        return torch.randint(0, 50, (rows, *shape), generator=g)
    return torch.randn(rows, *shape, generator=g)


def _grads(stage) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in stage.named_parameters()}


def _run(stage, xs, seed, *, split: bool, recompute: bool = False):
    """Two micro-batches through ``stage``: the parameters' accumulated gradients and the
    inputs' gradients."""
    stage.zero_grad(set_to_none=True)
    got_inputs = []
    held = []
    for x in xs:
        x = x.detach().requires_grad_(x.is_floating_point())
        stage.recompute = recompute
        out = tuple(o for o in stage(x) if o.is_floating_point() and o.requires_grad)
        gs = [torch.randn(o.shape, generator=torch.Generator().manual_seed(seed)) for o in out]
        if split:
            held.append(input_half(list(out), gs, [x], list(stage.parameters())))
        else:
            torch.autograd.backward(list(out), gs)
        got_inputs.append(None if x.grad is None else x.grad.clone())
    for h in held:  # every weight half after every input half, as the cool-down runs them
        weight_half(h)
    return _grads(stage), got_inputs


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_split_backward_equals_the_whole_backward_on_every_stage(name, recompute):
    stages, shape, tokens = _stages(name, 3)
    h: tuple[torch.Tensor, ...] = (_batch(shape, tokens),)
    for s, stage in enumerate(stages):
        xs = [h[0], h[0].flip(0)]
        whole = _run(stage, xs, s, split=False, recompute=recompute)
        split = _run(stage, xs, s, split=True, recompute=recompute)
        assert whole[0].keys() == split[0].keys()
        for n, g in whole[0].items():
            if g is None:
                assert split[0][n] is None, (name, s, n)
            else:
                assert torch.equal(g, split[0][n]), (name, s, n)
        for a, b in zip(whole[1], split[1], strict=True):
            assert (a is None and b is None) or torch.equal(a, b), (name, s)
        with torch.no_grad():
            h = tuple(o for o in stage(h[0]))


def test_the_weight_half_fires_the_gradient_hooks_and_the_input_half_does_not():
    (first, middle, _), shape, tokens = _stages("gpt", 3)
    with torch.no_grad():
        x = first(_batch(shape, tokens))[0]
    seen: list[str] = []
    names = {p: n for n, p in middle.named_parameters()}
    for p in middle.parameters():
        p.register_post_accumulate_grad_hook(lambda p: seen.append(names[p]))
    x = x.requires_grad_()
    (out,) = middle(x)
    held = input_half([out], [torch.ones_like(out)], [x], list(middle.parameters()))
    assert x.grad is not None and seen == []
    assert held.groups is not None  # the graph was split, not deferred whole
    weight_half(held)
    assert sorted(seen) == sorted(names.values())


def test_a_stage_whose_inputs_need_no_gradient_runs_its_whole_backward_in_the_weight_half():
    (first, _), shape, tokens = _stages("mlp", 2)
    x = _batch(shape, tokens)
    (out,) = first(x)
    held = input_half([out], [torch.ones_like(out)], [x], list(first.parameters()))
    assert held.groups is None and all(p.grad is None for p in first.parameters())
    weight_half(held)
    assert all(p.grad is not None for p in first.parameters())
