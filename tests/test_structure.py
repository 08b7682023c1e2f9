"""The package's shape: no import cycle between its modules, function-local imports
counted (a cycle hidden in a function still makes two modules one unit to read, test and
change)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "eagle3_extract"


def import_graph() -> dict[str, set[str]]:
    mods = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                names = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            graph[m] |= {n for n in names if n in mods and n != m}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    graph = import_graph()
    assert "eagle3_extract.extract.job" in graph and graph["eagle3_extract.cli"]  # the scan works
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]  # and finds one
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(
        " <-> ".join(c) + f" ({ {m: sorted(graph[m] & set(c)) for m in c} })" for c in found)


def test_development_drivers_are_not_imported_by_user_commands():
    """e2e and the peer comparison are development-only: no module a user command runs
    imports them (so they can change, or leave the package, without touching the job)."""
    graph = import_graph()
    dev = {"eagle3_extract.dev.e2e", "eagle3_extract.dev.peer", "eagle3_extract.dev.peer_run",
           "eagle3_extract.dev.peer_connector"}
    assert dev <= set(graph)
    users = {m: sorted(graph[m] & dev) for m in graph if m not in dev and graph[m] & dev}
    assert not users, users


# The stage folders, lowest first; a module imports only from its own floor or below. The
# package root holds the definitions every stage shares (config, errors, layout, manifest,
# types, quant, hub, lock, shm_watch, hydra_app, cpu_build, patching); cli, the
# eagle3-extract entry point, sits on top.
FLOORS = ["models", "dataset", "engine", "extract", "regenerate", "check", "drafter", "dev"]


def floor(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return 0
    if parts[1] == "cli":
        return len(FLOORS) + 1
    return FLOORS.index(parts[1]) + 1 if parts[1] in FLOORS else 0


def test_stages_import_only_their_floor_or_below():
    graph = import_graph()
    assert {m.split(".")[1] for m in graph if m.count(".") >= 2} <= set(FLOORS)  # no stray folder
    assert floor("eagle3_extract.drafter.train") > floor("eagle3_extract.extract.job") > 0
    upward = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                    if floor(d) > floor(m))
    assert not upward, upward
