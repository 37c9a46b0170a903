"""bundle/models/partition.py: specs loaded, split points checked against the model's blocks,
the balanced cut; a shipped spec's stages compute the model."""

from __future__ import annotations

import functools
from itertools import pairwise
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from bundle import models
from bundle.engine.stage import Stage, split_model
from bundle.errors import ConfigError, PartitionError
from bundle.models.partition import (
    PARTITIONS_DIR,
    PartitionSpec,
    auto_starts,
    available_specs,
    load_spec,
    resolve,
)

SHAPES = {
    "digits_cnn": (1, 8, 8),
    "mlp": (1, 8, 8),
    "skip_mlp": (1, 8, 8),
    "small_resnet": (3, 32, 32),
}


def shape_of(name: str) -> tuple[int, int, int]:
    return SHAPES.get(name, (3, 64, 64))


@functools.cache
def built(name: str) -> nn.Module:
    torch.manual_seed(0)
    return models.build(name, num_classes=10, input_shape=shape_of(name)).eval()


def names_of(name: str) -> list[str]:
    return [n for n, _ in models.blocks(built(name))]


def chain(stages: list[Stage], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    out: tuple[torch.Tensor, ...] = (x,)
    for stage in stages:
        out = stage(*out)
    return out


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("ref", available_specs())
def test_shipped_spec_splits_its_model_exactly(ref: str) -> None:
    spec = load_spec(ref)
    model = built(spec.model)
    blocks = models.blocks(model)
    starts = resolve(spec, blocks, len(spec.starts), spec.model)
    assert starts[0] == 0 and list(starts) == sorted(set(starts))
    stages = split_model(model, starts)
    x = torch.randn(2, *shape_of(spec.model))
    with torch.no_grad():
        expected = model(x)
        (got,) = chain(stages, x)
    assert torch.equal(got, expected)


def test_shipped_specs_include_the_resnet101_trials() -> None:
    assert {f"resnet101_trial{i}" for i in range(5)} <= set(available_specs())
    assert load_spec("resnet101_trial3") == PartitionSpec("resnet101", ("conv1", "layer3.3"))


def test_load_by_path_and_first_block_prepended(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, "model: resnet18\nstages: [layer3]\n"))
    assert spec == PartitionSpec("resnet18", ("layer3",))
    starts = resolve(spec, models.blocks(built("resnet18")), 2, "resnet18")
    assert starts == (0, names_of("resnet18").index("layer3.0"))


def test_unknown_spec_name_lists_shipped_specs() -> None:
    # A name that is no shipped spec is one split point: unknown to the model, the error says
    # which points and which specs there are.
    spec = load_spec("no_such_split")
    assert spec == PartitionSpec(None, ("no_such_split",))
    with pytest.raises(PartitionError) as err:
        resolve(spec, models.blocks(built("resnet18")), 2, "resnet18")
    assert "unknown split point 'no_such_split'" in str(err.value)
    assert "layer3.1" in str(err.value) and "resnet101_trial0" in str(err.value)
    with pytest.raises(ConfigError) as missing:
        load_spec("no/such.yaml")
    assert missing.value.key == "--partition" and ".yaml" in str(missing.value)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("model: [unclosed\n", "malformed YAML"),
        ("- conv1\n", "mapping"),
        ("model: mlp\nstages: [flatten]\nextra: 1\n", "extra"),
        ("model: mlp\n", "stages"),
        ("model: mlp\nstages: []\n", "stages"),
        ("model: mlp\nstages: [1, 2]\n", "stages"),
    ],
)
def test_malformed_spec_names_file_and_key(tmp_path: Path, text: str, needle: str) -> None:
    ref = write(tmp_path, text)
    with pytest.raises(PartitionError) as err:
        load_spec(ref)
    assert ref in str(err.value) and needle in str(err.value)


def test_unknown_point_lists_valid_points() -> None:
    spec = PartitionSpec("resnet50", ("conv1", "layer3.99"))
    with pytest.raises(PartitionError) as err:
        resolve(spec, models.blocks(built("resnet50")), 2, "resnet50")
    message = str(err.value)
    assert "layer3.99" in message
    for valid in ("layer3", "layer3.5", "layer4.2", "avgpool", "flatten", "fc"):
        assert valid in message


def test_point_inside_a_block_is_rejected() -> None:
    spec = PartitionSpec("resnet18", ("conv1", "layer1.0.conv2"))
    with pytest.raises(PartitionError, match="layer1.0.conv2"):
        resolve(spec, models.blocks(built("resnet18")), 2, "resnet18")


@pytest.mark.parametrize("points", [("conv1", "layer3", "layer2"), ("conv1", "layer3", "layer3.0")])
def test_out_of_order_or_repeated_points(points: tuple[str, ...]) -> None:
    with pytest.raises(PartitionError, match="out of order or repeated"):
        resolve(PartitionSpec("resnet18", points), models.blocks(built("resnet18")), 3, "resnet18")


def test_stage_count_mismatch_names_both_numbers() -> None:
    spec = PartitionSpec("mlp", ("flatten", "hidden.2"))
    with pytest.raises(PartitionError, match=r"2 stages.*has 3"):
        resolve(spec, models.blocks(built("mlp")), 3, "mlp")


def test_spec_for_another_model_is_rejected() -> None:
    spec = load_spec("resnet50_2stage")
    with pytest.raises(PartitionError, match="resnet50.*resnet101"):
        resolve(spec, models.blocks(built("resnet101")), 2, "resnet101")


def test_container_resolves_to_its_first_block() -> None:
    spec = PartitionSpec("resnet101", ("conv1", "layer3"))
    starts = resolve(spec, models.blocks(built("resnet101")), 2, "resnet101")
    assert names_of("resnet101")[starts[1]] == "layer3.0"


@pytest.mark.parametrize("name", ["mlp", "resnet50", "skip_mlp", "small_resnet"])
@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_auto_split_is_balanced_and_non_empty(name: str, num_stages: int) -> None:
    blocks = models.blocks(built(name))
    starts = resolve(None, blocks, num_stages, name)
    assert len(starts) == num_stages and starts[0] == 0
    bounds = [*starts, len(blocks)]
    assert all(a < b for a, b in pairwise(bounds))
    sizes = [
        sum(p.numel() for _, m in blocks[a:b] for p in m.parameters()) for a, b in pairwise(bounds)
    ]
    largest_block = max(sum(p.numel() for p in m.parameters()) for _, m in blocks)
    # An optimal contiguous cut is never worse than an even share plus one block.
    assert max(sizes) <= sum(sizes) / num_stages + largest_block + len(blocks)


def test_auto_split_one_block_per_stage_and_too_many_stages() -> None:
    blocks = models.blocks(built("skip_mlp"))
    assert auto_starts(blocks, len(blocks)) == tuple(range(len(blocks)))
    with pytest.raises(PartitionError, match=f"{len(blocks)} blocks into {len(blocks) + 1}"):
        resolve(None, blocks, len(blocks) + 1, "skip_mlp")


def test_specs_are_read_from_the_partitions_folder() -> None:
    assert PARTITIONS_DIR.name == "partitions"
    assert (PARTITIONS_DIR / "resnet101_trial0.yaml").is_file()
