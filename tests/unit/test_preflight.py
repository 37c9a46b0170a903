"""check_all: every pre-launch check once, in order, and what it hands the launcher."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from bundle import cli, data, preflight
from bundle.errors import BundleError, ConfigError, DataError
from bundle.models.cut import capture_key
from bundle.topology import Topology


def cfg(*argv):
    return cli.parse(list(argv), {})


CHECKS = (
    "check_data",
    "resolve",
    "check_devices",
    "check_cpu_shares",
    "check_model",
    "check_precision",
    "check_fault_tolerance",
    "check_lr_schedule",
    "check_paths",
    "check_observed_steps",
    "parse_fault",
    "parse_heal_fault",
    "check_resume",
)


@pytest.fixture
def calls(monkeypatch):
    """Every check of check_all, recorded by name as it runs (and then run)."""
    seen: list[str] = []
    owners = {
        "check_data": preflight.data,
        "check_devices": preflight.devices,
        "parse_fault": preflight,
    }
    for name in CHECKS:
        owner = owners.get(name, preflight)
        real = getattr(owner, name)

        def record(*args, _name=name, _real=real, **kwargs):
            seen.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, record)
    return seen


def test_a_plain_run_passes_every_check_once_in_order(calls):
    c = cfg("--itr", "2")
    plan = preflight.check_all(c, {})
    assert calls == list(CHECKS)
    assert plan == preflight.LaunchPlan(cfg=c, topo=Topology.from_config(c), resume=None, attempt=0)


def test_the_planners_choice_is_checked_once_and_handed_on(calls, monkeypatch):
    # The planner reads the data before it chooses; the data are not checked again after.
    resolved = cfg("--bundle-shape", "2,1")
    monkeypatch.setattr(preflight, "resolve", lambda c: calls.append("resolve") or resolved)
    plan = preflight.check_all(cfg("--bundle-shape", "auto"), {})
    assert calls == list(CHECKS)
    assert (plan.cfg, plan.topo) == (resolved, Topology.from_config(resolved))


def test_a_bad_data_directory_stops_before_the_planner(calls, tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        preflight.check_all(cfg("--bundle-shape", "auto", str(tmp_path / "nope")), {})
    assert calls == ["check_data"]


def test_a_bad_fault_hook_is_an_input_error():
    with pytest.raises(ConfigError, match="BUNDLE_FAULT"):
        preflight.check_all(cfg("--itr", "2"), {"BUNDLE_FAULT": "soon"})


def test_a_torchrun_restart_is_an_attempt_that_resumes(tmp_path):
    torchrun = {"RANK": "0", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}
    c = cli.parse(["--itr", "2", "--save-dir", str(tmp_path)], torchrun)
    restarted = {**torchrun, "TORCHELASTIC_RESTART_COUNT": "2"}
    plan = preflight.check_all(c, restarted)
    assert (plan.attempt, plan.resume) == (2, None)  # nothing saved yet: from step 0
    # Outside torchrun the count is not this job's.
    plan = preflight.check_all(replace(c, launch=replace(c.launch, torchrun=False)), restarted)
    assert plan.attempt == 0


def one_line_exit(argv: list[str], capsys, monkeypatch) -> tuple[int, list[str]]:
    """main.py's exit code and stderr lines for ``argv``, in this process (nothing is launched:
    each case fails a check)."""
    for key in ("RANK", "LOCAL_WORLD_SIZE", "SLURM_STEP_ID"):
        monkeypatch.delenv(key, raising=False)
    code = cli.main(argv)
    return code, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


def test_text_for_the_default_model_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    """digits_cnn cannot even be built for token windows; before, its constructor's ValueError
    ended main.py in a traceback."""
    text = tmp_path / "corpus.txt"
    text.write_text("any text at all, long enough for two windows. " * 40)
    code, lines = one_line_exit(
        ["--dataset", "text", "--data-file", str(text), "--itr", "1"], capsys, monkeypatch
    )
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(
        "main.py: error: --dataset: 'text' is not valid; gives token ids (input shape (64,)), "
        "for which --model digits_cnn cannot be built (ValueError: "
    ), lines[0]
    assert lines[0].endswith("train a language model on text, e.g. --model gpt")


def test_a_model_whose_constructor_refuses_the_data_names_the_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise ValueError("needs 3-channel images\nsecond line")

    monkeypatch.setattr(preflight.models, "build_on_meta", refuse)
    with pytest.raises(ConfigError) as err:
        preflight.check_model(cfg("--model", "mlp"), 2)
    assert str(err.value) == (
        "--model: 'mlp' is not valid; cannot be built for --dataset digits (input shape "
        "(1, 8, 8), 10 classes): ValueError: needs 3-channel images"
    )


class _RowByRow(nn.Module):
    """A forward looping over its batch's rows: torch.fx fails on a Proxy used as an integer,
    torch.export on the batch it must specialise."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 16), nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        return self.b(torch.cat([self.a(x[i : i + 1]) for i in range(x.shape[0])]))


