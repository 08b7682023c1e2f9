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


# --- issue 53's rules: each part handed only its own config, checks as a library, one
# entry style, bench/ by concern ------------------------------------------------------------

SRC = PKG.parent.parent
# What a command's own job functions are called: only these see the whole job config (a
# parameter named `cfg`); below them, functions take their config groups (cfg.engine,
# cfg.model, ...), typed with the schema's dataclasses. config.py's own checks of the schema
# (validate*, resolve_config) and hydra_app's plumbing see it too.
WHOLE_CONFIG = {"run", "preflight", "launch", "_task", "_extract", "_regenerate",
                "run_guarded", "_run_guarded", "unresolvable", "launch_hydra_job"}


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_only_a_commands_job_functions_take_the_whole_config():
    takers, fields = [], []
    for p in PKG.rglob("*.py"):
        rel = str(p.relative_to(PKG))
        tree = ast.parse(p.read_text())
        for fn in _functions(tree):
            names = [a.arg for a in fn.args.args + fn.args.kwonlyargs]
            if "cfg" in names and fn.name not in WHOLE_CONFIG and rel != "config.py":
                takers.append(f"{rel}:{fn.lineno} {fn.name}")
        for node in ast.walk(tree):  # no plan carries the whole config down either
            if isinstance(node, ast.ClassDef):
                fields += [f"{rel}:{node.name}.cfg" for s in node.body
                           if isinstance(s, ast.AnnAssign) and getattr(s.target, "id", "") == "cfg"]
    assert not takers, takers
    assert not fields, fields


def test_storage_is_made_in_one_place_and_nothing_outside_extract_imports_it():
    """`Storage.from_output` in the job's preflight (and Manifest.storage, how a reader of a
    finished run gets the same one back); extract/ is imported by its command only."""
    makers = sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
                    if "Storage.from_output(" in p.read_text())
    assert makers == ["extract/preflight.py", "manifest.py"], makers
    graph = import_graph()
    outside = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                     if d.startswith("eagle3_extract.extract")
                     and not m.startswith("eagle3_extract.extract") and m != "eagle3_extract.cli")
    assert not outside, outside


def test_validate_and_verify_are_commands_over_one_check_library():
    graph = import_graph()
    for cmd in ("validate", "verify"):
        deps = graph[f"eagle3_extract.check.{cmd}"]
        assert "eagle3_extract.check.files" in deps and "eagle3_extract.check.run_dir" in deps
    assert "eagle3_extract.check.validate" not in graph["eagle3_extract.check.verify"]
    # status, validate, export and train ask one function whether a run is complete
    for m in ("check.status", "check.validate", "drafter.export", "drafter.train"):
        assert "run_state" in (PKG / (m.replace(".", "/") + ".py")).read_text(), m
    assert "eagle3_extract.check.run_dir" in graph["eagle3_extract.check.status"]
    assert "eagle3_extract.run_state" not in graph["eagle3_extract.check.status"]


def test_every_command_starts_one_way_and_ends_one_way():
    """Nine console scripts, each a thin main over the same error path (entry.py): Hydra's
    commands through hydra_app.run_guarded, the argparse ones through entry.command."""
    import tomllib

    scripts = tomllib.loads((SRC / "pyproject.toml").read_text())["project"]["scripts"]
    assert len(scripts) == 9
    for name, target in scripts.items():
        module, func = target.split(":")
        text = (SRC / "src" / (module.replace(".", "/") + ".py")).read_text()
        fn = next(f for f in _functions(ast.parse(text)) if f.name == func)
        assert len(fn.body) <= 30, f"{name}: {func} is {len(fn.body)} statements, not thin"
        hydra = "hydra_main(" in text and "run_guarded(" in text
        argparse_ = any(ast.unparse(d) == f"command({name!r})" or
                        ast.unparse(d).startswith(f"command({name!r},")
                        for d in fn.decorator_list)
        assert hydra != argparse_, f"{name}: one entry style, the shared error path"


def test_no_module_over_500_lines_unless_it_says_it_is_one_idea():
    long = {str(p.relative_to(PKG)): len(p.read_text().splitlines()) for p in PKG.rglob("*.py")}
    over = {m: n for m, n in long.items() if n > 500
            and "One idea:" not in (ast.get_docstring(ast.parse((PKG / m).read_text())) or "")}
    assert not over, over


BENCH = SRC / "bench"


def test_bench_is_split_by_concern_and_uses_the_package_as_a_user_would():
    """Each bench/ folder has a README naming the docs sections it feeds; a script never
    imports another script (a module with a __main__ block), only its folder's libraries;
    no bench file imports a private name of the package."""
    folders = sorted(p.parent.name for p in BENCH.glob("*/README.md"))
    assert folders == ["device", "prediction", "throughput"], folders
    assert not list(BENCH.glob("*.py"))  # nothing left in the flat folder
    headings = [line.lstrip("#").strip() for doc in ("BENCHMARKS.md", "QUALITY.md")
                for line in (SRC / "docs" / doc).read_text().splitlines()
                if line.startswith("#")]
    import re

    for folder in folders:
        readme = (BENCH / folder / "README.md").read_text()
        named = re.findall(r'"([^"]+)"', readme)
        assert named, f"bench/{folder}/README.md names no docs section"
        for title in named:
            assert any(h.startswith(title) for h in headings), f"bench/{folder}: {title!r}"
        listed = {Path(p).name for p in re.findall(r"`([\w/]+\.(?:py|sh))`", readme)}
        files = {p.name for p in (BENCH / folder).rglob("*") if p.suffix in (".py", ".sh")}
        assert files <= listed, f"bench/{folder}/README.md does not list {files - listed}"
    scripts = {p.stem for p in BENCH.rglob("*.py") if "__main__" in p.read_text()}
    problems = []
    for p in BENCH.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module in scripts:
                    problems.append(f"{p.name} imports the script {node.module}")
                if node.module.startswith("eagle3_extract"):
                    problems += [f"{p.name}: {node.module}.{a.name}" for a in node.names
                                 if a.name.startswith("_")]
            elif isinstance(node, ast.Import):
                problems += [f"{p.name} imports the script {a.name}" for a in node.names
                             if a.name in scripts]
    assert not problems, problems
