"""The hop between bundles of a gradient sync, one bucket at a time: exact, compressed
(``--grad-compression``) or gathered and combined robustly (``--aggregate``).

A hop starts on a flat bucket buffer holding this process's contribution and returns a future
whose value is that buffer holding the SUM over the group (the sync's contract: each replica's
loss is already its share of the global-batch mean). The flat sync runs a hop as DDP's comm hook
over the stage group; the hierarchical sync runs it on the masters' allreduce only, so inside a
bundle gradients stay exact.

- ``bf16``/``fp16``: the bucket travels in half precision and is summed there (half the bytes).
- ``powersgd``: PyTorch's ``powerSGD_hook`` (rank-R approximation of each gradient matrix, small
  tensors uncompressed). It averages; the hop scales the average back to the sum. Error feedback is
  kept here, per parameter (not per DDP bucket, whose layout changes after the first step), so a
  checkpoint can hold it; random projections are seeded by (seed, step, bucket), so every replica
  draws alike and a resumed run draws what the uninterrupted one did.
- ``--aggregate median|trimmed:K``: the masters gather every bundle's bucket and combine it
  coordinate-wise (bundle.engine.aggregate), scaled back to the sum.

Every hop counts the bytes it sends against those of the same bucket in fp32 (``Wire``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

from bundle.collectives.comm import Comm
from bundle.data.samples import step_seed
from bundle.engine import aggregate
from bundle.engine.aggregate import Fault

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Wire:
    """Gradient bytes sent, against the same sync in fp32 every step."""

    sent: int = 0
    full: int = 0

    def add(self, sent: int, full: int) -> None:
        self.sent += sent
        self.full += full

    @property
    def ratio(self) -> float:
        return self.sent / self.full if self.full else 1.0


@dataclass(frozen=True, kw_only=True)
class HopGroups:
    """Where one replica of a stage syncs in two hops (the hierarchical sync, the meetings of
    ``--bundle-sync local|diloco``): inside its bundle, then among the bundles' masters.

    ``bundle_group``: the stage's replicas in this bundle (None: the replica is alone in it);
    ``bundle_master``: the global rank of their master; ``masters_group``: the stage's masters of
    every bundle, where this replica is one and its sync crosses bundles (else None);
    ``is_master``: whether it is its bundle's master; ``bundle``: its bundle's index.
    """

    bundle_group: dist.ProcessGroup | None
    bundle_master: int
    masters_group: dist.ProcessGroup | None
    is_master: bool = False
    bundle: int = 0


def done(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(value)
    return fut


class Hop:
    """Exact sum over ``group`` through ``comm`` (the sync's collectives, emulated NCCL included)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        comm: Comm,
        *,
        wire: Wire,
        bundle: int = 0,
        fault: Fault | None = None,
        seed: int = 0,
        warmup: int = 0,
    ) -> None:
        self.group, self.comm, self.wire = group, comm, wire
        self.bundle, self.fault, self.seed, self.warmup = bundle, fault, seed, warmup

    def start(
        self, index: int, buf: torch.Tensor, params: Sequence[nn.Parameter], step: int
    ) -> torch.futures.Future[torch.Tensor]:
        if self.fault is not None and self.fault.applies(self.bundle, step):
            self.fault.corrupt(buf, seed=self.seed, step=step)
        if step < self.warmup:
            return self.exact(buf)
        return self.compressed(index, buf, params, step)

    def exact(self, buf: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        nbytes = buf.numel() * buf.element_size()
        self.wire.add(nbytes, nbytes)
        fut = self.comm.all_reduce(buf, self.group).get_future()
        return fut.then(lambda f: f.value()[0])

    def compressed(
        self, index: int, buf: torch.Tensor, params: Sequence[nn.Parameter], step: int
    ) -> torch.futures.Future[torch.Tensor]:
        return self.exact(buf)

    # The state a checkpoint keeps of this process's hop (error feedback), by parameter name.
    def state(self, names: dict[nn.Parameter, str]) -> dict[str, torch.Tensor]:
        return {}

    def load(self, state: dict[str, torch.Tensor], names: dict[nn.Parameter, str]) -> None:
        """Restore what ``state`` saved (keys without their prefix)."""


class HalfHop(Hop):
    """The bucket summed in bf16 or fp16: half the bytes, rounding each share once."""

    def __init__(self, group, comm, *, dtype: torch.dtype, **kw) -> None:
        super().__init__(group, comm, **kw)
        self.dtype = dtype

    def compressed(self, index, buf, params, step):
        wire = buf.to(self.dtype)
        self.wire.add(wire.numel() * wire.element_size(), buf.numel() * buf.element_size())

        def back(f: Any) -> torch.Tensor:
            f.value()
            return buf.copy_(wire)

        return self.comm.all_reduce(wire, self.group).get_future().then(back)


class _Bucket:
    """What ``powerSGD_hook`` reads of a DDP bucket, for a bucket of the hierarchical sync."""

    def __init__(self, index: int, buf: torch.Tensor, params: Sequence[nn.Parameter]) -> None:
        self._index, self._buf, self._params = index, buf, list(params)

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buf

    def is_last(self) -> bool:
        return False  # powerSGD_hook counts steps by it; the warm-up is counted here instead

    def parameters(self) -> list[nn.Parameter]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        out, offset = [], 0
        for p in self._params:
            out.append(self._buf[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        return out


class PowerSGDHop(Hop):
    """PyTorch's PowerSGD with error feedback kept per parameter (see the module's docstring)."""

    def __init__(self, group, comm, *, rank: int, **kw) -> None:
        super().__init__(group, comm, **kw)
        self.size = group.size()
        self.psgd = psgd.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=0,  # the warm-up is this hop's (by step, not by DDP's counter)
            use_error_feedback=False,  # kept here instead, per parameter
            warm_start=False,  # fresh projections every step: no state beyond the errors
        )
        self.errors: dict[nn.Parameter, torch.Tensor] = {}

    def compressed(self, index, buf, params, step):
        bucket = _Bucket(index, buf, params)
        members = bucket.parameters()
        for p, g in zip(members, bucket.gradients(), strict=True):
            if p in self.errors:
                g.add_(self.errors[p].view(g.shape))
        before = buf.clone()
        # The same draws on every replica, and on a resumed run, whatever ran before.
        self.psgd.rng = np.random.RandomState(step_seed(self.seed, step, index) % 2**32)
        numel = self.psgd.total_numel_after_compression
        # Its rounds chain collectives from future callbacks, which run on the backend's threads:
        # two buckets in flight could start them in different orders on different ranks (a hang
        # on gloo, a mismatch on NCCL). One bucket at a time keeps every rank's order the same,
        # and its rounds are one call of the group's communicator (in order under nccl-emu).
        with self.comm.exclusive(self.group, f"PowerSGD's rounds (bucket {index})"):
            fut = psgd.powerSGD_hook(self.psgd, bucket)  # type: ignore[arg-type]
            fut.wait()
        sent = self.psgd.total_numel_after_compression - numel
        self.wire.add(sent * buf.element_size(), buf.numel() * buf.element_size())
        out = fut.value()
        offset = 0
        for p in members:  # the local error: what this share lost to the approximation
            n = p.numel()
            self.errors[p] = before[offset : offset + n] - out[offset : offset + n]
            offset += n
        return done(out.mul_(self.size))

    def state(self, names):
        return {f"error.{names[p]}": e for p, e in self.errors.items()}

    def load(self, state, names):
        by_name = {n: p for p, n in names.items()}
        for key, value in state.items():
            name = key.removeprefix("error.")
            if name in by_name:
                self.errors[by_name[name]] = value


class GatherHop(Hop):
    """Every bundle's bucket gathered; combined coordinate-wise by ``rule``, scaled to the sum.

    ``shares[b]`` turns bundle b's part of the global-batch sum into a whole-batch estimate
    (bundles' batches differ by at most a row)."""

    def __init__(self, group, comm, *, rule: str, shares: Sequence[float], **kw) -> None:
        super().__init__(group, comm, **kw)
        self.rule = rule
        self.share = shares[group.rank()]  # the masters' group is in bundle order

    def compressed(self, index, buf, params, step):
        nbytes = buf.numel() * buf.element_size()
        self.wire.add(nbytes, nbytes)
        # Each bundle's share scaled to a whole-batch estimate before the rule compares them.
        mine = buf * self.share
        buf.copy_(aggregate.gather_and_combine(mine, self.group, self.rule, self.comm))
        return done(buf)


def make_hop(
    kind: str,
    group: dist.ProcessGroup,
    comm: Any,
    *,
    wire: Wire,
    powersgd_rank: int = 4,
    rule: str = "mean",
    shares: Sequence[float] = (),
    **kw: Any,
) -> Hop:
    """The hop for ``--grad-compression kind`` (``none``: exact, or robust for ``rule``)."""
    if kind in HALF:
        return HalfHop(group, comm, dtype=HALF[kind], wire=wire, **kw)
    if kind == "powersgd":
        return PowerSGDHop(group, comm, rank=powersgd_rank, wire=wire, **kw)
    if rule != "mean":
        return GatherHop(group, comm, rule=rule, shares=shares, wire=wire, **kw)
    return Hop(group, comm, wire=wire, **kw)
