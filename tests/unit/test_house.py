"""The house rules the code keeps: no function in bundle/ over 80 lines, each package's
``__init__`` a module map naming every module of its package, and floors that run one way (the
launching side above the trainer, the runtime below it), and a worker that starts without the
heavy packages it does not use."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import bundle

ROOT = Path(bundle.__file__).parent
MAX_LINES = 80


def function_lengths(root: Path = ROOT) -> list[tuple[int, str]]:
    """(lines, "path:line name") of every function and method, def line through last line."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                found.append((lines, f"{path.relative_to(root.parent)}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)


def test_no_function_is_longer_than_80_lines():
    long = [f"{where} ({n} lines)" for n, where in function_lengths() if n > MAX_LINES]
    assert long == []


def test_the_length_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "long.py").write_text(f"def long():\n{body}\n")
    assert function_lengths(tmp_path)[0][0] == MAX_LINES + 1


def test_every_package_map_names_its_modules():
    missing = []
    for init in sorted(ROOT.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        for module in sorted(init.parent.glob("*.py")):
            name = module.stem
            if name in ("__init__", "__main__"):
                continue
            if f"``{name}``" not in doc:
                missing.append(f"{init.relative_to(ROOT.parent)}: {name}")
        for sub in sorted(p.parent.name for p in init.parent.glob("*/__init__.py")):
            if f"``{sub}/``" not in doc and f"``{sub}``" not in doc:
                missing.append(f"{init.relative_to(ROOT.parent)}: {sub}/")
    assert missing == []


# What the launching side stands on: none of it may import bundle.launch, at the top or inside a
# function.
BELOW_LAUNCH = ("runtime", "engine", "checkpoint", "observe", "models", "session.py", "trainer.py")


def launch_imports(root: Path = ROOT) -> list[str]:
    """``path:line`` of every import of bundle.launch in the floors below it."""
    found = []
    for below in BELOW_LAUNCH:
        top = root / below
        for path in sorted(top.rglob("*.py") if top.is_dir() else [top] if top.exists() else []):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                if any(n == "bundle.launch" or n.startswith("bundle.launch.") for n in names):
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def test_the_floors_below_the_launch_never_import_it():
    assert launch_imports() == []


def test_the_floor_check_sees_an_import_inside_a_function(tmp_path):
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "late.py").write_text(
        "import os\n\n\ndef f():\n    from bundle import launch\n"
        "    from bundle.launch.process import x\n"
    )
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "up.py").write_text("import bundle.launch.supervisor\n")
    (tmp_path / "launch.py").write_text("from bundle import launch\n")  # not a floor below
    got = launch_imports(tmp_path)
    name = tmp_path.name
    assert got == [
        f"{name}/runtime/late.py:5",
        f"{name}/runtime/late.py:6",
        f"{name}/engine/up.py:1",
    ]


# What a process of a run that does not use them must start without, each imported where it is
# used: torchvision (the zoo), DCP (checkpoints), DTensor (via pipelining or ZeRO) and scikit-learn
# (the digits, read from its file) cost a second or more of every process's start-up; the planner
# (auto) a third of one.
HEAVY = (
    "torchvision",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "torch.distributed.pipelining",
    "torch.distributed.optim",
    "sklearn",
    "transformers",
    "timm",
    "bundle.plan.planner",  # the planner: only for --bundle-shape/--partition auto
)


def test_a_worker_starts_without_the_heavy_packages_it_does_not_use():
    probe = (
        "import sys\n"
        "import bundle.cli, bundle.preflight, bundle.session, bundle.trainer\n"
        "import bundle.launch.process, bundle.launch.supervisor\n"
        "from bundle import data\n"
        "from bundle.config import DataConfig\n"
        "data.load(DataConfig(dataset='digits'), seed=0)\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
