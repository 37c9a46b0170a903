"""Bundle from Python: ``train(model, dataset=..., loss=..., **options)`` runs what ``main.py``
runs (the same config, checks, engine and launch), with your own functions in place of names.

    from bundle.api import train

    def build(num_classes, input_shape):          # -> nn.Module
        ...
    def data(split):                               # "train" | "val" -> a map-style Dataset
        ...
    def loss(outputs, labels):                     # -> the mean over the micro-batch's rows
        ...

    if __name__ == "__main__":
        result = train(build, dataset=data, loss=loss, bundle_shape="2,1", itr=100)
        print(result.summary)

Every process of the job imports your functions again (as ``module:function``): define them at
the top level of a module or of the script, and start training under ``if __name__ ==
"__main__":`` (processes are spawned; under torchrun or Slurm every process runs the script).
Options are the long command-line options with ``_`` for ``-`` (``micro_batches=4``,
``bundle_shape="2,1"``, ``no_eval=True``); ``docs/models.md`` has the rules for each function.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bundle import cli
from bundle.errors import ConfigError


@dataclass(frozen=True)
class RunResult:
    """How the run ended: main.py's exit code and its summary record (None if it wrote none)."""

    exit_code: int
    summary: dict[str, Any] | None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def reference(fn: str | Callable[..., Any], what: str) -> str:
    """A function as ``module:qualname``, the way every process finds it again."""
    if isinstance(fn, str):
        return fn
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or not name or "<" in name:
        raise ConfigError(
            what, fn, "pass a function defined at the top level of a module or script"
        )
    return f"{module}:{name}"


def argv_of(options: dict[str, Any]) -> list[str]:
    """``{"micro_batches": 4, "no_eval": True}`` -> ``["--micro-batches", "4", "--no-eval"]``."""
    argv: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [flag, ",".join(map(str, value))]
        else:
            argv += [flag, str(value)]
    return argv


def train(
    model: str | Callable[..., Any],
    *,
    dataset: str | Callable[[str], Any] | None = None,
    loss: str | Callable[..., Any] | None = None,
    argv: Sequence[str] = (),
    **options: Any,
) -> RunResult:
    """Train ``model`` (a factory or a model name) as ``main.py`` would; see the module doc."""
    given = {
        "model": reference(model, "model"),
        "dataset": reference(dataset, "dataset") if dataset is not None else None,
        "loss": reference(loss, "loss") if loss is not None else None,
        **options,
    }
    with tempfile.TemporaryDirectory(prefix="bundle-api-") as tmp:
        metrics = given.get("metrics_out") or os.path.join(tmp, "metrics.jsonl")
        given["metrics_out"] = metrics
        code = cli.main([*argv_of(given), *argv])
        summary = None
        if os.path.exists(metrics):
            with open(metrics) as f:
                lines = [json.loads(line) for line in f if line.strip()]
            summary = next((r for r in reversed(lines) if r.get("summary")), None)
    return RunResult(code, summary)
