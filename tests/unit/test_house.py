"""The house rules the code keeps: no function in bundle/ over 80 lines, and each package's
``__init__`` a module map naming every module of its package."""

from __future__ import annotations

import ast
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
