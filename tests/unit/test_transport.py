"""bundle/engine/transport.py: what each call posts between stages of uneven widths, as data
(a fake ``post`` records the operations instead of moving them)."""

from __future__ import annotations

import pytest
import torch

from bundle.engine.transport import Boundaries, TensorMeta, Transport
from bundle.ir.schedule import Op
from bundle.topology import Coord, Topology

# Shape 3,2 (ranks 0-2 the front, 3-4 the rear), one bundle, one micro-batch of 12 rows:
# the front replicas hold rows 0-4, 4-8, 8-12; the rear ones 0-6 and 6-12.
TOPO = Topology(shape=(3, 2), num_bundles=1, procs_per_node=5, global_batch=12, micro_batches=1)
META = (TensorMeta((2,), torch.float32), TensorMeta((), torch.int64))  # a feature and an id


@pytest.fixture(autouse=True)
def _default_group(world_of_one):
    """Point-to-point operations are described against the default group."""


def _transport(stage: int, replica: int) -> tuple[Transport, list[list[tuple]]]:
    posted: list[list[tuple]] = []

    def post(ops, labels):
        names = labels()
        assert len(names) == len(ops)
        posted.append(
            [
                (o.op.__name__, o.peer, tuple(o.tensor.shape), n)
                for o, n in zip(ops, names, strict=True)
            ]
        )
        return []

    transport = Transport(
        topo=TOPO,
        coord=Coord(0, stage, replica),
        boundaries=Boundaries(
            inputs=META if stage == 1 else (), outputs=META if stage == 0 else ()
        ),
        device=torch.device("cpu"),
        timeout=1.0,
        post=post,
    )
    return transport, posted


def test_a_front_replica_sends_each_rear_replica_exactly_its_rows():
    front, posted = _transport(stage=0, replica=1)  # rows 4-8
    x = torch.arange(8.0).reshape(4, 2)
    ids = torch.arange(4, 8)
    front.send_act(12, (x, ids)).wait()
    assert posted == [
        [
            ("isend", 3, (2, 2), "send_act0 to rank 3"),  # rows 4-6
            ("isend", 3, (2,), "send_act0 to rank 3"),
            ("isend", 4, (2, 2), "send_act0 to rank 4"),  # rows 6-8
            ("isend", 4, (2,), "send_act0 to rank 4"),
        ]
    ]


def test_a_rear_replica_receives_its_rows_from_every_front_replica_holding_them():
    rear, posted = _transport(stage=1, replica=0)  # rows 0-6: 0-4 from rank 0, 4-6 from rank 1
    (bufs,) = rear.recv_act(12, slot=0).wait()
    assert [tuple(b.shape) for b in bufs] == [(6, 2), (6,)]
    assert posted == [
        [
            ("irecv", 0, (4, 2), "recv_act0 from rank 0"),
            ("irecv", 0, (4,), "recv_act0 from rank 0"),
            ("irecv", 1, (2, 2), "recv_act0 from rank 1"),
            ("irecv", 1, (2,), "recv_act0 from rank 1"),
        ]
    ]
    # Only floating-point tensors carry a gradient back.
    rear.send_grad(12, (torch.zeros(6, 2),)).wait()
    assert [(name, peer, shape) for name, peer, shape, _ in posted[1]] == [
        ("isend", 0, (4, 2)),
        ("isend", 1, (2, 2)),
    ]


def test_receive_buffers_are_kept_per_slot_and_reused():
    rear, _ = _transport(stage=1, replica=1)
    (a,) = rear.recv_act(12, slot=0).wait()
    (b,) = rear.recv_act(12, slot=1).wait()
    (again,) = rear.recv_act(12, slot=0).wait()
    assert all(x is y for x, y in zip(a, again, strict=True))
    assert all(x.data_ptr() != y.data_ptr() for x, y in zip(a, b, strict=True))


def test_one_call_posts_every_part_in_one_batch():
    front, posted = _transport(stage=0, replica=0)  # rows 0-4, all on rear replica 0 (rank 3)
    front.call(
        [
            (Op.SEND_ACT, 12, (torch.zeros(4, 2), torch.zeros(4, dtype=torch.int64)), 0),
            (Op.RECV_GRAD, 12, 0, 0),
        ]
    ).wait()
    assert [(name, peer, label) for name, peer, _, label in posted[0]] == [
        ("isend", 3, "send_act0 to rank 3"),
        ("isend", 3, "send_act0 to rank 3"),
        ("irecv", 3, "recv_grad0 from rank 3"),
    ]


def test_a_send_that_does_not_match_the_boundary_is_refused_before_posting():
    front, posted = _transport(stage=0, replica=0)
    with pytest.raises(TypeError, match="do not match the boundary"):
        front.send_act(12, (torch.zeros(4, 3), torch.zeros(4, dtype=torch.int64)))
    with pytest.raises(TypeError, match="do not match the boundary"):
        front.send_act(12, (torch.zeros(4, 2, dtype=torch.float64), torch.zeros(4)))
    assert posted == []


def test_post_with_torch_is_the_default():
    from bundle.engine.transport import post_with_torch

    t = Transport(
        topo=TOPO, coord=Coord(0, 0, 0), boundaries=Boundaries(outputs=META),
        device=torch.device("cpu"), timeout=1.0,
    )  # fmt: skip
    assert t._post_call is post_with_torch
