"""The training loop's checkpoint component: when to save, what one rank saves, and resume.

Every rank takes part in every save and load (DCP is collective over the control group). Before a
save, the replicas of each stage compare a checksum of their parameters and optimizer state, so
the one copy DCP keeps of a replicated entry can never come from a drifted replica.

With ``--async-save`` a save copies the state to memory and returns; DCP writes it from a thread,
over a gloo group of its own (the training thread keeps using the others), and the checkpoint is
published (``bundle.json``, renamed from ``step-N.tmp``) when the next save begins or the run ends.

What a rank writes follows the sync: with ``--zero 1`` each replica writes the optimizer state
of the parameters it owns (keys are per parameter, so any shape reads them); with
``--bundle-sync local|diloco`` bundles differ between meetings, so bundle b > 0 writes its
parameters and optimizer state under ``bundle.<b>.`` (a bundle reads its own where the checkpoint
has them, else bundle 0's), the outer state under ``outer.`` and PowerSGD's error feedback per
rank under ``replica.<rank>.hop.`` (read back at the same layout only).

A save that cannot complete (a full disk, a permission or I/O error) leaves the checkpoints before
it as they were: ``step-N.tmp`` is removed and every rank raises one ``CheckpointError`` naming the
directory and the cause. Before writing, the ranks add up what the save will write and refuse it
if the filesystem has less free (nothing written).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from bundle import log
from bundle.checkpoint import format as ckpt
from bundle.checkpoint import split_state
from bundle.checkpoint.parts import RankParts, SaveSettings, optimizer_slots
from bundle.checkpoint.state import RankState
from bundle.collectives.comm import Collectives, Comm
from bundle.engine.sharded import is_sharded
from bundle.errors import CheckpointError
from bundle.runtime.groups import ProcessGroups
from bundle.topology import Coord, Topology

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Room kept free beyond a save's own bytes (DCP's index, bundle.json, filesystem blocks).
_MARGIN = 1.05
_MARGIN_BYTES = 64 << 10
_MIB = 1 << 20


def _save_errors() -> tuple[type[BaseException], ...]:
    """What a failed save or load raises: DCP's own exception is a BaseException. (Read where
    it is caught, by which time DCP is imported: it is not at start-up, see ckpt.safe_reader.)"""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """Integer sum of the tensor's bit patterns: equal tensors agree whatever the summation order."""
    flat = t.detach().contiguous().view(-1)
    return flat.view(_BITS[flat.element_size()]).sum(dtype=torch.int64)


