"""bundle/plan_file.py: a saved plan carries the data it was made for, and main.py --plan runs on
it unless other data are named; plan files written before that still load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bundle import cli, preflight
from bundle.data import input_spec
from bundle.errors import ConfigError
from bundle.topology import Topology
from tests.support.plan_fixtures import plan_script

SYNTHETIC = {"dataset": "synthetic", "image_size": 32, "num_classes": 100}


def plan_file(tmp_path: Path, data: dict | None, run: dict | None = None) -> str:
    plan: dict = {"run": run or {"model": "resnet18", "bundle_shape": "2"}}
    if data is not None:
        plan["data"] = data
    path = tmp_path / "plans.json"
    path.write_text(json.dumps({"plans": [plan]}))
    return str(path)


def test_the_plan_runs_on_the_data_it_was_made_for(tmp_path):
    path = plan_file(tmp_path, {**SYNTHETIC, "input_shape": [3, 32, 32]})
    c = cli.parse(["--plan", path], {})
    assert (c.data.dataset, c.data.image_size, c.data.num_classes) == ("synthetic", 32, 100)
    assert input_spec(c.data) == (100, (3, 32, 32))
    # resnet18 is built for it: before, the plan ran on the 1x8x8 digits and was refused.
    preflight.check_model(c, Topology.from_config(c).num_stages)


def test_data_named_on_the_command_line_or_in_a_config_win_over_the_plans(tmp_path):
    path = plan_file(tmp_path, SYNTHETIC)
    (tmp_path / "train").mkdir()
    c = cli.parse(["--plan", path, str(tmp_path)], {})
    assert (c.data.dataset, c.data.root, c.data.num_classes) == ("imagefolder", str(tmp_path), None)
    c = cli.parse(["--plan", path, "--dataset", "digits"], {})
    assert (c.data.dataset, c.data.image_size) == ("digits", 224)
    config = tmp_path / "run.yaml"
    config.write_text("dataset: digits\n")
    assert cli.parse(["--config", str(config), "--plan", path], {}).data.dataset == "digits"
    # A flag that only tunes the plan's data keeps the rest of it.
    c = cli.parse(["--plan", path, "--image-size", "64"], {})
    assert (c.data.dataset, c.data.image_size, c.data.num_classes) == ("synthetic", 64, 100)


def test_a_plan_file_without_data_still_loads(tmp_path):
    c = cli.parse(["--plan", plan_file(tmp_path, None, {"bundle_shape": "2,1"})], {})
    assert (c.parallel.shape, c.data.dataset) == ((2, 1), "digits")


@pytest.mark.parametrize(
    "data, needle",
    [
        ([1, 2], "data: \\[1, 2\\] is not valid; must be a mapping"),
        ({"dataset": "synthetic", "input_shape": [3, 0]}, "input_shape: \\[3, 0\\] is not valid"),
        ({"datasets": "synthetic"}, "data option: 'datasets' is not valid"),
        ({"dataset": "imagenet"}, "--dataset"),
    ],
)
def test_a_bad_data_section_is_one_line(tmp_path, data, needle):
    with pytest.raises(ConfigError, match=needle) as err:
        cli.parse(["--plan", plan_file(tmp_path, data)], {})
    assert "\n" not in str(err.value)


def test_the_planner_writes_the_data_into_every_plan(tmp_path, capsys):
    """Nominal GPUs (no cluster file, nothing measured): the JSON's plans name their data, and
    main.py --plan reads them back."""
    out = tmp_path / "plans.json"
    argv = ["--model", "resnet18", "--nodes", "1", "--gpus-per-node", "2", "--batch-size", "64"]
    argv += ["--image-size", "64", "--num-classes", "100", "--top", "2", "--json", str(out)]
    assert plan_script().main([*argv, "--profile-cache", ""]) == 0
    capsys.readouterr()
    report = json.loads(out.read_text())
    want = {
        "dataset": "synthetic",
        "image_size": 64,
        "num_classes": 100,
        "input_shape": [3, 64, 64],
    }
    assert [row["data"] for row in report["plans"]] == [want] * len(report["plans"])
    c = cli.parse(["--plan", str(out)], {})
    assert input_spec(c.data) == (100, (3, 64, 64))


@pytest.mark.parametrize(
    "model, want",
    [
        ("gpt", {"dataset": "text", "seq_len": 32, "num_classes": 256, "input_shape": [32]}),
        ("digits_cnn", {"dataset": "digits", "num_classes": 10, "input_shape": [1, 8, 8]}),
    ],
)
def test_the_planner_names_text_and_digits_data_as_main_py_takes_them(model, want):
    args = plan_script().parse_args(["--model", model, "--seq-len", "32"])
    assert plan_script()._data(args) == want
