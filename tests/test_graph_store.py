"""The graph store (cedlm/model/graph_store.py): a compiled step's graphs saved whole and loaded
by a later step object without tracing, keyed so that each call finds its own graph, and every
failure (a damaged file, guards that do not hold, a store that cannot be written) falling back to
the lazily compiled step. Here through dynamo's `eager` backend (capture, guards and the saved
artifact without code generation: seconds); tests/test_compiled_step.py stores and loads real
inductor graphs."""
from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from cedlm.model import CEDModel, graph_store
from cedlm.model import compiled_step
from cedlm.model.compiled_step import CompiledDecode, _portable_guards, own_copy, scratch_states
from cedlm.model.model import decode_step
from tests.test_compiled_step import every_kind_config


@pytest.fixture(scope="module")
def model():
    """Every layer kind in 6 layers of the tiny preset's widths (each capture traces them all)."""
    torch.manual_seed(0)
    return CEDModel(every_kind_config("tiny", initializer_range=0.08)).eval()


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("CEDLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiled_step, "BACKEND", "eager")
    return tmp_path / "graphs"


@pytest.fixture(scope="module")
def built(model, tmp_path_factory):
    """A store holding the batch-1 and batch >= 2 graphs, built once: (its files, the store
    object that built them, the sources it reported)."""
    d = tmp_path_factory.mktemp("built")
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setenv("CEDLM_CACHE_DIR", str(d))
        mp.setattr(compiled_step, "BACKEND", "eager")
        fn, step, how = _store(model), _step(model), []
        for B in (1, 2):
            args = _args(step, B)
            assert _close(fn(*args)[0], decode_step(*args)[0])
            how.append(fn.last)
    return sorted((d / "graphs").glob("*.pt2")), fn, how


def _copy(files, store):
    store.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copy(f, store / f.name)


def _step(model):
    """A CompiledDecode whose `_inputs` marks the dynamic dims as the compiled step's do."""
    return CompiledDecode(model, "compiled")


def _args(step, B, prompt_len=4):
    states = scratch_states(step.model, B)
    for st in states:
        for _ in range(prompt_len - 4):
            step.model.decode([7], [st])
    shapes = step.shape_for(states, paged=True)
    args, _ = step._inputs(torch.arange(B) + 5, states)
    return (shapes, *args)


def _close(a, b) -> bool:
    """Within float rounding (the captured graph may order a sum differently)."""
    return (a - b).abs().max().item() < 1e-4


def _store(model):
    def make(filt):
        return torch.compile(own_copy(decode_step), backend="eager", fullgraph=True,
                             options={"guard_filter_fn": filt})
    return graph_store.GraphStore(model, "decode", make(torch.compiler.skip_guard_on_all_nn_modules_unsafe),
                                  lambda: make(_portable_guards), extra={"backend": "eager"})


def test_call_keys_follow_the_graphs(model, store):
    step = _step(model)
    b1, b1_long = _args(step, 1), _args(step, 1, prompt_len=40)
    b2, b3 = _args(step, 2), _args(step, 3, prompt_len=20)
    key = graph_store.call_key
    assert key("decode", b1) == key("decode", b1_long)       # dynamic: blocks of the table and pools
    assert key("decode", b2) == key("decode", b3)            # dynamic: the batch (>= 2)
    assert key("decode", b1) != key("decode", b2)
    assert key("verify", b1) != key("decode", b1)
    flat = (step.shape_for(scratch_states(model, 1), paged=False), *b1[1:])
    assert key("decode", flat) != key("decode", b1)


@torch.no_grad()
def test_saved_then_loaded_by_a_new_step_object(model, store, built):
    files, fn, how = built
    assert how == ["compiled", "compiled"]
    assert len(files) == 2 and all(f.name.startswith(fn.prefix) for f in files)
    _copy(files, store)
    step = _step(model)
    again = _store(model)                                    # a later start: loads, traces nothing
    for B in (1, 3):
        args = _args(step, B, prompt_len=30)
        got = again(*args)[0]
        assert again.last == "loaded" and torch.equal(got, fn(*args)[0])   # the same graph
        assert _close(got, decode_step(*args)[0])
    assert sorted(f.name for f in store.glob("*.pt2")) == [f.name for f in files]


@torch.no_grad()
def test_a_damaged_file_is_built_again(model, store, built, caplog):
    step = _step(model)
    args = _args(step, 1)
    _copy(built[0], store)
    f = _store(model).path(graph_store.call_key("decode", args))
    f.write_bytes(f.read_bytes()[:1000])
    fn = _store(model)
    with caplog.at_level(logging.WARNING):
        assert _close(fn(*args)[0], decode_step(*args)[0])
    assert fn.last == "compiled" and "does not load" in caplog.text
    assert f.stat().st_size > 1000                           # replaced whole


@torch.no_grad()
def test_guards_that_fail_fall_back_to_the_lazy_step(model, store, built, caplog):
    step = _step(model)
    b1, b2 = _args(step, 1), _args(step, 2)
    _copy(built[0], store)
    fn = _store(model)
    # the batch-1 graph under batch 2's name
    os.replace(fn.path(graph_store.call_key("decode", b1)), fn.path(graph_store.call_key("decode", b2)))
    again = _store(model)
    with caplog.at_level(logging.WARNING):
        assert _close(again(*b2)[0], decode_step(*b2)[0])
    assert again.last == "lazy" and "guards do not hold" in caplog.text


@torch.no_grad()
def test_a_store_that_cannot_be_written_still_serves(model, store, caplog):
    store.parent.mkdir(parents=True, exist_ok=True)
    store.write_text("not a directory")
    step = _step(model)
    args = _args(step, 1)
    fn = _store(model)
    with caplog.at_level(logging.WARNING):
        assert _close(fn(*args)[0], decode_step(*args)[0])
    assert fn.last == "unsaved" and "not saved" in caplog.text
    assert compiled_step.how(fn) == "compiled (not saved to the graph store: see the warning above)"


def test_the_store_key_follows_code_model_and_options(model):
    base = graph_store.model_digest(model, {"opt": "O3"})
    assert graph_store.model_digest(model, {"opt": "O2"}) != base
    other = CEDModel(model.cfg.replace(vocab_size=model.cfg.vocab_size + 64))
    assert graph_store.model_digest(other, {"opt": "O3"}) != base
    assert len(graph_store.code_digest()) == 64


def test_stored_step_only_for_inductor_and_when_on(model, monkeypatch):
    monkeypatch.setattr(compiled_step, "BACKEND", "eager")
    assert not isinstance(compiled_step.stored_step(model, "decode"), graph_store.GraphStore)
    monkeypatch.setattr(compiled_step, "BACKEND", "inductor")
    assert isinstance(compiled_step.stored_step(model, "decode"), graph_store.GraphStore)
    monkeypatch.setenv("CEDLM_GRAPH_STORE", "0")
    assert not isinstance(compiled_step.stored_step(model, "decode"), graph_store.GraphStore)


def test_one_cache_folder_holds_the_store_and_inductors_code(tmp_path):
    """$CEDLM_CACHE_DIR moves inductor's cache with the graph store (a folder several users or
    checkouts share holds both: a stored graph loads with its C++ already built); a
    TORCHINDUCTOR_CACHE_DIR the user set is kept."""
    import subprocess
    import sys
    probe = "import os, cedlm; print(os.environ['TORCHINDUCTOR_CACHE_DIR'])"

    def inductor_dir(**env):
        e = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "CEDLM_CACHE_DIR")}
        e.update(env)
        return subprocess.run([sys.executable, "-c", probe], env=e, capture_output=True, text=True,
                              check=True).stdout.strip()

    assert inductor_dir(CEDLM_CACHE_DIR=str(tmp_path)) == str(tmp_path / "inductor")
    assert inductor_dir(CEDLM_CACHE_DIR=str(tmp_path), TORCHINDUCTOR_CACHE_DIR="/elsewhere") == "/elsewhere"
    assert inductor_dir(HOME=str(tmp_path / "home")) == str(tmp_path / "home" / ".cache" / "cedlm" / "inductor")


def test_a_cache_folder_this_user_cannot_write_leaves_inductor_in_their_own(tmp_path, monkeypatch):
    """Inductor locks and writes files while it loads a graph, so a shared folder this user may
    only read (another user's) keeps the graph store but not inductor's cache."""
    from cedlm.util import inductor_cache_dir
    shared = tmp_path / "shared"
    (shared / "inductor").mkdir(parents=True)
    monkeypatch.setenv("CEDLM_CACHE_DIR", str(shared))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert inductor_cache_dir() == shared / "inductor"
    monkeypatch.setattr(os, "access", lambda p, mode: str(p) != str(shared / "inductor"))
    assert inductor_cache_dir() == tmp_path / "home" / ".cache" / "cedlm" / "inductor"