class Checkpointer:
    """``restore(path) -> step`` once before training; ``maybe_save(step)`` after every step.

    A save is due on the ``--save-every`` cadence (an epoch by default), after the run's last step
    (``total``) and when the job stops for a signal. ``before_save`` holds what must happen just
    before one (the reporter closes its loss window, the process names its phase).
    """

    def __init__(
        self,
        saving: SaveSettings,
        *,
        topo: Topology,
        coord: Coord,
        rank: int,
        parts: RankParts,
        groups: ProcessGroups,
        comm: Comm | None = None,
    ) -> None:
        """``comm`` carries the agreement on the stage's (NCCL) group; ``groups.control`` and
        ``groups.async_save`` are gloo groups."""
        self.topo, self.coord, self.rank, self.parts = topo, coord, rank, parts
        self.cfg, self.settings, self.every = saving.config, saving.settings, saving.every
        self.total = saving.total
        self.comm = comm or Collectives()
        self.stage, self.group, self.async_group = parts.stage, groups.control, groups.async_save
        # The optimizer holding this rank's state; sharded: of the parameters it owns only.
        self.rank_state = RankState(parts)
        self.optimizer = self.rank_state.optimizer
        self.sharded = self.optimizer is not parts.optimizer
        # Sharded inside each bundle (--fault-tolerance bundle), not over the whole stage group:
        # every bundle holds each shard once, and bundle 0's owners count it.
        over = getattr(parts.optimizer, "world_size", 0)  # processes a ZeRO state is sharded over
        self.shards_per_bundle = self.sharded and over < len(topo.stage_group(coord.stage))
        self.owned = self.rank_state.owned
        self.outer, self.hop = parts.outer, parts.hop
        # Bundles that meet every H steps differ between meetings: each saves its own state.
        self.prefix = f"bundle.{coord.bundle}." if parts.outer is not None and coord.bundle else ""
        # Replicas to agree with (all of the stage's, or the bundle's own): None where none.
        if self.outer is not None:
            self.stage_group = groups.bundle if topo.shape[coord.stage] > 1 else None
        else:
            replicated = len(topo.stage_group(coord.stage)) > 1
            self.stage_group = groups.stage if replicated else None
        self.before_save: list[Callable[[int], None]] = []
        # What else bundle.json records of step N, on rank 0 (a stream's position: bundle.data).
        self.records: list[Callable[[int], dict]] = []
        self.canonical = coord.bundle == 0 and coord.replica == 0
        # Entries the same on every rank (the loss scale), saved and restored in place.
        self.extra = parts.extra
        # An asynchronous save in flight: its future (DCP's), step-N.tmp, step-N, N, records.
        self.pending: tuple[Any, str, str, int, dict] | None = None
        self.stalls: list[float] = []
        self.last_saved: str | None = None
        # The size of the last checkpoint written (known to rank 0, which publishes; 0 elsewhere):
        # the next one needs about as much room.
        self.last_bytes = 0

    # -- what this rank holds ----------------------------------------------------------------

    def _buffer_key(self, name: str) -> str:
        return f"model.{name}" if self.canonical else f"replica.{self.rank}.{name}"

    def state(self) -> dict[str, torch.Tensor]:
        """This rank's entries (``RankState``'s parts), keyed as the checkpoint stores them."""
        parts, pre = self.rank_state.state_dict(), self.prefix
        if self.parts.split is not None:
            parts = split_state.whole_state(parts, self.parts.split)
        out = {f"{pre}model.{name}": p for name, p in parts["model"].items()}
        out.update({f"{pre}optim.{key}": v for key, v in parts["optim"].items()})
        out.update({self._buffer_key(name): b for name, b in parts["buffers"].items()})
        out.update({f"outer.{key}": v for key, v in parts["outer"].items()})
        out.update({f"{self._hop_key}{key}": v for key, v in parts["hop"].items()})
        out.update(parts["extra"])
        out.update({f"base.{name}": d for name, d in self.parts.base_digests().items()})
        return out

    @property
    def _hop_key(self) -> str:
        return f"replica.{self.rank}.hop."

    def _writes(self, key: str) -> bool:
        """Whether DCP's one copy of ``key`` is this rank's to count (see _check_room)."""
        if key.startswith("replica."):
            return True
        if self.sharded and key.startswith("optim."):
            return not self.shards_per_bundle or self.coord.bundle == 0  # its owner holds it
        if key.startswith("bundle."):
            return self.coord.replica == 0
        return self.canonical

    # -- saving ------------------------------------------------------------------------------

    def due(self, step: int, *, stopping: bool = False) -> bool:
        """Whether to save after ``step``: on the cadence, at the end, or when the job stops."""
        return bool(self.cfg.save_dir) and (
            stopping or step % self.every == 0 or step == self.total
        )

    def maybe_save(self, step: int, *, stopping: bool = False) -> bool:
        """Save after ``step`` if a save is due (collective: every rank decides alike); a save
        at the end or for a stop is complete on disk on return. Whether it saved."""
        if not self.due(step, stopping=stopping):
            return False
        for hook in self.before_save:
            hook(step)
        self.save(step, block=stopping or step == self.total)
        return True

    def _agree(self, state: dict[str, torch.Tensor], step: int) -> None:
        """Replicas must hold the same parameters and optimizer state (not buffers: BatchNorm
        statistics differ between replicas by design)."""
        if self.stage_group is None:
            return
        params = {f"{self.prefix}model.{name}" for name in self.parts.params()}
        optim = f"{self.prefix}optim."
        # Sharded optimizer state differs between replicas by design: parameters only (under
        # --zero 3 neither: each replica holds its own shards).
        names = [
            k
            for k in state
            if (k in params or k.startswith("outer.") or (k.startswith(optim) and not self.sharded))
            and not is_sharded(state[k])
        ]
        if not names:
            return
        # One device for every checksum: an optimizer's step counts stay on the host (torch keeps
        # Adam's ``step`` on the CPU unless fused or capturable) while parameters are on the GPU,
        # and the stage group's all-reduce is NCCL's there.
        device = self.parts.device
        sums = torch.stack([_checksum(state[k]).to(device) for k in names])
        lo, hi = sums.clone(), sums.clone()
        self.comm.all_reduce(lo, self.stage_group, op=dist.ReduceOp.MIN).wait()
        self.comm.all_reduce(hi, self.stage_group, op=dist.ReduceOp.MAX).wait()
        differ = (lo != hi).nonzero().flatten().tolist()
        if differ:
            raise CheckpointError(
                f"replicas of stage {self.coord.stage} disagree after step {step} "
                f"({len(differ)} entries, e.g. {names[differ[0]]}); no checkpoint written"
            )

    def save(self, step: int, *, block: bool = True) -> None:
        """Write ``step-N`` (collective); with ``block``, it is complete on disk on return.

        The time training waits for it is appended to ``stalls`` (an asynchronous save's wait for
        its writes, where training has to wait, is added to its own entry).
        """
        self.wait()
        t0 = time.perf_counter()
        final = ckpt.step_dir(self._save_dir, step)
        tmp = final + ".tmp"
        state = self.state()
        self._agree(state, step)
        self._check_room(state, final)
        notes = {k: v for record in self.records for k, v in record(step).items()}
        failure: BaseException | None = None
        if self.rank == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
            except OSError as exc:
                failure = exc
        self._all_or_none(failure, tmp, final)
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(tmp)
        if self.async_group is None:
            try:  # DCP raises on every rank when one rank's writes failed
                dcp.save(state, storage_writer=writer, process_group=self.group)
                self._publish(tmp, final, step, notes)
            except _save_errors() as exc:
                failure = exc
            self._all_or_none(failure, tmp, final)
        else:
            future = dcp.async_save(state, storage_writer=writer, process_group=self.async_group)
            if self.rank == 0:  # the checksums too are computed off the training thread
                future = _then(future, lambda: ckpt.file_records(tmp))
            self.pending = (future, tmp, final, step, notes)
        self.stalls.append(round(time.perf_counter() - t0, 4))
        if block:
            self.wait()

    def _check_room(self, state: dict[str, torch.Tensor], final: str) -> None:
        """Refuse a save the filesystem has no room for, before writing anything (collective).

        DCP keeps one copy of an entry replicas share: the canonical replica of each stage
        counts its entries, every other rank its own buffers (and its owned optimizer state
        with --zero 1, its bundle's entries on replica 0 with --bundle-sync local|diloco);
        rank 0 adds the free space and the last checkpoint's size.
        """
        mine = sum(t.numel() * t.element_size() for k, t in state.items() if self._writes(k))
        free = shutil.disk_usage(_existing(self._save_dir)).free if self.rank == 0 else 0
        sums = torch.tensor([mine, free, self.last_bytes], dtype=torch.int64)
        dist.all_reduce(sums, group=self.group)  # every rank decides alike
        need, free = max(int(sums[0]), int(sums[2])), int(sums[1])
        if free < need * _MARGIN + _MARGIN_BYTES:
            raise CheckpointError(
                f"cannot save {final}: it needs about {need / _MIB:.1f} MiB and "
                f"{self._save_dir} has {free / _MIB:.1f} MiB free (no space left on device); "
                "nothing written"
            )

    def _all_or_none(self, failure: BaseException | None, tmp: str, final: str) -> None:
        """Every rank learns whether any rank's part of a save failed; if one did, rank 0 removes
        ``step-N.tmp`` and every rank raises the same one-line error (collective)."""
        said: list[str | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(
            said, None if failure is None else ckpt.cause_of(failure), group=self.group
        )
        causes = [c for c in said if c is not None]
        if not causes:
            return
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"cannot save {final}: {causes[0]}; earlier checkpoints untouched"
        ) from failure

    @property
    def _save_dir(self) -> str:
        if not self.cfg.save_dir:
            raise CheckpointError("a checkpoint save without --save-dir")
        return self.cfg.save_dir

    def poll(self) -> None:
        """Between steps: finish an asynchronous save whose writes are done (no collective)."""
        if self.pending is not None and self.pending[0].done():
            self._collect()

    def wait(self) -> None:
        """Let an asynchronous save in flight finish; on return it is complete on disk."""
        if self.async_group is None:
            return
        t0 = time.perf_counter()
        waited = self.pending is not None
        if waited:
            self._collect()
        # Every rank calls wait at the same points, pending or not, so this barrier pairs up.
        dist.barrier(group=self.group)
        if waited:
            self.stalls[-1] = round(self.stalls[-1] + time.perf_counter() - t0, 4)

    def _collect(self) -> None:
        """The asynchronous save's writes are done (or failed: raise): publish it.

        DCP's coordinator (rank 0) writes ``.metadata`` after every rank's data, so once rank 0's
        save has returned the checkpoint is whole, whatever the other ranks are doing.
        """
        if self.pending is None:
            return
        future, tmp, final, step, notes = self.pending
        self.pending = None
        try:
            files = future.result()  # raises what the writer raised (on every rank: DCP gathers)
            self._publish(tmp, final, step, notes, files)
        except _save_errors() as exc:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(
                f"cannot save {final}: {ckpt.cause_of(exc)}; earlier checkpoints untouched"
            ) from exc

    def _publish(
        self, tmp: str, final: str, step: int, notes: dict, files: dict | None = None
    ) -> None:
        """Rank 0 adds bundle.json and renames step-N.tmp to step-N; older ones are pruned."""
        if self.rank == 0:
            ckpt.publish(tmp, final, {**self.settings, **notes, "step": step}, files)
            self.last_bytes = ckpt.size_of(final)
            ckpt.prune(self._save_dir, self.cfg.keep)
        self.last_saved = final

    # -- resuming ----------------------------------------------------------------------------

    def restore(self, path: str | None) -> int:
        """Load this rank's entries from checkpoint ``path`` (None: fresh); returns its step."""
        info = ckpt.read_info(path) if path else {"step": 0}
        step = int(info["step"])
        self._same_everywhere(step, path)
        if path is None:
            return 0
        stored = ckpt.entries(path)
        same_layout = info.get("layout") == self.settings["layout"]
        params = self.parts.params()
        # A bundle's own entries where the checkpoint has them (local/diloco), else bundle 0's.
        pre = self.prefix if any(k.startswith(self.prefix) for k in stored) else ""
        want = {f"{pre}model.{name}": p.detach() for name, p in params.items()}
        owned = {n: p for n, p in params.items() if id(p) in self.owned}
        optim_state = optimizer_slots(owned, stored, want, pre)
        split = self.parts.split
        live = split_state.whole_targets(want, stored, split, pre) if split else {}
        for name, b in self.parts.buffers().items():
            mine = self._buffer_key(name)
            want[mine if same_layout and mine in stored else f"model.{name}"] = b
        # A checkpoint of a run without them (another precision) leaves their initial values.
        want.update({k: v for k, v in self.extra.items() if k in stored})
        outer = self.outer.state() if self.outer is not None else {}
        resumes_outer = bool(outer) and all(k in stored for k in outer)
        if resumes_outer:
            want.update(outer)
        hop_state = {
            k: torch.zeros(shape, dtype=dtype, device=self.parts.device)
            for k, (shape, dtype) in stored.items()
            if self.hop is not None and same_layout and k.startswith(self._hop_key)
        }
        want.update(hop_state)
        digests = self.parts.base_digests()
        base = {f"base.{n}": torch.zeros_like(d) for n, d in digests.items()}
        want.update(base)
        missing = sorted(k for k in want if k not in stored)
        if missing:
            raise CheckpointError(f"{path} lacks {len(missing)} entries, e.g. {missing[:3]}")
        try:  # verified before start; a file changed since then is still one line, not a traceback
            import torch.distributed.checkpoint as dcp

            dcp.load(want, storage_reader=ckpt.safe_reader(path), process_group=self.group)
        except _save_errors() as exc:
            raise CheckpointError(f"cannot load {path}: {ckpt.cause_of(exc)}") from exc
        changed = [n for n, d in digests.items() if not torch.equal(base[f"base.{n}"], d)]
        if changed:
            raise CheckpointError(
                f"--resume {path}: the frozen base differs from the one its adapters were "
                f"trained on ({len(changed)} tensors of stage {self.coord.stage}, e.g. "
                f"{changed[0]}); give the same --pretrained, --weights and --seed"
            )
        if split is not None:
            split_state.take_shards(want, live, optim_state, params, split, pre)
        for p, slots in optim_state.items():
            self.optimizer.state[p].update(slots)
        if self.outer is not None and not resumes_outer:
            self.outer.restart()
        if self.hop is not None:
            names = {p: n for n, p in params.items()}
            n = len(self._hop_key)
            self.hop.load({k[n:]: v for k, v in hop_state.items()}, names)
        layout = "" if same_layout else f", written at {_describe(info.get('layout'))}"
        log.get().info(f"resumed from {path} (step {step}{layout})")
        return step

    def _same_everywhere(self, step: int, path: str | None) -> None:
        """Every rank must start from the same step (a --save-dir every node sees)."""
        ends = torch.tensor([step, -step])
        dist.all_reduce(ends, op=dist.ReduceOp.MAX, group=self.group)
        if ends[0] != step or -ends[1] != step:
            raise CheckpointError(
                f"ranks start from different steps ({-int(ends[1])}..{int(ends[0])}; this one from "
                f"{path or 'scratch'}): --save-dir must be one filesystem every node sees"
            )


def _existing(path: str) -> str:
    """``path``, or its nearest ancestor that exists (the first save creates the directory)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _then(first: Any, then: Callable[[], Any]) -> Future:
    """A future of ``then()``, run on a thread of its own once ``first`` has succeeded."""
    out: Future = Future()

    def run() -> None:
        try:
            first.result()
            out.set_result(then())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever collects the save
            out.set_exception(exc)

    threading.Thread(target=run, name="bundle-checksums", daemon=True).start()
    return out


def _describe(layout: Any) -> str:
    if not layout:
        return "an unknown layout"
    shape = ",".join(map(str, layout["shape"]))
    shape += f" tensor-parallel {','.join(map(str, layout['tp']))}" if layout.get("tp") else ""
    return f"shape {shape} x {layout['num_bundles']} bundle(s), stages at {', '.join(layout['stages'])}"
