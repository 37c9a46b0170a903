"""bundle/observe/timing.py and the console: laps charged to categories, the per-stage breakdown, top-k counts, the progress bar, --trace-steps."""

from __future__ import annotations

import io

import pytest
import torch

from bundle.engine.loss import top_k_correct
from bundle.observe import timing
from bundle.observe.timing import CATEGORIES, CudaStepTimer, Mark, StepTimer, breakdown


class FakeClock:
    """perf_counter_ns that moves only when told."""

    def __init__(self) -> None:
        self.now = 1_000

    def __call__(self) -> int:
        return self.now

    def tick(self, ns: int) -> None:
        self.now += ns


def _run_step(timer: StepTimer, clock: FakeClock, step: int, ms: dict[Mark, int]) -> None:
    timer.begin(step)
    for mark, t in ms.items():
        clock.tick(t * 1_000_000)
        timer.lap(mark, 0 if mark is Mark.FORWARD else -1)
    timer.end()


STEP = {Mark.DATA: 1, Mark.FORWARD: 3, Mark.SEND_ACT: 2, Mark.SEND_WAIT: 4, Mark.OPTIMIZER: 5}


def _expected_row(steps: int) -> list[float]:
    # A send action's own lap is the engine's work on it; its call is posted in a lap of its own.
    per = {"data": 1, "forward": 3, "engine": 2, "send": 4, "optimizer": 5}
    return [steps, steps * 0.015] + [steps * per.get(c, 0) * 1e-3 for c in CATEGORIES]


def test_timer_charges_each_lap_to_its_category_and_leaves_warmup_out_of_the_run(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(timing, "perf_counter_ns", clock)
    timer = StepTimer(trace=(2, 2))
    for step in range(3):
        _run_step(timer, clock, step, STEP)
    assert timer.take_window() == pytest.approx(_expected_row(3))
    assert timer.take_window() == pytest.approx([0.0] * timing.ROW)
    assert timer.run == pytest.approx(_expected_row(2))  # the first step is warm-up
    # Only step 2 (1-based) is traced: contiguous slices, one per lap, in order.
    assert [(Mark(m), micro, step) for m, micro, step, _, _ in timer.slices] == [
        (m, 0 if m is Mark.FORWARD else -1, 1) for m in STEP
    ]
    ends = [s[4] for s in timer.slices]
    assert [s[3] for s in timer.slices[1:]] == ends[:-1]
    assert ends[-1] - timer.slices[0][3] == 15_000_000


def test_cuda_timer_reads_its_events_once_per_window(monkeypatch):
    """The CUDA timer's arithmetic on events that read a fake clock: the host timer's rows, one
    synchronisation per window plus one at the start of each traced step."""
    clock = FakeClock()
    syncs = []

    class Event:
        def __init__(self, enable_timing: bool) -> None:
            self.t = None

        def record(self) -> None:
            self.t = clock.now

        def synchronize(self) -> None:
            syncs.append("window")

        def elapsed_time(self, end: Event) -> float:
            return (end.t - self.t) / 1e6

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append("trace"))
    monkeypatch.setattr(timing, "perf_counter_ns", clock)
    timer = CudaStepTimer(torch.device("cuda", 0), trace=(2, 2))
    for step in range(3):
        _run_step(timer, clock, step, STEP)
    assert syncs == ["trace"]  # no synchronisation inside untraced steps
    assert timer.take_window() == pytest.approx(_expected_row(3))
    assert syncs == ["trace", "window"]
    assert timer.run == pytest.approx(_expected_row(2))
    assert [Mark(s[0]) for s in timer.slices] == list(STEP)
    assert timer.slices[-1][4] - timer.slices[0][3] == 15_000_000
    assert len(timer._pool) == 3 * (1 + len(STEP))  # events are reused, not leaked, next window
    _run_step(timer, clock, 3, STEP)
    timer.take_window()
    assert len(timer._pool) == 3 * (1 + len(STEP))
    # A caller that never closes windows (a benchmark loop) still has its events read and reused.
    monkeypatch.setattr(CudaStepTimer, "PENDING", 2)
    for step in range(4, 10):
        _run_step(timer, clock, step, STEP)
    assert len(timer._pool) == 3 * (1 + len(STEP)) and len(timer._steps) == 0
    assert timer.take_window() == pytest.approx(_expected_row(6))


