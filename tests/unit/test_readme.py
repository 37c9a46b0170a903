"""README and docs/*.md stay true: the two commands, flags, make targets, paths, links, anchors."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from bundle.config import options

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Pages that name repository paths and link to others, beside the README and docs.
NAMING = [*PAGES, ROOT / "partitions" / "README.md"]
MAX_README_LINES = 250

FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.M | re.S)  # also inside a list
SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")
FLAG = re.compile(r"(?<![\w-])(--[A-Za-z][\w-]*)")
# Repository paths as code names them: top-level folders and root files, never /abs/paths.
PATH = re.compile(
    r"(?<![\w./~-])("
    r"(?:bundle|models|scripts|tests|docs|partitions|configs|clusters|docker|\.ci)/[\w./-]*"
    r"|main\.py|Makefile|Dockerfile|pyproject\.toml|requirements(?:-dev)?\.txt|run-bundle-hp\.sh"
    r")"
)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def blocks(text: str) -> list[str]:
    """Fenced code blocks, backslash continuations joined."""
    return [b.replace("\\\n", " ") for b in FENCE.findall(text)]


def prose(text: str) -> str:
    return FENCE.sub("", text)


def spans(text: str) -> list[str]:
    """Inline code spans (one may wrap over a line)."""
    return [s.replace("\n", " ") for s in SPAN.findall(prose(text))]


def code(text: str) -> list[str]:
    return blocks(text) + spans(text)


def main_flags() -> set[str]:
    """Every spelling the parser accepts (aliases included), from the one options table."""
    parser = argparse.ArgumentParser()
    options.add_arguments(parser)
    return {s for action in parser._actions for s in action.option_strings}


def flags_shown(text: str) -> set[str]:
    """Flags given to main.py: on its command lines, in `make run ARGS`, after the sbatch script
    (which passes them on), and in the first column of tables headed `flag`."""
    found: set[str] = set()
    for chunk in code(text):
        for line in chunk.splitlines():
            line = re.sub(r"\s#\s.*", "", line)  # a shell comment is not an argument
            for rest in re.findall(r"(?:main\.py|bundle\.sbatch)\s(.*)", line):
                found |= set(FLAG.findall(rest))
            for args in re.findall(r"make run ARGS=\"([^\"]*)\"", line):
                found |= set(FLAG.findall(args))
    header = None
    for line in prose(text).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.lstrip().startswith("|"):
            header = None
        elif header is None:
            header = cells[0]
        elif header == "flag" and not set(cells[0]) <= set("-: "):
            found |= set(FLAG.findall(cells[0]))
    return found


def make_targets() -> set[str]:
    makefile = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*):(?!=)", makefile, re.M))


def make_targets_named(text: str) -> set[str]:
    return {t for chunk in code(text) for t in re.findall(r"(?<![\w-])make ([a-z][\w-]*)", chunk)}


def missing_paths(text: str) -> list[str]:
    """Repository paths named in code that do not exist; an all-capitals part (``NAME.yaml``,
    ``MODEL_SPLIT``) marks a placeholder."""
    missing = []
    for chunk in code(text):
        for path in PATH.findall(chunk):
            path = path.rstrip(".,")
            if (ROOT / path).exists():
                continue
            parts = re.split(r"[/.]", path)
            if not any(re.fullmatch(r"[A-Z][A-Z_]*", p) for p in parts):
                missing.append(path)
    return missing


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.*)$", prose(text), re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def resolves(page: Path, text: str, target: str) -> bool:
    """A relative link: its file exists and, where it names one, its anchor is a heading there."""
    file, _, anchor = target.partition("#")
    if file:
        dest = (page.parent / file).resolve()
        if not dest.exists():
            return False
        if not anchor:
            return True
        text = dest.read_text() if dest.suffix == ".md" else ""
    return anchor in anchors(text)


def broken_links(page: Path, text: str) -> list[str]:
    targets = LINK.findall(prose(text))
    # https:, mailto: and the like are not the repository's to keep.
    return [t for t in targets if not re.match(r"[a-z]+:", t) and not resolves(page, text, t)]


def readme_commands() -> list[str]:
    block = README.split("## Run and test", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.strip().splitlines()]


def test_readme_gives_exactly_run_and_test_and_ci_runs_the_same_test():
    assert readme_commands() == ["make run", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    recipes = dict(re.findall(r"^(\w+):.*\n((?:\t.*\n)+)", makefile, re.M))
    assert "main.py $(ARGS)" in recipes["run"] and "-m pytest" in recipes["test"]
    # The venv reuses the system's packages: PyTorch is not installed a second time.
    assert "--system-site-packages" in makefile
    ci = [line.split("#")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    # make run first, while the environment holds requirements.txt alone (lint adds the rest)
    first_run = next(i for i, line in enumerate(ci) if line.startswith("make run"))
    assert first_run < ci.index("make lint") < ci.index("make test")


def test_readme_is_short():
    lines = len(README.splitlines())
    assert lines <= MAX_README_LINES


def test_the_usage_section_names_real_flags_among_them_the_originals_and_their_aliases():
    usage = README.split("## Usage", 1)[1].split("\n## ", 1)[0]
    flags = set(FLAG.findall(usage))
    original = {"--batch-size", "--rank", "--itr", "--bundle-shape", "--num-bundle", "--IP"}
    original |= {"--portNum", "--model", "--world-size", "--DP-ONLY"}
    aliases = {"--steps", "--num-nodes", "--master-addr", "--master-port"}
    assert original | aliases <= flags
    assert sorted(flags - main_flags()) == []


def test_the_docs_pages_are_there():
    names = {p.name for p in PAGES}
    assert {"multi-node.md", "clusters.md", "checkpoints.md", "performance.md"} <= names
    assert {"gpu.md", "planner.md", "observing.md", "design.md", "configuration.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_main_flag_shown_exists(page):
    assert sorted(flags_shown(page.read_text()) - main_flags()) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_make_target_named_exists(page):
    assert sorted(make_targets_named(page.read_text()) - make_targets()) == []


@pytest.mark.parametrize("page", NAMING, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_script_and_path_named_exists(page):
    assert missing_paths(page.read_text()) == []


@pytest.mark.parametrize("page", NAMING, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    assert broken_links(page, page.read_text()) == []


def resuming_without_a_save_dir(text: str) -> list[str]:
    """main.py command lines in code blocks that resume the newest checkpoint (``--resume auto``)
    without naming the save directory it is in: copied, they cannot run."""
    return [
        line.strip()
        for block in blocks(text)
        for line in block.splitlines()
        if "main.py" in line and "--resume auto" in line and "--save-dir" not in line
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_that_resumes_the_newest_checkpoint_names_its_save_dir(page):
    assert resuming_without_a_save_dir(page.read_text()) == []


def test_the_checks_catch_what_they_are_for():
    page = ROOT / "docs" / "example.md"
    bad = (
        "# Example\n\n```bash\npython main.py --no-such-flag \\\n    --also-not\nmake no-such-target\n"
        'make run ARGS="--nor-this"\n```\n\n| flag | meaning |\n| --- | --- |\n| `--nor-that` | x |\n\n'
        "`scripts/no_such.py`, `bundle/gone.py::f`, `partitions/NAME.yaml`, [a](nope.md), "
        "[b](design.md#no-such-anchor), [c](#example), [d](#nowhere), <https://example.com>\n"
    )
    assert flags_shown(bad) == {"--no-such-flag", "--also-not", "--nor-this", "--nor-that"}
    assert make_targets_named(bad) == {"no-such-target", "run"}
    assert missing_paths(bad) == ["scripts/no_such.py", "bundle/gone.py"]
    assert broken_links(page, bad) == ["nope.md", "design.md#no-such-anchor", "#nowhere"]
    assert slug("On a GPU: `make gpu-check`") == "on-a-gpu-make-gpu-check"
    resumes = (
        "```bash\npython main.py ... --resume auto\npython main.py --save-dir d --resume auto\n```"
    )
    assert resuming_without_a_save_dir(resumes) == ["python main.py ... --resume auto"]
