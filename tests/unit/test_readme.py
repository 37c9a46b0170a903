"""README stays true: its two commands are the Makefile's and CI's; its flags exist."""

from __future__ import annotations

import re
from pathlib import Path

from bundle import cli

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def commands() -> list[str]:
    block = README.split("## Run and test", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.strip().splitlines()]


def test_readme_gives_exactly_run_and_test_and_ci_runs_the_same_test():
    assert commands() == ["make run", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    recipes = dict(re.findall(r"^(\w+):.*\n\t(.*)", makefile, re.M))
    assert "main.py $(ARGS)" in recipes["run"] and "-m pytest" in recipes["test"]
    # The venv reuses the system's packages: PyTorch is not installed a second time.
    assert "--system-site-packages" in makefile
    ci = [line.split("#")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "make test" in ci and "make lint" in ci


def test_main_flags_named_in_the_readme_exist():
    """Every flag in the Usage section and on any ``main.py`` command line is a real flag."""
    usage = README.split("## Usage", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in README.splitlines() if re.search(r"main\.py\s+(\[|--)", ln)]
    help_text = cli.build_parser().format_help()
    flags = set(re.findall(r"(--[A-Za-z][\w-]*)", usage + "\n".join(lines)))
    assert "--bundle-shape" in flags
    for flag in flags:
        assert flag in help_text, flag
