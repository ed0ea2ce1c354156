"""Structure rules of the code base, checked on its source (imports and syntax trees):

- run paths are computed only by the run's stores: RunLayout and `filesystem(` appear only in
  buffer/layout.py (the definitions), buffer/storage.py, buffer/checkpoints.py, the rooms
  (buffer/experience/, buffer/weights/, buffer/control/, buffer/reward/) and buffer/run.py;
- `launch/` imports the roles (rollout, trainer, buffer), never the reverse;
- no import circle among the project's modules (function-level imports included, and a module
  loaded by name through importlib counted as imported);
- no module is loaded by name (importlib.import_module, __import__): an import the graph cannot
  see is how a cycle hides;
- buffer/ has floors and no import goes back up: the ground (buffer/*.py: config, layout,
  storage, ledger, channel, checkpoints) imports no room; a room's base.py (its producer and
  consumer interfaces) imports only the ground and other bases; the rooms' media (fs.py,
  net_client.py, net_server.py, ...) import no top; the top (buffer/run.py, which builds each
  role's Run, and buffer/writer.py and buffer/inspect.py, which use it) is imported by nothing
  else in buffer/;
- rollout/ and trainer/ never compare `transport` (the Run picks the implementations);
- the type checker (mypy, configured in pyproject.toml) holds each role to its Run type: a
  trainer-only member used from a worker is an error.

Each rule is a function of parsed sources, so the tests below also feed it a violation and see
it caught.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("buffer", "rollout", "trainer", "launch", "protocol")
ROLES = ("buffer", "rollout", "trainer")
PATHS_ALLOWED = (
    "buffer/layout.py",
    "buffer/storage.py",
    "buffer/run.py",
    "buffer/checkpoints.py",
    "buffer/experience/",
    "buffer/weights/",
    "buffer/control/",
    "buffer/reward/",
)
BUFFER_TOP = ("buffer.run", "buffer.writer", "buffer.inspect")
BY_NAME = ("import_module", "__import__")  # loading a module by a string
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
    package = (
        module if module in known and any(k.startswith(module + ".") for k in known) else module.rpartition(".")[0]
    )
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif _loads_by_name(node):
            names = [a.value for a in node.args[:1] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        else:
            continue
        for name in names:
            while name and name not in known:  # a.b.c -> the deepest project module named
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def _loads_by_name(node: ast.AST) -> bool:
    """A call of importlib.import_module, import_module or __import__."""
    if not isinstance(node, ast.Call):
        return False
    fn = node.func
    return (fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None) in BY_NAME


def by_name_violations(trees: dict[str, ast.Module], known: tuple[str, ...] = ()) -> list[str]:
    """Modules loaded by name anywhere in the product, outside the `known` modules."""
    return [
        f"{m}:{node.lineno} loads a module by name"
        for m, tree in sorted(trees.items())
        if m not in known
        for node in ast.walk(tree)
        if _loads_by_name(node)
    ]


def buffer_floor(module: str) -> int:
    """0 the ground, 1 a room's base.py, 2 a room's other modules, 3 the top (module doc)."""
    if module in BUFFER_TOP:
        return 3
    parts = module.split(".")
    if len(parts) <= 2:  # buffer/<name>.py, or a room's (empty) __init__
        return 0
    return 1 if parts[-1] == "base" else 2


def floor_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports inside buffer/ from a lower floor to a higher one."""
    return [
        f"{m} (floor {buffer_floor(m)}) imports {d} (floor {buffer_floor(d)})"
        for m, deps in sorted(graph.items())
        if m.split(".")[0] == "buffer"
        for d in sorted(deps)
        if d.split(".")[0] == "buffer" and buffer_floor(d) > buffer_floor(m)
    ]