def test_breakdown_is_per_stage_mean_and_max_with_the_bubble():
    cat = {c: i for i, c in enumerate(CATEGORIES)}

    def row(steps: int, wall: float, **secs: float) -> list[float]:
        r = [steps, wall] + [0.0] * len(CATEGORIES)
        for k, v in secs.items():
            r[2 + cat[k]] = v
        return r

    rows = [
        row(2, 0.2, forward=0.1, wait_grad=0.1),  # stage 0: bubble 0.5
        row(2, 0.4, forward=0.1, wait_grad=0.2, send=0.1),  # stage 0: bubble 0.75
        row(2, 0.3, forward=0.2, wait_act=0.1),  # stage 1: bubble 1/3
    ]
    got = breakdown(rows, [0, 0, 1], ideal=0.2)
    s0, s1 = got["stages"]
    assert got["ideal_bubble"] == 0.2 and s0["processes"] == 2 and s1["processes"] == 1
    assert s0["step_s"] == pytest.approx({"mean": 0.15, "max": 0.2})
    assert s0["seconds"]["wait_grad"] == pytest.approx({"mean": 0.075, "max": 0.1})
    assert s0["bubble"] == pytest.approx({"mean": 0.625, "max": 0.75})
    assert s1["bubble"] == pytest.approx({"mean": 1 / 3, "max": 1 / 3})
    assert breakdown([row(0, 0.0)], [0], 0.0) is None
    lines = timing.table(got)
    assert len(lines) == 4 and "wait_grad" in lines[0] and "150.00" in lines[1]


def test_the_ideal_bubble_is_the_schedules():
    # GPipe and 1F1B: (S-1)/(M+S-1). ZB-H1 with F = I = W: (S-1)(F+I-W) / (M(F+B) + (S-1)F),
    # e.g. S=2, M=3: 1 s of a 10 s step (the planner's simulated case).
    assert timing.ideal_bubble(2, 4) == (pytest.approx(0.2), "(S-1)/(M+S-1)")
    assert timing.ideal_bubble(4, 8, "gpipe")[0] == pytest.approx(3 / 11)
    assert timing.ideal_bubble(2, 3, "zb-h1") == (pytest.approx(0.1), "(S-1)/(3M+S-1)")
    rows = [[1, 0.3, 0.2, *[0.0] * (len(CATEGORIES) - 1)]] * 2
    report = breakdown(rows, [0, 1], *timing.ideal_bubble(2, 3, "zb-h1"))
    assert timing.table(report)[-1] == "ideal bubble (S-1)/(3M+S-1) = 0.100"


def test_top_k_counts_a_hand_built_case():
    logits = torch.tensor(
        [
            [9.0, 1, 2, 3, 4, 5, 6],  # label 0: top-1
            [1.0, 9, 8, 7, 6, 5, 4],  # label 4: 5th highest -> top-5 only
            [1.0, 9, 8, 7, 6, 5, 4],  # label 6: 7th -> neither
            [0.0, 1, 2, 3, 4, 5, 6],  # label 3: 4th -> top-5 only
        ]
    )
    labels = torch.tensor([0, 4, 6, 3])
    assert top_k_correct(logits, labels, (1, 5)).tolist() == [1.0, 3.0]
    assert top_k_correct(logits[:, :3], torch.tensor([0, 1, 2, 2]), (1, 5)).tolist() == [3.0, 4.0]


def test_console_bar_on_a_terminal_and_plain_lines_otherwise(caplog):
    from bundle.observe.console import Console

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    bar = Console(total=20, start=0, steps_per_epoch=10, enabled=True, stream=screen)
    bar.advance(12)
    bar.window(12, {"loss": 1.5, "samples_per_s": 99.0, "lr": 0.1})
    bar.close()
    text = screen.getvalue()
    assert "12/20" in text and "epoch 2" in text and "loss 1.5000" in text and "99.0" in text

    plain = io.StringIO()
    lines = Console(total=20, start=0, steps_per_epoch=10, enabled=True, stream=plain)
    with caplog.at_level("INFO", logger="bundle"):
        lines.advance(12)
        lines.window(12, {"loss": 1.5, "samples_per_s": 99.0})
    lines.close()
    assert plain.getvalue() == ""
    assert [r.getMessage() for r in caplog.records] == ["step 12/20  loss 1.5000  99.0 samples/s"]


