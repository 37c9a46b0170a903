"""``--row-weights``: each replica's share of a micro-batch's rows, per stage, as the command line
spells it (``2:1,1``; ``W*N`` for N replicas of weight W) and as exact fractions. How rows are cut
by them is ``bundle.topology.weighted_sizes``."""

from __future__ import annotations

import itertools
from fractions import Fraction

from bundle.errors import TopologyError


def parse_row_weights(spec: str, shape: tuple[int, ...]) -> tuple[tuple[Fraction, ...], ...]:
    """``--row-weights``: stages separated by commas, a stage's replicas by colons (``2:1,1`` for
    shape ``2,1``); one number for a stage weighs its replicas alike; ``W*N`` is N replicas of
    weight W (``3.5*8:1*8``). Empty: every stage even."""
    if not spec:
        return tuple((Fraction(1),) * w for w in shape)
    stages = spec.split(",")
    if len(stages) != len(shape):
        raise TopologyError(
            "--row-weights",
            spec,
            f"give one entry per stage of shape {shape_text(shape)} "
            f"({len(shape)}), replicas separated by ':' (e.g. {_example(shape)})",
        )
    out = []
    for s, (text, width) in enumerate(zip(stages, shape, strict=True)):
        try:
            weights = tuple(w for part in text.split(":") for w in _repeated(part))
        except (ValueError, ZeroDivisionError):
            weights = ()
        if not weights or any(w <= 0 for w in weights):
            raise TopologyError(
                "--row-weights",
                spec,
                f"stage {s}: weights must be numbers > 0 (W, or W*N for N replicas of weight W)",
            )
        if len(weights) == 1:
            weights *= width
        if len(weights) != width:
            raise TopologyError(
                "--row-weights",
                spec,
                f"stage {s} has {width} replica(s) and {len(weights)} weights were given",
            )
        out.append(weights)
    return tuple(out)


def _repeated(part: str) -> tuple[Fraction, ...]:
    """``W`` or ``W*N`` (N replicas of weight W); ValueError where either is not a number."""
    weight, star, count = part.strip().partition("*")
    n = int(count) if star else 1
    if n < 1:
        raise ValueError(part)
    return (Fraction(weight.strip()),) * n


def format_row_weights(weights: tuple[tuple[float | Fraction, ...], ...]) -> str:
    """The ``--row-weights`` spelling of per-stage weights: a stage of equal weights as ``1``,
    three or more equal neighbours as ``W*N``."""

    def one(w: float | Fraction) -> str:
        f = Fraction(w).limit_denominator(1000)
        return str(f.numerator) if f.denominator == 1 else f"{float(f):g}"

    def stage(ws: tuple[float | Fraction, ...]) -> str:
        if len(set(ws)) == 1:
            return "1"
        runs = [(one(w), len(list(g))) for w, g in itertools.groupby(ws)]
        return ":".join(":".join([w] * n) if n < 3 else f"{w}*{n}" for w, n in runs)

    return ",".join(stage(ws) for ws in weights)


def shape_text(shape: tuple[int, ...]) -> str:
    return ",".join(map(str, shape))


def _example(shape: tuple[int, ...]) -> str:
    return ",".join(":".join("1" for _ in range(w)) for w in shape)
