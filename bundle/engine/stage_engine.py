"""The per-step engine of one replica of one stage: its schedule's actions, the point-to-point
calls they make, the gradient sync and the optimizer step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bundle.engine.loss import EVAL_COUNTS, as_float, classifies, cross_entropy, top_k_correct
from bundle.engine.memory import SavedBytes
from bundle.engine.parts import (
    Chunk,
    EngineParts,
    MicroBatch,
    StepHooks,
    StepOptions,
    given_batch,
    given_labels,
)
from bundle.engine.precision import Policy
from bundle.engine.split_backward import Held, input_half, weight_half
from bundle.engine.stage import Stage
from bundle.engine.stages import boundary_metas, build_stages
from bundle.engine.transport import Part, Pending, Transport, post_call
from bundle.ir.p2p import RECVS, step_plan
from bundle.ir.schedule import (
    REGISTRY,
    RELEASES,
    Action,
    Op,
    Pipe,
    peak_in_flight,
    unknown,
)
from bundle.observe.timing import Mark, StepTimer, last_mark
from bundle.topology import Coord, Topology

# Callers name these by this module, where they lived first.
__all__ = ["Chunk", "MicroBatch", "StageEngine", "boundary_metas", "build_stages"]


@dataclass
class _StepState:
    """What one training step keeps between its actions, per micro-batch (of one chunk)."""

    loss_sum: torch.Tensor
    inputs: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    outputs: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    grads: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    # What a backward's input half kept for its weight half (zero-bubble schedules).
    held: dict[int, Held] = field(default_factory=dict)


class StageEngine:
    """Runs training steps and evaluation passes of one replica through the pipeline schedule."""

    def __init__(
        self,
        *,
        topo: Topology,
        coord: Coord,
        parts: EngineParts,
        options: StepOptions,
        device: torch.device,
        timer: StepTimer | None = None,
    ) -> None:
        """``parts``: the replica's model chunks (the first one's stage, sync and transport are
        ``stage``, ``sync`` and ``transport`` here), its optimizer and the syncs after it."""
        first = parts.chunks[0]
        self.topo, self.coord, self.sync, self.transport = topo, coord, first.sync, first.transport
        # Bundles that meet every H steps (--bundle-sync local/diloco) meet after the step.
        self.outer = parts.outer
        # Weights this stage shares with another stage: their gradients summed after the sync.
        self.ties = parts.ties
        self.optimizer, self.device, self.stage = parts.optimizer, device, first.stage
        self.policy = options.policy or Policy(device_type=device.type)
        self.scaler = options.scaler
        # The micro-batch's mean, scaled by rows / global batch below: the global mean, shared out.
        self.loss = options.loss or cross_entropy()
        self.chunks = list(parts.chunks)
        V, S = len(self.chunks), topo.num_stages
        self._place(REGISTRY[options.schedule].pipe(S, V), coord.stage)
        self.sizes = topo.micro_sizes(coord.bundle)
        # The calls of a step and where each is posted (bundle.ir.p2p).
        self.plan = step_plan(
            options.schedule,
            coord.stage,
            S,
            topo.micro_batches,
            chunks=V,
            early_receives=options.early_receives,
            frozen=options.frozen,
        )
        self.actions = list(self.plan.actions)
        # A chunk that sends no gradient back needs none of its input's; one that runs no
        # backward (a frozen stage before the first that trains) keeps no activations for one.
        self.input_grads = [
            any(a.op is Op.SEND_GRAD and a.chunk == c for a in self.actions) for c in range(V)
        ]
        self.runs_backward = [
            any(a.op in RELEASES and a.chunk == c for a in self.actions) for c in range(V)
        ]
        # Which of its call's receives a receive is (a call may hold several: bundle.ir.rounds).
        self._nth = [
            [o for o in self.plan.calls[n].ops if o.op in RECVS].index(a) if a.op in RECVS else -1
            for a, n in zip(self.actions, self.plan.call_of, strict=True)
        ]
        # Each action ends with a lap of the step timer, some lap inside (bundle.observe.timing).
        self.timer = timer or StepTimer()
        self._marks = [last_mark(a.op, wire=not self.last[a.chunk]) for a in self.actions]
        # The micro-batch a post lap is labelled with: that of the first call posted there.
        self._post_micro = [
            self.plan.calls[p[0]].ops[0].micro if p else -1 for p in self.plan.post_at
        ]
        self.recompute = [
            self.policy.recomputes(self.actions, topo.micro_batches, chunk=c) for c in range(V)
        ]
        # Counts saved-for-backward bytes during steps when set (see bundle.engine.memory.SavedBytes).
        self.saved_bytes: SavedBytes | None = None
        # Each chunk's last backward work on the weights: where its gradient sync is armed.
        self.last_backward = {
            max(i for i, a in enumerate(self.actions) if a.op in RELEASES and a.chunk == c)
            for c in range(V)
            if self.runs_backward[c]
        }
        self.inv_batch = 1.0 / topo.global_batch
        # What a split backward's weight half accumulates into (listed once, not per micro-batch).
        self._weights = [[p for p in c.stage.parameters() if p.requires_grad] for c in self.chunks]
        self.max_in_flight = [
            peak_in_flight([a for a in self.actions if a.chunk == c]) for c in range(V)
        ]
        # What the job around declares it does inside a step (bundle.launch.ft.epochs): none here.
        self.hooks = StepHooks()
        # (step, what): formatted only when an error is reported, never in the hot path.
        self._at: tuple[int, object] = (-1, "set-up")
        self.peak_in_flight = 0

    def _place(self, pipe: Pipe, stage: int) -> None:
        """What each of the replica's chunks does at the edges of its piece of ``pipe``."""
        pieces = [pipe.piece(stage, c) for c in range(len(self.chunks))]
        # Piece 0 reads the inputs; the last piece computes the loss.
        self.first = [j == 0 for j in pieces]
        self.last = [j == pipe.pieces - 1 for j in pieces]
        # The chunk whose piece comes right before, where it runs on this stage too (the turn of
        # a V placement): its output is this chunk's input, and the gradient goes back in place.
        self.local_prev = [
            pipe.place(j - 1)[1] if j > 0 and not pipe.crosses(j, -1) else None for j in pieces
        ]
        self._sends = [pipe.crosses(j, 1) for j in pieces]  # its output goes to another stage

    @property
    def position(self) -> str:
        """What this replica is doing in its step ("step 3 recv_act1"), for the watchdog and errors."""
        step, what = self._at
        label = what if isinstance(what, str) else repr(what)
        return label if step < 0 else f"step {step + 1} {label}"

    def train_step(self, step: int, micro_data: list[MicroBatch] | None) -> torch.Tensor:
        """One synchronous step; returns this replica's share of the global mean loss (last stage).

        The step's time is charged to the timer; a caller that began the timer's step (to count
        fetching ``micro_data``) also ends it.
        """
        mine = not self.timer.is_open
        self.timer.begin(step)
        try:
            if self.saved_bytes is None:
                return self._train_step(step, micro_data)
            with self.saved_bytes.tracking():
                return self._train_step(step, micro_data)
        finally:
            if mine:
                self.timer.end()

    def _part(self, a: Action, st: _StepState) -> tuple[Transport, Part]:
        """One action of a call: the tensors a send carries, or the buffer slot a receive fills."""
        k, rows = a.micro, self.sizes[a.micro]
        transport = self.chunks[a.chunk].transport
        if a.op is Op.SEND_ACT:
            return transport, (a.op, rows, st.outputs[k], k)
        if a.op is Op.SEND_GRAD:
            xs = [x for x in st.inputs.pop(k) if x.is_floating_point()]
            grads = tuple(x.grad if x.grad is not None else torch.zeros_like(x) for x in xs)
            return transport, (a.op, rows, grads, k)
        if self.plan.slots:
            return transport, (a.op, rows, self.plan.slots[a], k)
        # A received activation stays alive until its backward, so activation buffers rotate over
        # one slot more than the schedule keeps in flight; gradients are used at once: two slots.
        slots = self.max_in_flight[a.chunk] + 1 if a.op is Op.RECV_ACT else 2
        return transport, (a.op, rows, k % slots, k)

    def _train_step(self, step: int, micro_data: list[MicroBatch] | None) -> torch.Tensor:
        plan, lap = self.plan, self.timer.lap
        loss_sum = torch.zeros((), device=self.device)  # the last piece's, added in place
        sts = [_StepState(loss_sum=loss_sum) for _ in self.chunks]
        posted: dict[int, Pending] = {}  # this step's calls (bundle.ir.p2p)
        for c in self.chunks:
            c.sync.step = step
        for i, a in enumerate(self.actions):
            k, st = a.micro, sts[a.chunk]
            self._at = (step, a)
            if plan.post_at[i]:
                for n in plan.post_at[i]:  # the calls posted here, each with every op in it
                    ops = plan.calls[n].ops
                    posted[n] = post_call([self._part(op, sts[op.chunk]) for op in ops])
                lap(Mark.POST, self._post_micro[i])
            if a.op is Op.RECV_ACT:
                xs = posted[plan.call_of[i]].wait()[self._nth[i]]
                lap(Mark.WAIT_ACT, k)
                # A fresh autograd leaf over the reused buffer (in its wire form, so its gradient
                # is too), so gradients never accumulate across micro-batches or steps.
                grad = self.input_grads[a.chunk]
                st.inputs[k] = tuple(
                    x.detach().requires_grad_(grad and x.is_floating_point()) for x in xs
                )
            elif a.op is Op.FORWARD:
                micro = micro_data[k] if micro_data is not None else (None, None)
                self._forward(sts, a.chunk, k, micro)
            elif a.op is Op.RECV_GRAD:
                st.grads[k] = posted[plan.call_of[i]].wait()[self._nth[i]]
                lap(Mark.WAIT_GRAD, k)
            elif a.op is Op.BACKWARD:
                self._backward(sts, a.chunk, k, last=i in self.last_backward)
            elif a.op is Op.BACKWARD_INPUT:
                self._backward_input(sts, a.chunk, k)
            elif a.op is Op.BACKWARD_WEIGHT:
                self._backward_weight(st, a.chunk, k, last=i in self.last_backward)
            elif a.op not in (Op.SEND_ACT, Op.SEND_GRAD):  # sends go out with their calls
                raise unknown(a, f"stage {self.coord.stage}'s engine")
            lap(self._marks[i], k)
        self._finish(step, posted)
        return loss_sum

    def _forward(self, sts: list[_StepState], c: int, k: int, micro: MicroBatch) -> None:
        chunk, st, policy = self.chunks[c], sts[c], self.policy
        transport = chunk.transport
        if self.first[c]:
            xs: tuple[torch.Tensor, ...] = self._batch_inputs(chunk.stage, micro)
            st.inputs[k] = xs
        else:
            prev = self.local_prev[c]
            if prev is not None:  # handed over in place, as a receive would (a fresh leaf)
                # Copied: an output passed through untouched is a view of the chunk before's
                # receive buffer, whose slot is free again once that chunk's backward ran.
                st.inputs[k] = tuple(
                    x.detach().clone().requires_grad_(x.is_floating_point())
                    for x in sts[prev].outputs[k]
                )
            xs = tuple(m.from_wire(x) for m, x in zip(transport.in_meta, st.inputs[k], strict=True))
        chunk.stage.recompute = self.recompute[c][k]
        side = self._side(chunk.stage, micro, xs if self.first[c] else None)
        with chunk.sync.no_sync(), policy.autocast(), torch.set_grad_enabled(self.runs_backward[c]):
            out = chunk.sync.module(*xs, side=side)
        if self.saved_bytes is not None and self.recompute[c][k]:
            self._measure_recompute(self.saved_bytes, chunk.stage, k, xs, side)
        if self.last[c]:
            labels = given_labels(micro[1]).to(self.device, non_blocking=True)
            # The loss in fp32, outside autocast.
            loss = self.loss(as_float(out), labels) * (len(labels) * self.inv_batch)
            st.loss_sum += loss.detach()
            st.outputs[k] = (self.scaler.scaled(loss) if self.scaler else loss,)
        else:
            self.timer.lap(Mark.FORWARD, k)  # what follows is the copy into wire form (if any)
            st.outputs[k] = tuple(
                m.to_wire(o) for m, o in zip(transport.out_meta, out, strict=True)
            )
        # Held until the backward, or until its weight half when the backward is split.
        held = sum(len(s.outputs) + len(s.held) for s in sts)
        self.peak_in_flight = max(self.peak_in_flight, held)

    def _backward(self, sts: list[_StepState], c: int, k: int, *, last: bool) -> None:
        st = sts[c]
        outputs, grads = self._seeds(st, c, k)
        self.chunks[c].sync.backward(outputs, grads, last=last)
        if self.first[c]:
            st.inputs.pop(k)
        self._hand_back(sts, c, k)

    def _hand_back(self, sts: list[_StepState], c: int, k: int) -> None:
        """The gradient of a chunk's inputs to the chunk before it on this stage (a V's turn),
        where another stage would have been sent it."""
        prev = self.local_prev[c]
        if prev is not None:
            xs = [x for x in sts[c].inputs.pop(k) if x.is_floating_point()]
            # Copied: a gradient passed through untouched is a view of a receive buffer, which
            # the next receive into its slot overwrites before the chunk before runs its W.
            sts[prev].grads[k] = tuple(
                x.grad.clone() if x.grad is not None else torch.zeros_like(x) for x in xs
            )

    def _seeds(
        self, st: _StepState, c: int, k: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Where micro-batch k's backward starts: the loss (last piece), or the outputs that need
        a gradient with the gradients received for them."""
        if self.saved_bytes is not None:
            self.saved_bytes.backward_starts(k)
        out = st.outputs.pop(k)
        if self.last[c]:
            return list(out), None
        floats = (o for o in out if o.is_floating_point())
        pairs = [(o, g) for o, g in zip(floats, st.grads.pop(k), strict=True) if o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _backward_input(self, sts: list[_StepState], c: int, k: int) -> None:
        """The input half: the gradient the stage upstream waits for (its send comes next)."""
        st = sts[c]
        outputs, grads = self._seeds(st, c, k)
        inputs = () if self.first[c] else st.inputs[k]
        st.held[k] = input_half(outputs, grads, inputs, self._weights[c])
        self._hand_back(sts, c, k)

    def _backward_weight(self, st: _StepState, c: int, k: int, *, last: bool) -> None:
        """The weight half, through the gradient sync like a whole backward (its hooks fire)."""
        held = st.held.pop(k)
        self.chunks[c].sync.backward([], None, last=last, run=lambda: weight_half(held))
        if self.first[c]:
            st.inputs.pop(k)

    def _finish(self, step: int, posted: dict[int, Pending]) -> None:
        """The step's sends complete, the gradients are summed, the optimizer steps."""
        lap = self.timer.lap
        self._at = (step, "gradient sync")
        for p in posted.values():  # the sends' calls; those with a receive were waited for
            p.wait()
        lap(Mark.SEND_WAIT)
        for c in self.chunks:
            c.sync.finish()
        if self.ties:
            self._at = (step, "tied weights' gradient sum")
            self.ties.sum()
        if self.hooks.commit is not None:
            self._at = (step, "commit vote")
            self.hooks.commit(step)
        lap(Mark.SYNC)
        self._at = (step, "optimizer")
        params = [p for c in self.chunks for p in c.stage.parameters()]
        if self.scaler is None or self.scaler.unscale_and_agree(params):
            self.optimizer.step()
        for c in self.chunks:
            c.sync.zero_grad(self.optimizer)
        if self.hooks.updated is not None:
            self.hooks.updated(step)
        lap(Mark.OPTIMIZER)
        if self.outer is not None:
            self._at = (step, "sync between bundles")
            self.outer.after_step(step)
            lap(Mark.SYNC)

    def _measure_recompute(
        self,
        saved: SavedBytes,
        stage: Stage,
        k: int,
        xs: tuple[torch.Tensor, ...],
        side: dict[str, torch.Tensor] | None,
    ) -> None:
        def plain() -> tuple[torch.Tensor, ...]:
            stage.recompute = False
            with self.policy.autocast():
                return stage(*xs, side=side)

        saved.recomputed_forward(k, stage, plain)

    def _batch_inputs(self, stage: Stage, micro: MicroBatch) -> tuple[torch.Tensor, ...]:
        """The first piece's inputs on the device: the batch, or its named inputs in order."""
        batch = given_batch(micro[0])
        if not isinstance(batch, dict):
            return (self.policy.prepare_input(batch, self.device),)
        names = stage.input_names
        return (
            self.policy.prepare_input(batch[names[0]], self.device),
            *(batch[n].to(self.device, non_blocking=True) for n in names[1:]),
        )

    def _side(
        self, stage: Stage, micro: MicroBatch, first: tuple[torch.Tensor, ...] | None
    ) -> dict[str, torch.Tensor] | None:
        """The named inputs a piece reads from the data (models.inputs): on the first piece,
        those of ``first`` already on the device; on the others, what the data handed this
        stage for them (None where the piece reads none)."""
        names = stage.side
        if not names:
            return None
        if first is not None:
            return dict(zip(stage.input_names, first, strict=True))
        data = given_batch(micro[0])
        if not isinstance(data, dict):
            raise ValueError(f"a piece reads the batch's {', '.join(names)}, but it names none")
        return {n: data[n].to(self.device, non_blocking=True) for n in names}

    @torch.no_grad()
    def eval_batch(self, rows: int, micro: MicroBatch | None) -> torch.Tensor:
        """Forward-only pass of one bundle batch of ``rows`` rows.

        Returns the last stage's ``EvalCounts`` of the batch, zeros elsewhere.
        """
        micro = micro or (None, None)
        counts = torch.zeros(EVAL_COUNTS, dtype=torch.float64, device=self.device)
        outs: list[tuple[torch.Tensor, ...]] = []
        for c, chunk in enumerate(self.chunks):  # the pieces in model order
            outs.append(self._eval_piece(c, chunk, rows, micro, outs))
            if self.last[c]:
                counts = self._eval_counts(outs[c], micro)
        return counts

    def _eval_piece(
        self,
        c: int,
        chunk: Chunk,
        rows: int,
        micro: MicroBatch,
        outs: list[tuple[torch.Tensor, ...]],
    ) -> tuple[torch.Tensor, ...]:
        transport, policy = chunk.transport, self.policy
        xs: tuple[torch.Tensor, ...]
        prev = self.local_prev[c]
        if self.first[c]:
            xs = self._batch_inputs(chunk.stage, micro)
        elif prev is not None:  # through the wire form, as a message would be
            xs = tuple(
                m.from_wire(m.to_wire(o))
                for m, o in zip(transport.in_meta, outs[prev], strict=True)
            )
        else:
            xs = tuple(
                m.from_wire(x)
                for m, x in zip(transport.in_meta, transport.recv_act(rows).wait()[0], strict=True)
            )
        chunk.stage.recompute = False
        side = self._side(chunk.stage, micro, xs if self.first[c] else None)
        with policy.autocast():
            out = chunk.sync.module(*xs, side=side)
        if self._sends[c]:
            transport.send_act(
                rows, tuple(m.to_wire(o) for m, o in zip(transport.out_meta, out, strict=True))
            ).wait()
        return out

    def _eval_counts(self, out: tuple[torch.Tensor, ...], micro: MicroBatch) -> torch.Tensor:
        labels = given_labels(micro[1]).to(self.device)
        out_f = as_float(out)
        counts = torch.zeros(EVAL_COUNTS, dtype=torch.float64, device=self.device)
        if isinstance(out_f, torch.Tensor) and classifies(out_f, labels):
            counts[:2] = top_k_correct(out_f.flatten(0, -2), labels.flatten(), (1, 5))
            counts[2] = labels.numel()
        counts[3] = self.loss(out_f, labels).detach().double() * len(labels)
        counts[4] = len(labels)
        return counts