@pytest.mark.parametrize("steps", ["4:2", "0:1", "a:b"])
def test_bad_trace_steps_are_refused_naming_the_flag(steps):
    from bundle import cli
    from bundle.errors import ConfigError

    with pytest.raises(ConfigError, match="--trace-steps"):
        cli.parse(["--trace", "t.json", "--trace-steps", steps], {})


def _engine(stage: int, post, timer: StepTimer):
    """One replica of ``stage`` of an mlp cut in two (shape 1,1, M = 2, 1F1B, receives posted
    early as on gloo), its messages handed to ``post``."""
    from bundle import models
    from bundle.engine.grad_sync import GradSync
    from bundle.engine.parts import Chunk, EngineParts, StepOptions
    from bundle.engine.stage import split_model
    from bundle.engine.stage_engine import StageEngine
    from bundle.engine.transport import Boundaries, TensorMeta, Transport
    from bundle.topology import Coord, Topology

    model = models.build("mlp", num_classes=4, input_shape=(3, 2, 2))
    piece = split_model(model, (0, 2))[stage]
    topo = Topology(shape=(1, 1), num_bundles=1, procs_per_node=2, global_batch=4, micro_batches=2)
    coord = Coord(0, stage, 0)
    meta = (TensorMeta.of(split_model(model, (0, 2))[0](torch.zeros(1, 3, 2, 2))[0]),)
    sides = Boundaries(inputs=meta) if stage else Boundaries(outputs=meta)
    transport = Transport(
        topo=topo, coord=coord, boundaries=sides, device=torch.device("cpu"), timeout=1.0, post=post
    )
    return StageEngine(
        topo=topo,
        coord=coord,
        parts=EngineParts(
            chunks=(Chunk(piece, GradSync(piece), transport),),
            optimizer=torch.optim.SGD(piece.parameters(), lr=0.1),
        ),
        options=StepOptions(schedule="1f1b", early_receives=True),
        device=torch.device("cpu"),
        timer=timer,
    )


@pytest.mark.parametrize(
    ("stage", "laps"),
    [
        (  # F0 S0 F1 S1 R0 B0 R1 B1, the gradients' receives posted at R0's and B0's start
            0,
            "post 0, forward 0, copy 0, post 0, send act 0, forward 1, copy 1, post 1, "
            "send act 1, wait grad 0, engine 0, post 1, backward 0, wait grad 1, engine 1, "
            "backward 1",
        ),
        (  # R0 F0 B0 S0 R1 F1 B1 S1, the activations' receives at R0's and F0's start
            1,
            "post 0, wait act 0, engine 0, post 1, forward 0, backward 0, post 0, send grad 0, "
            "wait act 1, engine 1, forward 1, backward 1, post 1, send grad 1",
        ),
    ],
)
def test_an_action_that_crosses_a_boundary_laps_its_post_wait_and_copy_apart(
    stage, laps, world_of_one, monkeypatch
):
    """Each slice of a traced step names its part of an action: the calls posted as it begins,
    a receive's wait, the engine's own work after it, a forward's conversion to wire form; the
    step's slices still add up to its time."""
    clock = FakeClock()
    monkeypatch.setattr(timing, "perf_counter_ns", lambda: clock.tick(1000) or clock())

    def post(ops, labels):  # the messages go nowhere; receives keep their buffers' contents
        return []

    timer = StepTimer(trace=(1, 1))
    engine = _engine(stage, post, timer)
    data = [(torch.randn(2, 3, 2, 2), torch.randint(0, 4, (2,))) for _ in range(2)]
    engine.train_step(0, data)
    names = [f"{timing.LABELS[Mark(m)]} {micro}" for m, micro, *_ in timer.slices]
    assert ", ".join(names[: len(laps.split(", "))]) == laps
    described = timing.step_laps(engine.plan, wire=[stage == 0])
    assert [(Mark(m), micro) for m, micro, *_ in timer.slices[: len(described)]] == described
    assert names[-3:] == ["send wait -1", "sync -1", "optimizer -1"]
    row = timer.take_window()
    assert sum(row[2:]) == pytest.approx(row[1])
    per = dict(zip(CATEGORIES, row[2:], strict=True))
    assert per["post"] > 0 and per["engine"] > 0 and per["wait_act" if stage else "wait_grad"] > 0
    assert per["copy"] > 0 if stage == 0 else per["copy"] == 0
