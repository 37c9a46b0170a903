"""The examples take what a user running two of them at once needs: a port of their own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.py"))


def flags(path: Path) -> set[str]:
    """The flags an example's argparse parser declares."""
    return {
        arg.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "add_argument"
        for arg in node.args
        if isinstance(arg, ast.Constant) and str(arg.value).startswith("--")
    }


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_that_trains_takes_a_port(path):
    if "train(" in path.read_text():
        assert "--port" in flags(path), f"{path.name}: no --port (its job would take 29500 first)"


def test_the_examples_are_there():
    assert {p.name for p in EXAMPLES} >= {"custom_model.py", "hf_causal_lm.py"}
