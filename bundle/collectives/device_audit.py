"""Under ``--backend nccl-emu``: which tensors would live on the rank's GPU, and the operations
that would combine them with host tensors where CUDA raises.

An emulated rank computes on the CPU, so a tensor that would be on its GPU and one that would stay
on the host look alike, and a bug that only CUDA reports (``torch.stack`` of a parameter's
checksum with the CPU ``step`` of an Adam optimizer) passes every CPU test. The audit tells them
apart: the rank's device is ``MARK`` (``cpu:0``, where a GPU run has ``cuda:0``), and a
``TorchFunctionMode`` on the training thread tags each tensor it sees made:

- **device**: moved or created on ``MARK`` (``module.to(device)``, ``x.to(device)``,
  ``torch.zeros(..., device=device)``), or computed from a device tensor; such a tensor reports
  ``MARK`` as its ``.device``, so ``torch.zeros(n, device=p.device)`` follows it as on a GPU, and a
  gradient read through ``.grad`` follows its tensor;
- **host**: made without a device (``torch.tensor(0.0)``, as Adam keeps its ``step``), moved to
  plain ``cpu`` (``.cpu()``, ``.to("cpu")``), or computed from host tensors only;
- **unknown**: made where Python does not see it (autograd's gradients, DDP's buckets), made on
  a device object naming plain ``cpu`` (read off a tensor where the mode does not answer, as in
  code ``torch.compile`` traced), and what is computed from unknown and host tensors. Unknown
  never fails a check.

An operation fails, as CUDA does, when it combines a device tensor with a host tensor that is not
a 0-dimensional scalar (CUDA takes those as numbers), with any host tensor in a list that must
share one device (``stack``, ``cat``), writes a device result into a host tensor (in place or
``out=``), or reads a device tensor into NumPy. Copies between them (``to``, ``copy_``) and
indexing a device tensor with host indices are allowed, as on CUDA. The emulator checks what
collectives and point-to-point calls carry: NCCL takes device tensors only.

The error names the operation and the first call site outside torch. Not covered: operations
inside torch's C++ (kernels see plain CPU tensors), code on other threads (loader workers,
asynchronous saves), and tensors made in C++ until Python reads them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

MARK = torch.device("cpu", 0)  # an emulated rank's device: what cuda:0 is to a GPU rank
_PLAIN_CPU = torch.device("cpu")
DEVICE, HOST = True, False  # a tensor's tag; absent: unknown

# Operations whose tensors CUDA requires on one device, 0-d scalars included.
_ONE_DEVICE = {
    torch.stack,
    torch.cat,
    torch.concat,
    torch.concatenate,
    torch.hstack,
    torch.vstack,
    torch.dstack,
    torch.column_stack,
}
# Copies between host and device (checked nowhere), and indexing (host indices are allowed).
_FREE = {"to", "type_as", "copy_", "__setitem__", "__getitem__", "index_put_", "index_put", "set_"}
_IN_PLACE_DUNDER = {
    f"__i{op}__"
    for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul")
    + ("and", "or", "xor", "lshift", "rshift")
}
_TO_NUMPY: set[Any] = {torch.Tensor.numpy, torch.Tensor.__array__}
_TORCH_DIR = os.path.dirname(torch.__file__)
_ATTRIBUTES = (torch.Tensor.device, torch.Tensor.data, torch.Tensor.grad)
_PASSING = {__file__, torch.overrides.__file__}  # frames between a call and the mode


class DeviceMixing(RuntimeError):
    """An operation CUDA would refuse: device and host tensors combined."""


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _target(device: Any) -> bool | None:
    """The tag a tensor made or moved onto ``device`` gets (None: the argument does not say)."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type != "cpu":
        return None
    return DEVICE if device == MARK else HOST


def call_site() -> str:
    """The innermost frame outside torch and this module: where the operation was asked for."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_TORCH_DIR) and path != __file__:
            return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "an unknown place"


def _asked_by_torch() -> bool:
    """Whether torch's own Python code made the call. It sees a device tensor's real device
    (``cpu``): its code for CPU tensors runs (DCP writes them as they are, where it would copy a
    GPU tensor to the host first), what it moves to that device keeps its tag
    (``optimizer.load_state_dict`` moves state to its parameter's device), and what it makes on a
    device it read off a tensor is unknown (PowerSGD's matrices, made on its bucket's device)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename in _PASSING:
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR)


def _name(func: Any) -> str:
    owner = getattr(func, "__self__", None)
    name = getattr(func, "__name__", repr(func))
    if owner is not None and name in ("__get__", "__set__"):
        return f"Tensor.{getattr(owner, '__name__', '?')}"
    qual = getattr(func, "__qualname__", "") or ""
    if qual.startswith(("Tensor.", "TensorBase.")):
        return f"Tensor.{name}"
    module = getattr(func, "__module__", None) or "torch"
    return f"{'torch' if module.startswith('torch._') else module}.{name}"


_SAME_DEVICE = "Expected all tensors to be on the same device"


