"""Import layering of the `cedlm` package, checked from the source (AST only, nothing imported).

Every `import x` / `from x import y` that names a cedlm module, at module level or inside a
function, class or `if` block, is an edge of the import graph. Modules are grouped into units:
the top-level subpackage or module (`cedlm.model.attention` belongs to `cedlm.model`). Between
units two rules hold:

* no cycles: the unit graph is acyclic;
* no upward edges: a unit imports only units of a lower layer (`LAYERS`), or units of its own
  layer where the edge is listed in `ALLOWED_SAME_LAYER`.

The package root `cedlm/__init__.py` is exempt (it lazily exposes `CEDModel`, `LLM`, ...), and so
is `from cedlm import Name` where `Name` is not a module. A module listed in `LAYERS` need not
exist; a unit that is not listed is a failure (new top-level modules must be placed in a layer).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "cedlm"
PKG = "cedlm"

# Higher layers may import lower ones, never the reverse.
LAYERS: dict[str, int] = {
    "cedlm.cli": 6, "cedlm.__main__": 6,
    "cedlm.server": 5, "cedlm.train": 5, "cedlm.eval": 5, "cedlm.bench": 5, "cedlm.plan": 5,
    "cedlm.data": 5,
    "cedlm.engine": 4,
    "cedlm.cache": 3, "cedlm.checkpoint": 3, "cedlm.official": 3,
    "cedlm.model": 2,
    "cedlm.kv_layout": 1, "cedlm.text": 1,
    # The compiled kernels and their gate: the model calls them; they run beside (and are checked
    # against) the pure-torch reference codecs of cedlm.quant, which they import.
    "cedlm.kernels": 1,
    "cedlm.quant": 0, "cedlm.config": 0, "cedlm.util": 0,
}

# Imports between units of one layer that are part of the design.
ALLOWED_SAME_LAYER: set[tuple[str, str]] = {
    ("cedlm.bench", "cedlm.plan"),       # the benchmarks report planner figures
    ("cedlm.train", "cedlm.data"),       # apps read the prepared corpus
    ("cedlm.eval", "cedlm.data"),
    ("cedlm.bench", "cedlm.data"),
    ("cedlm.config", "cedlm.quant"),     # validation reads the KV formats' scale blocks
    ("cedlm.config", "cedlm.util"),      # atomic writes of config.json
    ("cedlm.checkpoint", "cedlm.official"),  # load_model dispatches official-layout directories
}


# ----------------------------------------------------------------------------- the graph
def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PKG, *parts])


def _modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))
            if ".ipynb_checkpoints" not in p.parts}


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(mod: str, path: Path, known: set[str]) -> set[str]:
    """cedlm modules imported anywhere in one file (module-level and nested imports)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == PKG)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(mod, is_pkg, node)
            if target.split(".")[0] != PKG:
                continue
            for a in node.names:                 # `from pkg import submodule` names a module
                sub = f"{target}.{a.name}"
                out.add(sub if sub in known else target)
    return out


def import_graph(root: Path = ROOT) -> set[tuple[str, str]]:
    """(importer, imported) module pairs over every module of the package."""
    mods = _modules(root)
    known = set(mods)
    return {(m, t) for m, p in mods.items() for t in imports_of(m, p, known) if t != m}


# ----------------------------------------------------------------------------- the rules
def unit_of(mod: str) -> str | None:
    """`cedlm.x.y` -> `cedlm.x`; the package root -> None (exempt)."""
    parts = mod.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else None


def _cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def violations(edges: set[tuple[str, str]], layers: dict[str, int] = LAYERS,
               allowed: set[tuple[str, str]] = ALLOWED_SAME_LAYER) -> list[str]:
    """Every broken rule, one line each: cycles between units, upward / unlisted same-layer
    imports (`importer -> imported (layer a -> layer b)`), and units missing from `layers`."""
    out: list[str] = []
    unit_edges: set[tuple[str, str]] = set()
    unlisted: set[str] = set()
    for a, b in sorted(edges):
        ua, ub = unit_of(a), unit_of(b)
        if ua is None or ub is None or ua == ub:
            continue
        unit_edges.add((ua, ub))
        for u in (ua, ub):
            if u not in layers:
                unlisted.add(u)
        if ua not in layers or ub not in layers:
            continue
        la, lb = layers[ua], layers[ub]
        if la < lb or (la == lb and (ua, ub) not in allowed):
            out.append(f"{a} -> {b} (layer {la} -> layer {lb})")
    for comp in _cycles(unit_edges):
        members = set(comp)
        detail = sorted(f"{a} -> {b}" for a, b in unit_edges if a in members and b in members)
        out.append(f"cycle between {', '.join(comp)}: {'; '.join(detail)}")
    out += [f"{u}: not in LAYERS (place it in a layer)" for u in sorted(unlisted)]
    return out