def path_violations(trees: dict[str, ast.Module]) -> list[str]:
    """Uses of RunLayout or filesystem( outside the stores."""
    out = []
    for module, tree in trees.items():
        rel = module.replace(".", "/")
        if any((rel + ".py").startswith(a) or (rel + "/").startswith(a) for a in PATHS_ALLOWED):
            continue
        for node in ast.walk(tree):
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if isinstance(node, ast.alias):
                name = node.name
            if name in PATH_NAMES:
                out.append(f"{module}:{getattr(node, 'lineno', '?')} uses {name}")
    return out


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports of launch from the roles."""
    return [
        f"{m} imports {d}"
        for m, deps in sorted(graph.items())
        if m.split(".")[0] in ROLES
        for d in sorted(deps)
        if d.split(".")[0] == "launch"
    ]


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
                named = {
                    n.attr if isinstance(n, ast.Attribute) else n.id
                    for n in ast.walk(node)
                    if isinstance(n, (ast.Attribute, ast.Name))
                }
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


# protocol.verl_keys loads the role schemas (trainer.config, rollout.config) by name, which hides
# the cycle protocol.config -> protocol.verl_keys -> trainer.config -> protocol.config. Its fix
# waits for issue 23's changes to that file and the config call sites (issue 24, not done yet).
LOADED_BY_NAME_FOR_NOW = ("protocol.verl_keys",)


def test_no_module_is_loaded_by_name(trees):
    assert by_name_violations(trees, LOADED_BY_NAME_FOR_NOW) == []


def test_buffer_imports_never_go_back_up(trees):
    assert floor_violations(graph_of(trees)) == []


def mypy(*args: str) -> tuple[int, str]:
    """mypy with the project's settings (pyproject.toml), its exit status and report."""
    out = subprocess.run(
        [sys.executable, "-m", "mypy", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return out.returncode, out.stdout + out.stderr


# What only the trainer may use, reached from a worker's Run: each must be a type error.
TRAINER_ONLY = {
    "self.stores.publisher.prune(1)": '"WorkerRun" has no attribute "publisher"',
    "self.stores.reader(cfg.buffer, 1)": '"WorkerRun" has no attribute "reader"',
    "self.stores.checkpoints.latest()": '"WorkerRun" has no attribute "checkpoints"',
    "self.stores.files.metrics": '"WorkerRun" has no attribute "files"',
    "self.stores.serve(cfg.buffer)": '"WorkerRun" has no attribute "serve"',
    "self.stores.progress.write({})": '"ProgressStore" has no attribute "write"',
    "self.stores.state.mark_done({})": '"RunState" has no attribute "mark_done"',
    "self.stores.sync.open_version(0)": '"SyncClaims" has no attribute "open_version"',
    "self.stores.validation.request(0, 0)": '"ValidationStore" has no attribute "request"',
}


def test_the_type_checker_refuses_trainer_only_members_in_a_worker(tmp_path):
    """A copy of rollout/worker.py passes; with uses of the trainer's members planted after the
    worker gets its Run, each is reported."""
    source = (REPO / "rollout" / "worker.py").read_text()
    anchor = "        self.stores = setup_worker_run(cfg)\n"
    assert anchor in source
    copy = tmp_path / "worker_copy.py"
    copy.write_text(source)
    rc, report = mypy(str(copy))
    assert rc == 0, report
    copy.write_text(source.replace(anchor, anchor + "".join(f"        {use}\n" for use in TRAINER_ONLY)))
    rc, report = mypy(str(copy))
    assert rc == 1, report
    for use, error in TRAINER_ONLY.items():
        assert error in report, (use, report)


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
    hidden = _with(trees, "buffer.run", "import importlib\nimportlib.import_module('buffer.stores.net')\n")
    hidden = _with(hidden, "buffer.stores.net", "from buffer.run import Run\n")
    assert ["buffer.run", "buffer.stores.net"] in cycles(graph_of(hidden))
    assert "buffer.run:2 loads a module by name" in by_name_violations(hidden)
    up = _with(trees, "buffer.control.fs", "from buffer.run import TrainerRun\n")
    assert floor_violations(graph_of(up)) == ["buffer.control.fs (floor 2) imports buffer.run (floor 3)"]
    up = _with(trees, "buffer.backpressure", "from buffer.control.base import HeartbeatStore\n")
    assert floor_violations(graph_of(up)) == ["buffer.backpressure (floor 0) imports buffer.control.base (floor 1)"]
    up = _with(trees, "buffer.weights.base", "from buffer.weights.fs import WeightStore\n")
    assert floor_violations(graph_of(up)) == ["buffer.weights.base (floor 1) imports buffer.weights.fs (floor 2)"]
