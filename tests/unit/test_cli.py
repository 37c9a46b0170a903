"""The command line in one process: flags and YAML -> RunConfig, --help, one-line errors."""

from __future__ import annotations

import ast
from itertools import pairwise
from pathlib import Path

import pytest

from bundle import cli
from bundle import config as C
from bundle.errors import ConfigError, ExitCode, signalled
from bundle.launch.ft.handoff import EXIT_HANDOFF
from bundle.launch.ft.membership import EXIT_LEFT

ROOT = Path(__file__).resolve().parents[2]


def cfg(argv, env=None):
    return cli.parse(argv, env or {})


def test_defaults_are_one_bundle_of_front_and_rear_on_digits():
    c = cfg([])
    assert c.parallel.shape == (1, 1) and c.parallel.num_bundles == 1
    assert c.data.dataset == "digits" and c.model.name == "digits_cnn"
    assert c.procs_per_node == 2


def test_original_flags_keep_their_meaning(tmp_path):
    c = cfg(
        [
            "--batch-size",
            "32",
            "--rank",
            "1",
            "--itr",
            "5",
            "--bundle-shape",
            "4,2",
            "--num-bundle",
            "2",
            "--IP",
            "10.0.0.1",
            "--portNum",
            "4000",
            "--model",
            "resnet101",
            "--world-size",
            "2",
            str(tmp_path),
        ]
    )
    assert (c.train.batch_size, c.train.steps) == (32, 5)
    assert (c.parallel.shape, c.parallel.num_bundles) == ((4, 2), 2)
    assert (c.launch.node_rank, c.launch.num_nodes, c.launch.master_addr, c.launch.master_port) == (
        1,
        2,
        "10.0.0.1",
        4000,
    )
    assert c.data.dataset == "imagefolder" and c.data.root == str(tmp_path)
    assert c.procs_per_node == 6


def test_dp_only_is_one_stage_over_all_processes():
    assert cfg(["--DP-ONLY"]).parallel.shape == (2,)
    assert cfg(["--DP-ONLY", "--num-hp", "3"]).parallel.shape == (3,)
    c = cfg(["--DP-ONLY", "--nproc-per-node", "2", "--world-size", "2"])
    assert (c.parallel.shape, c.parallel.num_bundles) == ((4,), 1)


def test_torchrun_environment_sets_the_node_layout():
    env = {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1",
        "GROUP_RANK": "1",
    }
    c = cfg(["--num-bundle", "2"], env)
    assert (c.launch.torchrun, c.launch.num_nodes, c.launch.node_rank, c.procs_per_node) == (
        True,
        2,
        1,
        2,
    )


