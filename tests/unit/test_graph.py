"""models.graph: any module cut by its torch.fx graph, the blocks chained equal to the model
exactly, points named by module path, and every cut that cannot be made refused in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from bundle import models
from bundle.engine import ties
from bundle.engine.stage import split_model
from bundle.errors import PartitionError
from bundle.models import apply_blocks, graph, partition
from bundle.models.graph import Segment
from tests.support import user_models


def zoo(name: str, side: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return models.build(name, num_classes=10, input_shape=(3, side, side))


def chained(model: nn.Module, shape, points=()) -> tuple[list, torch.Tensor, torch.Tensor]:
    blocks = models.blocks(model, shape, points)
    x = torch.randn(2, *shape)
    model.eval()
    with torch.no_grad():
        return blocks, model(x), apply_blocks(blocks, x)


GRAPH_MODELS = {
    "mobilenet_v3_small": lambda: zoo("mobilenet_v3_small"),
    "efficientnet_b0": lambda: zoo("efficientnet_b0"),
    "regnet_y_400mf": lambda: zoo("regnet_y_400mf"),
    "shufflenet_v2_x0_5": lambda: zoo("shufflenet_v2_x0_5"),
    "squeezenet1_1": lambda: zoo("squeezenet1_1", 64),
    "small_densenet": lambda: user_models.densenet(10, (3, 32, 32)),
    "small_vit": lambda: user_models.vit(10, (3, 32, 32)),
    "skip_net": lambda: user_models.skip_net(10, (3, 32, 32)),
}


@pytest.mark.parametrize("name", list(GRAPH_MODELS))
def test_graph_blocks_chained_equal_the_model_exactly(name):
    model = GRAPH_MODELS[name]()
    blocks, want, got = chained(model, (3, 64, 64) if "squeeze" in name else (3, 32, 32))
    assert len(blocks) >= 4 and all(isinstance(b, Segment) for _, b in blocks)
    assert torch.equal(got, want)
    # Every parameter lives in exactly one block, under its full-model name.
    names = [n for _, b in blocks for n, _ in b.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())


def test_default_points_follow_the_module_tree():
    names = [n for n, _ in models.blocks(user_models.vit(10, (3, 32, 32)), (3, 32, 32))]
    assert names[0] == "conv_proj" and names[-1] == "heads.head"
    assert [n for n in names if n.startswith("encoder.layers.")] == [
        f"encoder.layers.encoder_layer_{i}" for i in range(3)
    ]
    dense = [n for n, _ in models.blocks(user_models.densenet(10, (3, 8, 8)), (3, 8, 8))]
    assert "features.denseblock1.denselayer2" in dense


def test_a_skip_connection_crosses_as_more_tensors():
    model = user_models.densenet(10, (3, 8, 8)).eval()
    blocks = models.blocks(model, (3, 8, 8))
    x, widths = torch.randn(2, 3, 8, 8), []
    with torch.no_grad():
        for _, block in blocks:
            x = block(*x) if isinstance(x, tuple) else block(x)
            widths.append(len(x) if isinstance(x, tuple) else 1)
    assert max(widths) >= 2  # inside a dense block, every earlier layer's output crosses


def test_a_point_deeper_than_the_defaults_is_cut_there():
    model = zoo("mobilenet_v3_small")
    blocks, want, got = chained(model, (3, 32, 32), ["features.4.block.1"])
    assert "features.4.block.1" in [n for n, _ in blocks] and torch.equal(got, want)
    stages = split_model(
        blocks,
        partition.resolve(partition.PartitionSpec(None, ("features.4.block.1",)), blocks, 2, "x"),
    )
    assert stages[1].names[0] == "features.4.block.1"
    assert stages[0].full_name("blocks.0.features.0.0.weight") == "features.0.0.weight"


@pytest.mark.parametrize(
    ("point", "says"),
    [
        ("features.0.1", "runs inside 'features.0', which runs whole"),
        ("features.99", "no such module"),
        ("nothing.here", "no such module"),
    ],
)
def test_a_point_that_cannot_be_cut_says_why(point, says):
    with pytest.raises(PartitionError, match=says):
        models.blocks(zoo("mobilenet_v3_small"), (3, 32, 32), [point])


class _Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.spare, self.b = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.a(x))


def test_a_module_the_forward_never_calls_is_no_point():
    with pytest.raises(PartitionError, match="never calls it"):
        models.blocks(_Unused(), (4,), ["spare"])


class _Masked(nn.Module):
    """A (T, T) mask made first and used last: it has no batch dimension to split by rows."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.mid, self.b = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        mask = torch.ones_like(x[0]).diag().tril()
        h = self.mid(self.a(x))
        return self.b(h @ mask)


def test_a_cut_that_a_tensor_without_the_batch_crosses_is_refused():
    with pytest.raises(PartitionError, match=r"cannot cut at 'mid': .* without the batch first"):
        models.blocks(_Masked(), (6,), ["mid"])
    # The defaults leave such a place out: 'b' is still a point (the mask is used by it).
    names = [n for n, _ in models.blocks(_Masked(), (6,))]
    assert "mid" not in names and names[0] == "a"


class _Doubling(nn.Module):
    def forward(self, x):
        return x * 2 if self.training else x


class _ModeDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.d, self.b = nn.Linear(4, 4), _Doubling(), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.d(self.a(x)))


