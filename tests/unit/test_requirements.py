"""What the runtime imports is what requirements.txt installs: every module-level import of a
third-party package in bundle/, models/ and main.py comes from a distribution requirements.txt
names (not one that only the dev requirements or this machine bring), and every import made only
when a feature asks for it comes from one of those or from an optional package the README names.
The containers, Slurm and Kubernetes install that same file."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from tests.support.runtime_only.sitecustomize import named, normalized

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "requirements.txt"
OWN = {"bundle", "models", "tests"}
# importlib calls whose first argument names a package imported when a feature asks for it
_DYNAMIC = {"import_module", "find_spec"}


def sources() -> Iterator[Path]:
    yield ROOT / "main.py"
    for folder in ("bundle", "models"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.relative_to(ROOT).parts[:2] != ("bundle", "models"):  # a link to models/
                yield path


def imports(tree: ast.Module) -> Iterator[tuple[int, str, bool]]:
    """(line, top-level name, at module level) of each absolute import, importlib's by name too;
    module level is what runs on import: the module's body, its classes, its ifs and trys."""

    def walk(node: ast.AST, top: bool) -> Iterator[tuple[int, str, bool]]:
        for child in ast.iter_child_nodes(node):
            inside = top and not isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            )
            if isinstance(child, ast.Import):
                yield from ((child.lineno, a.name.split(".")[0], inside) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                yield child.lineno, child.module.split(".")[0], inside
            elif (
                isinstance(child, ast.Call)
                and getattr(child.func, "attr", getattr(child.func, "id", None)) in _DYNAMIC
                and child.args
                and isinstance(child.args[0], ast.Constant)
                and isinstance(child.args[0].value, str)
            ):
                yield child.lineno, child.args[0].value.split(".")[0], inside
            yield from walk(child, inside)

    yield from walk(tree, True)


def third_party() -> Iterator[tuple[str, str, bool]]:
    """(where, top-level name, at module level) of each import of a package that is not ours and
    not the standard library's."""
    for path in sources():
        for line, name, top in imports(ast.parse(path.read_text(), str(path))):
            if name not in sys.stdlib_module_names and name not in OWN and name != "__future__":
                yield f"{path.relative_to(ROOT)}:{line}", name, top


@functools.cache
def installed() -> Mapping[str, list[str]]:
    """Top-level import name -> the distributions that provide it (a scan of every one)."""
    return importlib.metadata.packages_distributions()


def distributions(name: str) -> set[str]:
    return {normalized(d) for d in installed().get(name, [])}


def optional_in_readme() -> set[str]:
    """The packages the README's "Optional packages" line names, each for a feature of its own."""
    text = (ROOT / "README.md").read_text()
    item = text[text.index("- **Optional packages**") :].split("\n- ", 1)[0]
    return {normalized(n) for n in re.findall(r"`([A-Za-z0-9_-]+)` \(", item)}


def test_every_module_level_import_comes_from_a_distribution_requirements_txt_names():
    runtime = named(str(REQUIREMENTS))
    found = [(where, name) for where, name, top in third_party() if top]
    assert found, "the scan found no module-level import: it reads nothing"
    wrong = [
        f"{where}: import {name} ({', '.join(sorted(distributions(name))) or 'no distribution'})"
        for where, name in found
        if not distributions(name) & runtime
    ]
    assert not wrong, "not in requirements.txt:\n" + "\n".join(wrong)


def test_an_import_only_a_feature_makes_is_a_runtime_or_a_documented_optional_package():
    allowed = named(str(REQUIREMENTS)) | optional_in_readme()
    found = [(where, name) for where, name, top in third_party() if not top]
    assert {"transformers", "datasets"} <= {name for _, name in found}
    wrong = [
        f"{where}: import {name}"
        for where, name in found
        if not ({normalized(name)} | distributions(name)) & allowed
    ]
    assert not wrong, "neither in requirements.txt nor optional in the README:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    "source",
    [
        "import safetensors\n",
        "try:\n    import safetensors\nexcept ImportError:\n    pass\n",
        "class A:\n    from safetensors import safe_open\n",
        "if True:\n    import safetensors.torch\n",
    ],
)
def test_the_scan_sees_an_import_at_module_level_wherever_it_stands(source):
    """The static test can fail: a module-level import, bare, guarded or in a class body."""
    assert [(n, top) for _, n, top in imports(ast.parse(source))] == [("safetensors", True)]


def test_the_scan_tells_an_import_a_function_makes_by_name_or_through_importlib():
    source = "def f():\n    import transformers\n    return importlib.import_module('pyarrow')\n"
    found = [(n, top) for _, n, top in imports(ast.parse(source))]
    assert found == [("transformers", False), ("pyarrow", False)]


def test_the_image_slurm_and_kubernetes_install_requirements_txt_and_nothing_of_their_own():
    """One source of truth for the runtime set: the image installs requirements.txt (its pins in
    docker/constraints.txt name exactly the same packages, torch and torchvision taken from the
    base image), Slurm runs the environment ``make`` installs from it, Kubernetes runs the image."""
    dockerfile = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    installs = re.findall(r"pip install ([^&\n]*)", dockerfile)
    assert installs and all("-r /app/requirements.txt" in line for line in installs), installs
    assert all(
        word.startswith("-") or word.endswith(".txt") for line in installs for word in line.split()
    ), installs
    pinned = named(str(ROOT / "docker" / "constraints.txt"))
    assert pinned == named(str(REQUIREMENTS)) - {"torch", "torchvision"}
    for path in ("scripts/slurm/bundle.sbatch", "docker/k8s/bundle.yaml"):
        assert "pip install" not in (ROOT / path).read_text(), path
    assert "image: bundle:" in (ROOT / "docker/k8s/bundle.yaml").read_text()
    assert "$dir/.venv/bin/python" in (ROOT / "scripts/slurm/bundle.sbatch").read_text()


def test_each_way_to_a_transformers_class_says_how_to_install_it_when_it_is_missing(monkeypatch):
    """--model transformers:CLASS, export --hf and bundle.generate of a checkpoint that records
    such a class: one line with the command, not "not a model class"."""
    from bundle import generate
    from bundle.checkpoint import hf_export
    from bundle.errors import ConfigError
    from bundle.models import hf, refs

    monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ModuleNotFoundError
    calls = [
        lambda: refs.load_callable("transformers:GPT2LMHeadModel", "--model"),
        lambda: hf_export.model_class("GPT2LMHeadModel", "bundle.json hf_config class"),
        lambda: generate._transformers_model("GPT2LMHeadModel", "bundle.json model"),
    ]
    for call in calls:
        with pytest.raises(ConfigError, match=re.escape(hf.install_command())):
            call()
