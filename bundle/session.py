"""One rank's session, built once: its stage cut from the model, its process groups, gradient
sync, transport, optimizer and engine, and the data it reads."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch

from bundle import data
from bundle.checkpoint import format as ckpt
from bundle.checkpoint.manager import Checkpointer
from bundle.checkpoint.parts import RankParts, SaveSettings
from bundle.collectives import device_audit, nccl_emu
from bundle.collectives.comm import Collectives, Comm
from bundle.config import RunConfig
from bundle.data import loader
from bundle.engine import compiled, data_parallel, precision, ties
from bundle.engine.loss import Loss, cross_entropy
from bundle.engine.optim import make_optimizer
from bundle.engine.parts import Chunk, EngineParts, MicroBatch, StepOptions
from bundle.engine.precision import Policy
from bundle.engine.stage import Stage, joined
from bundle.engine.stage_engine import StageEngine
from bundle.engine.stages import Pieces, boundary_metas, build_stages, lora_record
from bundle.engine.tensor_parallel import Split, tensor_parallel_post
from bundle.engine.transport import Transport, post_with_torch
from bundle.ir.schedule import REGISTRY
from bundle.models.cut import Capture
from bundle.observe import timing
from bundle.runtime.devices import resolve_backend
from bundle.runtime.groups import ProcessGroups
from bundle.topology import Coord, Topology


@dataclass(frozen=True)
class Layout:
    """Where the stages of a run begin and how wide they are (a checkpoint records it)."""

    shape: list[int]
    num_bundles: int
    stages: list[str]  # the first block of each stage
    tp: list[int] = field(default_factory=list)  # each stage's TP degree; [] : none

    def as_dict(self) -> dict[str, object]:
        """As ``bundle.json`` records it (``tp`` only where a run has tensor parallelism)."""
        return {k: v for k, v in asdict(self).items() if k != "tp" or v}


@dataclass
class Session:
    """Everything one process built for training: its stage, engine, groups and data."""

    engine: StageEngine
    stage: Stage
    splits: data.DataSplits
    coord: Coord
    groups: ProcessGroups
    optimizer: torch.optim.Optimizer
    layout: Layout
    comm: Comm  # the collectives of its NCCL groups (bundle.collectives.comm)
    # Its stage's layers split over its replica's processes (tensor parallelism; degree 1: none)
    split: Split = field(default_factory=lambda: Split(0, 1))


def _emulator(
    cfg: RunConfig,
    backend: str,
    topo: Topology,
    rank: int,
    abort: Callable[[], str | None] | None,
) -> nccl_emu.Emulator | None:
    """Under nccl-emu, the session's emulated NCCL (its collectives, on an emulated device)."""
    if backend != "nccl-emu":
        return None
    return nccl_emu.for_session(cfg.launch, rank, topo.describe, abort)


def build_session(
    cfg: RunConfig,
    topo: Topology,
    rank: int,
    device: torch.device,
    *,
    arrive: Callable[[str], None] | None = None,
    capture: Capture | None = None,
    abort: Callable[[], str | None] | None = None,
) -> Session:
    """Build this rank's stage, groups, gradient sync, transport, optimizer and engine.

    ``arrive(name)``, when given, waits (with the start-up timeout) until every process reaches
    the same point, so uneven start-up is never charged to the per-operation ``--timeout``.
    Under nccl-emu the rank's ``device`` is the emulated GPU (bundle.collectives.device_audit).
    ``capture``: the model's graph split made by the launch's checks (None: cut here).
    ``abort``: under nccl-emu, asked while a call waits (bundle.collectives.nccl_emu.Emulator).
    """
    arrive = arrive or (lambda name: None)
    backend = resolve_backend(cfg)
    emu = _emulator(cfg, backend, topo, rank, abort)
    comm: Comm = emu if emu is not None else Collectives()
    device = device_audit.MARK if emu is not None else device
    coord = topo.coord(rank)
    S, V = topo.num_stages, cfg.parallel.virtual_stages
    splits = data.load(cfg.data, cfg.train.seed, needs_val=cfg.train.eval)
    # The model in S x V pieces; this rank runs (and gives memory to) its chunks' pieces only.
    pipe = REGISTRY[cfg.parallel.schedule].pipe(S, V)
    keep = {pipe.piece(coord.stage, c) for c in range(V)}
    split = Split(coord.tp, topo.tp_of(coord.stage))
    stages = _stages(cfg, S * V, splits, capture, keep, split)
    frozen = 0 if V > 1 else frozen_front(stages)
    tied = ties.find(stages)
    tied = tied if V == 1 else ties.by_stage(tied, lambda j: pipe.place(j)[0])
    policy = Policy.of(cfg.compute, device)
    metas = boundary_metas(stages, splits.input_shape, policy, splits.inputs)
    layout = Layout(list(topo.shape), topo.num_bundles, [s.names[0] for s in stages], list(topo.tp))
    own = [policy.prepare_stage(stages[pipe.piece(coord.stage, c)].to(device)) for c in range(V)]
    if cfg.compute.compile:  # before --zero 3 shards them: FSDP's hooks run around each block
        own = [compiled.compile_blocks(piece, cfg.compute.compile_backend) for piece in own]
    # What the checkpoint and the optimizer see: every chunk's blocks (one of them, without
    # interleaving).
    stage = own[0] if V == 1 else joined(own)
    del stages
    if device.type == "cuda":
        precision.set_tf32(cfg.compute.tf32)
    arrive("model built")
    groups = data_parallel.process_groups(cfg, topo, coord)
    if groups.tp is not None:
        split.bind(comm, groups.tp)
    chunks = _chunks(cfg, topo, coord, Pieces(pipe, own, metas), groups, device, comm, emu)
    optimizer = make_optimizer(
        cfg.train, stage, shard_over=data_parallel.shard_group(cfg, topo, coord, groups), comm=comm
    )
    engine = StageEngine(
        topo=topo,
        coord=coord,
        parts=EngineParts(
            chunks=tuple(chunks),
            optimizer=optimizer,
            outer=data_parallel.make_outer(
                cfg, topo, coord, stage, groups, chunks[0].sync.wire, comm
            ),
            ties=data_parallel.make_ties(cfg, topo, coord, stage, comm, tied),
        ),
        options=StepOptions(
            schedule=cfg.parallel.schedule,
            policy=policy,
            # The skip decision spans the job: the default group holds every rank.
            scaler=policy.make_scaler(device, comm=comm),
            loss=make_loss(cfg),
            # gloo alone lets a receive progress on its own: there it is posted ahead (bundle.ir.p2p).
            early_receives=backend == "gloo",
            frozen=frozen,
        ),
        device=device,
        timer=timing.make_timer(device),
    )
    arrive("ready to train")
    return Session(engine, stage, splits, coord, groups, optimizer, layout, comm, split)


