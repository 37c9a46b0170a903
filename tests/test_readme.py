"""README stays true: its set-up and test commands are the ones CI runs; its flags exist."""

from __future__ import annotations

import re
from pathlib import Path

import main

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def commands() -> list[str]:
    block = README.split("## Set-up, run, test", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.strip().splitlines()]


def test_readme_gives_exactly_set_up_run_and_test():
    setup, run, test = commands()
    assert run == "python main.py"
    ci = (ROOT / ".ci" / "run").read_text()
    assert setup in ci and test in ci


def test_main_flags_named_in_the_readme_exist():
    """Every flag in the Usage section and on any ``main.py`` command line is a real flag."""
    usage = README.split("## Usage", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in README.splitlines() if re.search(r"main\.py\s+(\[|--)", ln)]
    help_text = main.build_parser().format_help()
    flags = set(re.findall(r"(--[A-Za-z][\w-]*)", usage + "\n".join(lines)))
    assert "--bundle-shape" in flags
    for flag in flags:
        assert flag in help_text, flag
