"""tests/support/config.py: the test config factory changes only what it is given."""

from __future__ import annotations

import pytest

from bundle.config import RunConfig
from bundle.errors import ConfigError


def test_only_the_named_fields_change(config):
    cfg = config(parallel={"shape": (2, 1)}, train={"steps": 3}, metrics_out="m.jsonl")
    base = RunConfig()
    assert cfg.parallel.shape == (2, 1) and cfg.parallel.num_bundles == base.parallel.num_bundles
    assert cfg.train.steps == 3 and cfg.train.lr == base.train.lr
    assert cfg.metrics_out == "m.jsonl" and cfg.data == base.data


def test_sections_validate_and_unknown_fields_are_refused(config):
    with pytest.raises(ConfigError):
        config(parallel={"micro_batches": 0})
    with pytest.raises(TypeError):
        config(paralel={"shape": (1,)})
    with pytest.raises(TypeError):
        config(parallel={"shap": (1,)})
