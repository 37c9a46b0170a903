"""The learning rate of every step: constant, step decay or cosine, after an optional linear warm-up.

The rate is a pure function of the step, like the data order, so a resumed run continues the same
curve with nothing to restore but its step; a checkpoint records the schedule's settings with the
run's others (``bundle.json``), and resuming under other ones is noted. Step ``t`` (counted from
0) runs at ``lr * warm-up(t) * decay(t)``:

- warm-up, over ``W = floor(--warmup-epochs x steps per epoch)`` steps: linear from
  ``WARMUP_START`` x ``--lr`` at step 0 to ``--lr`` at step ``W`` (Goyal et al., 2017);
- ``step``: times ``--lr-gamma`` for every milestone at or before ``t``; a milestone ``30`` is
  after 30 epochs, ``500s`` after 500 steps (``30,60`` over 90 epochs is pytorch/examples'
  ImageNet decay). A milestone at or after the run's last step changes no step's rate: it is
  dropped (``past_the_run``, noted before start), so a short run of a recipe needs no other flags;
- ``cosine``: from ``--lr`` after the warm-up down towards 0 at the end of the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from itertools import pairwise
from typing import TYPE_CHECKING, NamedTuple, Protocol

from bundle.errors import ConfigError

if TYPE_CHECKING:
    import torch

LR_SCHEDULES = ("constant", "step", "cosine")
WARMUP_START = 0.1  # the warm-up's first rate, as a fraction of --lr


class Milestone(NamedTuple):
    """One entry of ``--lr-steps``: after ``at`` epochs, or ``at`` steps (``unit == "step"``)."""

    at: int
    unit: str  # "epoch" or "step"

    def __str__(self) -> str:
        return f"{self.at}s" if self.unit == "step" else str(self.at)


def parse_milestones(text: str | None) -> tuple[Milestone, ...]:
    """``"30,60,80"`` (epochs) or ``"500s,900s"`` (steps) -> milestones, strictly increasing."""
    if text is None or not str(text).strip():
        return ()
    wrong = ConfigError(
        "--lr-steps",
        text,
        "give positive whole epochs (30,60,80) or step counts ending in s (500s,900s), "
        "in increasing order, one unit for all",
    )
    out = []
    for part in str(text).split(","):
        part = part.strip()
        unit = "step" if part.endswith("s") else "epoch"
        digits = part[:-1] if unit == "step" else part
        if not digits.isdigit() or int(digits) < 1:
            raise wrong
        out.append(Milestone(int(digits), unit))
    if len({m.unit for m in out}) > 1 or any(b.at <= a.at for a, b in pairwise(out)):
        raise wrong
    return tuple(out)


def spell(milestones: tuple[Milestone, ...]) -> str:
    """Milestones as ``--lr-steps`` takes them (``""`` for none)."""
    return ",".join(map(str, milestones))


def warmup_steps(warmup_epochs: float, steps_per_epoch: int) -> int:
    # Through the decimal the user wrote: 0.29 x 100 is 28.999... in binary floating point.
    return math.floor(Fraction(repr(float(warmup_epochs))) * steps_per_epoch)


class Settings(Protocol):
    """What the schedule reads of a run's settings (``bundle.config.TrainConfig`` holds them):
    declared here, so the settings may import the schedule and not the other way round."""

    @property
    def steps(self) -> int: ...
    @property
    def lr(self) -> float: ...
    @property
    def lr_schedule(self) -> str: ...
    @property
    def lr_steps(self) -> tuple[Milestone, ...]: ...
    @property
    def lr_gamma(self) -> float: ...
    @property
    def warmup_epochs(self) -> float: ...


def needs_epoch_length(train: Settings) -> bool:
    """Whether checking the schedule against the run needs the steps per epoch (the data's size):
    the schedule counts in epochs and the run in steps, or the other way round."""
    counts_steps = bool(train.steps)
    in_epochs = train.warmup_epochs > 0 or any(m.unit == "epoch" for m in train.lr_steps)
    in_steps = any(m.unit == "step" for m in train.lr_steps)
    return (counts_steps and in_epochs) or (not counts_steps and in_steps)


def milestone_steps(train: Settings, steps_per_epoch: int) -> tuple[int, ...]:
    """Every ``--lr-steps`` milestone as the step it takes effect at."""
    return tuple(m.at if m.unit == "step" else m.at * steps_per_epoch for m in train.lr_steps)


def past_the_run(train: Settings, *, steps_per_epoch: int, total: int) -> tuple[Milestone, ...]:
    """The milestones a run of ``total`` steps ends before: they change no step's rate."""
    steps = milestone_steps(train, steps_per_epoch)
    return tuple(m for m, at in zip(train.lr_steps, steps, strict=True) if at >= total)


@dataclass(frozen=True, kw_only=True)
class LRSchedule:
    """The rate of every step of one run; ``milestones`` and ``warmup`` are in steps."""

    base: float
    kind: str = "constant"
    milestones: tuple[int, ...] = ()
    gamma: float = 0.1
    warmup: int = 0
    total: int = 1

    @classmethod
    def of(cls, train: Settings, *, steps_per_epoch: int, total: int) -> LRSchedule:
        """The schedule of a run of ``total`` steps, without the milestones it ends before; a
        warm-up that does not end inside the run is a ConfigError naming the flag (unlike a late
        milestone, it would change the rate of every step)."""
        steps = tuple(at for at in milestone_steps(train, steps_per_epoch) if at < total)
        warmup = warmup_steps(train.warmup_epochs, steps_per_epoch)
        if warmup >= total:
            raise ConfigError(
                "--warmup-epochs",
                train.warmup_epochs,
                f"the warm-up ({warmup} steps) must end before the run does ({total} steps)",
            )
        return cls(
            base=train.lr,
            kind=train.lr_schedule,
            milestones=steps,
            gamma=train.lr_gamma,
            warmup=warmup,
            total=total,
        )

    def factor(self, step: int) -> float:
        """The rate of step ``step`` (counted from 0) as a fraction of the base rate."""
        warm = 1.0
        if step < self.warmup:
            warm = WARMUP_START + (1.0 - WARMUP_START) * step / self.warmup
        if self.kind == "step":
            return warm * self.gamma ** sum(1 for m in self.milestones if m <= step)
        if self.kind == "cosine" and step >= self.warmup:
            done = (step - self.warmup) / (self.total - self.warmup)
            return 0.5 * (1.0 + math.cos(math.pi * done))
        return warm

    def at(self, step: int) -> float:
        return self.base * self.factor(step)

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Set the rate of step ``step`` on every parameter group; returns it."""
        lr = self.at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr
