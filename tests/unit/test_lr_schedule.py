"""Learning-rate schedules as data, their flags, and bad schedules refused before anything starts."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import pytest
import torch

from bundle import cli, preflight
from bundle import config as C
from bundle.errors import ConfigError
from bundle.lr_schedule import LRSchedule, Milestone, parse_milestones, warmup_steps

ROOT = Path(__file__).resolve().parents[2]


def train(**kw) -> C.TrainConfig:
    return C.TrainConfig(**{"lr": 1.0, **kw})


def rates(schedule: LRSchedule) -> list[float]:
    return [round(schedule.at(t), 6) for t in range(schedule.total)]


def test_constant_is_the_base_rate_every_step():
    s = LRSchedule.of(train(lr=0.05, epochs=2), steps_per_epoch=3, total=6)
    assert [s.at(t) for t in range(6)] == [0.05] * 6


def test_step_decay_at_epoch_and_step_milestones():
    # 4 steps per epoch: milestones after epochs 1 and 2 are steps 4 and 8.
    by_epochs = train(lr_schedule="step", lr_steps=parse_milestones("1,2"), lr_gamma=0.5)
    s = LRSchedule.of(by_epochs, steps_per_epoch=4, total=10)
    assert s.milestones == (4, 8)
    assert rates(s) == [1.0] * 4 + [0.5] * 4 + [0.25] * 2
    by_steps = train(lr_schedule="step", lr_steps=parse_milestones("3s,5s"), steps=6)
    assert rates(LRSchedule.of(by_steps, steps_per_epoch=100, total=6)) == [1, 1, 1, 0.1, 0.1, 0.01]


def test_pytorch_examples_imagenet_decay():
    """lr x 0.1 ** (epoch // 30) over 90 epochs, the recipe of pytorch/examples' imagenet."""
    t = train(lr=0.1, epochs=90, lr_schedule="step", lr_steps=parse_milestones("30,60"))
    s = LRSchedule.of(t, steps_per_epoch=5, total=450)
    assert all(math.isclose(s.at(i), 0.1 * 0.1 ** (i // 5 // 30)) for i in range(450))


def test_linear_warmup_then_cosine():
    t = train(lr_schedule="cosine", warmup_epochs=0.5, epochs=3)
    s = LRSchedule.of(t, steps_per_epoch=4, total=12)
    assert s.warmup == 2
    # From 0.1 x lr, linearly; then half a cosine from lr over the 10 remaining steps.
    cosine = [round(0.5 * (1 + math.cos(math.pi * k / 10)), 6) for k in range(10)]
    assert rates(s) == [0.1, 0.55, *cosine]


def test_warmup_then_step():
    t = train(lr_schedule="step", lr_steps=parse_milestones("1"), warmup_epochs=1, epochs=2)
    assert rates(LRSchedule.of(t, steps_per_epoch=2, total=4)) == [0.1, 0.55, 0.1, 0.1]


def test_warmup_length_follows_the_written_decimal():
    assert warmup_steps(0.29, 100) == 29  # not 28 from 28.999... in binary floating point
    assert warmup_steps(0.0, 100) == 0


def test_apply_sets_every_parameter_group():
    opt = torch.optim.SGD(
        [{"params": [torch.zeros(1, requires_grad=True)]}, {"params": [torch.zeros(1)]}], lr=1.0
    )
    s = LRSchedule.of(train(lr_schedule="cosine", epochs=2), steps_per_epoch=2, total=4)
    assert s.apply(opt, 2) == s.at(2) == pytest.approx(0.5)
    assert [g["lr"] for g in opt.param_groups] == [s.at(2)] * 2


@pytest.mark.parametrize(
    "text, expected",
    [
        ("30,60,80", (Milestone(30, "epoch"), Milestone(60, "epoch"), Milestone(80, "epoch"))),
        ("500s, 900s", (Milestone(500, "step"), Milestone(900, "step"))),
        ("", ()),
        (None, ()),
    ],
)
def test_milestones_parse(text, expected):
    assert parse_milestones(text) == expected


@pytest.mark.parametrize("text", ["60,30", "30,30", "30,500s", "0", "x", "3.5", "-1", "s", "30,"])
def test_bad_milestones_name_the_flag(text):
    with pytest.raises(ConfigError, match="--lr-steps"):
        parse_milestones(text)


def test_recipe_flags_fill_the_training_config(tmp_path):
    argv = ["--lr-schedule", "step", "--lr-steps", "2,4", "--lr-gamma", "0.2", "--epochs", "5"]
    argv += ["--warmup-epochs", "0.5", "--label-smoothing", "0.1", "--nesterov", "--wd", "1e-4"]
    t = cli.parse(argv, {}).train
    assert (t.lr_schedule, t.lr_steps, t.lr_gamma) == ("step", parse_milestones("2,4"), 0.2)
    assert (t.warmup_epochs, t.label_smoothing, t.nesterov, t.weight_decay) == (
        0.5,
        0.1,
        True,
        1e-4,
    )
    # YAML takes the milestones as a list or as the command line's text.
    path = tmp_path / "recipe.yaml"
    path.write_text("lr-schedule: step\nlr_steps: [30s, 60s]\nitr: 100\nwd: 0.001\n")
    t = cli.parse(["--config", str(path)], {}).train
    assert (t.lr_steps, t.weight_decay) == (parse_milestones("30s,60s"), 0.001)


def test_node_rank_is_the_original_spelling_of_rank():
    assert cli.parse(["--node-rank", "1", "--world-size", "2"], {}).launch.node_rank == 1


# Each is refused before any process starts: one line naming the flag, exit code 2. The last
# needs the data's size (steps per epoch: 1438 digits / batch 64 = 22).
BAD = {
    "unknown schedule": (["--lr-schedule", "linear"], "--lr-schedule"),
    "milestones out of order": (["--lr-schedule", "step", "--lr-steps", "3,2"], "--lr-steps"),
    "step without milestones": (["--lr-schedule", "step"], "--lr-steps"),
    "milestones without step": (["--lr-steps", "2"], "--lr-steps"),
    "warm-up as long as the run": (["--warmup-epochs", "5"], "--warmup-epochs"),
    "bad gamma": (["--lr-gamma", "0"], "--lr-gamma"),
    "smoothing of one": (["--label-smoothing", "1"], "--label-smoothing"),
    "nesterov without momentum": (["--nesterov", "--momentum", "0"], "--nesterov"),
    "warm-up longer than --itr": (["--warmup-epochs", "1", "--itr", "20"], "(22 steps)"),
}

# Milestones the run ends before change no step's rate: dropped, in one note before start (the
# last two need the data's size: 22 steps per epoch).
LATE = {
    "epoch beyond the run": (["--lr-steps", "2,5"], "milestone 5 comes", (44,)),
    "step beyond the run": (["--lr-steps", "10s", "--itr", "10"], "milestone 10s comes", ()),
    "epoch milestone beyond --itr": (["--lr-steps", "1", "--itr", "22"], "milestone 1 comes", ()),
    "step milestone beyond the epochs": (
        ["--lr-steps", "10s,110s,120s", "--epochs", "5"],
        "milestones 110s,120s come",
        (10,),
    ),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_schedule_is_one_line_and_exit_2(name, capsys, monkeypatch):
    for key in ("RANK", "LOCAL_WORLD_SIZE", "SLURM_STEP_ID"):
        monkeypatch.delenv(key, raising=False)
    args, needle = BAD[name]
    try:
        code = cli.main(args)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("main.py: error:") and needle in lines[0], lines[0]


@pytest.mark.parametrize("name", sorted(LATE))
def test_milestones_the_run_ends_before_are_dropped_with_one_note(name, capsys):
    args, needle, kept = LATE[name]
    c = cli.parse(["--lr-schedule", "step", *args], {})
    preflight.check_lr_schedule(c)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("main.py: note: --lr-steps"), lines
    assert needle in lines[0] and lines[0].endswith(": dropped"), lines[0]
    total = c.train.steps or c.train.epochs * 22
    assert LRSchedule.of(c.train, steps_per_epoch=22, total=total).milestones == kept


def test_milestones_inside_the_run_make_no_note(capsys):
    preflight.check_lr_schedule(cli.parse(["--lr-schedule", "step", "--lr-steps", "2,4"], {}))
    assert capsys.readouterr().err == ""


def imagenet_like(root: Path, images: int) -> Path:
    """DATA_DIR with ``images`` training files of one class (only counted, never decoded)."""
    for split in ("train", "val"):
        (root / split / "n01440764").mkdir(parents=True)
    for i in range(images):
        (root / "train" / "n01440764" / f"{i}.JPEG").touch()
    return root


def test_a_short_run_of_the_imagenet_config_needs_no_other_flag(tmp_path, monkeypatch, capsys):
    """--itr 1 of configs/imagenet-resnet50.yaml: its milestones (epochs 30 and 60) are dropped
    with a note; before, the run was refused until --lr-schedule and --lr-steps were overridden."""
    monkeypatch.chdir(ROOT)
    data = imagenet_like(tmp_path, 256)  # one batch of 256: one step per epoch
    c = cli.parse(["--config", "configs/imagenet-resnet50.yaml", "--itr", "1", str(data)], {})
    preflight.check_lr_schedule(c)
    err = capsys.readouterr().err
    assert "--lr-steps 30,60: milestones 30,60 come at or after the end of the run (--itr 1)" in err


def recipes() -> list[list[str]]:
    """The main.py commands of docs/configuration.md's Recipes section, as argument lists."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    section = text.split("## Recipes", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    return [shlex.split(line)[2:] for line in block.splitlines() if "main.py" in line]


def test_the_documented_recipes_are_accepted_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    data = imagenet_like(tmp_path, 0)
    commands = recipes()
    assert len(commands) == 2 and all(c[-1] == "/data/imagenet" for c in commands), commands
    for argv in commands:
        c = cli.parse([*argv[:-1], str(data)], {})
        assert c.model.name == "resnet50" and c.data.root == str(data)
        preflight.check_lr_schedule(c)  # the same unit: no data read
    assert capsys.readouterr().err == ""


def test_the_imagenet_config_is_pytorch_examples_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    (tmp_path / "train" / "n01440764").mkdir(parents=True)
    c = cli.parse(["--config", "configs/imagenet-resnet50.yaml", str(tmp_path)], {})
    assert (c.model.name, c.data.dataset, c.data.root) == ("resnet50", "imagefolder", str(tmp_path))
    t = c.train
    assert (t.batch_size, t.lr, t.momentum, t.weight_decay, t.epochs) == (256, 0.1, 0.9, 1e-4, 90)
    # ImageNet's 1,281,167 training images make 5004 steps of 256 per epoch.
    spe = 1_281_167 // 256
    s = LRSchedule.of(t, steps_per_epoch=spe, total=90 * spe)
    for step in (0, 30 * spe - 1, 30 * spe, 60 * spe - 1, 60 * spe, 90 * spe - 1):
        assert math.isclose(s.at(step), 0.1 * 0.1 ** (step // spe // 30)), step
