"""RunConfig: what nodes compare at start (shared_view) and what a checkpoint records (run_settings)."""

from __future__ import annotations

import pytest

from bundle import config as C
from bundle.checkpoint import format as ckpt
from bundle.config import options
from bundle.lr_schedule import Milestone

DEFAULT = C.RunConfig()

# Every node-local value set, and the trace on: none of them may make two nodes disagree.
TRACED = C.RunConfig(
    parallel=C.ParallelConfig(shape=(4, 2), num_bundles=2),
    model=C.ModelConfig(name="mlp"),
    data=C.DataConfig(dataset="synthetic"),
    train=C.TrainConfig(
        steps=1000,
        lr_schedule="step",
        lr_steps=(Milestone(500, "step"), Milestone(900, "step")),
        checkpoint="w.pt",
    ),
    launch=C.LaunchConfig(node_rank=1, num_nodes=2),
    checkpoint=C.CheckpointConfig(save_dir="ck", resume="auto"),
    compute=C.ComputeConfig(precision="bf16"),
    observe=C.ObserveConfig(trace="t.json", trace_steps="3:4", profile_dir="p", tensorboard="tb"),
    metrics_out="m.jsonl",
)

# Every recorded setting away from its default, and a planner's prediction.
TUNED = C.RunConfig(
    parallel=C.ParallelConfig(micro_batches=4, schedule="gpipe", grad_sync="hierarchical"),
    model=C.ModelConfig(name="resnet50", partition="resnet50_2stage"),
    data=C.DataConfig(dataset="imagefolder", root="/data", workers=2),
    train=C.TrainConfig(
        batch_size=256,
        epochs=90,
        lr=0.1,
        momentum=0.8,
        weight_decay=1e-4,
        nesterov=True,
        lr_schedule="step",
        lr_steps=(Milestone(30, "epoch"), Milestone(60, "epoch")),
        lr_gamma=0.2,
        warmup_epochs=0.5,
        label_smoothing=0.1,
        seed=7,
    ),
    compute=C.ComputeConfig(precision="fp16", recompute="always", channels_last=True, tf32=False),
    observe=C.ObserveConfig(profile_steps="2:3", profile_dir="prof"),
    predicted_samples_per_s=123.4,
)


# The data-parallel options' defaults: shared between nodes and recorded by checkpoints alike.
DATA_PARALLEL_DEFAULTS = {
    "zero": 0,
    "grad_compression": "none",
    "powersgd_rank": 4,
    "compression_warmup": 10,
    "bundle_sync": "step",
    "outer_lr": 0.7,
    "outer_momentum": 0.9,
    "aggregate": "mean",
}


def shared(**sections):
    """DEFAULT's shared view with some sections' entries replaced."""
    view = {
        "parallel": {
            "shape": [1, 1],
            "num_bundles": 1,
            "micro_batches": 1,
            "schedule": "1f1b",
            "virtual_stages": 1,
            "grad_sync": "flat",
            "bucket_mb": 25.0,
            **DATA_PARALLEL_DEFAULTS,
            "row_weights": "",
            "placement": [],
            "tensor_parallel": [],
        },
        "model": {
            "name": "digits_cnn",
            "partition": None,
            "args": None,
            "weights_strict": False,
            "loss": None,
            "output": None,
            "lora": None,
            "lora_train": None,
            "base_dtype": None,
        },
        "data": {
            "dataset": "digits",
            "root": None,
            "workers": 0,
            "image_size": 224,
            "num_classes": None,
            "synthetic_size": 4096,
            "text_field": "text",
            "label_field": None,
            "seq_len": 64,
            "skip_bad_samples": False,
        },
        "train": {
            "batch_size": 64,
            "steps": 0,
            "epochs": 5,
            "lr": 0.05,
            "momentum": 0.9,
            "weight_decay": 0.0,
            "nesterov": False,
            "optimizer": "sgd",
            "betas": [0.9, 0.999],
            "eps": 1e-8,
            "no_decay_norm_bias": False,
            "lr_schedule": "constant",
            "lr_steps": [],
            "lr_gamma": 0.1,
            "warmup_epochs": 0.0,
            "label_smoothing": 0.0,
            "seed": 0,
            "log_every": 10,
            "eval": True,
            "eval_only": False,
            "val_batches": 0,
        },
        "launch": {
            "num_nodes": 1,
            "nproc_per_node": 0,
            "master_addr": "127.0.0.1",
            "backend": "auto",
            "timeout": 30.0,
            "init_timeout": 300.0,
            "torchrun": False,
            "max_restarts": 0,
            "fault_tolerance": "restart",
            "min_bundles": 1,
            "share_gpus": False,
            "emu_eager_bytes": 0,
            "emu_strict": False,
        },
        "checkpoint": {"save_every": 0, "keep": 3, "async_save": False},
        "compute": {
            "precision": "fp32",
            "recompute": "never",
            "channels_last": False,
            "tf32": True,
            "compile": False,
            "compile_backend": "inductor",
        },
        "observe": {"trace": False, "trace_steps": None, "profile_steps": None},
        "predicted_samples_per_s": None,
    }
    for name, entries in sections.items():
        if isinstance(view[name], dict):
            view[name] = {**view[name], **entries}
        else:
            view[name] = entries
    return view


