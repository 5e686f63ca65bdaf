"""The shape of the code: the daemon's stages import downwards only, no module imports itself back, and no class
or module outgrows a reader.

Read from the source (the AST of every module of the package), so these hold without importing anything:
imports under ``if TYPE_CHECKING:`` are annotations only and do not count; imports inside functions (the
object store's extra, loaded only for a tier that needs it) count like the others.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Where each installed package's source lies in the repository (pyproject's package-dir).
SOURCES = {"ckptstage.client": "client", "ckptstage.daemon": "daemon", "ckptstage.protos": "protos",
           "ckptstage.dcp": "dcp", "ckptstage.lightning": "integrations/lightning", "ckptstage.hf": "integrations/hf"}

# The daemon's stages, lowest first: a module may import its own stage and those below it, never one above.
# Foundation modules (errors, logs, events, metrics, fsutil, config, ...) sit under every stage, and the
# retention planner with them: it is pure (it imports nothing of the daemon) and its rules are the config's
# vocabulary. The entry points (main, launcher) sit above everything.
STAGES = ["foundation", "tiers", "catalog", "save+drain", "retention", "peers", "node", "serve", "entry"]
STAGE_OF_PACKAGE = {"tiers": "tiers", "catalog": "catalog", "save": "save+drain", "drain": "save+drain",
                    "retention": "retention", "peers": "peers", "node": "node", "serve": "serve"}
FOUNDATION_TOO = {"ckptstage.daemon.retention.planner"}
ENTRY = {"ckptstage.daemon.main"}

MAX_CLASS_LINES = 300
MAX_MODULE_LINES = 500


def modules() -> Iterator[tuple[str, Path]]:
    """Every module of the package: (dotted name, file); generated protobuf code aside."""
    for package, folder in SOURCES.items():
        root = REPO / folder
        for path in sorted(root.rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join([package, *parts]), path


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """The tree's nodes, less the bodies of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def imports(name: str, path: Path, annotations: bool = False) -> set[str]:
    """The ckptstage modules ``name`` imports at run time (``from pkg import module`` as the module); with
    ``annotations``, those it imports for its annotations only too."""
    known = dict(modules())
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree) if annotations else _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ckptstage."))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ckptstage."):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
    return {m for m in found if m != name}


def stage(module: str) -> str | None:
    """The daemon stage ``module`` belongs to; None outside the daemon."""
    if not module.startswith("ckptstage.daemon"):
        return None
    if module in FOUNDATION_TOO:
        return "foundation"
    if module in ENTRY or module == "ckptstage.daemon.launcher":
        return "entry" if module in ENTRY else "foundation"
    parts = module.split(".")
    return STAGE_OF_PACKAGE.get(parts[2], "foundation") if len(parts) > 3 else "foundation"


def test_the_daemon_stages_import_downwards_only() -> None:
    upward = []
    for name, path in modules():
        mine = stage(name)
        if mine is None:
            continue
        for target in sorted(imports(name, path)):
            theirs = stage(target)
            if theirs is not None and STAGES.index(theirs) > STAGES.index(mine):
                upward.append(f"{name} ({mine}) imports {target} ({theirs})")
    assert upward == [], "\n".join(upward)


def test_no_module_imports_itself_back() -> None:
    """Not even for annotations: two modules that need each other's types are one idea cut in two."""
    graph = {name: imports(name, path, annotations=True) for name, path in modules()}
    cycles = []
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(trail[trail.index(nxt):] + [nxt]) if nxt in trail else f"{node} -> {nxt}")
            elif nxt in graph and not state.get(nxt):
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for name in sorted(graph):
        if not state.get(name):
            visit(name, [name])
    assert cycles == [], "\n".join(cycles)


def sizes() -> dict[str, int]:
    """Every class over MAX_CLASS_LINES and every module over MAX_MODULE_LINES: name -> lines."""
    found = {}
    for name, path in modules():
        source = path.read_text()
        lines = len(source.splitlines())
        if lines > MAX_MODULE_LINES:
            found[name] = lines
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                length = node.end_lineno - node.lineno + 1
                if length > MAX_CLASS_LINES:
                    found[f"{name}.{node.name}"] = length
    return found


def test_no_class_or_module_outgrows_a_reader() -> None:
    too_big = sizes()
    assert too_big == {}, f"over {MAX_CLASS_LINES} lines a class, {MAX_MODULE_LINES} a module: split it: {too_big}"


@pytest.mark.parametrize("package", sorted(p for p in SOURCES if p.startswith("ckptstage.daemon")) or ["-"])
def test_every_daemon_package_says_its_job_first(package: str) -> None:
    for init in (REPO / SOURCES[package]).rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init.relative_to(REPO)} has no docstring saying what its package is for"
        assert len(doc.splitlines()[0]) <= 120, f"{init.relative_to(REPO)}: its first line is its job, in one line"
