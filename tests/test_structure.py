"""Structure rules of the code base, checked on its source (imports and syntax trees):

- run paths are computed only by the run's stores: RunLayout and `filesystem(` appear only in
  buffer/layout.py (the definitions), buffer/storage.py, buffer/stores/* and buffer/run.py;
- `launch/` imports the roles (rollout, trainer, buffer), never the reverse;
- no import circle among the project's modules (function-level imports included);
- rollout/ and trainer/ never compare `transport` (the Run picks the implementations).

Each rule is a function of parsed sources, so the tests below also feed it a violation and see
it caught.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("buffer", "rollout", "trainer", "launch", "protocol")
ROLES = ("buffer", "rollout", "trainer")
PATHS_ALLOWED = ("buffer/layout.py", "buffer/storage.py", "buffer/run.py", "buffer/checkpoints.py",
                 "buffer/experience/", "buffer/weights/", "buffer/control/")
PATH_NAMES = ("RunLayout", "filesystem")


def sources() -> dict[str, ast.Module]:
    """Module name -> syntax tree of every project module."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = ast.parse(path.read_text(), str(path))
    return out


def imports(module: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The project modules `module` imports, anywhere in it (`from a import b` counts a.b when
    that is a module, else a)."""
    out = set()
    package = module if module in known and any(k.startswith(module + ".") for k in known) else \
        module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # a.b.c -> the deepest project module named
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def path_violations(trees: dict[str, ast.Module]) -> list[str]:
    """Uses of RunLayout or filesystem( outside the stores."""
    out = []
    for module, tree in trees.items():
        rel = module.replace(".", "/")
        if any((rel + ".py").startswith(a) or (rel + "/").startswith(a) for a in PATHS_ALLOWED):
            continue
        for node in ast.walk(tree):
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) \
                else None
            if isinstance(node, ast.alias):
                name = node.name
            if name in PATH_NAMES:
                out.append(f"{module}:{getattr(node, 'lineno', '?')} uses {name}")
    return out


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports of launch from the roles."""
    return [f"{m} imports {d}" for m, deps in sorted(graph.items())
            if m.split(".")[0] in ROLES for d in sorted(deps) if d.split(".")[0] == "launch"]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def transport_violations(trees: dict[str, ast.Module]) -> list[str]:
    """Comparisons involving something named `transport` in rollout/ and trainer/."""
    out = []
    for module, tree in trees.items():
        if module.split(".")[0] not in ("rollout", "trainer"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                named = {n.attr if isinstance(n, ast.Attribute) else n.id
                         for n in ast.walk(node) if isinstance(n, (ast.Attribute, ast.Name))}
                if "transport" in named:
                    out.append(f"{module}:{node.lineno} compares transport")
    return out


def graph_of(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    known = set(trees)
    return {m: imports(m, t, known) for m, t in trees.items()}


@pytest.fixture(scope="module")
def trees():
    return sources()


def test_only_the_stores_compute_run_paths(trees):
    assert path_violations(trees) == []


def test_launch_imports_the_roles_never_the_reverse(trees):
    assert layering_violations(graph_of(trees)) == []


def test_no_import_circle(trees):
    assert cycles(graph_of(trees)) == []


def test_roles_never_branch_on_the_transport(trees):
    assert transport_violations(trees) == []


# --- each rule catches a violation ------------------------------------------------------------------

def _with(trees: dict, module: str, code: str) -> dict:
    return {**trees, module: ast.parse(code)}


def test_the_rules_catch_violations(trees):
    assert path_violations(_with(trees, "rollout.bad", "from buffer.layout import RunLayout\n"))
    assert path_violations(_with(trees, "launch.bad", "fs, p = filesystem(root)\n"))
    assert not path_violations(_with(trees, "buffer.control.ok", "RunLayout('/r')\n"))
    bad = _with(trees, "trainer.bad", "from launch import local\n")
    assert layering_violations(graph_of(bad)) == ["trainer.bad imports launch.local"]
    circle = _with(trees, "rollout.vllm_engine", "def f():\n    from rollout.engine import HFEngine\n")
    assert ["rollout.engine", "rollout.vllm_engine"] in cycles(graph_of(circle))
    assert transport_violations(_with(trees, "trainer.bad", "if cfg.buffer.transport == 'grpc':\n    pass\n"))
    assert transport_violations(_with(trees, "rollout.bad", "x = 'fs' != transport\n"))
