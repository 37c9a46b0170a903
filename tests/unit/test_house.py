"""The house rules the code keeps, measured by walking the library's source (``bundle/`` and the
``models/`` it links to): no function over 80 lines or 8 parameters, no file over 450 lines, no
modules that import each other in a circle, each package's ``__init__`` a module map naming every
module of its package, floors that run one way (``FLOORS``: every import points to its own floor or
one below), and a worker that starts without the heavy packages it does not use."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import bundle

ROOT = Path(bundle.__file__).parent
MAX_LINES = 80
MAX_PARAMETERS = 8
MAX_FILE_LINES = 450


def library_files(root: Path = ROOT) -> list[Path]:
    """Every source file of the library, through the ``models`` link (which ``rglob`` does not
    follow), as paths under ``root``."""
    found = set(root.rglob("*.py"))
    for link in (p for p in root.iterdir() if p.is_symlink() and p.is_dir()):
        found |= {link / f.relative_to(link.resolve()) for f in link.resolve().rglob("*.py")}
    return sorted(found)


def function_lengths(root: Path = ROOT) -> list[tuple[int, str]]:
    """(lines, "path:line name") of every function and method, def line through last line."""
    found = []
    for path in library_files(root):
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


def parameter_counts(root: Path = ROOT) -> list[tuple[int, str]]:
    """(parameters, "path:line name") of every function and method: each parameter but
    ``self``/``cls``, ``*args`` and ``**kwargs`` one each."""
    found = []
    for path in library_files(root):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                named = [
                    x
                    for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)
                    if x.arg not in ("self", "cls")
                ]
                count = len(named) + bool(a.vararg) + bool(a.kwarg)
                found.append((count, f"{path.relative_to(root.parent)}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)


def test_no_function_takes_more_than_8_parameters():
    many = [f"{where} ({n})" for n, where in parameter_counts() if n > MAX_PARAMETERS]
    assert many == []


def test_the_parameter_check_counts_keyword_only_and_star_arguments(tmp_path):
    (tmp_path / "wide.py").write_text(
        "class C:\n    def m(self, a, /, b, *rest, c, d=1, **kw):\n        pass\n"
    )
    assert parameter_counts(tmp_path) == [(6, f"{tmp_path.name}/wide.py:2 m")]


def file_lengths(root: Path = ROOT) -> list[tuple[int, str]]:
    """(lines, path) of every library file, longest first."""
    found = [
        (len(p.read_text().splitlines()), str(p.relative_to(root.parent)))
        for p in library_files(root)
    ]
    return sorted(found, reverse=True)


def test_no_library_file_is_longer_than_450_lines():
    long = [f"{where} ({n} lines)" for n, where in file_lengths() if n > MAX_FILE_LINES]
    assert long == []


def test_the_file_check_reads_through_the_models_link(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "big.py").write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    (tmp_path / "lib" / "models").symlink_to(tmp_path / "elsewhere")
    assert file_lengths(tmp_path / "lib") == [(MAX_FILE_LINES + 1, "lib/models/big.py")]


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Each library module -> the library modules it imports (at the top or in a function): a
    ``from package import name`` names the module ``name`` where there is one, else the package."""
    paths = {}
    for path in library_files(root):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {m: set() for m in paths}
    for module, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                while name not in paths and "." in name:
                    name = name.rpartition(".")[0]
                if name in paths and name != module:
                    graph[module].add(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import one another in a circle (strongly connected, 2 or more)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:  # Tarjan's, on a graph of a hundred nodes
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return found


def test_no_modules_import_each_other_in_a_circle():
    assert circles(import_graph()) == []


def test_the_circle_check_sees_a_circle_through_an_import_inside_a_function(tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "__init__.py").write_text("")
    (lib / "a.py").write_text("from lib import b\n")
    (lib / "b.py").write_text("def f():\n    from lib.c import x\n")
    (lib / "c.py").write_text("import lib.a\n")
    (lib / "d.py").write_text("from lib import a\n")  # into the circle, not part of it
    assert circles(import_graph(lib)) == [["lib.a", "lib.b", "lib.c"]]


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


# The floors, lowest first. Each top-level module or package of the library (``__init__``: the
# root's own map) stands on exactly one, and imports only from its own floor or the ones below, at
# the top or inside a function. A new module is placed here before anything imports it.
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # leaves: each imports at most the errors
    (
        "ground",
        (
            "__init__",
            "errors",
            "log",
            "rows",
            "row_weights",
            "lr_schedule",
            "plan_file",
        ),
    ),
    # pure values built once from the config: the config itself, the topology, the schedule IR
    ("pure", ("config", "topology", "ir")),
    # what a training process stands on: devices, the job's store, groups, watchdogs; the
    # collectives of its NCCL groups and their emulation
    ("runtime", ("runtime", "collectives")),
    # timing, metrics, traces: the engine laps the step timer
    ("observe", ("observe",)),
    # what is trained: the models (built, their partition specs, cut into pieces) and their data
    ("models", ("models", "data")),
    # the model's pieces run as stages, and one stage's step
    ("engine", ("engine",)),
    ("checkpoint", ("checkpoint",)),
    ("session", ("session",)),
    ("trainer", ("evaluate", "trainer")),
    # the processes of a job started, supervised, restarted
    ("launch", ("launch",)),
    # before a run: the planner (it measures through launch's local worlds) and every check
    ("before a run", ("plan", "preflight")),
    # the doors: the command line, train() from Python, sampling after training
    ("entry", ("cli", "api", "generate")),
)


