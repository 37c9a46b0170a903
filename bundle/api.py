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

``export_hf(step, out)`` writes a ``transformers`` model's step as the directory
``from_pretrained`` reads (``docs/hub.md``).
"""

from __future__ import annotations

import ast
import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

from bundle import cli
from bundle.errors import ConfigError, LaunchError

if TYPE_CHECKING:
    from bundle.checkpoint.hf_export import HFExport


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


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not isinstance(test, ast.Compare) or len(test.ops) != 1:
        return False
    sides = [test.left, *test.comparators]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    texts = [s.value for s in sides if isinstance(s, ast.Constant)]
    return isinstance(test.ops[0], ast.Eq) and names == ["__name__"] and texts == ["__main__"]


def check_guarded(caller: FrameType) -> None:
    """Refuse a call from a script's top level outside ``if __name__ == "__main__":``: every
    process of the job imports the script again, and each would start a job of its own."""
    frame: FrameType | None = caller
    while frame is not None and not (
        frame.f_code.co_name == "<module>"
        and frame.f_globals.get("__name__") in ("__main__", "__mp_main__")
    ):
        frame = frame.f_back  # the script's own top-level line that led here
    if frame is None:
        return
    script = frame.f_globals.get("__file__")
    if not isinstance(script, str) or not os.path.isfile(script):
        return  # python -c or a notebook: no file to import again
    try:
        with open(script, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, UnicodeDecodeError):
        return
    line = frame.f_lineno
    guarded = [
        (node.lineno, node.end_lineno or node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and _is_main_test(node.test)
    ]
    if not any(first <= line <= last for first, last in guarded):
        raise LaunchError(
            f"{script}:{line} runs bundle.api.train outside 'if __name__ == \"__main__\":'; "
            "every process of the job imports the script again and would start a job of its "
            "own: put the call under it"
        )


def train(
    model: str | Callable[..., Any],
    *,
    dataset: str | Callable[[str], Any] | None = None,
    loss: str | Callable[..., Any] | None = None,
    argv: Sequence[str] = (),
    **options: Any,
) -> RunResult:
    """Train ``model`` (a factory or a model name) as ``main.py`` would; see the module doc."""
    check_guarded(sys._getframe(1))
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


def export_hf(checkpoint: str, out: str, **options: Any) -> HFExport:
    """A ``transformers`` model's step directory as the directory ``from_pretrained`` reads,
    as ``python -m bundle.checkpoint export STEP --hf OUT`` writes it (docs/hub.md); options:
    ``max_shard_size`` ("5GB"), ``force``, ``model_config``, ``tokenizer``. Raises a
    ``BundleError`` naming what is wrong."""
    from bundle.checkpoint.hf_export import export_hf as export

    return export(checkpoint, out, **options)
