"""bundle/checkpoint/state.py: a rank's state by named parts, read and taken in place, the one
definition a checkpoint saves and fault tolerance carries, hands over and sends."""

from __future__ import annotations

import pytest
import torch

from bundle import models
from bundle.checkpoint.parts import RankParts
from bundle.checkpoint.state import PARTS, RankState, checked, on_cpu, shared
from bundle.collectives.device_audit import DEVICE, MARK, DeviceAudit
from bundle.config import TrainConfig
from bundle.engine.optim import make_optimizer
from bundle.engine.stage import split_model
from bundle.models.partition import resolve

INPUT = (1, 4, 4)


class _Errors:
    """A compression hop's per-rank state (PowerSGD's error feedback), by parameter name."""

    def __init__(self) -> None:
        self.errors: dict[str, torch.Tensor] = {}

    def state(self, names):
        return {f"error.{n}": e for n, e in self.errors.items()}

    def load(self, state, names):
        self.errors = {k.removeprefix("error."): v for k, v in state.items()}


def stage_and_optimizer(optimizer: str = "sgd", *, steps: int = 1, device=None):
    """(a stage trained ``steps`` steps with its optimizer, an untrained one): RankParts each."""
    out = []
    for trained in (True, False):
        torch.manual_seed(0 if trained else 1)
        model = models.build("mlp", num_classes=3, input_shape=INPUT)
        blocks = resolve(None, models.blocks(model), 1, "mlp")
        (stage,) = split_model(model, blocks)
        stage = stage.to(device) if device is not None else stage
        cfg = TrainConfig(optimizer=optimizer, lr=0.1, momentum=0.9, weight_decay=0.01)
        opt = make_optimizer(cfg, stage)
        for _ in range(steps if trained else 0):
            x = torch.randn(4, *INPUT)
            stage(x.to(device) if device is not None else x)[0].sum().backward()
            opt.step()
        scale = torch.tensor(2.0 if trained else 1.0)
        out.append(RankParts(stage=stage, optimizer=opt, hop=_Errors(), extra={"scale": scale}))
    return out[0], out[1]


def assert_same_state(got: RankState, want: RankState, parts=PARTS) -> None:
    a, b = got.state_dict(), want.state_dict()
    for part in parts:
        assert sorted(a[part]) == sorted(b[part]), part
        for name, value in b[part].items():
            assert torch.equal(a[part][name].cpu(), value.cpu()), f"{part} {name}"


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_state_taken_in_place_equals_the_one_read(optimizer):
    trained, fresh = stage_and_optimizer(optimizer)
    trained.hop.errors = {"0.weight": torch.ones(2)}
    state = RankState(trained).state_dict()
    assert set(state) == set(PARTS) and state["optim"] and state["hop"]
    RankState(fresh).load_state_dict(state)
    assert_same_state(RankState(fresh), RankState(trained))
    # Adam's step count stays on the host, where torch keeps it.
    steps = [v for k, v in RankState(fresh).state_dict()["optim"].items() if k.endswith(".step")]
    assert all(s.device.type == "cpu" for s in steps) and (optimizer == "sgd") != bool(steps)


def test_what_a_peer_sends_leaves_out_the_rank_s_own_error_feedback():
    trained, fresh = stage_and_optimizer()
    trained.hop.errors = {"0.weight": torch.ones(2)}
    sent = shared(on_cpu(RankState(trained).state_dict()))
    assert sent["hop"] == {} and sent["model"]
    RankState(fresh).load_state_dict(sent)
    assert fresh.hop.errors == {}


def test_optimizer_state_received_on_the_host_goes_to_the_device_under_the_audit():
    """Found under nccl-emu: after a heal with momentum, the update mixed a host momentum buffer
    with device tensors."""
    with DeviceAudit() as audit:
        trained, fresh = stage_and_optimizer(device=MARK)
        RankState(fresh).load_state_dict(on_cpu(RankState(trained).state_dict()))
        for buf in RankState(fresh).state_dict()["optim"].values():
            assert audit.on_device(buf) is DEVICE
        fresh.stage(torch.randn(4, *INPUT).to(MARK))[0].sum().backward()
        fresh.optimizer.step()  # refused as a host/device mix if a buffer stayed on the host


@pytest.mark.parametrize(
    "got, says",
    [
        ([], "has the parts"),
        ({part: {} for part in PARTS[:-1]}, "has the parts"),
        ({**{part: {} for part in PARTS}, "model": {"w": 1.0}}, "part model is not names"),
        ({**{part: {} for part in PARTS}, "optim": {3: torch.ones(1)}}, "part optim is not"),
    ],
)
def test_a_state_read_back_is_exactly_parts_of_tensors_by_name(got, says):
    with pytest.raises(ValueError, match=says):
        checked(got)