class _ManyDoublings(nn.Module):
    """Twenty blocks whose forwards read self.training (timm's drop-path habit)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), _Doubling()) for _ in range(20))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _equal_in_both_modes(model: nn.Module, blocks) -> None:
    x = torch.randn(3, 4)
    for mode in (True, False):
        model.train(mode)
        for _, b in blocks:
            b.train(mode)
        assert torch.equal(apply_blocks(blocks, x), model(x))


def test_every_module_that_reads_self_training_is_found_in_one_pass(monkeypatch):
    calls = []
    trace = graph._trace
    monkeypatch.setattr(graph, "_trace", lambda *a: calls.append(1) or trace(*a))
    model = _ManyDoublings()
    blocks = models.blocks(model, (4,))
    assert len(calls) <= 4, len(calls)  # one trace pair to find them all, one to confirm
    _equal_in_both_modes(model, blocks)


class _Chooser(nn.Module):
    """Calls one child in training and another in evaluation: the parent itself runs whole."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x) if self.training else self.b(x) * 2


class _ChoosesInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre, self.choose, self.post = nn.Linear(4, 4), _Chooser(), nn.Linear(4, 2)

    def forward(self, x):
        return self.post(self.choose(self.pre(x)))


@pytest.mark.parametrize("make", [_ModeDependent, _ChoosesInside])
def test_a_module_that_reads_self_training_runs_whole_in_both_modes(make):
    model = make()
    blocks = models.blocks(model, (4,))
    _equal_in_both_modes(model, blocks)


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x) if x.sum() > 0 else x


def test_an_untraceable_forward_is_refused_in_one_line():
    with pytest.raises(PartitionError, match="torch.fx cannot trace") as err:
        models.blocks(_DataDependent(), (4,))
    assert "\n" not in str(err.value)


def test_a_weight_tied_across_stages_is_held_by_each_and_named_as_its_module_uses_it():
    blocks = models.blocks(user_models.tied(3, (4,)), (4,))
    names = [n for n, _ in blocks]
    stages = split_model(blocks, (0, names.index("mid")))
    assert [t.holders for t in ties.find(stages)] == [
        ((0, "shared.weight"), (1, "shared.weight")),
        ((0, "shared.bias"), (1, "shared.bias")),
    ]
    # Both uses in one stage: no tie.
    assert ties.find(split_model(blocks, (0, names.index("out")))) == []


def test_an_exported_tied_embedding_is_named_by_each_module_that_uses_it():
    model = user_models.gpt2(50, (8,))
    blocks = models.blocks(model, (8,))
    names = [n for n, _ in blocks]
    stages = split_model(blocks, (0, names.index("transformer.h.2")))
    assert [t.holders for t in ties.find(stages)] == [
        ((0, "transformer.wte.weight"), (1, "lm_head.weight"))
    ]
    x = torch.randint(0, 50, (5, 8))
    want = model(x).logits
    assert torch.equal(stages[1](*stages[0](x))[0], want)


def test_a_sequential_is_cut_between_its_children():
    blocks = models.blocks(user_models.sequential(3, (4,)), (4,))
    assert [n for n, _ in blocks] == ["0", "1", "2", "3.0", "3.1", "4", "5", "6"]


class _WithOptionalArgs(nn.Module):
    """A forward with defaulted arguments (timm's ``attn_mask=None``): they keep their defaults."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x, mask=None, scale: float = 2.0):
        h = self.a(x) * scale
        if mask is not None:
            h = h * mask
        return self.b(h)


def test_a_forwards_defaulted_arguments_keep_their_defaults_in_every_segment():
    model = _WithOptionalArgs()
    blocks, want, got = chained(model, (4,), ["b"])
    assert [n for n, _ in blocks] == ["a", "b"] and torch.equal(got, want)


@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "convnext_atto", "resnet18d"])
def test_timm_models_through_their_factory(name):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = models.build(
        "timm:create_model",
        num_classes=5,
        input_shape=(3, 32, 32),
        args={"model_name": name, **({"img_size": 32} if "vit" in name else {})},
    )
    assert isinstance(model, nn.Module) and model.num_classes == 5 and timm.__version__
    blocks, want, got = chained(model, (3, 32, 32))
    assert len(blocks) >= 4 and torch.equal(got, want)


class _CapturedBatchNorm(nn.Module):
    """A batch norm in a forward only torch.export captures (a loop over ``int`` of a shape);
    ``lowered``: with ``torch.no_grad`` inside, which export records as a higher-order operator
    that the capture lowers to ATen operators (batch norm then runs as its functional form)."""

    def __init__(self, lowered: bool) -> None:
        super().__init__()
        self.l1, self.bn, self.l2 = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)
        self.lowered = lowered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(int(x.shape[0] > 0)):  # fx cannot trace int() of a shape
            pass
        if self.lowered:
            with torch.no_grad():
                shift = torch.arange(4, device=x.device).float()
        else:
            shift = torch.arange(4, device=x.device).float()
        return self.l2(self.bn(self.l1(x) + shift))


@pytest.mark.parametrize("lowered", [False, True])
def test_a_captured_batch_norm_follows_the_segments_mode(lowered):
    """Captured in training mode, a batch norm's segments still normalise by the running
    statistics in evaluation, and leave them (and the count of batches) alone there."""
    torch.manual_seed(0)
    model = _CapturedBatchNorm(lowered)
    blocks = graph.blocks(model, (torch.randn(3, 4),))
    x = torch.randn(5, 4)
    for mode in (True, False):
        model.train(mode)
        for _, block in blocks:
            block.train(mode)
        before = {k: v.clone() for k, v in model.bn.state_dict().items()}
        out = apply_blocks(blocks, x)
        out = out[0] if isinstance(out, tuple) else out
        after = model.bn.state_dict()
        changed = {k for k in before if not torch.equal(before[k], after[k])}
        if mode:
            assert changed == {"running_mean", "running_var", "num_batches_tracked"}
        else:
            assert changed == set()
            assert torch.equal(out, model(x))
