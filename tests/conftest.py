"""Fixtures every tier shares; the helpers themselves live in tests/support/."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.distributed as dist

from bundle.config import RunConfig
from tests.support.config import make_config


@pytest.fixture
def config() -> Callable[..., RunConfig]:
    """The config factory (``tests.support.config.make_config``): ``config(train={"steps": 3})``."""
    return make_config


@pytest.fixture
def world_of_one() -> Iterator[dist.ProcessGroup]:
    """This process as a job of one rank on gloo (for what needs a default group), and a group."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.new_group(backend="gloo")
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _seeded() -> Any:
    """Every test starts from the same global RNG state, whatever ran before it."""
    import torch

    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    yield
    torch.random.set_rng_state(state)
