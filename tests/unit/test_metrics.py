"""bundle/observe/metrics.py: how a run's start line and summary name the model it trains."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from bundle import cli, log
from bundle.observe.build import reporter_rank
from bundle.observe.metrics import Summary, model_label
from bundle.topology import Topology
from bundle.trainer import JobLink, Reporting, Run, Trainer


@pytest.mark.parametrize(
    "name, args, label",
    [
        ("timm:create_model", {"model_name": "resnet18"}, "resnet18"),
        ("torchvision.models:get_model", {"name": "resnet50", "weights": None}, "resnet50"),
        ("tests.support.user_models:mlp", {"width": 8}, "tests.support.user_models:mlp"),
        ("resnet18", {}, "resnet18"),
        ("gpt", {"layers": 2}, "gpt"),
    ],
)
def test_a_factory_asked_for_a_model_by_name_is_named_by_that_model(name, args, label):
    assert model_label(name, args) == label


def trainer_of(*argv: str) -> Trainer:
    """A Trainer whose session is the little _facts and _announce read (nothing is built)."""
    cfg = cli.parse(list(argv), {})
    topo = Topology.from_config(cfg)
    run = Run(cfg, topo, reporter_rank(topo), 0, 0, 3, 3)  # the rank that reports
    engine = SimpleNamespace(
        scaler=None,
        device=torch.device("cpu"),
        peak_in_flight=1,
        sync=SimpleNamespace(wire=SimpleNamespace(ratio=1.0)),
        chunks=[SimpleNamespace(sync=SimpleNamespace(wire=SimpleNamespace(sent=96)))],
    )
    stage = torch.nn.Linear(3, 2)  # 6 + 2 float32 parameters, the bias frozen
    stage.bias.requires_grad_(False)
    optimizer = torch.optim.SGD([stage.weight], lr=0.1, momentum=0.9)
    stage(torch.ones(1, 3)).sum().backward()
    optimizer.step()  # a momentum buffer of the weight's size
    optimizer.zero_grad()  # as after every step: the gradients are counted from the parameters
    coord = topo.coord(run.rank)
    session: object = SimpleNamespace(engine=engine, optimizer=optimizer, stage=stage, coord=coord)
    parts: object = SimpleNamespace(stalls=[])
    return Trainer(
        run,
        session,  # type: ignore[arg-type]
        batches=iter(()),
        lr_schedule=None,  # type: ignore[arg-type]
        checkpointer=parts,  # type: ignore[arg-type]
        reporting=Reporting(
            evaluator=None,  # type: ignore[arg-type]
            reporter=None,  # type: ignore[arg-type]
            profiler=None,  # type: ignore[arg-type]
        ),
        job=JobLink(phase=None, vote=None),  # type: ignore[arg-type]
    )


def test_the_summary_of_a_timm_run_names_the_model_and_the_factory(capsys):
    trainer = trainer_of("--model", "timm:create_model", "--model-args", "model_name=resnet18")
    summary = Summary(trainer._facts(1.0), samples_per_s=10.0, final_loss=1.0)
    printed = json.loads(summary.line())
    assert (printed["model"], printed["factory"]) == ("resnet18", "timm:create_model")
    log.setup("[rank 1 b0 s1]")
    trainer._announce()
    assert "training resnet18 (timm:create_model): shape 1,1" in capsys.readouterr().err


def test_the_summary_of_a_named_model_has_no_factory():
    printed = json.loads(Summary(trainer_of()._facts(1.0), 10.0, 1.0).line())
    assert printed["model"] == "digits_cnn" and "factory" not in printed


def test_the_summary_counts_the_bytes_held_and_the_largest_over_the_job(world_of_one):
    trainer = trainer_of()
    trainer.session.groups = SimpleNamespace(control=world_of_one)  # type: ignore[assignment]
    facts = trainer._facts(1.0)
    assert (facts.param_bytes, facts.grad_bytes, facts.optimizer_bytes) == (32, 24, 24)
    # A job of one process: the largest are its own, through the all-reduce.
    most = (facts.most_param_bytes, facts.most_grad_bytes, facts.most_optimizer_bytes)
    assert most == (32, 24, 24) and all(type(b) is int for b in most)
    printed = json.loads(Summary(facts, 10.0, 1.0).line())
    assert printed["grad_bytes"] == 24 and printed["most_param_bytes"] == 32
    # The whole model's counts (the bias frozen), and the sync's 96 bytes over the 3 steps run.
    assert (printed["trainable_params"], printed["all_params"]) == (6, 8)
    assert printed["grad_sync_bytes"] == 32
