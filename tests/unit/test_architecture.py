"""The shape of the package, checked from its source: every import of every module under
src/rsrv that runs is read (at module level and inside functions; imports under ``if
TYPE_CHECKING:`` are annotations, not dependencies), and

* no import cycle exists between modules, nor between packages;
* data flows one way: the protocol layer never imports the worker (nor any process
  package), and nothing imports a process package (worker, node, gateway) but the CLI
  and the process packages' own modules;
* one package reaches into another only through its public ``__init__`` (private
  ``_modules`` are the package's business).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from support import ROOT

SRC = ROOT / "src"
PROCESSES = {"worker", "node", "gateway"}


def modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "rsrv").rglob("*.py"):
        if "generated" in path.parts:
            continue
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The rsrv modules ``name`` imports (``from pkg import mod`` counts as the module)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # "from pkg import mod" imports the module; "from mod import name", the module
            submodules = [f"{module}.{alias.name}" for alias in node.names]
            targets = [t for t in submodules if t in known] or [module]
        else:
            continue
        for target in targets:
            if target in known and target != name:
                found.add(target)
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node, except what sits under ``if TYPE_CHECKING:``."""
    pending = [tree]
    while pending:
        node = pending.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                pending.extend(child.orelse)
                continue
            pending.append(child)


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one member (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_modules():
    edges = graph()
    # a package's __init__ re-exports its modules; importing the package from one of
    # them would be the only way to close a loop through it, so __init__ edges count.
    assert cycles(edges) == []


def test_no_import_cycle_between_packages():
    edges: dict[str, set[str]] = defaultdict(set)
    for module, targets in graph().items():
        for target in targets:
            a, b = package_of(module), package_of(target)
            if a and b and a != b:
                edges[a].add(b)
    assert cycles(edges) == []


def test_protocol_never_imports_a_process():
    for module, targets in graph().items():
        if package_of(module) in ("protocol", "transport", "scheduler", "runtime", "bundle"):
            bad = sorted(t for t in targets if package_of(t) in PROCESSES)
            assert not bad, f"{module} imports {bad}"


def test_process_packages_are_imported_only_by_the_cli_and_themselves():
    for module, targets in graph().items():
        for target in targets:
            pkg = package_of(target)
            if pkg in PROCESSES and package_of(module) != pkg:
                assert module in ("rsrv.cli",) or package_of(module) in PROCESSES, (
                    f"{module} imports {target}"
                )


def test_packages_meet_through_their_public_init():
    for module, targets in graph().items():
        for target in targets:
            if package_of(module) != package_of(target):
                private = [p for p in target.split(".")[2:] if p.startswith("_")]
                assert not private, f"{module} imports {target}, a private module"
