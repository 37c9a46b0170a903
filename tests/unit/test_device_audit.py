"""bundle/collectives/device_audit.py: device and host tensors told apart on the CPU, and the
operations CUDA refuses for mixing them, in one process (the audit entered for each test only)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bundle.collectives.device_audit import DEVICE, HOST, MARK, DeviceAudit, DeviceMixing


@pytest.fixture
def audit():
    with DeviceAudit() as mode:
        yield mode


def _checksum(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.int32).sum(dtype=torch.int64)


def test_what_moves_to_the_device_reports_it_and_what_it_makes_follows(audit):
    layer = nn.Linear(3, 2).to(MARK)
    assert layer.weight.device == MARK and audit.on_device(layer.weight) is DEVICE
    out = layer(torch.randn(4, 3).to(MARK))
    assert audit.on_device(out) is DEVICE
    assert audit.on_device(torch.zeros(2, device=layer.weight.device)) is DEVICE
    assert audit.on_device(torch.zeros_like(layer.weight)) is DEVICE
    assert audit.on_device(torch.tensor(0.0)) is HOST  # a factory without a device
    assert audit.on_device(out.cpu()) is HOST and out.cpu().device == torch.device("cpu")
    assert audit.on_device(torch.randn(2).to(out)) is DEVICE  # x.to(y): y's device
    out.sum().backward()
    assert layer.weight.grad.device == MARK  # a gradient follows its tensor


def test_a_device_read_where_the_audit_does_not_answer_is_not_taken_for_the_host(audit):
    """Code torch.compile traced reads a device tensor's real device (plain ``cpu``): what it
    makes there is unknown, so an embedding of its positions passes; "cpu" named is the host."""
    table = nn.Embedding(8, 2).to(MARK)
    made = torch.arange(4, device=torch.device("cpu"))  # as the compiled code's x.device gives
    assert audit.on_device(made) is None
    assert audit.on_device(table(made)) is DEVICE
    assert audit.on_device(torch.arange(4, device="cpu")) is HOST
    with pytest.raises(DeviceMixing, match="embedding"):
        table(torch.arange(4, device="cpu"))


def test_the_unfixed_checkpoint_agreement_is_refused_naming_the_operation_and_place(audit):
    layer = nn.Linear(3, 2).to(MARK)
    opt = torch.optim.Adam(layer.parameters())
    layer(torch.randn(4, 3).to(MARK)).sum().backward()
    opt.step()
    step = opt.state[layer.weight]["step"]
    assert audit.on_device(step) is HOST  # torch keeps Adam's step on the host
    with pytest.raises(DeviceMixing, match=r"torch\.stack .*test_device_audit\.py:\d+ in test_"):
        torch.stack([_checksum(layer.weight), _checksum(step)])
    fixed = torch.stack([_checksum(layer.weight), _checksum(step).to(layer.weight.device)])
    assert audit.on_device(fixed) is DEVICE


def test_cuda_s_own_allowances_pass(audit):
    w = torch.ones(3).to(MARK)
    w * torch.tensor(2.0)  # a 0-d host tensor is a number to CUDA
    w[torch.tensor([0, 2])]  # host indices
    w.copy_(torch.ones(3))  # copies between them
    torch.ones(3).copy_(w)
    unknown = torch.ones(3)
    del audit.tags[unknown]  # as if made in C++ (autograd, DDP): never fails a check
    w + unknown


@pytest.mark.parametrize(
    "mix",
    [
        lambda w, h: w + h,  # a host operand that is not a scalar
        lambda w, h: torch.cat([w, h]),
        lambda w, h: h.add_(w),  # a device result written into host memory
        lambda w, h: torch.add(w, w, out=h),
        lambda w, h: w.detach().numpy(),
    ],
    ids=["elementwise", "cat", "in-place", "out", "numpy"],
)
def test_what_cuda_refuses_fails(audit, mix):
    with pytest.raises(DeviceMixing, match="nccl-emu device audit"):
        mix(torch.ones(3).to(MARK), torch.ones(3))


def test_optimizer_state_loaded_from_a_state_dict_lands_beside_its_parameter(audit):
    layer = nn.Linear(3, 2).to(MARK)
    opt = torch.optim.AdamW(layer.parameters())
    layer(torch.randn(4, 3).to(MARK)).sum().backward()
    opt.step()
    again = torch.optim.AdamW(layer.parameters())
    again.load_state_dict(opt.state_dict())
    state = again.state[layer.weight]
    assert audit.on_device(state["exp_avg"]) is DEVICE and audit.on_device(state["step"]) is HOST
    again.step()  # mixes nothing CUDA refuses


def test_collectives_take_device_tensors_only(audit):
    audit.require_device([torch.ones(2).to(MARK)], "all_reduce")
    with pytest.raises(DeviceMixing, match="all_reduce on the stage group is given a host"):
        audit.require_device([torch.ones(2)], "all_reduce on the stage group")