RECORDED_DEFAULT = {
    "model": "digits_cnn",
    "dataset": "digits",
    "micro_batches": 1,
    **DATA_PARALLEL_DEFAULTS,
    "batch_size": 64,
    "seed": 0,
    "lr": 0.05,
    "momentum": 0.9,
    "weight_decay": 0.0,
    "nesterov": False,
    "optimizer": "sgd",
    "betas": "0.9,0.999",
    "eps": 1e-8,
    "no_decay_norm_bias": False,
    "lr_schedule": "constant",
    "lr_steps": "",
    "lr_gamma": 0.1,
    "warmup_epochs": 0.0,
    "label_smoothing": 0.0,
    "precision": "fp32",
    "recompute": "never",
    "channels_last": False,
    "model_args": None,
    "loss": None,
    "model_output": None,
    "pretrained": None,
    "lora": None,
    "lora_train": None,
    "base_dtype": None,
    "text_field": "text",
    "label_field": None,
    "seq_len": 64,
    "tokenizer": None,
}


def test_shared_view_of_the_defaults():
    assert DEFAULT.shared_view() == shared()


def test_shared_view_drops_node_local_values_and_keeps_whether_to_trace():
    assert TRACED.shared_view() == shared(
        parallel={"shape": [4, 2], "num_bundles": 2},
        model={"name": "mlp"},
        data={"dataset": "synthetic"},
        train={"steps": 1000, "lr_schedule": "step", "lr_steps": [[500, "step"], [900, "step"]]},
        launch={"num_nodes": 2},
        compute={"precision": "bf16"},
        observe={"trace": True, "trace_steps": "3:4"},
    )


def test_shared_view_of_every_recorded_setting_changed():
    assert TUNED.shared_view() == shared(
        parallel={"micro_batches": 4, "schedule": "gpipe", "grad_sync": "hierarchical"},
        model={"name": "resnet50", "partition": "resnet50_2stage"},
        data={"dataset": "imagefolder", "root": "/data", "workers": 2},
        train={
            "batch_size": 256,
            "epochs": 90,
            "lr": 0.1,
            "momentum": 0.8,
            "weight_decay": 1e-4,
            "nesterov": True,
            "lr_schedule": "step",
            "lr_steps": [[30, "epoch"], [60, "epoch"]],
            "lr_gamma": 0.2,
            "warmup_epochs": 0.5,
            "label_smoothing": 0.1,
            "seed": 7,
        },
        compute={"precision": "fp16", "recompute": "always", "channels_last": True, "tf32": False},
        observe={"profile_steps": "2:3"},
        predicted_samples_per_s=123.4,
    )


def test_a_checkpoint_records_the_training_settings():
    assert ckpt.run_settings(DEFAULT) == RECORDED_DEFAULT
    assert ckpt.run_settings(TRACED) == {
        **RECORDED_DEFAULT,
        "model": "mlp",
        "dataset": "synthetic",
        "lr_schedule": "step",
        "lr_steps": "500s,900s",
        "precision": "bf16",
    }
    assert ckpt.run_settings(TUNED) == {
        **RECORDED_DEFAULT,
        "model": "resnet50",
        "dataset": "imagefolder",
        "micro_batches": 4,
        "batch_size": 256,
        "seed": 7,
        "lr": 0.1,
        "momentum": 0.8,
        "weight_decay": 1e-4,
        "nesterov": True,
        "lr_schedule": "step",
        "lr_steps": "30,60",
        "lr_gamma": 0.2,
        "warmup_epochs": 0.5,
        "label_smoothing": 0.1,
        "precision": "fp16",
        "recompute": "always",
        "channels_last": True,
    }


def test_a_recorded_setting_is_named_as_its_option():
    # A resume under another value is noted as "resuming with --KEY VALUE".
    assert set(DEFAULT.run_settings()) <= {o.dest for o in options.OPTIONS if o.field}


def test_an_evaluation_only_run_needs_a_model_to_evaluate_and_validation():
    import pytest

    from bundle.errors import ConfigError

    only = C.TrainConfig(eval_only=True)
    with pytest.raises(
        ConfigError, match="needs a model to evaluate: --resume, --weights or --pretrained"
    ):
        C.RunConfig(train=only)
    with pytest.raises(ConfigError, match="leave --no-eval out"):
        C.RunConfig(
            train=C.TrainConfig(eval_only=True, eval=False), model=C.ModelConfig(weights="w.pt")
        )
    C.RunConfig(train=only, checkpoint=C.CheckpointConfig(resume="auto", save_dir="ckpt"))


