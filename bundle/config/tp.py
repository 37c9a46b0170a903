"""What ``--tensor-parallel`` combines with so far, refused in one line before any process starts.

A stage's degree splits its layers' matrices over the processes of each replica
(``bundle.models.tp``); what a rank holds of a split layer is its shard, which the options
refused here would have to know about: the other exchanges of the data-parallel side, a
quantized base (``--lora`` adapters are split with their layers), and a bundle that heals from
its peers. (``--compile`` compiles a stage's blocks with their split layers in them.)
(``--zero 1`` and ``--zero 3`` shard over the replicas' processes of
the same index in their TP groups, which hold the same shards.)
"""

from __future__ import annotations

from bundle.config.job import ComputeConfig, LaunchConfig, ParallelConfig
from bundle.errors import ConfigError


def check_tensor_parallel(
    par: ParallelConfig,
    compute: ComputeConfig,
    launch: LaunchConfig,
    base_dtype: str | None = None,
) -> None:
    """Refuse what a tensor-parallel run does not combine with yet (nothing without one);
    ``base_dtype``: the model's ``--base-dtype`` (a quantized frozen base under ``--lora``)."""
    degrees = par.tp_degrees
    if max(degrees, default=1) == 1:
        return
    refused = {
        "--grad-compression": par.grad_compression != "none" and par.grad_compression,
        "--bundle-sync": par.bundle_sync != "step" and par.bundle_sync,
        "--aggregate": par.aggregate != "mean" and par.aggregate,
        "--row-weights": par.row_weights,
        "--base-dtype": base_dtype,
        "--fault-tolerance": launch.fault_tolerance == "bundle" and "bundle",
    }
    for flag, value in refused.items():
        if value:
            raise ConfigError(
                flag,
                value,
                f"--tensor-parallel {','.join(map(str, degrees))} does not combine with it "
                "yet: drop one of them",
            )
