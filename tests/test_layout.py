"""The package's layers, checked on its import graph.

Every file of ``mptrain/`` is parsed (imports inside functions and classes
included, relative imports resolved), and the test fails, naming the file, the
line and the import, on:

- an import from a layer to one above it in :data:`ORDER` (the package root's
  own modules, ``mptrain/*.py``, are the commands layer on top);
- an import circle between modules, at any depth;
- an import of an mptrain module inside a function (lazy imports are for heavy
  optional third-party packages only);
- a subpackage ``__init__.py`` without a docstring (its one-line charter) or
  with any import in it.

``mptrain/__init__.py`` runs before every submodule, so it may import only from
``core``. ``test_checker_catches_each_kind_of_violation`` runs the same checker
on a small tree with one planted violation of each kind.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Bottom to top. The package root's modules (mptrain/*.py) are the commands layer above all of these.
ORDER = ("core", "config", "model", "data", "precision", "plan", "distributed", "observe", "checkpoint", "run", "advice", "compare")
COMMANDS = len(ORDER)


@dataclass(frozen=True)
class Edge:
    src: str  # importing module, dotted
    dst: str  # imported module, dotted
    file: str  # path relative to the tree's parent, e.g. mptrain/run/step.py
    line: int
    text: str  # the import statement as written (unparsed)
    local: bool  # inside a function body


def _module_name(pkg_root: Path, path: Path) -> str:
    parts = list(path.relative_to(pkg_root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(pkg_root: Path, dotted: str) -> bool:
    """A dotted name under the package that is a module or a subpackage on disk."""
    rel = Path(*dotted.split(".")[1:]) if "." in dotted else Path()
    base = pkg_root / rel
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _resolve(pkg_root: Path, name: str, is_pkg: bool, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The project modules an import statement loads (empty for third-party ones)."""
    top = pkg_root.name
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name == top or a.name.startswith(top + ".")]
    if node.level:
        here = name.split(".") if is_pkg else name.split(".")[:-1]
        base_parts = here[:len(here) - (node.level - 1)] if node.level > 1 else here
        base = ".".join(base_parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if base != top and not base.startswith(top + "."):
        return []
    out = []
    for a in node.names:
        sub = f"{base}.{a.name}"
        out.append(sub if a.name != "*" and _is_module(pkg_root, sub) else base)
    return out


class _Collector(ast.NodeVisitor):
    def __init__(self, pkg_root: Path, name: str, is_pkg: bool, file: str):
        self.pkg_root, self.name, self.is_pkg, self.file = pkg_root, name, is_pkg, file
        self.depth = 0
        self.edges: list[Edge] = []

    def _function(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _import(self, node):
        for dst in dict.fromkeys(_resolve(self.pkg_root, self.name, self.is_pkg, node)):
            self.edges.append(Edge(self.name, dst, self.file, node.lineno, ast.unparse(node), self.depth > 0))

    visit_Import = visit_ImportFrom = _import


def _layer(pkg_root: Path, dotted: str) -> Optional[int]:
    """Index in ORDER; COMMANDS for mptrain/*.py; 0 for the package root (it runs first); None if undeclared."""
    parts = dotted.split(".")
    if len(parts) == 1:
        return 0
    if parts[1] in ORDER:
        return ORDER.index(parts[1])
    return None if (pkg_root / parts[1]).is_dir() else COMMANDS


def _layer_name(i: int) -> str:
    return ORDER[i] if i < COMMANDS else "commands (mptrain/*.py)"


def _cycles(edges: list[Edge]) -> list[list[Edge]]:
    """One circle per strongly connected component of the module graph (Tarjan)."""
    graph: dict[str, list[Edge]] = {}
    for e in edges:
        graph.setdefault(e.src, []).append(e)
        graph.setdefault(e.dst, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[set[str]] = []

    def strong(v: str) -> None:  # recursion depth is bounded by the number of modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for e in graph[v]:
            if e.dst not in index:
                strong(e.dst)
                low[v] = min(low[v], low[e.dst])
            elif e.dst in on:
                low[v] = min(low[v], index[e.dst])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            strong(v)
    out = []
    for comp in comps:
        self_loop = [e for e in graph[next(iter(comp))] if e.dst == e.src]
        if len(comp) == 1 and not self_loop:
            continue
        if self_loop:
            out.append(self_loop[:1])
            continue
        # Walk inside the component from its smallest module until a module repeats: that is a circle.
        start = min(comp)
        path, seen, v = [], {start: 0}, start
        while True:
            e = min((e for e in graph[v] if e.dst in comp), key=lambda e: e.dst)
            path.append(e)
            v = e.dst
            if v in seen:
                out.append(path[seen[v]:])
                break
            seen[v] = len(path)
    return out


def check(pkg_root: Path) -> list[str]:
    """Every layering problem of the package at ``pkg_root``, one line each: ``file:line: import -- why``."""
    problems: list[str] = []
    edges: list[Edge] = []
    root = pkg_root.name
    undeclared: set[str] = set()
    for path in sorted(pkg_root.rglob("*.py")):
        file = path.relative_to(pkg_root.parent).as_posix()
        name = _module_name(pkg_root, path)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=file)
        collector = _Collector(pkg_root, name, path.name == "__init__.py", file)
        collector.visit(tree)
        edges += collector.edges
        if path.name == "__init__.py" and path.parent != pkg_root:
            if not ast.get_docstring(tree):
                problems.append(f"{file}:1: no docstring -- a subpackage's __init__.py holds its one-line charter")
            for node in ast.walk(tree):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    problems.append(f"{file}:{node.lineno}: {ast.unparse(node)} -- a subpackage's __init__.py "
                                    "imports nothing (import the module itself where it is needed)")
        if _layer(pkg_root, name) is None and name.split(".")[1] not in undeclared:
            undeclared.add(name.split(".")[1])
            problems.append(f"{file}:1: package {name.split('.')[1]!r} is not in tests/test_layout.py ORDER "
                            "-- declare its place among the layers")
    for e in edges:
        if e.local:
            problems.append(f"{e.file}:{e.line}: {e.text} -- an mptrain import inside a function; import it at "
                            "the top of the module (only heavy optional third-party packages are imported lazily)")
        src, dst = _layer(pkg_root, e.src), _layer(pkg_root, e.dst)
        if src is not None and dst is not None and dst > src:
            who = ("the package root, which runs before every module and may import only core," if e.src == root
                   else _layer_name(src))
            problems.append(f"{e.file}:{e.line}: {e.text} -- {who} imports from "
                            f"{_layer_name(dst)}, a layer above it (imports run downward only: {' < '.join(ORDER)} "
                            "< commands)")
    for circle in _cycles(edges):
        steps = "; ".join(f"{e.file}:{e.line}: {e.text}" for e in circle)
        chain = " -> ".join([circle[0].src] + [e.dst for e in circle])
        problems.append(f"import circle {chain}: {steps}")
    return problems


def test_imports_run_downward_with_no_circle():
    problems = check(ROOT / "mptrain")
    assert not problems, "layering problems:\n" + "\n".join(problems)


def test_every_declared_layer_is_a_subpackage_with_a_charter():
    for name in ORDER:
        init = ROOT / "mptrain" / name / "__init__.py"
        assert init.is_file(), f"layer {name!r} of ORDER has no mptrain/{name}/__init__.py"


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / "mptrain" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root / "mptrain"


CLEAN = {
    "__init__.py": '"""root"""\nfrom mptrain.core.a import f\n',
    "core/__init__.py": '"""Layer 0."""\n',
    "core/a.py": "def f():\n    import json  # third-party lazy import: fine\n    return json\n",
    "run/__init__.py": '"""Layer 7."""\n',
    "run/b.py": "from mptrain.core import a\nfrom . import c\nimport torch\n",
    "run/c.py": "from ..core.a import f\n",
    "tool.py": "from mptrain.run import b\n",
}


def test_checker_passes_a_clean_tree(tmp_path):
    assert check(_tree(tmp_path, CLEAN)) == []


@pytest.mark.parametrize("rel, text, expected", [
    ("core/a.py", "from mptrain.run.b import x\n",
     "mptrain/core/a.py:1: from mptrain.run.b import x -- core imports from run, a layer above it"),
    ("core/a.py", "import os\n\nfrom ..run import c\n",
     "mptrain/core/a.py:3: from ..run import c -- core imports from run"),
    ("run/b.py", "import mptrain.tool\n", "mptrain/run/b.py:1: import mptrain.tool -- run imports from commands"),
    ("run/c.py", "def g():\n    from mptrain.core.a import f\n    return f\n",
     "mptrain/run/c.py:2: from mptrain.core.a import f -- an mptrain import inside a function"),
    ("run/c.py", "from . import b\n", "import circle mptrain.run.b -> mptrain.run.c -> mptrain.run.b: "
                                      "mptrain/run/b.py:2: from . import c; mptrain/run/c.py:1: from . import b"),
    ("run/__init__.py", '"""Layer 7."""\nfrom . import b\n',
     "mptrain/run/__init__.py:2: from . import b -- a subpackage's __init__.py imports nothing"),
    ("run/__init__.py", "x = 1\n", "mptrain/run/__init__.py:1: no docstring"),
    ("__init__.py", '"""root"""\nfrom mptrain.run import b\n',
     "mptrain/__init__.py:2: from mptrain.run import b -- the package root, which runs before every module and "
     "may import only core, imports from run"),
    ("extra/__init__.py", '"""?"""\n', "mptrain/extra/__init__.py:1: package 'extra' is not in"),
])
def test_checker_catches_each_kind_of_violation(tmp_path, rel, text, expected):
    problems = check(_tree(tmp_path, {**CLEAN, rel: text}))
    assert any(p.startswith(expected) for p in problems), problems


# ------------------------------------------------------------------ sizes and the plan of the run
LONGEST = 700
"""No module is longer than this (the schema aside: a docstring per config field); a
file past it usually holds two concerns."""
TRAINER_IMPORTS = 15
"""``run/trainer.py`` reads as the run's table of contents: it imports at most this many
project modules (what builds, what it calls in the loop, what it records; the precision
phases' schedule is the loop's, since precision can change within a run; the thread count
is set around the whole run, since on a CPU it is part of the run's arithmetic)."""
ONE_PLACE = {"choose": "mptrain/plan/build.py", "mesh_shape": "mptrain/plan/build.py",
             "micro_steps": "mptrain/plan/build.py", "adopt_init_from": "mptrain/plan/build.py",
             "precision_plan": "mptrain/plan/build.py"}
"""Each derived fact of a run computed in one place, the plan's builder: the optimizer
choice, the mesh, the micro-batches, the model ``model.init_from`` makes, the precision
(its dtypes and recipe); everything else reads them from the plan."""


def _project_imports(path: Path) -> set[str]:
    pkg = ROOT / "mptrain"
    collector = _Collector(pkg, _module_name(pkg, path), path.name == "__init__.py", path.as_posix())
    collector.visit(ast.parse(path.read_text(encoding="utf-8")))
    return {e.dst for e in collector.edges}


def test_no_module_is_longer_than_its_limit():
    long = {p.relative_to(ROOT).as_posix(): n for p in (ROOT / "mptrain").rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > LONGEST}
    long.pop("mptrain/config/schema.py", None)
    assert not long, f"modules over {LONGEST} lines: {long}"


def test_the_trainer_imports_few_project_modules():
    found = _project_imports(ROOT / "mptrain" / "run" / "trainer.py")
    assert len(found) <= TRAINER_IMPORTS, sorted(found)


def test_each_derived_fact_of_a_run_is_computed_in_one_place():
    calls: dict[str, set[str]] = {name: set() for name in ONE_PLACE}
    for path in (ROOT / "mptrain").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if name in calls:
                    calls[name].add(path.relative_to(ROOT).as_posix())
    assert calls == {name: {where} for name, where in ONE_PLACE.items()}, calls
