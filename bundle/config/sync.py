"""The data-parallel options of ``ParallelConfig`` (docs/data-parallel.md): their spellings, and
the combinations refused before start, each in one line naming the flag."""

from __future__ import annotations

from typing import Any

from bundle.errors import ConfigError, positive
from bundle.ir.schedule import REGISTRY

COMPRESSIONS = ("none", "bf16", "fp16", "powersgd")
ZERO_LEVELS = (0, 1, 3)  # --zero: off, the optimizer's state sharded, everything sharded


def parse_bundle_sync(text: str) -> tuple[str, int]:
    """``"step"`` -> ``("step", 1)``; ``"local:8"`` -> ``("local", 8)``; ``"diloco:H"`` alike."""
    mode, sep, every = str(text).partition(":")
    if mode == "step" and not sep:
        return "step", 1
    if mode in ("local", "diloco") and every.isdigit() and int(every) >= 1:
        return mode, int(every)
    raise ConfigError(
        "--bundle-sync", text, "choose step, local:H or diloco:H (H: steps between syncs, >= 1)"
    )


def parse_aggregate(text: str) -> int | None:
    """How many of the highest and lowest values per coordinate a rule drops: ``mean`` -> None
    (nothing, and no gathering), ``median`` -> 0 (the middle), ``trimmed:K`` -> K."""
    rule, sep, k = str(text).partition(":")
    if rule == "mean" and not sep:
        return None
    if rule == "median" and not sep:
        return 0
    if rule == "trimmed" and k.isdigit() and int(k) >= 1:
        return int(k)
    raise ConfigError("--aggregate", text, "choose mean, median or trimmed:K (K >= 1)")


def check(par: Any) -> None:
    """The data-parallel options alone, then the combinations that make no sense."""
    if par.zero not in ZERO_LEVELS:
        raise ConfigError(
            "--zero",
            par.zero,
            "choose 0 (off), 1 (shard optimizer state) or 3 (parameters, gradients and "
            "optimizer state)",
        )
    if par.grad_compression not in COMPRESSIONS:
        raise ConfigError(
            "--grad-compression",
            par.grad_compression,
            f"choose one of: {', '.join(COMPRESSIONS)}",
        )
    positive("--powersgd-rank", par.powersgd_rank)
    positive("--compression-warmup", par.compression_warmup, 0)
    parse_bundle_sync(par.bundle_sync)
    parse_aggregate(par.aggregate)
    if par.outer_lr <= 0:
        raise ConfigError("--outer-lr", par.outer_lr, "must be > 0")
    if not 0 <= par.outer_momentum < 1:
        raise ConfigError("--outer-momentum", par.outer_momentum, "must be in [0, 1)")
    _check_combinations(par)


def _check_combinations(par: Any) -> None:
    """The data-parallel options together, and with the job's bundles and widths."""
    mode, _ = parse_bundle_sync(par.bundle_sync)
    trim = parse_aggregate(par.aggregate)
    n = par.num_bundles
    if mode != "step" and n == 1:
        raise ConfigError(
            "--bundle-sync", par.bundle_sync, "syncs between bundles: needs --num-bundle > 1"
        )
    if trim is not None and n < max(3, 2 * trim + 1):
        needs = (
            "at least 3 bundles (the median of 2 is their mean)"
            if trim == 0
            else (f"more than {2 * trim} bundles (it drops the {trim} highest and lowest)")
        )
        raise ConfigError("--aggregate", par.aggregate, f"needs {needs}; this job has {n}")
    if par.grad_compression != "none":
        _check_compression(par, mode, trim)
    if par.zero and mode != "step":
        raise ConfigError(
            "--zero",
            par.zero,
            f"shards state that --bundle-sync {par.bundle_sync} keeps per bundle; "
            "use --bundle-sync step",
        )
    if par.zero == 3:
        _check_zero3(par)
    if par.shape and max(par.shape) * n == 1:
        for flag, value, off in (
            ("--zero", par.zero, 0),
            ("--grad-compression", par.grad_compression, "none"),
        ):
            if value != off:
                raise ConfigError(
                    flag,
                    value,
                    "needs a stage with replicas to sync with; every stage "
                    f"of shape {','.join(map(str, par.shape))} x 1 bundle has one",
                )


def _check_zero3(par: Any) -> None:
    """What --zero 3 (FSDP2 inside each stage) composes with: an exact sync every step, and a
    backward FSDP sees whole."""
    refused = {
        "--grad-compression": (par.grad_compression != "none", par.grad_compression),
        "--aggregate": (par.aggregate != "mean", par.aggregate),
    }
    for flag, (given, value) in refused.items():
        if given:
            raise ConfigError(
                flag, value, "--zero 3 reduces shards of gradients exactly; use --zero 1 with it"
            )
    if REGISTRY[par.schedule].split_backward:
        raise ConfigError(
            "--schedule",
            par.schedule,
            "splits the backward into input and weight halves; --zero 3 reduce-scatters a "
            "block's gradients when its input gradient is computed, before the weight half: use "
            "1f1b, gpipe or interleaved (or --zero 1)",
        )


def _check_compression(par: Any, mode: str, trim: int | None) -> None:
    flag, value = "--grad-compression", par.grad_compression
    if mode != "step":
        raise ConfigError(
            flag,
            value,
            f"compresses the per-step sync between bundles; --bundle-sync "
            f"{par.bundle_sync} has none (and syncs inside a bundle exactly)",
        )
    if trim is not None:
        raise ConfigError(
            flag,
            value,
            f"cannot be combined with --aggregate {par.aggregate} (which gathers "
            "every bundle's gradient uncompressed)",
        )
    if par.grad_sync == "hierarchical" and par.num_bundles == 1:
        raise ConfigError(
            flag,
            value,
            "with --grad-sync hierarchical compresses the masters' hop between "
            "bundles: needs --num-bundle > 1",
        )