class DeviceAudit(TorchFunctionMode):
    """The tags and the checks (see the module's docstring); one per process, on its main thread."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: WeakIdKeyDictionary = WeakIdKeyDictionary()

    # -- tags ----------------------------------------------------------------------------------

    def on_device(self, t: torch.Tensor) -> bool | None:
        return self.tags.get(t)

    def tag(self, t: torch.Tensor, where: bool) -> None:
        self.tags[t] = where

    def require_device(self, tensors: Any, what: str) -> None:
        """What NCCL moves must be on the device (emulated collectives and p2p calls)."""
        for t in _tensors(tensors):
            if self.tags.get(t) is HOST:
                raise DeviceMixing(
                    f"nccl-emu device audit: {what} is given a host tensor "
                    f"(shape {list(t.shape)}, {t.dtype}); NCCL takes tensors on the GPU only"
                )

    # -- the mode ------------------------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        if owner is not None and any(owner is a for a in _ATTRIBUTES):
            return self._attribute(owner, func, args, kwargs)
        tensors = list(_tensors((args, kwargs)))
        inputs = [t for t in tensors if t in self.tags]
        ours = [self.tags[t] for t in inputs]
        if func in _TO_NUMPY and DEVICE in ours:
            self._fail(
                func, "reads a device tensor into NumPy", "can't convert cuda tensor to numpy"
            )
        if DEVICE in ours and HOST in ours and getattr(func, "__name__", "") not in _FREE:
            self._check(func, args, kwargs, inputs)
        out = func(*args, **kwargs)
        where = self._result_tag(func, args, kwargs, ours, len(tensors))
        # (torch's own calls reach here with plain numbers too: FSDP's sym_max of two sizes)
        in_place = bool(args) and isinstance(out, torch.Tensor) and out is args[0]
        if in_place and where is HOST and self.tags.get(out) is DEVICE:
            out = out.clone()  # to the host: a copy, as from a GPU (torch returns the tensor)
        if where is not None:
            for t in _tensors(out):
                if t not in self.tags or func is torch.Tensor.to:
                    self.tags[t] = where
        return out

    def _attribute(self, owner, func, args, kwargs):
        """``t.device`` (the device reports MARK), ``p.data = ...`` (``module.to`` swaps its
        parameters' data) and ``t.grad`` (a gradient follows its tensor)."""
        name = getattr(func, "__name__", "")
        if owner is torch.Tensor.device:
            if self.tags.get(args[0]) is DEVICE and not _asked_by_torch():
                return MARK
        elif owner is torch.Tensor.data and name == "__set__":
            where = self.tags.get(args[1])
            if where is not None:
                self.tags[args[0]] = where
        elif owner is torch.Tensor.grad and name == "__get__":
            grad = func(*args, **kwargs)
            where = self.tags.get(args[0])
            if grad is not None and where is not None and grad not in self.tags:
                self.tags[grad] = where
            return grad
        return func(*args, **kwargs)

    def _result_tag(self, func, args, kwargs, ours: list, seen: int) -> bool | None:
        if func is torch.Tensor.to:
            other = next(_tensors(args[1:]), None)  # x.to(y): y's device
            if other is not None:
                return self.tags.get(other)
            to = {k: v for k, v in kwargs.items() if k != "copy"}  # _parse_to takes no copy
            moved = _target(torch._C._nn._parse_to(*args[1:], **to)[0])
            if moved is HOST and _asked_by_torch():  # torch saw the real device (see .device)
                return self.tags.get(args[0])
            return moved if moved is not None else self.tags.get(args[0])
        if func is torch.Tensor.cpu:
            return self.tags.get(args[0]) if _asked_by_torch() else HOST
        device = kwargs.get("device")
        made = _target(device)
        # torch's code that names "cpu" means the host (Adam's step); a device it read off a
        # tensor (PowerSGD's bucket.device) is the real cpu of either, for all we know. So is a
        # plain cpu device object anywhere: read off a tensor here it would be MARK, so it was
        # read where the mode does not answer (code torch.compile traced: ``x.device`` there is
        # the real device).
        if made is HOST and not isinstance(device, str) and device == _PLAIN_CPU:
            return None
        if made is not None:
            return made
        if DEVICE in ours:
            return DEVICE
        if not seen:  # a factory without a device: on the host, on a GPU too
            return HOST
        return HOST if len(ours) == seen else None  # host only from host tensors alone

    def _check(self, func, args, kwargs, inputs: list[torch.Tensor]) -> None:
        hosts = [t for t in inputs if self.tags[t] is HOST]
        if func in _ONE_DEVICE:
            self._fail(
                func, f"combines device tensors with {len(hosts)} host tensor(s) in one list"
            )
        big = [t for t in hosts if t.dim() > 0]
        if big:
            shape = list(big[0].shape)
            self._fail(func, f"combines device tensors with a host tensor of shape {shape}")
        first = args[0] if args else None
        name = getattr(func, "__name__", "")
        in_place = name.endswith("_") and not name.endswith("__") or name in _IN_PLACE_DUNDER
        target = kwargs.get("out", first if in_place else None)
        for t in _tensors(target):
            if self.tags.get(t) is HOST:
                self._fail(func, "writes a device result into a host tensor")

    def _fail(self, func, what: str, cuda_says: str = _SAME_DEVICE) -> None:
        raise DeviceMixing(
            f"nccl-emu device audit: {_name(func)} {what}, at {call_site()} "
            f"(on a GPU: '{cuda_says}')"
        )


_AUDIT: DeviceAudit | None = None


def install() -> DeviceAudit:
    """This process's audit, entered on the calling (training) thread once; later calls return it.

    It stays on for the rest of the process: emulated ranks are processes of their own.
    """
    global _AUDIT
    if _AUDIT is None:
        _AUDIT = DeviceAudit()
        _AUDIT.__enter__()
    return _AUDIT


def current() -> DeviceAudit | None:
    """The process's audit, if one was installed."""
    return _AUDIT
