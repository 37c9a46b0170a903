"""Model registry: every model builds, and its blocks chained reproduce model(x) exactly."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

from bundle import models
from bundle.errors import ConfigError
from bundle.models import apply_blocks

SMALL = ("mlp", "mlp_wide", "digits_cnn", "skip_mlp", "small_resnet", "gpt")
# Big torchvision nets run on 64x64 so the suite stays cheap; adaptive pooling makes that legal.
SHAPES = {
    "digits_cnn": (1, 8, 8),
    "mlp": (1, 8, 8),
    "mlp_wide": (1, 8, 8),
    "skip_mlp": (1, 8, 8),
    "gpt": (16,),
}


def shape_of(name: str) -> tuple[int, ...]:
    return SHAPES.get(name, (3, 32, 32) if name == "small_resnet" else (3, 64, 64))


def example(name: str, rows: int = 2) -> torch.Tensor:
    if name == "gpt":
        return torch.randint(0, 10, (rows, *shape_of(name)))
    return torch.randn(rows, *shape_of(name))


@functools.cache
def built(name: str) -> nn.Module:
    torch.manual_seed(0)
    return models.build(name, num_classes=10, input_shape=shape_of(name)).eval()


def test_available_is_sorted_and_complete() -> None:
    names = models.available()
    assert names == sorted(names)
    assert set(names) == {"resnet18", "resnet50", "resnet101", "vgg16", *SMALL}


@pytest.mark.parametrize("name", models.available())
def test_blocks_chain_equals_model(name: str) -> None:
    model = built(name)
    x = example(name)
    with torch.no_grad():
        expected = model(x)
        got = apply_blocks(models.blocks(model), x)
    assert expected.shape == (2, *((16,) if name == "gpt" else ()), 10)
    assert torch.allclose(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", models.available())
def test_block_names_cover_every_parameter_once(name: str) -> None:
    model = built(name)
    full = dict(model.named_parameters())
    seen: list[str] = []
    for block_name, block in models.blocks(model):
        for param_name, param in block.named_parameters():
            key = f"{block_name}.{param_name}"
            assert full[key] is param
            seen.append(key)
    assert sorted(seen) == sorted(full)


def test_resnet_and_vgg_block_names() -> None:
    names = [n for n, _ in models.blocks(built("resnet18"))]
    assert names[:5] == ["conv1", "bn1", "relu", "maxpool", "layer1.0"]
    assert names[-4:] == ["layer4.1", "avgpool", "flatten", "fc"]
    assert len([n for n in models.blocks(built("resnet101")) if n[0].startswith("layer3.")]) == 23
    vgg = [n for n, _ in models.blocks(built("vgg16"))]
    assert vgg[0] == "features.0" and vgg[30] == "features.30"
    assert vgg[31:34] == ["avgpool", "flatten", "classifier.0"]
    assert vgg[-1] == "classifier.6"


@pytest.mark.parametrize("name", [n for n in SMALL if n != "gpt"])
def test_small_models_have_no_batch_statistics(name: str) -> None:
    norms = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)
    assert not any(isinstance(m, norms) for m in built(name).modules())


def test_skip_mlp_blocks_pass_two_tensors() -> None:
    model = built("skip_mlp")
    out = apply_blocks(models.blocks(model)[:2], torch.randn(2, *shape_of("skip_mlp")))
    assert isinstance(out, tuple) and len(out) == 2
    assert all(t.requires_grad for t in out)


def test_unknown_model_lists_choices() -> None:
    with pytest.raises(ConfigError) as err:
        models.build("resnet9000", num_classes=10, input_shape=(3, 32, 32))
    assert err.value.key == "--model" and err.value.value == "resnet9000"
    for name in models.available():
        assert name in str(err.value)


def test_bad_build_arguments_name_the_value() -> None:
    with pytest.raises(ConfigError, match="input_shape"):
        models.build("resnet18", num_classes=10, input_shape=(1, 8, 8))
    with pytest.raises(ConfigError, match="num_classes"):
        models.build("mlp", num_classes=0, input_shape=(1, 8, 8))


def test_blocks_of_foreign_model_is_a_typed_error() -> None:
    with pytest.raises(ValueError, match="Linear"):
        models.blocks(nn.Linear(2, 2))


def test_digits_cnn_learns_digits() -> None:
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    split = int(0.8 * len(y))
    torch.manual_seed(0)
    model = models.build("digits_cnn", num_classes=10, input_shape=(1, 8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(3):
        for i in range(0, split, 32):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[i : i + 32]), y[i : i + 32]).backward()
            opt.step()
    with torch.no_grad():
        accuracy = (model(x[split:]).argmax(1) == y[split:]).float().mean().item()
    assert accuracy >= 0.9


# -- a user's factory, torchvision's zoo, --weights -------------------------------------------


def test_a_factory_is_called_with_the_arguments_it_declares(tmp_path, monkeypatch):
    model = models.build(
        "tests.support.user_models:sequential", num_classes=3, input_shape=(1, 4, 4)
    )
    assert isinstance(model, nn.Sequential) and model[-1].out_features == 3
    # A file path works too, and only the arguments the function takes are passed (+ model args).
    (tmp_path / "mine.py").write_text(
        "import torch.nn as nn\n"
        "def build(num_classes, width=8):\n"
        "    return nn.Sequential(nn.Flatten(1), nn.Linear(16, width), nn.Linear(width, num_classes))\n"
    )
    built_ = models.build(
        f"{tmp_path}/mine.py:build", num_classes=2, input_shape=(1, 4, 4), args={"width": 5}
    )
    assert built_[1].out_features == 5
    monkeypatch.chdir(tmp_path)
    assert isinstance(models.build("mine:build", num_classes=2, input_shape=(16,)), nn.Sequential)


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("no_such_module_xyz:build", "cannot import no_such_module_xyz: ModuleNotFoundError"),
        ("tests.support.user_models:nope", "has no attribute 'nope'"),
        ("tests.support.user_models:not_a_model", "returned a dict, not an nn.Module"),
        ("tests.support.user_models:SkipNet.forward.x", "has no attribute"),
    ],
)
def test_a_bad_factory_is_one_config_error(name, says):
    with pytest.raises(ConfigError, match=says) as err:
        models.build(name, num_classes=3, input_shape=(1, 4, 4))
    assert err.value.key == "--model" and "\n" not in str(err.value)


def test_any_zoo_model_builds_and_image_sizes_are_checked():
    assert models.is_known("mobilenet_v3_small") and models.is_known("swin_t")
    vit = models.build("vit_b_32", num_classes=4, input_shape=(3, 64, 64))
    assert vit.image_size == 64 and vit.heads.head.out_features == 4
    with pytest.raises(ConfigError, match="vit_b_16 takes square images of side multiples of 16"):
        models.build("vit_b_16", num_classes=4, input_shape=(3, 40, 40))
    with pytest.raises(ConfigError, match="inception_v3 takes square images of side at least 75"):
        models.build("inception_v3", num_classes=4, input_shape=(3, 32, 32))
    with pytest.raises(ConfigError, match="--model-args"):
        models.build("mlp", num_classes=4, input_shape=(1, 4, 4), args={"width": 3})


def test_weights_load_before_the_cut_and_a_misfit_is_one_line(tmp_path):
    torch.manual_seed(1)
    source = models.build("mlp", num_classes=3, input_shape=(1, 4, 4))
    torch.save(source.state_dict(), tmp_path / "w.pt")
    target = models.build("mlp", num_classes=3, input_shape=(1, 4, 4))
    models.load_weights(target, str(tmp_path / "w.pt"))
    assert all(
        torch.equal(a, b)
        for a, b in zip(source.state_dict().values(), target.state_dict().values(), strict=True)
    )
    other = models.build("mlp", num_classes=5, input_shape=(1, 4, 4))
    fresh = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(
        ConfigError,
        match=r"does not fit the model: 2 of another shape \(e.g. head.weight: \(3, 256\) vs \(5, 256\)\)",
    ):
        models.load_weights(other, str(tmp_path / "w.pt"), strict=True)
    # Fine-tuning: what fits is loaded, the head for 5 classes keeps its initialisation.
    note = models.load_weights(other, str(tmp_path / "w.pt"))
    assert note is not None and "\n" not in note
    assert "loaded 8 of the model's 10 tensors, 2 initialised afresh" in note, note
    for k, v in other.state_dict().items():
        want = fresh[k] if k.startswith("head.") else source.state_dict()[k]
        assert torch.equal(v, want), k
    torch.save({"fc.weight": torch.zeros(3, 3)}, tmp_path / "nothing.pt")
    with pytest.raises(ConfigError, match="does not fit the model: 10 missing"):
        models.load_weights(other, str(tmp_path / "nothing.pt"))
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    with pytest.raises(ConfigError, match="cannot read it"):
        models.load_weights(other, str(tmp_path / "junk.pt"))


def test_what_a_model_takes():
    assert models.input_dtype(built("gpt")) == torch.long
    assert models.input_dtype(nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 2))) == torch.long
    assert models.input_dtype(built("digits_cnn")) == torch.float32


def test_a_users_own_models_package_meets_none_of_ours(tmp_path):
    """The tool's models are bundle.models: a project with its own ``models`` package imports the
    tool, and ``--model models:build`` is the user's function."""
    import subprocess
    import sys

    pkg = tmp_path / "models"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "import torch.nn as nn\n"
        "def build(num_classes, input_shape):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(16, num_classes))\n"
    )
    code = (
        "from bundle.api import train\n"
        "from bundle import models as ours\n"
        "import models as theirs\n"
        "m = ours.build('models:build', num_classes=3, input_shape=(1, 4, 4))\n"
        "print(theirs.__file__, type(m).__name__, len(m))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(pkg / "__init__.py"), "Sequential", "2"]
