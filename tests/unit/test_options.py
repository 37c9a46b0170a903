"""The options table: the one declaration behind the parser, the YAML keys and RunConfig."""

from __future__ import annotations

import dataclasses
import typing

import yaml

from bundle import cli, options
from bundle import config as C


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