def _stages(
    cfg: RunConfig,
    pieces: int,
    splits: data.DataSplits,
    capture: Capture | None,
    keep: set[int],
    split: Split,
) -> list[Stage]:
    """The model cut into ``pieces`` (``build_stages``) for the data's input."""
    shape, classes = splits.input_shape, splits.num_classes
    return build_stages(
        cfg, pieces, shape, classes, capture, keep=keep, inputs=splits.inputs, split=split
    )


def frozen_front(stages: list[Stage]) -> int:
    """How many stages from the front have nothing to train (a frozen embedding before the
    adapters, a piece that only reshapes): no gradient needs to reach them (bundle.ir.p2p)."""
    n = 0
    while n < len(stages) - 1 and not any(p.requires_grad for p in stages[n].parameters()):
        n += 1
    return n


def _chunks(
    cfg: RunConfig,
    topo: Topology,
    coord: Coord,
    mine: Pieces,
    groups: ProcessGroups,
    device: torch.device,
    comm: Comm,
    emu: nccl_emu.Emulator | None,
) -> list[Chunk]:
    """This rank's model chunks (one without interleaving), each one of its pieces with its own
    gradient sync (built in chunk order on every replica: collective) and transport."""
    out = []
    pipe = mine.pipe
    for c, piece in enumerate(mine.modules):
        transport = Transport(
            topo=topo,
            coord=coord,
            boundaries=mine.boundaries(pipe.piece(coord.stage, c)),
            device=device,
            timeout=cfg.launch.timeout,
            post=tensor_parallel_post(
                emu.batch_isend_irecv if emu is not None else post_with_torch, topo, coord
            ),
            chunk=c,
            pipe=pipe,
        )
        sync = data_parallel.make_sync(cfg, topo, coord, piece, groups, device, comm)
        out.append(Chunk(piece, sync, transport))
    return out


def param_counts(session: Session) -> tuple[int, int]:
    """The whole model's parameters that train, and all of them (PEFT's counts): each stage
    counted by its first replica of bundle 0 (collective over the job's control group)."""
    coord = session.coord
    counts = torch.zeros(2, dtype=torch.float64)
    if coord.bundle == 0 and coord.replica == 0:
        # Under tensor parallelism each process holds its shards; whole tensors count once.
        split = {id(p) for p in session.split.params(session.stage)} if coord.tp else set()
        for p in session.stage.parameters():
            if coord.tp == 0 or id(p) in split:
                counts[0 if p.requires_grad else 1] += p.numel()
        counts[1] += counts[0]
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(counts, group=session.groups.control)
    return int(counts[0]), int(counts[1])


def make_loss(cfg: RunConfig) -> Loss:
    """``--loss module:function``, else cross-entropy (with ``--label-smoothing``)."""
    if cfg.model.loss:
        from bundle.models import load_callable

        return load_callable(cfg.model.loss, "--loss")
    return cross_entropy(cfg.train.label_smoothing)


