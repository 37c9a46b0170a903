"""bundle/engine/optim.py: the optimizer a stage builds from --optimizer and its groups."""

from __future__ import annotations

import pytest
import torch

from bundle import models
from bundle.config import TrainConfig, parse_betas
from bundle.engine.optim import make_optimizer, state_bytes
from bundle.errors import ConfigError


def test_each_optimizer_with_its_settings():
    model = models.build(
        "gpt", num_classes=16, input_shape=(4,), args={"layers": 1, "width": 8, "heads": 2}
    )
    sgd = make_optimizer(TrainConfig(lr=0.1, momentum=0.8, weight_decay=0.01, nesterov=True), model)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["nesterov"]
    assert sgd.param_groups[0]["weight_decay"] == 0.01 and sgd.defaults["momentum"] == 0.8
    cfg = TrainConfig(optimizer="adamw", betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
    adamw = make_optimizer(cfg, model)
    assert type(adamw) is torch.optim.AdamW and adamw.defaults["betas"] == (0.9, 0.95)
    assert adamw.defaults["eps"] == 1e-6 and len(adamw.param_groups) == 1
    assert type(make_optimizer(TrainConfig(optimizer="adam"), model)) is torch.optim.Adam


def test_no_decay_on_biases_and_norm_scales_when_asked():
    model = models.build(
        "gpt", num_classes=16, input_shape=(4,), args={"layers": 1, "width": 8, "heads": 2}
    )
    opt = make_optimizer(
        TrainConfig(optimizer="adamw", weight_decay=0.1, no_decay_norm_bias=True), model
    )
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(
        p.dim() == 1 for p in plain["params"]
    )
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_optimizer_settings_are_checked():
    assert parse_betas("0.9,0.95") == (0.9, 0.95)
    for bad in ("0.9", "0.9,1.0", "a,b"):
        with pytest.raises(ConfigError, match="--betas"):
            parse_betas(bad)
    with pytest.raises(ConfigError, match="--optimizer"):
        TrainConfig(optimizer="lion")
    with pytest.raises(ConfigError, match="needs sgd"):
        TrainConfig(optimizer="adamw", nesterov=True)


@pytest.mark.parametrize(
    ("train", "per_param"),
    [
        (TrainConfig(momentum=0.0), 0),  # plain SGD keeps nothing
        (TrainConfig(momentum=0.9), 1),  # a momentum buffer
        (TrainConfig(optimizer="adamw"), 2),  # two moments (and a scalar step count each)
    ],
)
def test_state_bytes_counts_what_the_optimizer_keeps(train, per_param):
    model = torch.nn.Linear(5, 3)  # 18 float32 parameters in 2 tensors
    opt = make_optimizer(train, model)
    assert state_bytes(opt) == 0  # nothing before the first step
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    counts = 2 * 4 if train.optimizer == "adamw" else 0  # float32 step tensors
    assert state_bytes(opt) == per_param * 18 * 4 + counts


def test_every_optimizer_name_the_config_accepts_is_built_and_no_other():
    import pytest

    from bundle import config as C
    from bundle.engine import optim
    from bundle.errors import ConfigError

    assert set(optim.OPTIMIZERS) == set(C.OPTIMIZERS)
    stage = torch.nn.Linear(2, 2)
    for name in C.OPTIMIZERS:
        assert type(optim.make_optimizer(C.TrainConfig(optimizer=name), stage)).__name__ in (
            "SGD",
            "AdamW",
            "Adam",
        )
    bogus = object.__new__(C.TrainConfig)  # as if the config's list had a name this lacks
    object.__setattr__(bogus, "__dict__", {**C.TrainConfig().__dict__, "optimizer": "lion"})
    with pytest.raises(ConfigError, match="choose one of: sgd, adamw, adam"):
        optim.make_optimizer(bogus, stage)


@pytest.fixture
def mesh_of_two():
    """A mesh of two ranks, this process rank 0 of a fake process group (no peer, no traffic):
    room for a DTensor whose local shard is half of it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def test_local_bytes_of_a_tensor_and_of_a_dtensor_its_shard(mesh_of_two):
    from torch.distributed.tensor import DTensor, Shard

    from bundle.engine.optim import local_bytes

    assert local_bytes(torch.zeros(4, 3)) == 48
    assert local_bytes(torch.zeros(5, dtype=torch.bfloat16)) == 10
    sharded = DTensor.from_local(torch.zeros(2, 3), mesh_of_two, [Shard(0)])
    assert sharded.shape == (4, 3)  # the global tensor: twice what this rank holds
    assert local_bytes(sharded) == 24
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    opt.state[opt.param_groups[0]["params"][0]] = {"momentum_buffer": sharded}
    assert state_bytes(opt) == 24
