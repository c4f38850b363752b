"""The store is a cache, never a dependency.

Every store call site (block put, block get, keys at start-up, session save and restore) fails in
turn -- injected exceptions, a full disk, Redis down, Redis hung (SIGSTOP) -- and through the engine
(`LLM(model="tiny", store=...)`, small KV budget, 8-token blocks) every request still completes
with the tokens of a run without a store, blocks in use return to zero, failures are counted, the
circuit breaker opens and closes again, and a hung Redis costs a bounded few seconds instead of
30 s per call. Junk in a store directory is skipped and left in place.

Numbers (blocks in use after each fault, seconds per request with Redis hung) are recorded in
$CEDLM_TEST_RESULTS/store_faults.json when that variable is set.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

import cedlm.cache.store as S
from cedlm import LLM, SamplingParams
from cedlm.cache.store import DirStore, Record, StoreGuard, open_store
from conftest import _free_port, _ping            # the redis fixture's own helpers

pytestmark = pytest.mark.foreground    # times wall-clock latencies: see tests/ahead.py

# Measurements go to $CEDLM_TEST_RESULTS/store_faults.json when that is set (never into tests/).
RESULTS = Path(os.environ["CEDLM_TEST_RESULTS"]) if os.environ.get("CEDLM_TEST_RESULTS") else None
BT = 8                                   # block tokens
MAX_SEQS = 4
SP = SamplingParams(max_tokens=4, temperature=0)


def _budget(llm_blocks: int = 40) -> int:
    # tiny preset: 2640 B of windows per sequence, 560 B per 8-token block -> 40 blocks
    return MAX_SEQS * 2640 + llm_blocks * 560


def _prompts(prefix_seed: int, n: int = 4) -> list[list[int]]:
    """n prompts of 41 tokens sharing a 32-token prefix (5 hashed blocks each, 4 shared)."""
    base = [3 + (prefix_seed * 131 + i * 17) % 500 for i in range(32)]
    return [base + [3 + (prefix_seed * 7 + j * 29 + k * 13) % 500 for k in range(9)] for j in range(n)]


WARM = _prompts(1)                       # blocks already in the warm store
NEW = _prompts(2)                        # blocks not in it yet


def _llm(store, budget_blocks: int = 40) -> LLM:
    return LLM(model="tiny", store=store, block_tokens=BT, kv_budget_bytes=_budget(budget_blocks),
               max_num_seqs=MAX_SEQS, prefill_mode="exact", replay_mode="exact")


def _record(name: str, value) -> None:
    if RESULTS is None:
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    p = RESULTS / "store_faults.json"
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        data = {}
    data[name] = value
    p.write_text(json.dumps(data, indent=2, sort_keys=True))


def _done(outs) -> bool:
    """Every request ran to its max_tokens. (That a prefix hit with exact replay reproduces the
    cold run's tokens is pinned in tests/test_engine.py; here only completion is checked.)"""
    return all(o.finish_reason == "length" and len(o.token_ids) == SP.max_tokens for o in outs)


@pytest.fixture(scope="module")
def warm_dir(tmp_path_factory):
    """A directory store holding the blocks of WARM (written by a healthy engine)."""
    path = tmp_path_factory.mktemp("warm") / "store"
    llm = _llm(str(path))
    llm.generate(WARM, SP)
    assert llm.engine.pool.num_used == 0 and llm.stats()["store_errors"] == 0
    assert len(DirStore(path).keys()) == 8                   # 4 shared blocks + 1 own per prompt
    return path


# ----------------------------------------------------------------------------- injected faults


class Faulty:
    """A store wrapper whose chosen operations raise (or answer junk)."""

    def __init__(self, inner, fail: dict[str, str]):
        self.inner, self.fail, self.calls = inner, fail, Counter()

    def _call(self, op, fn, *args):
        self.calls[op] += 1
        how = self.fail.get(op)
        if how == "raise" or (how == "every_other" and self.calls[op] % 2 == 0):
            raise RuntimeError(f"injected {op} failure")
        if how == "oserror":
            raise OSError(errno.EIO, f"injected {op} I/O error")
        out = fn(*args)
        if how == "unusable" and out is not None:   # the right shapes, arrays that cannot be copied
            class Bad:
                def __init__(self, shape):
                    self.shape = shape
            return SimpleNamespace(meta=out.meta, arrays={k: Bad(v.shape) for k, v in out.arrays.items()})
        return out

    def put(self, key, record):
        return self._call("put", self.inner.put, key, record)

    def get(self, key):
        return self._call("get", self.inner.get, key)

    def delete(self, key):
        return self._call("delete", self.inner.delete, key)

    def keys(self):
        return self._call("keys", self.inner.keys)

    def stats(self):
        return self._call("stats", self.inner.stats)


CASES = {
    "put": {"put": "raise"},
    "get": {"get": "raise"},
    "get_every_other": {"get": "every_other"},     # a prefix hit that breaks off half-way
    "get_unusable_record": {"get": "unusable"},    # a block taken, then the copy fails
    "keys_at_startup": {"keys": "raise"},
    "io_errors_everywhere": {"put": "oserror", "get": "oserror", "keys": "oserror"},
}


@pytest.mark.parametrize("case", list(CASES))
def test_failure_at_each_call_site_is_a_miss_and_frees_every_block(case, warm_dir, tmp_path):
    path = tmp_path / "store"
    shutil.copytree(warm_dir, path)
    faulty = Faulty(DirStore(path), CASES[case])
    llm = _llm(faulty)
    used = []
    for batch in (WARM[:2] + NEW[:2], WARM[1:3] + NEW[1:3]):   # the second: pool and store hits again
        outs = llm.generate(batch, SP)
        assert _done(outs) and len(outs) == len(batch)
        used.append(llm.engine.pool.num_used)
    # sessions: save and restore through the same store
    saved = llm.save_session("s", NEW[0])
    restored = llm.restore_session("s")
    used.append(llm.engine.pool.num_used)
    st = llm.stats()
    assert used == [0] * len(used)
    assert st["store_errors"] >= 1, st
    assert sum(faulty.calls[op] for op in CASES[case]) >= 1
    if "put" in CASES[case]:
        assert saved == 0 and restored is None
    elif "get" in CASES[case]:
        assert saved > 0 and (restored is None if CASES[case]["get"] == "raise" else True)
    else:
        assert saved > 0 and restored is not None
    if case in ("put", "get", "io_errors_everywhere"):
        assert st["store_breaker_state"] == "open" and st["store_breaker_open"] == 1
        assert st["store_breaker_trips"] == (2 if case == "io_errors_everywhere" else 1)
        assert st["store_skipped"] > 0
        kinds = {"put": ["write"], "get": ["read"]}.get(case, ["read", "write"])
        assert all(st[f"store_{k}_breaker"] == "open" for k in kinds), st
    for k in ("store_breaker_state", "store_skipped", "store_timeouts", "store_consecutive_failures"):
        assert k in llm.engine.kv_stats()                    # what the server exports
    _record(f"call_site/{case}", {"blocks_in_use_after_each_round": used, "store_errors": st["store_errors"],
                                  "store_skipped": st["store_skipped"], "breaker": st["store_breaker_state"],
                                  "calls": dict(faulty.calls)})


# ----------------------------------------------------------------------------- full disk


def test_full_disk_is_a_miss_no_leak_and_recovers(tmp_path, monkeypatch, caplog):
    path = tmp_path / "store"

    def enospc(f, parts):
        raise OSError(errno.ENOSPC, "No space left on device")

    clock = _Clock()                                           # frozen while the disk is full
    guard = StoreGuard(DirStore(path), failure_threshold=3, cooldown_s=30.0, log_interval_s=60.0, clock=clock)
    llm = _llm(guard, budget_blocks=24)                        # 13 requests x 6 blocks would exhaust it
    monkeypatch.setattr(S, "_write_parts", enospc)
    prompts = [_prompts(10 + i, 1)[0] for i in range(13)]
    used = []
    with caplog.at_level(logging.WARNING, logger="cedlm.cache.store.guard"):
        for p in prompts:
            out = llm.generate([p], SP)[0]
            assert out.finish_reason == "length" and len(out.token_ids) == 4
            used.append(llm.engine.pool.num_used)
        assert llm.save_session("full", prompts[0]) == 0
    st = llm.stats()
    assert used == [0] * 13
    assert st["store_errors"] == 3 and st["store_breaker_state"] == "open" and st["store_skipped"] > 0
    assert st["store_write_breaker"] == "open" and st["store_read_breaker"] == "closed"   # reads still served
    assert not list(path.iterdir())                           # no temp files, no half entries
    logged = [r for r in caplog.records if r.name == "cedlm.cache.store.guard"]
    assert len(logged) == 2, [r.getMessage() for r in logged]   # first failure + breaker opened
    # the disk is freed: after the cool-down the store is tried again and takes blocks
    monkeypatch.undo()
    clock.t = 30.0
    assert llm.stats()["store_breaker_state"] == "half_open"
    outs = llm.generate(prompts[:3], SP)
    assert [o.finish_reason for o in outs] == ["length"] * 3 and llm.engine.pool.num_used == 0
    st = llm.stats()
    assert st["store_breaker_state"] == "closed" and st["store_errors"] == 3
    assert len(DirStore(path).keys()) == 3 * 5                # the blocks produced again were written
    assert llm.save_session("full", prompts[0]) > 0 and llm.restore_session("full") is not None
    _record("full_disk", {"requests": 13, "blocks_in_use_after_each": used, "pool_blocks": llm.engine.pool.num_blocks,
                          "store_errors": 3, "log_lines": len(logged)})


# ----------------------------------------------------------------------------- Redis


def _start_redis(workdir: Path, port: int | None = None) -> tuple[subprocess.Popen, int]:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not on PATH")
    pytest.importorskip("redis")
    for _ in range(5):
        p = port or _free_port()
        proc = subprocess.Popen([exe, "--port", str(p), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                 "--dir", str(workdir), "--daemonize", "no"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None and not _ping(p):
            time.sleep(0.05)
        if proc.poll() is None and _ping(p):
            return proc, p
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    pytest.fail("could not start redis-server")


def _stop_redis(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_redis_timeouts_are_bounded_and_configurable(redis_url):
    s = open_store(redis_url)
    kw = s._r.connection_pool.connection_kwargs
    assert kw["socket_timeout"] == S.DEFAULT_SOCKET_TIMEOUT_S <= 2 and kw["socket_connect_timeout"] <= 2
    s = open_store(redis_url, socket_timeout=0.25, connect_timeout=0.5)
    kw = s._r.connection_pool.connection_kwargs
    assert (kw["socket_timeout"], kw["socket_connect_timeout"]) == (0.25, 0.5)
    assert open_store(redis_url + "?socket_timeout=0.3")._r.connection_pool.connection_kwargs["socket_timeout"] == 0.3
    with pytest.raises(ValueError):
        S.RedisStore(redis_url, socket_timeout=0)


def test_redis_down_from_the_start():
    pytest.importorskip("redis")
    url = f"redis://127.0.0.1:{_free_port()}/0"              # nobody listens there
    llm = _llm(url)                                          # starts anyway (a warning), store = miss
    t0 = time.monotonic()
    outs = llm.generate(WARM + NEW, SP)
    dt = time.monotonic() - t0
    assert _done(outs)
    assert llm.engine.pool.num_used == 0
    assert llm.save_session("x", WARM[0]) == 0 and llm.restore_session("x") is None
    st = llm.stats()
    assert llm.engine.pool.num_used == 0
    assert st["store_errors"] == 3 and st["store_breaker_state"] == "open"
    _record("redis_down_from_start", {"blocks_in_use": llm.engine.pool.num_used, "seconds_8_requests": round(dt, 2),
                                      "store_errors": st["store_errors"], "store_skipped": st["store_skipped"]})


def test_redis_dies_and_comes_back(tmp_path):
    proc, port = _start_redis(tmp_path)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        guard = StoreGuard(open_store(url), cooldown_s=0.5)
        llm = _llm(guard)
        llm.generate(WARM[:1], SP)
        assert llm.stats()["store_errors"] == 0 and len(guard.keys()) == 5
        _stop_redis(proc)                                      # Redis goes away mid-run
        used = []
        for p in NEW:
            assert _done(llm.generate([p], SP))
            used.append(llm.engine.pool.num_used)
        assert used == [0] * 4
        st = llm.stats()
        assert st["store_errors"] >= 1 and st["store_breaker_state"] == "open"
        proc, _ = _start_redis(tmp_path, port)                 # back, empty
        time.sleep(0.6)
        outs = llm.generate(NEW, SP)
        assert _done(outs) and llm.engine.pool.num_used == 0
        assert len(guard.keys()) == 8                          # NEW's blocks written once it was back
        assert _done(llm.generate(WARM[:1], SP))               # WARM's blocks: in memory, not in Redis
        assert len(guard.keys()) == 13                         # written back once the store works again
        st = llm.stats()
        assert st["store_breaker_state"] == "closed"
        _record("redis_dies_and_returns", {"blocks_in_use_while_down": used, "store_errors": st["store_errors"],
                                           "breaker_after_return": st["store_breaker_state"]})
    finally:
        _stop_redis(proc)


def test_redis_hung_costs_seconds_not_minutes(tmp_path):
    proc, port = _start_redis(tmp_path)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        guard = StoreGuard(open_store(url), failure_threshold=3, cooldown_s=3.0)   # default 1 s socket timeouts
        llm = _llm(guard)
        llm.generate(WARM[:1], SP)                             # warm: keys() and a few puts went fine
        assert llm.stats()["store_errors"] == 0
        os.kill(proc.pid, signal.SIGSTOP)                      # hung: accepts connections, never answers
        times, used = [], []
        for p in WARM[1:2] + NEW:
            t0 = time.monotonic()
            out = llm.generate([p], SP)[0]
            times.append(round(time.monotonic() - t0, 2))
            assert _done([out])
            used.append(llm.engine.pool.num_used)
        st = llm.stats()
        assert used == [0] * 5
        assert st["store_timeouts"] >= 1 and st["store_breaker_state"] == "open", st
        assert max(times) < 8.0, times                         # at most failure_threshold timeouts, once
        assert sum(times) < 12.0, times
        # a session save/restore while hung is a miss too (skipped while the breaker is open)
        t0 = time.monotonic()
        assert llm.save_session("h", NEW[0]) == 0 and llm.restore_session("h") is None
        session_s = time.monotonic() - t0
        assert session_s < 5.0
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(3.1)
        outs = llm.generate(NEW, SP)
        assert _done(outs) and llm.engine.pool.num_used == 0
        assert len(guard.keys()) == 5 + 8                      # written again once it answered
        assert llm.stats()["store_breaker_state"] == "closed"
        _record("redis_hung", {"seconds_per_request": times, "blocks_in_use_after_each": used,
                               "store_timeouts": st["store_timeouts"], "store_skipped": st["store_skipped"],
                               "session_save_restore_s": round(session_s, 2)})
    finally:
        _stop_redis(proc)


# ----------------------------------------------------------------------------- the breaker itself


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class _Flaky:
    def __init__(self):
        self.broken, self.calls = True, 0

    def get(self, key):
        self.calls += 1
        if self.broken:
            raise ConnectionError("down")
        return None

    def put(self, key, record):
        self.calls += 1
        if key == "too-big":
            raise ValueError("entry larger than capacity")
        if self.broken:
            raise TimeoutError("hung")

    def keys(self):
        raise ConnectionError("down")


def test_breaker_opens_skips_and_recovers(caplog):
    clock, inner, stats = _Clock(), _Flaky(), {}
    g = StoreGuard(inner, failure_threshold=3, cooldown_s=10, log_interval_s=5, stats=stats, clock=clock)
    with caplog.at_level(logging.WARNING, logger="cedlm.cache.store.guard"):
        # unreachable (ConnectionError, timeouts): counts against reads and writes alike
        assert g.get("k") is None and g.put("k", Record()) is False and g.get("k") is None
        assert inner.calls == 3 and stats["store_breaker_state"] == "open"
        assert stats["store_read_breaker"] == stats["store_write_breaker"] == "open"
        assert stats["store_errors"] == 3 and stats["store_timeouts"] == 1 and stats["store_breaker_trips"] == 2
        for _ in range(100):                                   # skipped: no call reaches the store
            assert g.get("k") is None and g.put("k", Record()) is False
        assert inner.calls == 3 and stats["store_skipped"] == 200
        clock.t = 10.0
        assert g.state == "half_open" and stats["store_breaker_open"] == 1
        assert g.get("k") is None and stats["store_breaker_state"] == "open"   # the trial failed
        assert stats["store_breaker_trips"] == 4 and inner.calls == 4
        clock.t = 20.0
        inner.broken = False
        assert g.put("k", Record()) is True                    # write trial: closed; reads still half-open
        assert g.breaker_states() == {"read": "half_open", "write": "closed"} and g.state == "half_open"
        assert g.get("k") is None and g.state == "closed" and stats["store_breaker_open"] == 0
        assert stats["store_consecutive_failures"] == 0
        for _ in range(5):                                     # a caller's error moves no breaker
            assert g.put("too-big", Record()) is False
        assert g.state == "closed" and stats["store_errors"] == 9
        assert g.keys() == [] and g.keys_or_none() is None     # 2 failures: below the threshold
        assert g.state == "closed" and stats["store_errors"] == 11
    msgs = [r.getMessage() for r in caplog.records]
    # 11 failures at t=0, 10 and 20, 5 s apart: 3 lines; openings at t=0 (read and write) and 10: 2
    assert len([m for m in msgs if "treated as a cache miss" in m]) == 3, msgs
    assert any("(2 more since the last report" in m for m in msgs), msgs
    assert len([m for m in msgs if "circuit breaker open" in m]) == 2, msgs


def test_full_disk_stops_writes_only():
    """A full disk (ENOSPC) opens the write breaker; reads keep serving hits."""
    class Full:
        def __init__(self):
            self.gets = 0

        def put(self, key, record):
            raise OSError(errno.ENOSPC, "No space left on device")

        def get(self, key):
            self.gets += 1
            return Record(meta={"hit": True})

    inner = Full()
    g = StoreGuard(inner, failure_threshold=2)
    for _ in range(5):
        assert g.put("k", Record()) is False
        assert g.get("k").meta == {"hit": True}
    assert g.breaker_states() == {"read": "closed", "write": "open"} and inner.gets == 5
    assert g.counters["store_errors"] == 2 and g.counters["store_skipped"] == 3


# ----------------------------------------------------------------------------- junk in the directory


def _run_with_deadline(fn, fifos, timeout=20.0):
    """fn() in a thread; if it blocks (e.g. opened a FIFO), unblock it and fail."""
    box = {}

    def target():
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["err"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        for f in fifos:                                         # let a blocked open() return
            try:
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        t.join(5)
        pytest.fail("the store blocked on junk in its directory")
    if "err" in box:
        raise box["err"]
    return box["out"]


def test_junk_in_the_store_directory_is_skipped_and_left_alone(tmp_path, monkeypatch, caplog):
    path = tmp_path / "store"
    good = DirStore(path)
    good.put("good", Record(meta={"v": 1}))
    victim_name = good._filename("unreadable-entry")
    good.put("unreadable-entry", Record(meta={"v": 2}))
    (path / "x.kv").mkdir()                                    # a directory
    (path / "x.kv" / "inner").write_text("keep me")
    os.mkfifo(path / "fifo.kv")                                # a FIFO: opening it would block
    (path / "notes.kv").write_text("someone else's file")      # a foreign regular file
    (path / "locked.kv").write_bytes(b"\x89CEDLMKV")
    os.chmod(path / "locked.kv", 0)
    os.symlink(path / good._filename("good"), path / "link.kv")
    os.chmod(path / victim_name, 0)                            # our own entry, now unreadable
    foreign_target = good._filename("at-our-name")
    (path / foreign_target).mkdir()                            # junk exactly where an entry would go
    unreadable = {str(path / "locked.kv"), str(path / victim_name)}
    real_open = os.open

    def no_access(p, flags, *a, **kw):                          # root ignores chmod 0: say EACCES anyway
        if os.fspath(p) in unreadable:
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(p))
        return real_open(p, flags, *a, **kw)

    monkeypatch.setattr(os, "open", no_access)
    with caplog.at_level(logging.WARNING, logger="cedlm.cache.store.dir_store"):
        s = _run_with_deadline(lambda: DirStore(path), [path / "fifo.kv"])
        keys = _run_with_deadline(s.keys, [path / "fifo.kv"])   # a re-scan: no new log line
    assert keys == ["good"]
    skipped = s.skipped()
    assert set(skipped) == {"x.kv", "fifo.kv", "notes.kv", "locked.kv", "link.kv", victim_name, foreign_target}
    assert skipped["fifo.kv"] == "not a regular file" and "cannot open" in skipped[victim_name]
    assert s.stats()["skipped"] == 7 and s.stats()["corrupt"] == 0
    assert len([r for r in caplog.records if "skipped" in r.getMessage()]) == 1
    for name in skipped:                                       # nothing deleted
        assert os.path.lexists(path / name), name
    assert (path / "x.kv" / "inner").read_text() == "keep me"
    assert s.get("good").meta == {"v": 1}
    # at get/put time: junk at an entry's name is a miss and stays; an unreadable entry is an error
    assert s.get("at-our-name") is None
    with pytest.raises(S.NotRegularFile):
        s.put("at-our-name", Record())
    assert (path / foreign_target).is_dir()
    with pytest.raises(PermissionError):
        s.get("unreadable-entry")
    g = StoreGuard(s)
    assert g.get("unreadable-entry") is None and g.put("at-our-name", Record()) is False
    assert g.stats()["store_errors"] == 2 and os.path.exists(path / victim_name)
    # and an engine starts and serves over this directory
    llm = _run_with_deadline(lambda: _llm(str(path)), [path / "fifo.kv"])
    outs = _run_with_deadline(lambda: llm.generate(WARM[:2], SP), [path / "fifo.kv"])
    assert [o.finish_reason for o in outs] == ["length"] * 2 and llm.engine.pool.num_used == 0
    assert llm.stats()["store_errors"] == 0
    monkeypatch.undo()
    for name in ("locked.kv", victim_name):
        os.chmod(path / name, stat.S_IRUSR | stat.S_IWUSR)
    _record("junk_dir", {"skipped": skipped, "blocks_in_use": llm.engine.pool.num_used})


def test_corrupt_blocks_are_rewritten_by_the_same_engine(tmp_path):
    path = tmp_path / "store"
    llm = _llm(str(path))
    p = WARM[0]
    first = llm.generate([p], SP)[0].token_ids
    files = sorted(path.glob("*.kv"))
    assert len(files) == 5
    original = {f.name: f.read_bytes() for f in files}
    for f in files:                                            # bit rot in every block
        raw = bytearray(original[f.name])
        raw[len(raw) // 2] ^= 0x01
        f.write_bytes(bytes(raw))
    pool = llm.engine.pool                                     # push the blocks out of the pool
    taken = [pool.allocate() for _ in range(pool.num_free)]
    for b in taken:
        pool.release(b)
    assert not pool.cached
    again = llm.generate([p], SP)[0]                           # corrupt: a miss, recomputed from scratch
    assert again.token_ids == first and again.num_cached_tokens == 0
    assert llm.engine.kv.stats["store_block_hits"] == 0 and llm.engine.pool.num_used == 0
    assert llm.engine.store.stats()["corrupt"] == 1            # the first one; the lookup stops there
    # ... and every block of the chain re-written, by this engine, without a restart: the same bytes
    assert {f.name: f.read_bytes() for f in sorted(path.glob("*.kv"))} == original
    fresh = DirStore(path)
    assert all(fresh.get(k) is not None for k in fresh.keys()) and fresh.stats()["corrupt"] == 0
    other = _llm(str(path))
    assert _done(other.generate([p], SP))
    assert other.engine.kv.stats["store_block_hits"] == 5 and other.engine.pool.num_used == 0
    _record("corrupt_rewritten", {"blocks_rewritten": 5, "blocks_in_use": llm.engine.pool.num_used})


def test_abort_with_a_failing_store_frees_everything(warm_dir, tmp_path):
    """A client going away mid-request (abort) while every store call fails: no exception, no leak."""
    path = tmp_path / "store"
    shutil.copytree(warm_dir, path)
    llm = _llm(Faulty(DirStore(path), {"put": "raise", "get": "raise", "keys": "raise"}))
    eng = llm.engine
    reqs = [eng.add_request(p, SamplingParams(max_tokens=8, temperature=0)) for p in WARM[:2] + NEW[:2]]
    for _ in range(6):                                         # some prefilled, some decoding
        eng.step()
    assert eng.pool.num_used > 0
    for r in reqs:
        eng.abort(r.request_id)
    assert eng.pool.num_used == 0 and not eng.has_work
    assert _done(llm.generate(NEW[2:], SP)) and eng.pool.num_used == 0
    _record("abort_with_failing_store", {"blocks_in_use_after_abort": eng.pool.num_used,
                                         "store_errors": llm.stats()["store_errors"]})