@pytest.mark.parametrize(
    "change, flag",
    [
        ({"parallel": {"num_bundles": 1}}, "--num-bundle"),
        ({"parallel": {"num_bundles": 2}, "launch": {"torchrun": True}}, "--torchrun"),
        ({"parallel": {"num_bundles": 2, "zero": 3}}, "--zero"),
    ],
)
def test_bundle_fault_tolerance_refuses_what_it_does_not_support(change, flag):
    from bundle.errors import ConfigError
    from tests.support.config import make_config

    launch = {"fault_tolerance": "bundle", **change.pop("launch", {})}
    with pytest.raises(ConfigError) as e:
        make_config(launch=launch, **change)
    assert e.value.key == flag


@pytest.mark.parametrize(
    "change",
    [
        {"grad_sync": "hierarchical"},
        {"zero": 1},
        {"bundle_sync": "diloco:4"},
        {"grad_compression": "powersgd"},
    ],
)
def test_bundle_fault_tolerance_composes_with_every_sync(change):
    from tests.support.config import make_config

    cfg = make_config(launch={"fault_tolerance": "bundle"}, parallel={"num_bundles": 2, **change})
    assert cfg.launch.fault_tolerance == "bundle"
    ft = {"fault_tolerance": "bundle"}
    make_config(
        launch=ft, checkpoint={"async_save": True, "save_dir": "c"}, parallel={"num_bundles": 2}
    )


def test_robust_aggregation_under_bundle_fault_tolerance_keeps_enough_bundles():
    from bundle.errors import ConfigError
    from tests.support.config import make_config

    median = {"num_bundles": 4, "aggregate": "median"}
    with pytest.raises(ConfigError, match="combines at least 3 bundles") as e:
        make_config(launch={"fault_tolerance": "bundle", "min_bundles": 2}, parallel=median)
    assert e.value.key == "--min-bundles"
    make_config(launch={"fault_tolerance": "bundle", "min_bundles": 3}, parallel=median)


@pytest.mark.parametrize(
    "change, flag, says",
    [
        ({"parallel": {"zero": 2}}, "--zero", "or 3 \\(parameters"),
        (
            {"parallel": {"zero": 3, "grad_compression": "powersgd"}},
            "--grad-compression",
            "exactly",
        ),
        (
            {"parallel": {"zero": 3, "aggregate": "median", "num_bundles": 3}},
            "--aggregate",
            "exactly",
        ),
        ({"parallel": {"zero": 3, "bundle_sync": "diloco:4"}}, "--zero", "per bundle"),
        ({"parallel": {"zero": 3, "schedule": "zb-h1"}}, "--schedule", "reduce-scatters"),
        (
            {"parallel": {"schedule": "zb-h1"}, "compute": {"compile": True}},
            "--schedule",
            "compiled",
        ),
        (
            {"compute": {"compile": True, "compile_backend": "tvm"}},
            "--compile-backend",
            "aot_eager",
        ),
        ({"parallel": {"zero": 3}, "compute": {"channels_last": True}}, "--channels-last", "FSDP2"),
    ],
)
def test_zero3_and_compile_refuse_what_they_cannot_run_in_one_line(change, flag, says):
    from bundle.errors import ConfigError
    from tests.support.config import make_config

    change = {
        "parallel": {"num_bundles": 2, **change.get("parallel", {})},
        **{k: v for k, v in change.items() if k != "parallel"},
    }
    with pytest.raises(ConfigError, match=says) as e:
        make_config(**change)
    assert e.value.key == flag


def test_zero3_and_compile_run_with_every_other_schedule_and_sync():
    from tests.support.config import make_config

    for schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
        for sync in ("flat", "hierarchical"):
            par = {"num_bundles": 2, "zero": 3, "schedule": schedule, "grad_sync": sync}
            par |= {"shape": (2, 2), "virtual_stages": 2} if "interleaved" in schedule else {}
            cfg = make_config(parallel=par, compute={"compile": True})
            assert cfg.parallel.zero == 3 and cfg.compute.compile


@pytest.mark.parametrize(
    "schedule, micro_batches, says",
    [("zbv", 1, "ZBV on 2 stages needs at least 3"), ("interleaved-1f1b", 5, "in rounds")],
)
def test_too_few_micro_batches_for_a_schedule_name_the_micro_batches(schedule, micro_batches, says):
    """The flag to change is --micro-batches, not the chunks the schedule runs by default."""
    from bundle.errors import ConfigError
    from tests.support.config import make_config

    with pytest.raises(ConfigError, match=says) as e:
        # virtual_stages 0: the schedule's own number of chunks, as the command line leaves it
        par = {"schedule": schedule, "micro_batches": micro_batches, "virtual_stages": 0}
        make_config(parallel=par)
    assert (e.value.key, e.value.value) == ("--micro-batches", micro_batches)
