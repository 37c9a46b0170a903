"""bundle/engine/grad_sync.py: the hierarchical sync's buckets and the collectives it starts, with
a fake ``Comm`` that records each collective (no processes)."""

from __future__ import annotations

import torch
from torch import nn

from bundle.engine.grad_sync import HierarchicalSync
from bundle.engine.hops import HopGroups

BUNDLE, MASTERS = "bundle-group", "masters-group"  # stand-ins: only the fake reads them


class Done:
    """A finished collective on ``tensor``, as torch's ``Work`` (its future holds ``[tensor]``)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def wait(self, timeout=None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result([self.tensor])
        return fut


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, str]] = []

    def reduce(self, tensor, dst, group):
        self.calls.append(("reduce", tensor.numel(), group))
        tensor.mul_(3)  # as if three replicas had summed the same gradient
        return Done(tensor)

    def all_reduce(self, tensor, group):
        self.calls.append(("all_reduce", tensor.numel(), group))
        tensor.mul_(2)  # two bundles
        return Done(tensor)

    def broadcast(self, tensor, src, group):
        self.calls.append(("broadcast", tensor.numel(), group))
        return Done(tensor)


def _stage() -> nn.Module:
    torch.manual_seed(0)
    # 2*3+3 = 9, 3*4+4 = 16, 4*2+2 = 10 parameters per layer (weights and biases)
    return nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def _sync(bucket_mb: float, *, master: bool = True, masters: bool = True):
    comm = Recorder()
    stage = _stage()
    sync = HierarchicalSync(
        stage,
        groups=HopGroups(
            bundle_group=BUNDLE,
            bundle_master=0,
            masters_group=MASTERS if masters else None,
            is_master=master,
        ),
        bucket_mb=bucket_mb,
        comm=comm,
    )
    return sync, stage, comm


def _step(sync: HierarchicalSync, stage: nn.Module) -> None:
    out = stage(torch.ones(5, 2)).sum()
    sync.backward([out], None, last=True)
    sync.finish()


def test_buckets_follow_the_size_limit_in_reverse_registration_order():
    # Tiny buckets: a new bucket as soon as one holds any bytes, i.e. one per parameter, last first.
    sync, stage, _ = _sync(bucket_mb=1e-9)
    assert [b.numel() for b in sync.buffers] == [2, 8, 4, 12, 3, 6]
    # Large buckets: one for the whole stage.
    sync, _, _ = _sync(bucket_mb=25.0)
    assert [b.numel() for b in sync.buffers] == [35]
    # Every gradient is a view into exactly one bucket.
    sync, stage, _ = _sync(bucket_mb=1e-9)
    for p in stage.parameters():
        assert sum(p.grad.data_ptr() == b.data_ptr() for b in sync.buffers) == 1


def test_each_bucket_is_reduced_then_allreduced_then_broadcast_once():
    sync, stage, comm = _sync(bucket_mb=1e-9)
    _step(sync, stage)
    sizes = [2, 8, 4, 12, 3, 6]
    assert sorted(c for c in comm.calls if c[0] == "reduce") == sorted(
        ("reduce", n, BUNDLE) for n in sizes
    )
    assert [c for c in comm.calls if c[0] != "reduce"] == [
        *(("all_reduce", n, MASTERS) for n in sizes),
        *(("broadcast", n, BUNDLE) for n in sizes),
    ]


def test_the_sync_sums_never_averages():
    sync, stage, _ = _sync(bucket_mb=25.0)
    plain = _stage()
    plain(torch.ones(5, 2)).sum().backward()
    _step(sync, stage)
    for p, q in zip(stage.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad * 3 * 2)  # three replicas, two bundles


def test_a_replica_that_is_not_master_skips_the_masters_allreduce():
    sync, stage, comm = _sync(bucket_mb=25.0, master=False)
    _step(sync, stage)
    assert [c[0] for c in comm.calls] == ["reduce", "broadcast"]
    sync, stage, comm = _sync(bucket_mb=25.0, masters=False)  # one bundle: no masters' group
    _step(sync, stage)
    assert [c[0] for c in comm.calls] == ["reduce", "broadcast"]


def test_reduces_start_in_bucket_order_whatever_order_gradients_arrive_in():
    """On NCCL the n-th reduce of every member must be the same bucket's: a replica whose
    backward produces gradients in another order (data-dependent branches) launches alike."""
    sizes = [2, 8, 4, 12, 3, 6]  # bucket 0 holds the last parameter
    for arrival in ("last parameter first", "first parameter first"):
        sync, stage, comm = _sync(bucket_mb=1e-9)
        params = list(stage.parameters())
        built = params if arrival == "last parameter first" else params[::-1]
        out = torch.zeros(())
        for p in built:  # autograd runs the latest-built branch first
            out = out + (p * 1.0).sum()
        sync.backward([out], None, last=True)
        if arrival == "first parameter first":  # bucket 0 was ready last: nothing ran ahead
            assert [c[1] for c in comm.calls if c[0] == "reduce"] == sizes
        sync.finish()
        assert [c[1] for c in comm.calls if c[0] == "reduce"] == sizes, arrival
