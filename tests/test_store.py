"""Cache-entry store: blob format, corruption -> miss, crash-safe writes, LRU; directory and Redis."""

import errno
import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import numpy as np
import pytest
import torch

from cedlm.cache import store as S
from cedlm.cache.store import (MAGIC, VERSION, CorruptRecord, DirStore, Record, RedisStore, Store,
                               StoreConnectionError, decode_record, encode_record, open_store)


# ----------------------------------------------------------------------------- helpers


def make_record(seed: int = 0, rows: int = 64, tokens: int = 256) -> Record:
    """A record shaped like an engine entry: KV / index-key byte rows per source layer, token ids,
    fp32 compressor state (with NaN payloads, -0.0, inf and denormals: bytes must survive)."""
    rng = np.random.default_rng(seed)
    comp = rng.standard_normal((3, 16)).astype(np.float32)
    comp.view(np.uint32)[0, :4] = [0x7FC00001, 0xFFC12345, 0x80000000, 0x00000001]  # NaNs, -0.0, denormal
    comp[0, 4] = np.inf
    return Record(
        meta={"model": "fp-" + "ab" * 8, "n_tokens": tokens, "block_tokens": 64,
              "kinds": {"kv.2": 72, "idx.2": 36, "kv.6": 72}, "positions": [0, tokens], "note": "ü"},
        arrays={
            "kv.2": rng.integers(0, 256, (rows, 72), dtype=np.uint8),
            "idx.2": rng.integers(0, 256, (rows, 36), dtype=np.uint8),
            "kv.6": rng.integers(0, 256, (rows // 4, 72), dtype=np.uint8),
            "tokens": rng.integers(0, 2**31 - 1, tokens, dtype=np.int32),
            "comp": comp,
            "empty": np.zeros((0, 72), dtype=np.uint8),
        })


def assert_same(got: Record, want: Record):
    assert got is not None
    assert got.meta == want.meta
    assert list(got.arrays) == list(want.arrays)
    for name, w in want.arrays.items():
        w = w.numpy() if isinstance(w, torch.Tensor) else w
        g = got.arrays[name]
        assert isinstance(g, np.ndarray)
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert g.tobytes() == w.tobytes(), name


def reseal(body: bytes) -> bytes:
    """Append a valid checksum to a (tampered) blob body, so only the tampering is wrong."""
    return body + hashlib.blake2b(body, digest_size=32).digest()


# ----------------------------------------------------------------------------- backends


class DirBackend:
    name = "dir"

    def __init__(self, root):
        self.root = root

    def open(self, capacity_bytes=None):
        return DirStore(self.root, capacity_bytes=capacity_bytes)

    def raw_get(self, store, key):
        return (store.path / store._filename(key)).read_bytes()

    def raw_set(self, store, key, blob):
        (store.path / store._filename(key)).write_bytes(blob)


class RedisBackend:
    name = "redis"

    def __init__(self, url):
        self.url = url
        self.prefix = f"t-{uuid.uuid4().hex[:8]}:"  # one namespace per test on the shared server

    def open(self, capacity_bytes=None):
        return RedisStore(self.url, prefix=self.prefix, capacity_bytes=capacity_bytes)

    def raw_get(self, store, key):
        return store._r.get(store._bkey(key))

    def raw_set(self, store, key, blob):
        store._r.set(store._bkey(key), blob)


@pytest.fixture(params=["dir", "redis"])
def backend(request, tmp_path):
    if request.param == "dir":
        return DirBackend(tmp_path / "store")
    return RedisBackend(request.getfixturevalue("redis_url"))


# ----------------------------------------------------------------------------- blob format


def test_blob_layout_and_roundtrip():
    rec = make_record()
    blob = encode_record(rec, key="seq-1")
    magic, version, hlen = struct.unpack_from("<8sIQ", blob)
    assert magic == MAGIC and version == VERSION
    header = json.loads(blob[20:20 + hlen])
    assert header["key"] == "seq-1" and header["meta"] == rec.meta
    data_start = (20 + hlen + 63) // 64 * 64
    assert len(blob) == data_start + header["data_nbytes"] + 32
    assert blob[-32:] == hashlib.blake2b(blob[:-32], digest_size=32).digest()
    for d in header["arrays"]:
        a = rec.arrays[d["name"]]
        assert d["dtype"] == a.dtype.name and d["shape"] == list(a.shape) and d["nbytes"] == a.nbytes
        assert d["offset"] % 64 == 0
        assert blob[data_start + d["offset"]:data_start + d["offset"] + d["nbytes"]] == a.tobytes()
    got, key = decode_record(bytearray(blob))
    assert key == "seq-1"
    assert_same(got, rec)
    assert got.arrays["kv.2"].flags.writeable
    got_ro, _ = decode_record(blob)  # immutable bytes -> read-only views, same values
    assert_same(got_ro, rec)
    assert encode_record(rec, key="seq-1") == blob  # deterministic


@pytest.mark.parametrize("how", ["flip_middle_byte", "truncate_one", "garbage", "wrong_version", "bad_descriptor"])
def test_decode_raises_corrupt_record(how):
    blob = encode_record(make_record(), key="k")
    with pytest.raises(CorruptRecord):
        decode_record(CORRUPTIONS[how](blob))
    with pytest.raises(CorruptRecord, match="expected 'other'"):
        decode_record(blob, expect_key="other")


def test_torch_inputs_and_tensors_view():
    rec = Record(meta={}, arrays={"kv.2": torch.randint(0, 256, (5, 9), dtype=torch.uint8),
                                  "tokens": torch.arange(7, dtype=torch.int32),
                                  "comp": torch.randn(2, 3).t()})  # non-contiguous
    got, _ = decode_record(bytearray(encode_record(rec)))
    assert_same(got, Record(meta={}, arrays={k: v.contiguous() for k, v in rec.arrays.items()}))
    t = got.tensors()
    assert t["comp"].dtype == torch.float32 and torch.equal(t["comp"], rec.arrays["comp"])
    assert t["tokens"].dtype == torch.int32 and t["kv.2"].dtype == torch.uint8


def test_big_endian_input_keeps_values():
    a = np.arange(10, dtype=">i4")
    got, _ = decode_record(bytearray(encode_record(Record(arrays={"t": a}))))
    assert got.arrays["t"].dtype == np.dtype("<i4") and (got.arrays["t"] == a).all()


@pytest.mark.parametrize("rec, err", [
    (Record(meta={"x": object()}), TypeError),
    (Record(meta={"x": float("nan")}), TypeError),
    (Record(arrays={"x": np.zeros(3, np.float64)}), TypeError),
    (Record(arrays={"x": torch.zeros(3, dtype=torch.bfloat16)}), TypeError),
    (Record(arrays={"x": [1, 2]}), TypeError),
    (Record(arrays={3: np.zeros(3, np.uint8)}), TypeError),
])
def test_bad_records_rejected(rec, err):
    with pytest.raises(err):
        encode_record(rec)


# ----------------------------------------------------------------------------- both backends


def test_roundtrip(backend):
    s = backend.open()
    assert isinstance(s, Store)
    rec = make_record(1)
    assert s.get("seq") is None
    s.put("seq", rec)
    assert_same(s.get("seq"), rec)
    # torch in, numpy out, same bytes
    trec = Record(meta={"k": 1}, arrays={"kv.2": torch.from_numpy(rec.arrays["kv.2"]),
                                         "tokens": torch.from_numpy(rec.arrays["tokens"])})
    s.put("seq/torch", trec)
    assert_same(s.get("seq/torch"), trec)
    st = s.stats()
    assert st["hits"] == 2 and st["misses"] == 1 and st["corrupt"] == 0 and st["entries"] == 2
    assert st["bytes"] == len(encode_record(rec, "seq")) + len(encode_record(trec, "seq/torch"))
    assert st["capacity_bytes"] is None and st["evictions"] == 0
    assert_same(backend.open().get("seq"), rec)  # a fresh instance sees it


def test_overwrite_delete_keys(backend):
    s = backend.open()
    a, b = make_record(1), make_record(2, rows=8)
    s.put("k1", a)
    s.put("k2", a)
    s.put("k1", b)
    assert_same(s.get("k1"), b)
    assert sorted(s.keys()) == ["k1", "k2"]
    assert s.stats()["bytes"] == len(encode_record(b, "k1")) + len(encode_record(a, "k2"))
    s.delete("k1")
    s.delete("k1")  # absent: no error
    assert s.get("k1") is None and s.keys() == ["k2"]
    with pytest.raises(TypeError):
        s.put("", a)


def _flip_middle(blob):
    b = bytearray(blob)
    b[len(b) // 2] ^= 0x01
    return bytes(b)


def _wrong_version(blob):
    b = bytearray(blob[:-32])
    struct.pack_into("<I", b, 8, VERSION + 1)
    return reseal(bytes(b))


def _bad_descriptor(blob):  # valid checksum, header lies about an array's size
    hlen = struct.unpack_from("<Q", blob, 12)[0]
    header = json.loads(blob[20:20 + hlen])
    header["arrays"][0]["nbytes"] += 1
    h = json.dumps(header, separators=(",", ":")).encode()
    new_hlen = len(h)
    start = (20 + new_hlen + 63) // 64 * 64
    old_start = (20 + hlen + 63) // 64 * 64
    body = struct.pack("<8sIQ", MAGIC, VERSION, new_hlen) + h + bytes(start - 20 - new_hlen) + blob[old_start:-32]
    return reseal(body)


CORRUPTIONS = {
    "flip_middle_byte": _flip_middle,
    "flip_last_byte": lambda b: b[:-1] + bytes([b[-1] ^ 0xFF]),
    "truncate_half": lambda b: b[:len(b) // 2],
    "truncate_one": lambda b: b[:-1],
    "truncate_to_prefix": lambda b: b[:10],
    "empty": lambda b: b"",
    "extended": lambda b: b + b"\0",
    "garbage": lambda b: os.urandom(len(b)),
    "wrong_magic": lambda b: reseal(b"XCEDLMKV" + b[8:-32]),
    "wrong_version": _wrong_version,
    "bad_descriptor": _bad_descriptor,
    "other_keys_blob": lambda b: encode_record(make_record(5), key="another-key"),
}


@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_corruption_is_a_miss(backend, how):
    s = backend.open()
    old, new = make_record(1), make_record(2)
    s.put("victim", old)
    s.put("bystander", old)
    backend.raw_set(s, "victim", CORRUPTIONS[how](backend.raw_get(s, "victim")))
    assert s.get("victim") is None  # never raises, never partial
    st = s.stats()
    assert st["corrupt"] == 1 and st["misses"] == 1 and st["hits"] == 0
    assert s.keys() == ["bystander"]  # the bad entry is dropped
    assert s.get("victim") is None and s.stats()["corrupt"] == 1  # plain miss now
    assert_same(s.get("bystander"), old)
    s.put("victim", new)
    assert_same(s.get("victim"), new)
    assert sorted(s.keys()) == ["bystander", "victim"]


def _equal_records(n, rows=64):
    recs = [make_record(i, rows=rows) for i in range(n)]
    size = len(encode_record(recs[0], "k0"))
    assert all(len(encode_record(r, f"k{i}")) == size for i, r in enumerate(recs))
    return recs, size


def test_lru_evicts_least_recently_used(backend):
    recs, size = _equal_records(5)
    s = backend.open(capacity_bytes=3 * size + size // 2)  # room for 3
    for k in ("k0", "k1", "k2"):
        s.put(k, recs[int(k[1])])
    assert_same(s.get("k0"), recs[0])  # k0 is now the most recently used; k1 the least
    s.put("k3", recs[3])
    assert s.get("k1") is None
    assert sorted(s.keys()) == ["k0", "k2", "k3"]
    st = s.stats()
    assert st["evictions"] == 1 and st["entries"] == 3 and st["bytes"] == 3 * size
    assert st["bytes"] <= st["capacity_bytes"]
    for k in ("k0", "k2", "k3"):
        assert_same(s.get(k), recs[int(k[1])])
    # Order now k0, k2, k3 (oldest first); it survives reopening the store.
    s2 = backend.open(capacity_bytes=3 * size + size // 2)
    assert s2.keys() == ["k0", "k2", "k3"]
    s2.put("k4", recs[4])
    assert s2.keys() == ["k2", "k3", "k4"] and s2.stats()["evictions"] == 1


def test_overwrite_does_not_evict_and_big_entry_rejected(backend):
    recs, size = _equal_records(3)
    s = backend.open(capacity_bytes=2 * size)
    s.put("a", recs[0])
    s.put("b", recs[1])
    s.put("a", recs[2])  # same size, replaces: still fits
    assert sorted(s.keys()) == ["a", "b"] and s.stats()["evictions"] == 0
    big = make_record(9, rows=64 * 3)
    with pytest.raises(ValueError, match=f"capacity_bytes={2 * size}"):
        s.put("big", big)
    assert sorted(s.keys()) == ["a", "b"] and s.get("big") is None
    # a bigger entry that fits evicts as many as needed
    two = make_record(8, rows=64 + 32)
    s.put("c", two)
    assert s.keys() == ["c"] and s.stats()["evictions"] == 2
    with pytest.raises(ValueError, match="capacity_bytes"):
        backend.open(capacity_bytes=0)


def test_threads(backend):
    s = backend.open()
    recs = [make_record(i, rows=16) for i in range(4)]
    errors = []

    def work(t):
        try:
            for j in range(20):
                s.put("shared", recs[(t + j) % 4])
                s.put(f"own{t}", recs[t])
                g = s.get("shared")
                assert g is not None and any(
                    g.arrays["kv.2"].tobytes() == r.arrays["kv.2"].tobytes() and g.meta == r.meta for r in recs)
                assert_same(s.get(f"own{t}"), recs[t])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(s.keys()) == ["own0", "own1", "own2", "own3", "shared"]
    assert s.stats()["corrupt"] == 0


# ----------------------------------------------------------------------------- DirStore specifics


def test_dir_store_has_a_byte_budget_by_default_and_it_is_configurable(tmp_path):
    """A directory store evicts least recently used entries beyond DEFAULT_CAPACITY_BYTES unless
    given another budget (None: unbounded), from the constructor, open_store and the engine's
    store_capacity_bytes option."""
    from cedlm.cache.store import DEFAULT_CAPACITY_BYTES
    from cedlm.cache.store.guard import StoreGuard
    from cedlm.engine.llm import LLM
    assert DEFAULT_CAPACITY_BYTES == 8 << 30
    assert DirStore(tmp_path / "a").capacity_bytes == DEFAULT_CAPACITY_BYTES
    assert DirStore(tmp_path / "a", capacity_bytes=None).capacity_bytes is None
    assert open_store(f"dir:{tmp_path / 'b'}").capacity_bytes == DEFAULT_CAPACITY_BYTES
    assert open_store(str(tmp_path / "b"), capacity_bytes=1 << 20).stats()["capacity_bytes"] == 1 << 20
    llm = LLM("tiny", store=f"dir:{tmp_path / 'c'}", store_capacity_bytes=3 << 20, num_threads=1)
    inner = llm.engine.store
    inner = inner.store if isinstance(inner, StoreGuard) else inner
    assert isinstance(inner, DirStore) and inner.capacity_bytes == 3 << 20


def _disk_of(path, disk_bytes, failures):
    """A `_write_parts` writing to a disk of `disk_bytes` that holds only the store's entries:
    ENOSPC (after a partial write, as a real full disk leaves) when the blob does not fit."""
    def write(f, parts):
        parts = [memoryview(p).cast("B") for p in parts]
        used = sum(e.stat().st_size for e in os.scandir(path) if e.name.endswith(".kv"))
        if used + sum(p.nbytes for p in parts) > disk_bytes:
            f.write(parts[0][:16])
            failures.append(used)
            raise OSError(errno.ENOSPC, "No space left on device")
        for p in parts:
            f.write(p)
    return write


def test_full_disk_evicts_least_recently_used_and_keeps_storing(tmp_path, monkeypatch):
    """The disk fills before the byte budget: the put that hits ENOSPC evicts least recently used
    entries and is written; later puts make room first (no failed write each time) while the
    disk-full size holds; afterwards the store grows again if the disk has room."""
    from cedlm.cache.store import dir_store
    path = tmp_path / "s"
    recs = {f"k{i:02d}": make_record(i, rows=8) for i in range(20)}
    size = len(encode_record(recs["k00"], "k00"))
    assert {len(encode_record(r, k)) for k, r in recs.items()} == {size}
    s = DirStore(path)                                  # the default budget: far above this disk
    failures: list = []
    monkeypatch.setattr(S, "_write_parts", _disk_of(path, 5 * size + size // 2, failures))
    for k in list(recs)[:5]:
        s.put(k, recs[k])
    assert_same(s.get("k00"), recs["k00"])             # k00 is now the most recently used
    s.put("k05", recs["k05"])                           # the disk is full: k01 goes
    assert len(failures) == 1 and s.keys() == ["k02", "k03", "k04", "k00", "k05"]
    st = s.stats()
    assert st["evictions"] == 1 and st["disk_full_bytes"] == 5 * size and st["bytes"] == 5 * size
    for k in list(recs)[6:12]:
        s.put(k, recs[k])
    assert len(failures) == 1                           # room made before each write
    assert s.keys() == ["k07", "k08", "k09", "k10", "k11"]
    for k in s.keys():
        assert_same(s.get(k), recs[k])
    assert not list(path.glob(".tmp-*"))                # no partial file left behind
    # the disk-full size lapses; the disk has grown meanwhile: the store holds more again
    monkeypatch.setattr(dir_store, "DISK_FULL_HOLD_S", 0.0)
    monkeypatch.setattr(S, "_write_parts", _disk_of(path, 8 * size + size // 2, failures))
    for k in list(recs)[12:15]:
        s.put(k, recs[k])
    assert len(s.keys()) == 8 and s.stats()["disk_full_bytes"] is None and len(failures) == 1


def test_a_disk_full_of_others_data_is_an_error_the_guard_counts(tmp_path, monkeypatch):
    """With no entry of its own to delete the put fails (ENOSPC), leaving no temp file; behind the
    StoreGuard that is a counted miss."""
    from cedlm.cache.store import StoreGuard
    path = tmp_path / "s"
    s = DirStore(path)
    monkeypatch.setattr(S, "_write_parts", _disk_of(path, 100, []))
    with pytest.raises(OSError) as ei:
        s.put("k", make_record(0, rows=8))
    assert ei.value.errno == errno.ENOSPC and not list(path.glob(".tmp-*")) and s.keys() == []
    g = StoreGuard(s)
    assert g.put("k", make_record(0, rows=8)) is False and g.counters["store_errors"] == 1


CHILD = textwrap.dedent("""
    import sys, time
    import numpy as np
    from cedlm.cache import store as S
    path, mode, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "slow":
        def slow_write(f, parts):
            written = 0
            for p in parts:
                f.write(p)
                written += len(p)
                if written >= nbytes // 2:
                    f.flush()
                    print("HALF", flush=True)
                    time.sleep(120)
        S._write_parts = slow_write
    rec = S.Record(meta={"which": "new"}, arrays={"kv.2": np.full(nbytes, 7, np.uint8),
                                                "tokens": np.arange(1000, dtype=np.int32)})
    store = S.DirStore(path)
    print("START", flush=True)
    store.put("seq", rec)
    print("DONE", flush=True)
""")


def _old_record():
    return Record(meta={"which": "old"}, arrays={"kv.2": np.full(1 << 20, 3, np.uint8),
                                                 "tokens": np.arange(500, dtype=np.int32)})


def _temps(path):
    return sorted(p.name for p in path.iterdir() if p.name.endswith(".partial"))


@pytest.mark.parametrize("had_old", [True, False])
def test_kill_mid_write_leaves_old_value(tmp_path, had_old):
    path = tmp_path / "store"
    if had_old:
        DirStore(path).put("seq", _old_record())
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path), "slow", str(32 << 20)],
                             stdout=subprocess.PIPE, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = child.stdout.readline()
            lines.append(line)
            if line.strip() == "HALF" or not line:
                break
        assert lines[-1].strip() == "HALF", lines
        assert len(_temps(path)) == 1  # a half-written temp file...
        if had_old:  # ...while readers still see the old value
            assert_same(DirStore(path).get("seq"), _old_record())
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    assert len(_temps(path)) == 1
    s = DirStore(path)
    assert _temps(path) == []  # cleaned on open
    if had_old:
        assert s.keys() == ["seq"]
        assert_same(s.get("seq"), _old_record())
    else:
        assert s.keys() == [] and s.get("seq") is None
    assert s.stats()["corrupt"] == 0
    s.put("seq", Record(meta={"which": "newer"}, arrays={}))
    assert s.get("seq").meta == {"which": "newer"}


def test_kill_during_large_real_write(tmp_path):
    """200 MB put with the real writer, SIGKILLed once its temp file has data: the entry is the old
    record or the new one, complete, never a mix; the temp file is gone after reopening."""
    path = tmp_path / "store"
    DirStore(path).put("seq", _old_record())
    nbytes = 200 << 20
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path), "real", str(nbytes)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "START"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and child.poll() is None:
            temps = [p for p in path.iterdir() if p.name.endswith(".partial")]
            if temps and temps[0].stat().st_size > 0:
                break
            time.sleep(0.001)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL  # killed, not finished
    s = DirStore(path)
    assert _temps(path) == []
    got = s.get("seq")
    assert got is not None and s.keys() == ["seq"] and s.stats()["corrupt"] == 0
    if got.meta["which"] == "old":
        assert_same(got, _old_record())
    else:
        assert got.meta == {"which": "new"} and got.arrays["kv.2"].shape == (nbytes,)
        assert (got.arrays["kv.2"] == 7).all()


def test_temp_cleanup_spares_live_writers_and_foreign_files(tmp_path):
    path = tmp_path / "store"
    path.mkdir()
    host = S._host_tag()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (path / f".tmp-{host}-{dead}-abc.partial").write_bytes(b"half")
    (path / f".tmp-{host}-{os.getpid()}-def.partial").write_bytes(b"in progress")
    (path / ".tmp-otherhost-1-ghi.partial").write_bytes(b"other machine")
    old = path / ".tmp-otherhost-2-jkl.partial"
    old.write_bytes(b"ancient")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    (path / "README.txt").write_text("not ours")
    DirStore(path)
    assert _temps(path) == sorted([f".tmp-{host}-{os.getpid()}-def.partial", ".tmp-otherhost-1-ghi.partial"])
    assert (path / "README.txt").exists()


def test_unreadable_entry_dropped_on_open(tmp_path):
    path = tmp_path / "store"
    s = DirStore(path)
    s.put("a", make_record(1))
    s.put("b", make_record(2))
    (path / s._filename("a")).write_bytes(b"junk")
    s2 = DirStore(path)
    assert s2.keys() == ["b"] and s2.stats()["corrupt"] == 1
    assert not (path / s._filename("a")).exists()


def test_two_dirstores_share_a_directory(tmp_path):
    a, b = DirStore(tmp_path / "s"), DirStore(tmp_path / "s")
    rec = make_record(3)
    a.put("x", rec)
    assert_same(b.get("x"), rec)
    assert b.stats()["entries"] == 1 and b.keys() == ["x"]
    b.delete("x")
    assert a.get("x") is None


# ----------------------------------------------------------------------------- RedisStore specifics


def test_redis_connection_error_names_url():
    pytest.importorskip("redis")
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"redis://127.0.0.1:{port}/0"
    with pytest.raises(StoreConnectionError, match=f"127.0.0.1:{port}"):
        RedisStore(url)
    with pytest.raises(StoreConnectionError) as e:
        RedisStore(f"redis://:hunter2@127.0.0.1:{port}/0")
    assert "hunter2" not in str(e.value) and "***" in str(e.value)


def test_redis_prefixes_isolate_and_clients_share(redis_url):
    a = RedisStore(redis_url, prefix="iso-a:")
    a2 = RedisStore(redis_url, prefix="iso-a:")
    b = RedisStore(redis_url, prefix="iso-b:")
    rec = make_record(4)
    a.put("x", rec)
    assert_same(a2.get("x"), rec)
    assert b.get("x") is None and b.keys() == []
    a.delete("x")


def test_redis_blob_vanishing_is_a_clean_miss(redis_url):
    s = RedisStore(redis_url, prefix=f"van-{uuid.uuid4().hex[:6]}:")
    s.put("x", make_record(1))
    s._r.delete(s._bkey("x"))  # e.g. the server's own maxmemory eviction
    assert s.get("x") is None
    assert s.keys() == [] and s.stats()["entries"] == 0 and s.stats()["corrupt"] == 0


# ----------------------------------------------------------------------------- open_store


def test_open_store(tmp_path, monkeypatch):
    assert isinstance(open_store(f"dir:{tmp_path / 'a'}"), DirStore)
    s = open_store(str(tmp_path / "b"), capacity_bytes=10 << 20)
    assert isinstance(s, DirStore) and s.path == tmp_path / "b" and s.capacity_bytes == 10 << 20
    assert open_store(tmp_path / "c").path == tmp_path / "c"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    d = open_store(None)
    assert isinstance(d, DirStore) and d.path == tmp_path / "home" / ".cache" / "cedlm" / "store"
    assert d.path.is_dir()
    with pytest.raises(ValueError):
        open_store("dir:")


def test_open_store_redis(redis_url):
    s = open_store(redis_url, capacity_bytes=1 << 20)
    assert isinstance(s, RedisStore) and s.capacity_bytes == 1 << 20
    assert s.stats()["backend"] == "redis"
