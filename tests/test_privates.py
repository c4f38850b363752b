"""No cedlm module reaches into another's privates (AST only, nothing imported).

A private name is one with a leading underscore (not a dunder). Allowed:

* `self._x`, `cls._x`, `super()._x`: an object's own privates;
* `obj._x` where `_x` is defined in the same module (a class reading a private of another
  instance of itself, a module-private helper used where it lives);
* namedtuple's public API (`_asdict`, `_replace`, `_fields`, `_make`).

Everything else, `other._x` and `from cedlm.a import _x` in another module, fails, except the
reaches listed in EXCEPTIONS, each with its reason. The engine's request path (server worker,
engine, scheduler, KV cache manager, speculator) must never appear there.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "cedlm"
NAMEDTUPLE_API = {"_asdict", "_replace", "_fields", "_make", "_field_defaults"}

# (path relative to the repository, the reach as ast.unparse writes it) -> why it is allowed
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("cedlm/official/load.py", "mod._parameters"):
        "torch.nn.Module keeps parameters in _parameters; replacing one in place has no public API",
    ("cedlm/official/load.py", "mod._buffers"): "as _parameters, for buffers",
    ("cedlm/cache/store/__init__.py", "from cedlm.cache.store.dir_store import _host_tag"):
        "the store package re-exports its directory store's helpers for its own tests",
    ("cedlm/cache/store/__init__.py", "from cedlm.cache.store.dir_store import _write_parts"):
        "as _host_tag",
    ("cedlm/bench/peer.py", "lc._attn_implementation"):
        "transformers selects the attention kernel of a config built in code through this field",
    ("cedlm/plan/capacity.py", "from cedlm.plan.kvbytes import _num"):
        "two modules of the planner share one number formatter",
    ("cedlm/model/compiled_step.py", "cpp_builder._get_optimization_cflags"):
        "inductor has no setting for the C++ optimisation level of its kernels (-O3 is written in "
        "this function); CEDLM_COMPILE_OPT wraps it (torch is pinned)",
    ("cedlm/model/compiled_step.py", "torch._dynamo"):
        "torch.compile's mark_dynamic (one graph for every context length and batch size) has no "
        "public spelling in torch 2.13 (torch.compiler has none)",
    ("cedlm/model/graph_store.py", "torch._inductor"):
        "inductor's settings have no public spelling in torch 2.13 (torch.compile takes them as "
        "options; loading a stored graph takes none) and a graph must load under the settings it "
        "was compiled with (torch is pinned)",
    ("cedlm/train/compile.py", "torch._dynamo"):
        "torch._dynamo.config.recompile_limit (a graph per sequence length) has no public spelling",
}

REQUEST_PATH = ("cedlm/engine/", "cedlm/cache/kv_cache_manager.py", "cedlm/server/worker.py",
                "cedlm/server/completions.py", "cedlm/server/chat.py")


def _defined(tree: ast.AST) -> set[str]:
    """Every name the module defines: functions, classes, assigned names, attributes assigned on
    self / cls, arguments, imports."""
    names: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
              and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")):
            names.add(n.attr)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
        elif isinstance(n, ast.arg):
            names.add(n.arg)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names.update(a.asname or a.name.split(".")[0] for a in n.names)
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def reaches(path: Path) -> list[tuple[int, str]]:
    """(line, reach) of every reach into another module's or object's privates in one file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    own = _defined(tree)
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and _private(n.attr) and n.attr not in NAMEDTUPLE_API:
            v = n.value
            if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                continue
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                continue
            if n.attr not in own:
                out.append((n.lineno, ast.unparse(n)))
        elif isinstance(n, ast.ImportFrom) and (n.module or "").startswith("cedlm"):
            out += [(n.lineno, f"from {n.module} import {a.name}") for a in n.names if _private(a.name)]
    return out


def test_no_reach_into_privates():
    bad = []
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT.parent).as_posix()
        for line, what in reaches(p):
            if (rel, what) not in EXCEPTIONS or rel.startswith(REQUEST_PATH):
                bad.append(f"{rel}:{line}: {what}")
    assert not bad, "reaches into another module's privates:\n" + "\n".join(bad)


def test_the_check_finds_a_reach(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("class A:\n    def f(self, other):\n        self._ok = 1\n        return other._ok, "
                   "engine._emit(1)\n        engine._decode = None\nfrom cedlm.engine.engine import _hidden\n")
    assert sorted(w for _, w in reaches(src)) == ["engine._decode", "engine._emit",
                                                  "from cedlm.engine.engine import _hidden"]