# ----------------------------------------------------------------------------- tests
def test_graph_sees_nested_and_relative_imports():
    edges = import_graph()
    assert ("cedlm.engine.loader", "cedlm.checkpoint") in edges           # inside a function
    assert ("cedlm.data.corpus", "cedlm.data.sources") in edges           # relative import
    assert ("cedlm.config.presets", "cedlm.config.schema") in edges       # module level


def test_layering():
    found = violations(import_graph())
    assert not found, "import layering broken:\n  " + "\n  ".join(found)


# The engine reaches the model's forward through its step wrappers only (`CompiledDecode` for a
# token per sequence, `dspark_steps` for the DSpark draft and verification), each of which owns
# its reference fallback: no second implementation of a step is imported into cedlm.engine.
ENGINE_STEP_NAMES = {"draft_block", "verify", "rollback", "mark", "blocks_forward", "decode_step",
                     "draft_step"}


def test_engine_calls_one_step():
    bad = []
    for mod, path in _modules().items():
        if unit_of(mod) != "cedlm.engine":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cedlm.model"):
                bad += [f"{mod}: from {node.module} import {a.name}" for a in node.names
                        if a.name in ENGINE_STEP_NAMES]
            if (isinstance(node, ast.Attribute) and node.attr in ENGINE_STEP_NAMES
                    and isinstance(node.value, ast.Name) and node.value.id in ("dspark", "rollback")):
                bad.append(f"{mod}: {node.value.id}.{node.attr}")
    assert not bad, "the engine calls a step's second implementation:\n  " + "\n  ".join(bad)


# What an engine step may ask the scheduler (cedlm/engine/scheduler.py): plan the step and take
# what ran, plus the two calls whose answer the step needs before it goes on; requests come and
# go between steps (add, check, abort, requeue).
SCHEDULER_VERBS = {"schedule", "update_from_output", "reserve_lookahead", "fork",
                   "add", "check", "abort", "requeue"}


def test_engine_talks_to_the_scheduler_with_its_verbs():
    """The engine's step reports what ran with `update_from_output`; it never moves a count
    itself (`advance`, `prefill_done`, `finish` are the scheduler's)."""
    bad = []
    for mod, path in _modules().items():
        if unit_of(mod) not in ("cedlm.engine", "cedlm.server") or mod == "cedlm.engine.scheduler":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "scheduler"
                    and node.func.attr not in SCHEDULER_VERBS):
                bad.append(f"{mod}: scheduler.{node.func.attr}()")
    assert not bad, "a call outside the scheduler's verbs:\n  " + "\n  ".join(bad)


def test_checker_reports_upward_edges_and_cycles():
    layers = {"cedlm.low": 0, "cedlm.mid": 1, "cedlm.top": 2}
    edges = {
        ("cedlm.top.app", "cedlm.mid.core"),          # fine: downward
        ("cedlm.mid.core", "cedlm.low.util"),         # fine: downward
        ("cedlm.low.util", "cedlm.top.app"),          # upward, and closes a cycle
        ("cedlm.mid.core", "cedlm.mid.other"),        # same unit: ignored
        ("cedlm.low.util", "cedlm.new.thing"),        # a unit missing from the layers
    }
    found = violations(edges, layers, allowed=set())
    assert "cedlm.low.util -> cedlm.top.app (layer 0 -> layer 2)" in found
    assert any(v.startswith("cycle between cedlm.low, cedlm.mid, cedlm.top") for v in found)
    assert "cedlm.new: not in LAYERS (place it in a layer)" in found
    assert len(found) == 3
    # A same-layer edge fails unless listed.
    same = {("cedlm.a.x", "cedlm.b.y")}
    assert violations(same, {"cedlm.a": 1, "cedlm.b": 1}, allowed=set()) == [
        "cedlm.a.x -> cedlm.b.y (layer 1 -> layer 1)"]
    assert violations(same, {"cedlm.a": 1, "cedlm.b": 1}, allowed={("cedlm.a", "cedlm.b")}) == []


if __name__ == "__main__":
    for line in violations(import_graph()) or ["no violations"]:
        print(line)