def shard(topo: Topology, coord: Coord, micro_batches: int, *, job_rows: bool = True) -> data.Shard:
    """This replica's rows of every batch: of the job's bundle it stands for (``job_rows``; the
    training batches, whose rows a bundle keeps when another leaves), or of this layout's."""
    whole = topo.whole if job_rows else topo
    return data.Shard(
        num_bundles=whole.num_bundles,
        micro_batches=micro_batches,
        width=topo.stage_weights(coord.stage),
        bundle=topo.job_bundle(coord.bundle) if job_rows else coord.bundle,
        replica=coord.replica,
    )


def pins(device: torch.device | None) -> bool:
    """Pinned batches only for a CUDA process: pinning opens a CUDA context even on gloo."""
    return device is not None and device.type == "cuda"


def reads_data(topo: Topology, coord: Coord, stage: Stage) -> bool:
    """Stage 0 reads inputs (and labels), the loss's stage labels, a stage whose pieces read
    named inputs (models.inputs) those; the others read nothing."""
    return coord.stage in (0, topo.loss_stage) or bool(stage.side)


def train_stream(
    session: Session,
    topo: Topology,
    seed: int,
    total: int,
    workers: int,
    *,
    start: int = 0,
    device: torch.device | None = None,
    position: dict | None = None,
) -> Iterator[list[MicroBatch] | None]:
    """Per step, this replica's M micro-batches: inputs on stage 0, labels on the last stage.

    The loader pins its batches only for a CUDA ``device``. A stream (``--dataset hf``) goes on
    from ``position``, what the checkpoint resumed from recorded of it (None: from its start).
    """
    coord = session.coord
    if not reads_data(topo, coord, session.stage):
        while True:
            yield None
    train, rows, batch = (
        session.splits.train,
        shard(topo, coord, topo.micro_batches),
        topo.whole.global_batch,
    )
    if hasattr(train, "seek"):
        train.seek(start * batch, position, batch)
        lists = data.stream_indices(rows, batch, total, start=start)
    else:
        lazy = getattr(train, "lazy_order", False)
        lists = data.replica_indices(
            rows, data.size(train), batch, seed, total, start=start, lazy=lazy
        )
    stream = loader.stage_micro_batches(
        session.splits.train,
        lists,
        first=coord.stage == 0,
        workers=workers,
        pin_memory=pins(device),
        side=session.stage.side,
    )
    while True:
        yield [next(stream) for _ in range(topo.micro_batches)]


# -- what a checkpoint of this session records ----------------------------------------------------


def checkpoint_settings(cfg: RunConfig, session: Session) -> dict[str, object]:
    """What a checkpoint records of the run that wrote it (checked again on resume).

    A ``transformers`` model's class and config are recorded as data (``hf_config``), so the
    step alone rebuilds it (``--hf`` export, ``bundle.generate``). The stages hold pieces of the
    model's graph, not the model: it is built again here on the meta device (no memory), as
    the run built it, once per process and only when the run saves."""
    hf = None
    if cfg.checkpoint.save_dir and cfg.model.name.startswith("transformers:"):
        from bundle.checkpoint import hf_export

        hf = hf_export.record_for(
            cfg.model.name,
            num_classes=session.splits.num_classes,
            input_shape=tuple(session.splits.input_shape),
            args=cfg.model.kwargs,
            config_file=cfg.model.config_file,
            pretrained=cfg.model.pretrained,
        )
    lora = None
    if cfg.checkpoint.save_dir and cfg.model.lora:
        lora = lora_record(cfg, tuple(session.splits.input_shape), session.splits.num_classes)
    return {
        **ckpt.run_settings(cfg),
        **data.identity(cfg.data),
        "format": ckpt.FORMAT,
        "num_classes": session.splits.num_classes,
        "input_shape": list(session.splits.input_shape),
        "layout": session.layout.as_dict(),
        "torch": torch.__version__,
        **({"hf_config": hf} if hf else {}),
        **({"lora_adapters": lora} if lora else {}),
    }


def make_checkpointer(
    cfg: RunConfig, topo: Topology, rank: int, session: Session, *, total: int = 0
) -> Checkpointer:
    """This rank's checkpointer; ``total`` (the run's last step) is always saved when given."""
    scaler = session.engine.scaler
    checkpointer = Checkpointer(
        SaveSettings(
            config=cfg.checkpoint,
            settings=checkpoint_settings(cfg, session),
            steps_per_epoch=data.epoch_steps(
                session.splits.train, cfg.train.batch_size, cfg.train.steps
            ),
            total=total,
        ),
        topo=topo,
        coord=session.coord,
        rank=rank,
        parts=RankParts(
            stage=session.stage,
            optimizer=session.optimizer,
            outer=session.engine.outer,
            hop=session.engine.sync.hop,
            extra=scaler.state() if scaler else {},
            frozen_base=cfg.model.lora is not None,
            split=session.split if session.split.specs else None,
        ),
        groups=session.groups,
        comm=session.comm,
    )
    train = session.splits.train
    if rank == 0 and hasattr(train, "position"):  # rank 0 reads the stream: it says where it is
        rows = topo.whole.global_batch
        checkpointer.records.append(lambda step: {"data_position": train.position(step * rows)})
    return checkpointer