def test_yaml_values_apply_and_the_command_line_wins(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("bundle-shape: [2, 1]\nlr: 0.5\nmicro_batches: 4\nschedule: gpipe\n")
    c = cfg(["--config", str(path), "--lr", "0.1"])
    assert (
        c.parallel.shape == (2, 1)
        and c.parallel.micro_batches == 4
        and c.parallel.schedule == "gpipe"
    )
    assert c.train.lr == 0.1


@pytest.mark.parametrize(
    "text, match",
    [
        ("bogus: 1\n", "bogus"),
        ("schedule: zigzag\n", "zigzag"),
        ("lr: fast\n", "fast"),
        ("precision: fp8\n", "precision"),
        ("no-tf32: maybe\n", "no-tf32"),
        ("batch-size: 3.5\n", "batch-size"),
        ("lr: null\n", "lr"),
    ],
)
def test_yaml_errors_name_the_key(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        cfg(["--config", str(path)])


def alias_bomb() -> str:
    """A few hundred bytes of YAML that stand for 2 x 9**9 values (a "billion laughs"): each
    level's list names the one before it nine times."""
    levels = ["&a [" + ",".join("x" * 9) + "]"]
    levels += [f"&{n} [" + ",".join([f"*{p}"] * 9) + "]" for p, n in pairwise("abcdefghi")]
    return "bundle_shape: [[" + ", ".join(levels) + "], *i, *i]\n"


@pytest.mark.timeout(10)
def test_a_yaml_alias_bomb_is_refused_at_once_in_one_line_naming_the_alias(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    assert path.stat().st_size < 500
    with pytest.raises(ConfigError, match=r"^--config: .* line 1: the alias \*a") as exc:
        cfg(["--config", str(path)])
    assert "\n" not in str(exc.value) and len(str(exc.value)) < 400


def test_an_alias_of_one_value_is_read_and_an_alias_of_a_list_is_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lr: &two 2\nmicro_batches: *two\n")
    c = cfg(["--config", str(path)])
    assert (c.train.lr, c.parallel.micro_batches) == (2.0, 2)
    path.write_text("bundle_shape: &shape [2, 1]\n\nlr_steps: *shape\n")
    with pytest.raises(ConfigError, match=r"line 3: the alias \*shape .*list"):
        cfg(["--config", str(path)])


@pytest.mark.parametrize("value", ["[[2, 1], 1]", "[2, {a: 1}]", "[2, true]"])
def test_a_tuple_option_takes_only_a_flat_list_of_numbers_or_words(tmp_path, value):
    path = tmp_path / "run.yaml"
    path.write_text(f"bundle_shape: {value}\n")
    with pytest.raises(ConfigError, match=r"^bundle_shape \(in --config .*flat list"):
        cfg(["--config", str(path)])


def test_speed_and_memory_flags_fill_compute_and_launch():
    c = cfg([])
    assert c.compute == C.ComputeConfig(
        precision="fp32", recompute="never", channels_last=False, tf32=True
    )
    assert c.launch.share_gpus is False
    argv = ["--precision", "bf16", "--recompute", "except-last", "--channels-last", "--no-tf32"]
    c = cfg([*argv, "--share-gpus"])
    assert c.compute == C.ComputeConfig(
        precision="bf16", recompute="except-last", channels_last=True, tf32=False
    )
    assert c.launch.share_gpus is True


def test_speed_and_memory_yaml_keys(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "precision: fp16\nrecompute: always\nchannels_last: true\nno-tf32: true\nshare-gpus: true\n"
    )
    c = cfg(["--config", str(path), "--precision", "bf16"])
    assert c.compute == C.ComputeConfig(
        precision="bf16", recompute="always", channels_last=True, tf32=False
    )
    assert c.launch.share_gpus is True


@pytest.mark.parametrize(
    "argv", [["--precision", "fp8"], ["--recompute", "sometimes"], ["--no-tf32=yes"]]
)
def test_bad_speed_and_memory_flag_is_one_line_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cfg(argv)
    assert exc.value.code == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("main.py: error:"), lines
    assert argv[0].split("=")[0] in lines[0]


def test_help_is_grouped_and_lists_every_flag():
    text = cli.build_parser().format_help()
    for group in (
        "parallelism",
        "training",
        "model and data",
        "launch",
        "configuration and output",
        "speed and memory",
    ):
        assert f"{group}:" in text
    for flag in (
        "--batch-size",
        "--rank",
        "--itr",
        "--bundle-shape",
        "--num-bundle",
        "--IP",
        "--portNum",
        "--model",
        "--world-size",
        "--DP-ONLY",
        "--lr",
        "--momentum",
        "--weight-decay",
        "--micro-batches",
        "--schedule",
        "--epochs",
        "--seed",
        "--backend",
        "--nproc-per-node",
        "--dataset",
        "--partition",
        "--config",
        "--metrics-out",
        "--grad-sync",
        "--timeout",
    ):
        assert flag in text


def test_help_names_every_registered_model():
    from bundle import models

    text = " ".join(cli.build_parser().format_help().split())
    assert all(name in text for name in models.available())


def test_the_originals_model_names_are_a_model_and_its_split():
    for trial in range(5):
        name = f"resnet101_trial{trial}"
        assert cfg(["--model", name]).model == C.ModelConfig(name="resnet101", partition=name)
    assert cfg(["--model", "resnet50_2stage", "--partition", "resnet50_2stage"]).model == (
        C.ModelConfig(name="resnet50", partition="resnet50_2stage")
    )
    # A registered name stays itself, even where a partition file shares its prefix.
    assert cfg(["--model", "mlp_wide"]).model == C.ModelConfig(name="mlp_wide")
    with pytest.raises(ConfigError, match="--partition: 'resnet101_trial1'.*--model resnet101$"):
        cfg(["--model", "resnet101_trial4", "--partition", "resnet101_trial1"])


def test_help_says_what_main_py_says_it_is():
    doc = ast.get_docstring(ast.parse((ROOT / "main.py").read_text()))
    assert doc.splitlines()[0] == cli.DESCRIPTION
    assert cli.DESCRIPTION in " ".join(cli.build_parser().format_help().split())


# Each original flag and its self-explaining spelling: (original, alias, value, field).
ALIASES = [
    ("--world-size", "--num-nodes", "4", "launch.num_nodes"),
    ("--itr", "--steps", "7", "train.steps"),
    ("--IP", "--master-addr", "10.0.0.9", "launch.master_addr"),
    ("--portNum", "--master-port", "4000", "launch.master_port"),
    ("--rank", "--node-rank", "1", "launch.node_rank"),
    ("--weight-decay", "--wd", "0.01", "train.weight_decay"),
]


@pytest.mark.parametrize("original, alias, value, field", ALIASES)
def test_an_alias_sets_the_same_field_as_the_original_flag(original, alias, value, field):
    extra = [] if "num_nodes" in field else ["--world-size", "4"]  # a node rank below the nodes
    with_original, with_alias = cfg([*extra, original, value]), cfg([*extra, alias, value])
    assert with_alias == with_original != cfg(extra)
    section, name = field.split(".")
    assert str(getattr(getattr(with_alias, section), name)) == value


@pytest.mark.parametrize("original, alias, value, field", ALIASES)
def test_an_alias_is_shown_beside_its_flag(original, alias, value, field):
    text = cli.build_parser().format_help()
    assert any(original in ln and alias in ln for ln in text.splitlines()), alias


@pytest.mark.parametrize("original, alias, value, field", ALIASES)
def test_the_yaml_key_of_the_original_flag_still_works(tmp_path, original, alias, value, field):
    path = tmp_path / "run.yaml"
    nodes = "" if original == "--world-size" else "world-size: 4\n"
    path.write_text(f"{nodes}{original.lstrip('-')}: {value}\n")
    assert cfg(["--config", str(path)]) == cfg(["--world-size", "4", original, value])
    # And the command line's alias beats it.
    other = {"10.0.0.9": "10.0.0.8"}.get(value, "2")
    assert cfg(["--config", str(path), alias, other]) == cfg(["--world-size", "4", alias, other])


@pytest.mark.parametrize("original, alias, value, field", ALIASES)
def test_an_alias_is_a_yaml_key_too(tmp_path, original, alias, value, field):
    # --config takes "keys as the long options", and an alias is one.
    path = tmp_path / "run.yaml"
    path.write_text(f"world-size: 4\n{alias.lstrip('-')}: {value}\n")
    assert cfg(["--config", str(path)]) == cfg(["--world-size", "4", original, value])


def test_every_exit_code_is_one_value_and_the_docs_give_the_same_numbers():
    assert [int(c) for c in ExitCode] == [0, 1, 2, 3, 4]  # distinct: a supervisor tells them apart
    assert (EXIT_LEFT, EXIT_HANDOFF, signalled(15)) == (ExitCode.LEFT, ExitCode.HANDOFF, 143)
    docs = (Path(__file__).resolve().parents[2] / "docs" / "fault-tolerance.md").read_text()
    assert (
        f"exit code {int(ExitCode.LEFT)}" in docs and f"exit code {int(ExitCode.HANDOFF)}" in docs
    )