def room(module: str) -> str:
    """The top-level module or package a library module is part of (``__init__``: the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def floor_faults(
    graph: dict[str, set[str]], floors: tuple[tuple[str, tuple[str, ...]], ...] = FLOORS
) -> list[str]:
    """What breaks the floors: a room on two floors or on none, a room placed that is not there,
    and every import that points to a floor above its own."""
    level: dict[str, int] = {}
    faults = []
    for i, (_, rooms) in enumerate(floors):
        for r in rooms:
            if r in level:
                faults.append(f"{r}: on two floors")
            level[r] = i
    faults += [f"{m}: on no floor" for m in sorted(graph) if room(m) not in level]
    faults += [f"{r}: placed, but not there" for r in sorted(set(level) - set(map(room, graph)))]
    for m in sorted(graph):
        for d in sorted(graph[m]):
            here, there = level.get(room(m), -1), level.get(room(d), -1)
            if here >= 0 and there > here:
                faults.append(
                    f"{m} ({floors[here][0]}) imports {d} ({floors[there][0]}), a floor above"
                )
    return faults


def test_every_import_points_to_its_own_floor_or_one_below():
    assert floor_faults(import_graph()) == []


def test_the_floor_check_sees_an_import_up_inside_a_function_and_a_module_on_no_floor(tmp_path):
    lib = tmp_path / "lib"
    (lib / "mid").mkdir(parents=True)
    (lib / "__init__.py").write_text("")
    (lib / "low.py").write_text("import os\n\n\ndef f():\n    from lib.high import x\n")
    (lib / "mid" / "__init__.py").write_text("")
    (lib / "mid" / "part.py").write_text("import lib.high.top\n")
    (lib / "high.py").write_text("from lib import low, mid\n")  # down: allowed
    (lib / "new.py").write_text("")
    floors = (("low", ("__init__", "low")), ("mid", ("mid", "gone")), ("high", ("high",)))
    assert floor_faults(import_graph(lib), floors) == [
        "lib.new: on no floor",
        "gone: placed, but not there",
        "lib.low (low) imports lib.high (high), a floor above",
        "lib.mid.part (mid) imports lib.high (high), a floor above",
    ]
    twice = (("a", ("__init__",)), ("b", ("__init__",)))
    assert floor_faults({"lib": set()}, twice) == ["__init__: on two floors"]


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


# The job's store is one namespace, spelled in bundle/runtime/keys.py: nowhere else does a call of
# a store method take a string or an f-string for its key.
STORE_METHODS = {"set", "get", "add", "check", "compare_set", "wait", "delete_key"}  # a key
STORE_METHODS |= {"multi_get", "multi_set"}  # a list of keys
KEYS_MODULE = Path("bundle", "runtime", "keys.py")


def _names_a_store(node: ast.expr) -> bool:
    """``store``, ``_store``, ``job_store``, ``self.store``, ``x._store`` ..."""
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
    return name in ("store", "_store") or name.endswith("_store")


def _spelled_in_place(node: ast.expr) -> bool:
    """A string, an f-string, or a list or tuple holding one (``store.check([...])``)."""
    if isinstance(node, ast.List | ast.Tuple):
        return any(_spelled_in_place(e) for e in node.elts)
    return isinstance(node, ast.JoinedStr) or (
        isinstance(node, ast.Constant) and isinstance(node.value, str)
    )


def spelled_store_keys(root: Path = ROOT) -> list[str]:
    """Every store call outside the keys module whose key is spelled in place, as
    "path:line store.method"."""
    found = []
    for path in library_files(root):
        where = path.relative_to(root.parent)
        if where == KEYS_MODULE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in STORE_METHODS
                and _names_a_store(node.func.value)
            ):
                continue
            key = node.args[:1] + [k.value for k in node.keywords if k.arg in ("key", "keys")]
            if any(_spelled_in_place(k) for k in key):
                found.append(f"{where}:{node.lineno} {ast.unparse(node.func)}")
    return sorted(found)


def test_every_store_key_is_spelled_in_the_keys_module():
    assert spelled_store_keys() == []


def test_the_store_key_check_sees_a_key_spelled_in_place(tmp_path):
    lib = tmp_path / "bundle"
    (lib / "runtime").mkdir(parents=True)
    (lib / "runtime" / "keys.py").write_text('def f(store):\n    store.set("bundle/abort", "")\n')
    (lib / "a.py").write_text(
        "def f(store, self, keys, cache):\n"
        '    store.set("bundle/abort", "x")\n'
        '    self.store.check([f"ft/{1}/members"])\n'
        '    self._store.wait(keys=["a"])\n'
        "    self.store.get(keys.ABORT)\n"
        '    cache.get("bundle/abort")\n'
    )
    assert spelled_store_keys(lib) == [
        "bundle/a.py:2 store.set",
        "bundle/a.py:3 self.store.check",
        "bundle/a.py:4 self._store.wait",
    ]
