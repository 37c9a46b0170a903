"""How the bundles' contributions combine, coordinate-wise (``--aggregate``), and a faulty bundle
to test that against (``BUNDLE_BYZANTINE``).

``mean`` is what an allreduce computes. ``median`` and ``trimmed:K`` need every bundle's value of
every coordinate, so the masters gather all N contributions (N times the memory and traffic of an
allreduce for the hop between bundles) and each computes the same result from the same data:

    contributions (N x n) --sort per coordinate--> drop K lowest, K highest --mean--> (n)

``median`` is the middle value (the mean of the two middle ones for even N). Both return the
mean's scale: a contribution is an estimate of the same quantity, so the rule estimates it too.

The fault injector replaces one bundle's contribution from a given step: ``noise`` (standard
normal, seeded by seed, step and bundle, so a resumed run is corrupted alike), ``flip`` (sign) or
``scale`` (x100). It exists for tests and demonstrations; nothing else reads it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bundle.collectives.comm import Comm
from bundle.config import parse_aggregate
from bundle.data.samples import step_seed
from bundle.errors import ConfigError

BYZANTINE_ENV = "BUNDLE_BYZANTINE"
FAULT_MODES = ("noise", "flip", "scale")
SCALE = 100.0


def combine(stacked: torch.Tensor, rule: str) -> torch.Tensor:
    """Combine N contributions (rows of ``stacked``) coordinate-wise by ``rule``."""
    trim = parse_aggregate(rule)
    n = stacked.shape[0]
    if trim is None:
        return stacked.mean(dim=0)
    if n <= 2 * trim:
        raise ValueError(f"--aggregate {rule} cannot combine {n} contributions")
    ordered = stacked.sort(dim=0).values
    if trim == 0:  # median
        mid = n // 2
        return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return ordered[trim : n - trim].mean(dim=0)


def gather_and_combine(
    t: torch.Tensor, group: dist.ProcessGroup, rule: str, comm: Comm
) -> torch.Tensor:
    """Every group member's ``t`` (gathered through ``comm``), combined by ``rule`` (the same
    result on every member)."""
    parts = [torch.empty_like(t) for _ in range(group.size())]
    comm.all_gather(parts, t, group).wait()
    return combine(torch.stack(parts), rule)


@dataclass(frozen=True)
class Fault:
    """Bundle ``bundle`` sends a corrupted contribution from step ``start`` (1-based) on."""

    bundle: int
    mode: str
    start: int = 1

    def applies(self, bundle: int, step: int) -> bool:
        """Whether ``bundle``'s contribution in 0-based ``step`` is corrupted."""
        return bundle == self.bundle and step + 1 >= self.start

    def corrupt(self, t: torch.Tensor, *, seed: int, step: int) -> None:
        """Replace ``t`` in place by what the faulty bundle sends."""
        if self.mode == "flip":
            t.neg_()
        elif self.mode == "scale":
            t.mul_(SCALE)
        else:
            g = torch.Generator().manual_seed(step_seed(seed, step, self.bundle))
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(t))


def parse_fault(text: str | None, num_bundles: int) -> Fault | None:
    """``BUNDLE_BYZANTINE=B:MODE[:FROM]`` (bundle B, 0-based; from step FROM, default 1)."""
    if not text:
        return None
    parts = text.split(":")
    ok = 2 <= len(parts) <= 3 and parts[0].isdigit() and parts[1] in FAULT_MODES
    ok = ok and (len(parts) == 2 or (parts[2].isdigit() and int(parts[2]) >= 1))
    if not ok or int(parts[0]) >= num_bundles:
        raise ConfigError(
            BYZANTINE_ENV,
            text,
            f"give BUNDLE:MODE[:FROM_STEP] with BUNDLE < {num_bundles} and MODE one of "
            f"{', '.join(FAULT_MODES)}, e.g. 1:noise:10",
        )
    return Fault(int(parts[0]), parts[1], int(parts[2]) if len(parts) == 3 else 1)


def fault_from_env(num_bundles: int) -> Fault | None:
    return parse_fault(os.environ.get(BYZANTINE_ENV), num_bundles)
