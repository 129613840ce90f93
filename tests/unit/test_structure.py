"""The shape of the package, read from the source with `ast` (nothing is imported): no import cycles, each
layer imports only the layers it may, small modules and functions, and one module that talks to transformers' attention
registry. Imports inside functions count like top-level ones: they run too, just later. Importing `a.b.c` runs
`a/b/__init__.py` before `a/b/c.py`, so an import is an edge to each package above its target as well (`runs`)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "longdoc"
MAX_LINES = 400
MAX_FUNCTION_LINES = 80  # a function longer than this is several steps: name them
REGISTRY_NAMES = {"AttentionInterface", "AttentionMaskInterface", "_global_mapping"}

# layer -> the longdoc packages it must never import (docs/design.md: each layer depends only on those above it)
FORBIDDEN = {
    "longdoc.runtime": ("longdoc.parallel", "longdoc.hf", "longdoc.models", "longdoc.corpus", "longdoc.train",
                        "longdoc.eval", "longdoc.lmeval", "longdoc.plan", "longdoc.bench"),
    "longdoc.hf": ("longdoc.train", "longdoc.eval", "longdoc.bench", "longdoc.corpus", "longdoc.plan"),
    "longdoc.corpus": ("longdoc.train", "longdoc.eval", "longdoc.bench"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    """Every longdoc module by dotted name (a package by its own name, for its __init__)."""
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@cache
def _tree(name: str) -> ast.Module:
    return ast.parse(modules()[name].read_text(), filename=str(modules()[name]))


def _is_package(name: str) -> bool:
    return modules()[name].name == "__init__.py"


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def imports_of(name: str) -> Iterator[tuple[str, int]]:
    """(imported longdoc module, line) for every import statement anywhere in module `name`."""
    known = modules()
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                package = name if _is_package(name) else name.rpartition(".")[0]
                base_parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not _within(base, "longdoc"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:  # `from longdoc import models` imports the submodule longdoc.models
                    yield sub, node.lineno
                elif base in known:
                    yield base, node.lineno


def runs(importer: str, target: str) -> list[str]:
    """The modules Python runs when `importer` imports `target`: each package above `target` (its __init__, outermost
    first), then `target` itself; less those already running, `importer` and the packages above it (Python ran
    them before `importer`). So `longdoc.hf.attention` importing `longdoc.hf.kinds.temperature` runs
    `longdoc.hf.kinds` (which imports every kind) before `longdoc.hf.kinds.temperature`."""
    parts = target.split(".")
    chain = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return [m for m in chain if not _within(importer, m)]


@cache
def graph() -> dict[str, dict[str, int]]:
    """module -> {longdoc module its imports run: first line that runs it}, the parent packages' __init__ included."""
    known = modules()
    g: dict[str, dict[str, int]] = {}
    for name in known:
        edges: dict[str, int] = {}
        for target, line in imports_of(name):
            for ran in runs(name, target):
                if ran in known:
                    edges.setdefault(ran, line)
        g[name] = edges
    return g


def _cycles(g: dict[str, dict[str, int]]) -> list[list[str]]:
    """One shortest cycle per strongly connected component with more than one module (Tarjan, iterative);
    fixing it may reveal another in the same component, which the next run reports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(g[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = set()
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.add(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    components.append(comp)
    cycles = []
    for comp in components:
        start = min(comp)
        # breadth-first from `start` back to itself inside the component: the shortest cycle through it
        paths = {start: [start]}
        frontier = [start]
        found = None
        while frontier and found is None:
            nxt = []
            for m in frontier:
                for t in sorted(g[m]):
                    if t not in comp:
                        continue
                    if t == start:
                        found = paths[m] + [start]
                        break
                    if t not in paths:
                        paths[t] = paths[m] + [t]
                        nxt.append(t)
                if found:
                    break
            frontier = nxt
        cycles.append(found)
    return cycles


def _describe(cycle: list[str]) -> str:
    g = graph()
    return cycle[0] + "".join(f" -(line {g[a][b]})-> {b}" for a, b in zip(cycle, cycle[1:]))


# ---- the resolver itself, on known parts of the tree (so that the checks below cannot pass vacuously) ----

def test_resolver_sees_the_package_and_its_imports():
    g = graph()
    assert {"longdoc", "longdoc.parallel", "longdoc.parallel.layout", "longdoc.runtime",
            "longdoc.runtime.spawn"} <= set(g)
    assert len(g) > 40
    # `from longdoc.parallel import layout as layouts` (top level) names the submodule, not the package
    assert "longdoc.parallel.layout" in g["longdoc.parallel.api"]
    # `from longdoc.parallel.api import ContextParallel` inside start() counts (an import in a function)
    assert "longdoc.parallel.api" in g["longdoc.train.world"]
    # `from longdoc.runtime.launch import launched_world` runs longdoc/runtime/__init__.py first
    assert {"longdoc.runtime", "longdoc.runtime.launch"} <= set(g["longdoc.train.world"])


def test_resolver_adds_the_parent_packages_python_runs_first():
    assert runs("longdoc.hf.attention", "longdoc.hf.kinds.temperature") == ["longdoc.hf.kinds",
                                                                          "longdoc.hf.kinds.temperature"]
    assert runs("longdoc.train.loop", "longdoc.hf.patch") == ["longdoc.hf", "longdoc.hf.patch"]
    assert runs("longdoc.hf.kinds", "longdoc.hf.kinds.mamba") == ["longdoc.hf.kinds.mamba"]  # its own __init__ runs
    g = graph()
    # `from longdoc.parallel.recurrent import ...` runs longdoc/parallel/__init__.py first
    assert {"longdoc.parallel", "longdoc.parallel.recurrent"} <= set(g["longdoc.hf.recurrent"])
    # `from longdoc.hf import branches` inside longdoc.hf: the package is already running, no edge to it
    assert "longdoc.hf" not in g["longdoc.hf.attention"]


def test_cycle_finder_reports_the_path():
    g = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}, "e": {"e": 1}}
    assert _cycles(g) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b": 1}, "b": {}}) == []


# ---- the acceptance checks ----

def test_no_import_cycles():
    cycles = _cycles(graph())  # sorted module order: the same report on every run
    assert not cycles, "import cycles between longdoc modules (break each, e.g. by moving the shared part " \
                       "into a module both import):\n" + "\n".join(_describe(c) for c in cycles)


def test_parallel_imports_no_other_longdoc_layer():
    bad = [f"{m} imports {t} (line {line})" for m, edges in graph().items() if _within(m, "longdoc.parallel")
           for t, line in edges.items() if not _within(t, "longdoc.parallel")]
    assert not bad, "longdoc.parallel is the CP core and must import only torch and itself:\n" + "\n".join(bad)


def _import_chain(g: dict[str, dict[str, int]], start: str, forbidden: tuple[str, ...]) -> list[str] | None:
    """Shortest chain of imports from `start` to a module inside `forbidden`, or None: importing a module
    runs what it imports, so a neutral module in between does not make a layer violation go away."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for m in frontier:
            for t in sorted(g[m]):
                if t in paths:
                    continue
                paths[t] = paths[m] + [t]
                if any(_within(t, f) for f in forbidden):
                    return paths[t]
                nxt.append(t)
        frontier = nxt
    return None