class _ChecksItsRows(nn.Module):
    """A forward that checks its batch size is an int: torch.fx's reason prints the Proxy."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 16), nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if not isinstance(rows, int):
            raise TypeError(f"expected a whole number of rows, got {rows}")
        return self.b(self.a(x.flatten(1)))


def row_by_row(num_classes: int) -> nn.Module:
    return _RowByRow(num_classes)


def checks_its_rows(num_classes: int) -> nn.Module:
    return _ChecksItsRows(num_classes)


UNCAPTURABLE = [f"tests.unit.test_preflight:{name}" for name in ("row_by_row", "checks_its_rows")]


class _SizeChecked(nn.Module):
    """A model that checks its input's height with a message formatted from it, as timm's
    ViT does, and says what it was built for (``pretrained_cfg``)."""

    pretrained_cfg = {"input_size": (3, 8, 8)}

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(192, 16), nn.Linear(16, num_classes)

    def forward(self, x):
        height = x.shape[-2]
        torch._assert(height == 8, f"Input height ({height}) doesn't match model (8).")
        return self.b(self.a(x.flatten(1)))


def size_checked(num_classes: int) -> nn.Module:
    return _SizeChecked(num_classes)


def test_a_models_own_size_check_says_what_input_it_takes_not_fxs_proxy():
    c = cfg("--model", "tests.unit.test_preflight:size_checked", "--dataset", "synthetic",
            "--image-size", "4")  # fmt: skip
    with pytest.raises(BundleError) as err:
        preflight.check_model(c, 2)
    text = str(err.value)
    assert "Proxy" not in text and "\n" not in text, text
    assert "fails on an input of shape (3, 4, 4): Input height (a traced value)" in text
    assert text.endswith("it was built for inputs of 3x8x8: give --image-size 8, or build it "
                         "for this input (--model-args, e.g. img_size or image_size)")  # fmt: skip


@pytest.mark.parametrize("model", UNCAPTURABLE)
def test_a_model_no_capture_takes_cannot_be_cut_in_one_line(model):
    with pytest.raises(BundleError) as err:
        preflight.check_model(cfg("--model", model), 2)
    assert "cannot cut" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("model", UNCAPTURABLE)
def test_no_torch_fx_proxy_reaches_the_message(model):
    with pytest.raises(BundleError) as err:
        preflight.check_model(cfg("--model", model), 2)
    assert "Proxy" not in str(err.value), str(err.value)


def test_a_graph_split_is_made_once_and_handed_to_every_process():
    c = cfg("--model", "tests.support.user_models:skip_net", "--bundle-shape", "2,1")
    plan = preflight.check_all(c, {})
    assert plan.capture is not None
    assert plan.capture.key == capture_key(c.model, data.input_spec(c.data)[1])
    assert preflight.check_all(cfg("--bundle-shape", "2,1"), {}).capture is None  # its own chain


def test_bundle_fault_tolerance_on_nccl_is_refused_only_where_turned_off():
    c = cfg("--num-bundle", "2", "--fault-tolerance", "bundle")
    off = {preflight.NCCL_FT_ENV: "0"}
    with pytest.raises(ConfigError, match="turned off on NCCL here .BUNDLE_NCCL_FT=0."):
        preflight.check_fault_tolerance(c, "nccl", environ=off)
    preflight.check_fault_tolerance(c, "nccl", environ={})
    preflight.check_fault_tolerance(c, "gloo", environ=off)
    preflight.check_fault_tolerance(c, "nccl-emu", environ=off)
    preflight.check_fault_tolerance(cfg("--num-bundle", "2"), "nccl", environ=off)  # restart


def test_more_pieces_than_blocks_are_refused_before_start_and_interleaving_takes_two_chunks():
    many = cfg("--schedule", "interleaved-1f1b", "--virtual-stages", "8", "--micro-batches", "4")
    with pytest.raises(ConfigError, match="2 stages x 8 chunks is 16 model pieces") as err:
        preflight.check_all(many, {})
    assert "non-empty pieces" in str(err.value) and "stages into" not in str(err.value)
    zbv = cfg("--schedule", "zbv", "--micro-batches", "4")
    assert zbv.parallel.virtual_stages == 2  # its only number of chunks: no flag needed
    assert cfg("--schedule", "1f1b").parallel.virtual_stages == 1
    interleaved = cfg("--schedule", "interleaved-1f1b", "--micro-batches", "4")
    assert interleaved.parallel.virtual_stages == 2  # runs as named, without the flag
    with pytest.raises(ConfigError) as err:
        cfg("--schedule", "zbv", "--virtual-stages", "3")
    assert "exactly 2" in str(err.value) and "or more" not in str(err.value)


def test_a_plan_made_for_gpus_says_it_runs_on_the_cpus_of_a_node_without_any(capsys, monkeypatch):
    from bundle.runtime import devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    c = cfg("--bundle-shape", "1,1")
    placed = ((0, 0, "A100", None), (0, 1, "V100", None))
    c = replace(c, parallel=replace(c.parallel, placement=placed))
    devices.check_devices(c, Topology.from_config(c))
    err = capsys.readouterr().err
    assert err.startswith("main.py: note: --plan was made for 1 node(s) of 2 A100/V100 GPU(s)")
    assert "this node has no CUDA device" in err and err[-1] == "\n" and err.count("\n") == 1
    devices.check_devices(cfg("--bundle-shape", "1,1"), Topology.from_config(c))  # no plan
    assert capsys.readouterr().err == ""
