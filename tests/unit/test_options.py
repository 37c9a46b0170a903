"""The options table: the one declaration behind the parser, the YAML keys and RunConfig."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import yaml

from bundle import cli
from bundle import config as C
from bundle.config import options
from bundle.errors import ConfigError, PartitionError
from bundle.models.partition import load_spec
from bundle.plan.cluster import load_cluster


def cfg(argv, env=None):
    return cli.parse(argv, env or {})


# RunConfig fields no option fills, on purpose: set from torchrun's environment in to_config, and
# by the planner when it resolves --bundle-shape/--partition auto.
NOT_OPTIONS = {"launch.torchrun", "predicted_samples_per_s", "parallel.placement"}  # --plan's


def leaf_fields(cls: type, prefix: str = "") -> set[str]:
    hints = typing.get_type_hints(cls)
    out: set[str] = set()
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            out |= leaf_fields(kind, f"{prefix}{f.name}.")
        else:
            out.add(prefix + f.name)
    return out


def test_the_option_table_is_the_single_source(tmp_path):
    # Unset options give exactly the dataclass defaults: no default is restated anywhere.
    assert cfg([]) == C.RunConfig()
    # Every field is some option's (or deliberately none), and no two options fill one field.
    filled = [o.field for o in options.OPTIONS if o.field]
    assert len(filled) == len(set(filled))
    assert set(filled) | NOT_OPTIONS == leaf_fields(C.RunConfig)
    assert not set(filled) & NOT_OPTIONS
    # Every entry is in --help, and (but --config) a YAML key whose unset value is the default.
    text = cli.build_parser().format_help()
    for opt in options.OPTIONS:
        assert (opt.flag if opt.flag.startswith("-") else opt.metavar) in text, opt.flag
    values = {opt.flag.lstrip("-"): opt.unset for opt in options.OPTIONS if opt.yaml}
    assert [o.flag for o in options.OPTIONS if not o.yaml] == ["--config", "--plan"]
    path = tmp_path / "unset.yaml"
    path.write_text(yaml.safe_dump(values))
    assert cfg(["--config", str(path)]) == C.RunConfig()


def test_no_two_options_share_a_spelling():
    spellings = [f for o in options.OPTIONS for f in (o.flag, *o.aliases)]
    assert len(spellings) == len(set(spellings))
    keys = [k for o in options.OPTIONS if o.yaml for k in o.keys]
    assert len(keys) == len(set(keys)) == len(options.BY_YAML_KEY)


def laughs(levels: int = 9) -> list:
    """What a YAML alias bomb reads as: each level a list naming the one below nine times."""
    value: list = ["x"] * 9
    for _ in range(levels - 1):
        value = [value] * 9
    return value


@pytest.mark.timeout(10)
def test_an_error_shows_a_huge_value_briefly_and_an_ordinary_one_whole():
    assert (
        str(ConfigError("--lr", "fast", "must be float"))
        == "--lr: 'fast' is not valid; must be float"
    )
    small = {"layers": 2, "names": ["a", "b"], "pair": (1,)}
    assert repr(small) in str(ConfigError("--model-args", small, "x"))
    text = str(ConfigError("bundle_shape", [laughs(), laughs()], "must be a flat list"))
    assert text.startswith("bundle_shape: [[[[") and len(text) < 300
    assert "x" * 250 not in str(ConfigError("--prompt", "x" * 10**6, "shorter"))


@pytest.mark.parametrize(
    "read, error",
    [
        (lambda path: cfg(["--config", path]), ConfigError),
        (load_cluster, ConfigError),
        (load_spec, PartitionError),
    ],
    ids=["--config", "--cluster", "--partition"],
)
def test_every_reader_of_a_users_yaml_refuses_an_alias_that_expands(tmp_path, read, error):
    path = tmp_path / "user.yaml"
    path.write_text("model: &m [mlp, mlp]\nstages: *m\nname: *m\n")
    with pytest.raises(error, match=r"line 2: the alias \*m"):
        read(str(path))