def test_layers_import_only_layers_above_them():
    bad = []
    for layer, forbidden in FORBIDDEN.items():
        for m in graph():
            if _within(m, layer) and (chain := _import_chain(graph(), m, forbidden)):
                bad.append(_describe(chain))
    assert not bad, "layer violations (see docs/design.md, Layers):\n" + "\n".join(bad)


def test_layer_check_follows_imports_through_other_modules():
    g = {"longdoc.hf.x": {"longdoc.models": 3}, "longdoc.models": {"longdoc.train.loop": 9},
         "longdoc.train.loop": {}}
    assert _import_chain(g, "longdoc.hf.x", ("longdoc.train",)) == ["longdoc.hf.x", "longdoc.models",
                                                                   "longdoc.train.loop"]
    assert _import_chain(g, "longdoc.hf.x", ("longdoc.eval",)) is None


def test_no_module_over_the_line_limit():
    sizes = {m: len(p.read_text().splitlines()) for m, p in modules().items()}
    big = {m: n for m, n in sizes.items() if n > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split by responsibility): {big}"


def test_no_function_over_the_line_limit():
    long = {f"{m}.{node.name}": node.end_lineno - node.lineno + 1 for m in modules() for node in ast.walk(_tree(m))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split into named steps): {long}"


def _registry_references(name: str) -> set[str]:
    found = set()
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.Name) and node.id in REGISTRY_NAMES:
            found.add(node.id)
        elif isinstance(node, ast.Attribute) and node.attr in REGISTRY_NAMES:
            found.add(node.attr)
        elif isinstance(node, ast.alias) and node.name.rpartition(".")[2] in REGISTRY_NAMES:
            found.add(node.name)
    return found


def test_attention_registry_is_touched_in_one_module():
    users = {m: sorted(refs) for m in modules() if (refs := _registry_references(m))}
    assert len(users) == 1, ("transformers' attention registry must be used by exactly one module "
                             f"(one backend, one call path); referenced in: {users}")


def test_no_test_module_imports_another_test_module():
    """Shared test helpers live in plain modules (tests/support/distributed.py, tests/support/training.py,
    tests/support/fake_cp.py...): importing a test module runs its collection side effects and couples unrelated
    tests."""
    tests = ROOT / "tests"
    bad = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                    if n.startswith("tests.") and n.rpartition(".")[2].startswith("test_")]
    assert not bad, "move what these share into a helper module under tests/support/:\n" + "\n".join(bad)


def test_training_code_never_reads_the_suite():
    """Nothing that makes training data (corpus, train, recipes) imports or names the suite's generators."""
    for module, imported in graph().items():
        if module.startswith(("longdoc.corpus", "longdoc.train")):
            assert not [m for m in imported if m.startswith("longdoc.eval.ruler")], module
    root = Path(__file__).resolve().parents[2]
    for path in [*(root / "recipes").rglob("*.yaml"), *(root / "data" / "synth").rglob("*.json")]:
        text = path.read_text()
        assert "eval.ruler" not in text and "special magic" not in text, path


def test_the_layer_kinds_reach_attention_only_through_its_public_names():
    """hf/recurrent.py and the kinds read the call's documents through attention's public `call_documents`, never its
    private helpers (issue 31 section 5)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "longdoc" / "hf"
    offenders = [f"{p.name}:{n}" for p in [root / "recurrent.py", *sorted((root / "kinds").glob("*.py"))]
                 for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bbackend\._\w", line)]
    assert offenders == []
