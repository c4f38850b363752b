"""Persistent store for per-sequence cache entries (global KV rows, index keys, token ids, compressor
state): one self-describing, checksummed blob per key, in a directory or in Redis.

Blob layout (all integers little-endian)::

    0   8 B   magic  b"\\x89CEDLMKV"
    8   4 B   format version (uint32) = 1
    12  8 B   header length H (uint64)
    20  H B   header: UTF-8 JSON {"key", "meta", "arrays": [{name, dtype, shape, offset, nbytes}],
                                  "data_nbytes"}
    ..        zero padding to a multiple of 64  -> data_start
    ..        array bytes; array i at data_start + offset_i (offsets 64-aligned), zero padding between
    -32 32 B  blake2b(digest_size=32) of every byte before it

Decoding checks magic, version, every length and offset, and the checksum before any array is
built; any mismatch raises :class:`CorruptRecord`, which the stores turn into a miss (counted in
``stats()["corrupt"]``) and a deletion of the bad entry. Arrays come back as numpy arrays whose
bytes are exactly the bytes that were put (no dtype or value conversion).

Window (SWA) state is deliberately not part of any record: it is rebuilt by replaying tokens.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import socket
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol, runtime_checkable

import numpy as np

MAGIC = b"\x89CEDLMKV"
VERSION = 1
_PREFIX = struct.Struct("<8sIQ")  # magic, version, header length
_ALIGN = 64
_CHECKSUM_SIZE = 32
_MAX_HEADER = 64 << 20  # a header larger than this is corruption, not a record
_CHUNK = 8 << 20  # write granularity (bounded copies for huge arrays)

# The dtypes a record may carry (little-endian on disk). The engine uses uint8 (KV / index-key
# bytes), int32 (token ids) and float32 (compressor state); the others are allowed for convenience.
_DTYPES = {
    "uint8": np.dtype("<u1"),
    "int8": np.dtype("<i1"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
}


class CorruptRecord(ValueError):
    """A blob failed validation (bad magic/version/lengths/checksum). Stores treat it as a miss."""


class StoreConnectionError(ConnectionError):
    """The store's backend could not be reached (raised at construction)."""


# ----------------------------------------------------------------------------- Record


def _as_numpy(name: str, value: Any) -> np.ndarray:
    if type(value).__module__.split(".")[0] == "torch":
        import torch

        if value.dtype not in (torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.float32):
            raise TypeError(f"array {name!r}: unsupported torch dtype {value.dtype} (allowed: {sorted(_DTYPES)})")
        value = value.detach().to("cpu").contiguous().numpy()
    if not isinstance(value, np.ndarray):
        raise TypeError(f"array {name!r}: expected a numpy array or torch tensor, got {type(value).__name__}")
    if value.dtype.name not in _DTYPES:
        raise TypeError(f"array {name!r}: unsupported dtype {value.dtype} (allowed: {sorted(_DTYPES)})")
    # Byte-order conversion only (values unchanged); a no-op for native little-endian arrays.
    return np.ascontiguousarray(value, dtype=_DTYPES[value.dtype.name])


@dataclass
class Record:
    """One cache entry: JSON-able ``meta`` plus named arrays (uint8 KV rows, int32 token ids, fp32
    compressor state...). Arrays may be numpy arrays or torch tensors on put; get returns numpy."""

    meta: dict = field(default_factory=dict)
    arrays: dict = field(default_factory=dict)

    def tensors(self) -> dict:
        """The arrays as CPU torch tensors (zero-copy views of the decoded arrays)."""
        import torch

        return {k: torch.from_numpy(_as_numpy(k, v)) for k, v in self.arrays.items()}

    @property
    def nbytes(self) -> int:
        return sum(_as_numpy(k, v).nbytes for k, v in self.arrays.items())


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _Encoded:
    """A record laid out as a blob: header bytes + array buffers, written without a full copy."""

    def __init__(self, record: Record, key: str | None, version: int = VERSION):
        if not isinstance(record, Record):
            raise TypeError(f"expected a Record, got {type(record).__name__}")
        if not isinstance(record.meta, dict):
            raise TypeError(f"Record.meta must be a dict, got {type(record.meta).__name__}")
        if not isinstance(record.arrays, dict):
            raise TypeError(f"Record.arrays must be a dict, got {type(record.arrays).__name__}")
        self.arrays: list[np.ndarray] = []
        descs = []
        offset = 0
        for name, value in record.arrays.items():
            if not isinstance(name, str):
                raise TypeError(f"array names must be str, got {name!r}")
            a = _as_numpy(name, value)
            offset = _align(offset)
            descs.append({"name": name, "dtype": a.dtype.name, "shape": list(a.shape),
                          "offset": offset, "nbytes": int(a.nbytes)})
            self.arrays.append(a)
            offset += a.nbytes
        header = {"key": key, "meta": record.meta, "arrays": descs, "data_nbytes": offset}
        try:
            self.header = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
        except (TypeError, ValueError) as e:
            raise TypeError(f"Record.meta must be JSON-serialisable (no NaN/inf): {e}") from None
        self.prefix = _PREFIX.pack(MAGIC, version, len(self.header))
        self.data_start = _align(len(self.prefix) + len(self.header))
        self.descs = descs
        self.data_nbytes = offset
        self.size = self.data_start + self.data_nbytes + _CHECKSUM_SIZE

    def parts(self) -> Iterator[memoryview | bytes]:
        """The blob's bytes, in order, checksum last."""
        h = hashlib.blake2b(digest_size=_CHECKSUM_SIZE)
        head = self.prefix + self.header + bytes(self.data_start - len(self.prefix) - len(self.header))
        h.update(head)
        yield head
        pos = 0
        for d, a in zip(self.descs, self.arrays):
            if d["offset"] > pos:
                pad = bytes(d["offset"] - pos)
                h.update(pad)
                yield pad
            mv = memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")
            for i in range(0, len(mv), _CHUNK):
                chunk = mv[i:i + _CHUNK]
                h.update(chunk)
                yield chunk
            pos = d["offset"] + d["nbytes"]
        yield h.digest()

    def tobytes(self) -> bytes:
        out = bytearray(self.size)
        pos = 0
        for p in self.parts():
            out[pos:pos + len(p)] = p
            pos += len(p)
        assert pos == self.size
        return bytes(out)


def encode_record(record: Record, key: str | None = None) -> bytes:
    """Serialise ``record`` to one self-describing blob (see the module docstring)."""
    return _Encoded(record, key).tobytes()


def _read_prefix(buf) -> tuple[int, int]:
    """Validate the fixed prefix; return (version, header length)."""
    if len(buf) < _PREFIX.size:
        raise CorruptRecord(f"blob too short ({len(buf)} bytes)")
    magic, version, hlen = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptRecord("bad magic")
    if version != VERSION:
        raise CorruptRecord(f"unsupported format version {version} (expected {VERSION})")
    if hlen > _MAX_HEADER:
        raise CorruptRecord(f"header length {hlen} is implausible")
    return version, hlen


def _parse_header(raw) -> dict:
    try:
        header = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptRecord(f"bad header JSON: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("meta"), dict) \
            or not isinstance(header.get("arrays"), list) or not isinstance(header.get("data_nbytes"), int):
        raise CorruptRecord("header is missing meta/arrays/data_nbytes")
    return header


def decode_record(blob, expect_key: str | None = None) -> tuple[Record, str | None]:
    """Parse and fully validate a blob; return (record, stored key). Raises :class:`CorruptRecord`.

    ``blob`` may be bytes, bytearray or memoryview; a writable buffer (bytearray) gives writable
    arrays that share its memory, otherwise the arrays are read-only views.
    """
    try:
        mv = memoryview(blob).cast("B")
        _, hlen = _read_prefix(mv)
        hend = _PREFIX.size + hlen
        if len(mv) < hend + _CHECKSUM_SIZE:
            raise CorruptRecord("blob truncated inside header")
        header = _parse_header(mv[_PREFIX.size:hend])
        data_start = _align(hend)
        data_nbytes = header["data_nbytes"]
        if data_nbytes < 0 or len(mv) != data_start + data_nbytes + _CHECKSUM_SIZE:
            raise CorruptRecord(f"blob length {len(mv)} != {data_start + data_nbytes + _CHECKSUM_SIZE} "
                                "(truncated or extended)")
        body_end = len(mv) - _CHECKSUM_SIZE
        if hashlib.blake2b(mv[:body_end], digest_size=_CHECKSUM_SIZE).digest() != bytes(mv[body_end:]):
            raise CorruptRecord("checksum mismatch")
        key = header.get("key")
        if expect_key is not None and key != expect_key:
            raise CorruptRecord(f"blob holds key {key!r}, expected {expect_key!r}")
        arrays = {}
        for d in header["arrays"]:
            name, dtype, shape = d["name"], _DTYPES.get(d["dtype"]), tuple(d["shape"])
            off, nb = d["offset"], d["nbytes"]
            if not isinstance(name, str) or dtype is None or name in arrays \
                    or not all(isinstance(s, int) and s >= 0 for s in shape) \
                    or not isinstance(off, int) or not isinstance(nb, int) or off < 0 \
                    or nb != math.prod(shape) * dtype.itemsize or off + nb > data_nbytes:
                raise CorruptRecord(f"bad array descriptor {d!r}")
            count = nb // dtype.itemsize
            arrays[name] = np.frombuffer(mv, dtype=dtype, count=count, offset=data_start + off).reshape(shape)
        return Record(meta=header["meta"], arrays=arrays), key
    except CorruptRecord:
        raise
    except Exception as e:  # any structural surprise is corruption, never a crash in the caller
        raise CorruptRecord(f"malformed blob: {type(e).__name__}: {e}") from None


# ----------------------------------------------------------------------------- Store protocol


@runtime_checkable
class Store(Protocol):
    def put(self, key: str, record: Record) -> None: ...
    def get(self, key: str) -> Record | None: ...
    def delete(self, key: str) -> None: ...
    def keys(self) -> list[str]: ...
    def stats(self) -> dict: ...


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not key:
        raise TypeError(f"store keys must be non-empty str, got {key!r}")


def _check_capacity(capacity_bytes) -> int | None:
    if capacity_bytes is None:
        return None
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
        raise ValueError(f"capacity_bytes must be a positive int or None, got {capacity_bytes!r}")
    return capacity_bytes


def _too_big(size: int, capacity: int, key: str) -> ValueError:
    return ValueError(f"entry {key!r} is {size} bytes, larger than the store's capacity_bytes={capacity}; "
                      "raise capacity_bytes or store less per entry")


class _Counters:
    def __init__(self):
        self.hits = self.misses = self.corrupt = self.evictions = 0


# ----------------------------------------------------------------------------- DirStore

_ENTRY_SUFFIX = ".kv"
_TMP_PREFIX = ".tmp-"
_TMP_SUFFIX = ".partial"
_STALE_TMP_S = 3600.0  # a temp file this old is garbage whoever wrote it


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())[:32] or "host"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_parts(f, parts) -> None:
    """Write every part to the open file (module-level so tests can simulate a slow writer)."""
    for p in parts:
        f.write(p)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class DirStore:
    """One file per key under ``path``: ``<blake2b(key)>.kv``.

    Writes go to ``.tmp-<host>-<pid>-*.partial`` in the same directory, are fsynced and renamed over
    the entry with ``os.replace`` (atomic), so a reader sees the old blob or the new one, never a
    mix; a writer killed mid-write leaves only a temp file, removed by the next open. LRU order is
    the files' mtimes (set on put, touched on every hit), mirrored in memory; when the total size
    exceeds ``capacity_bytes`` the least recently used entries are deleted. Thread-safe within a
    process; other processes sharing the directory are safe (atomic files) but their puts are only
    counted towards capacity after this process re-scans (``keys()`` or a new ``DirStore``).
    """

    def __init__(self, path: str | os.PathLike, capacity_bytes: int | None = None):
        self.path = Path(path).expanduser()
        self.capacity_bytes = _check_capacity(capacity_bytes)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._n = _Counters()
        self._index: OrderedDict[str, tuple[str, int]] = OrderedDict()  # key -> (filename, size), LRU first
        self._total = 0
        self._clock = 0
        with self._lock:
            self._clean_temps()
            self._scan()
            self._evict(keep=None)

    # -- helpers
    def _filename(self, key: str) -> str:
        return hashlib.blake2b(key.encode("utf-8"), digest_size=20).hexdigest() + _ENTRY_SUFFIX

    def _now_ns(self) -> int:
        self._clock = max(time.time_ns(), self._clock + 1)
        return self._clock

    def _clean_temps(self) -> None:
        host, now = _host_tag(), time.time()
        for p in self.path.glob(_TMP_PREFIX + "*" + _TMP_SUFFIX):
            parts = p.name[len(_TMP_PREFIX):].split("-")
            try:
                mine = len(parts) >= 3 and parts[0] == host
                dead = mine and not _pid_alive(int(parts[1]))
                old = now - p.stat().st_mtime > _STALE_TMP_S
                if dead or old:
                    p.unlink()
            except (OSError, ValueError):
                continue

    def _read_key(self, p: Path) -> str | None:
        """The key stored in a file's header (cheap: reads the header only); None if unreadable."""
        try:
            with open(p, "rb") as f:
                pre = f.read(_PREFIX.size)
                _, hlen = _read_prefix(pre)
                header = _parse_header(f.read(hlen))
            key = header.get("key")
            return key if isinstance(key, str) and self._filename(key) == p.name else None
        except (OSError, CorruptRecord):
            return None

    def _scan(self) -> None:
        found = []
        for p in self.path.glob("*" + _ENTRY_SUFFIX):
            try:
                st = p.stat()
            except OSError:
                continue
            key = self._read_key(p)
            if key is None:  # unreadable header: garbage in our namespace
                self._n.corrupt += 1
                p.unlink(missing_ok=True)
                continue
            found.append((st.st_mtime_ns, key, p.name, st.st_size))
        found.sort()
        self._index = OrderedDict((k, (fn, size)) for _, k, fn, size in found)
        self._total = sum(size for _, _, _, size in found)
        if found:
            self._clock = max(self._clock, found[-1][0])

    def _forget(self, key: str) -> None:
        entry = self._index.pop(key, None)
        if entry is not None:
            self._total -= entry[1]

    def _evict(self, keep: str | None) -> None:
        if self.capacity_bytes is None:
            return
        while self._total > self.capacity_bytes:
            victim = next((k for k in self._index if k != keep), None)
            if victim is None:
                break
            fn, _ = self._index[victim]
            (self.path / fn).unlink(missing_ok=True)
            self._forget(victim)
            self._n.evictions += 1

    # -- Store API
    def put(self, key: str, record: Record) -> None:
        _check_key(key)
        enc = _Encoded(record, key)
        if self.capacity_bytes is not None and enc.size > self.capacity_bytes:
            raise _too_big(enc.size, self.capacity_bytes, key)
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=f"{_TMP_PREFIX}{_host_tag()}-{os.getpid()}-",
                                   suffix=_TMP_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                _write_parts(f, enc.parts())
                f.flush()
                os.fsync(f.fileno())
            with self._lock:
                fn = self._filename(key)
                ts = self._now_ns()
                os.utime(tmp, ns=(ts, ts))
                os.replace(tmp, self.path / fn)
                tmp = None
                _fsync_dir(self.path)
                self._forget(key)
                self._index[key] = (fn, enc.size)
                self._total += enc.size
                self._evict(keep=key)
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    def get(self, key: str) -> Record | None:
        _check_key(key)
        fn = self._filename(key)
        p = self.path / fn
        # Read and verify outside the lock (hashing a big blob takes a while); the file we opened is
        # a complete blob whatever writers do meanwhile, because they only ever os.replace it.
        try:
            with open(p, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                buf = bytearray(st.st_size)
                mv, got = memoryview(buf), 0
                while got < len(buf):
                    n = f.readinto(mv[got:])
                    if not n:
                        break
                    got += n
        except FileNotFoundError:
            with self._lock:
                if not p.exists():  # (a put may have landed since; puts replace under the lock)
                    self._forget(key)
                self._n.misses += 1
            return None
        except OSError:
            with self._lock:
                self._n.misses += 1
            return None
        try:
            if got != len(buf):
                raise CorruptRecord("short read")
            record, _ = decode_record(buf, expect_key=key)
        except CorruptRecord:
            with self._lock:
                self._n.corrupt += 1
                self._n.misses += 1
                try:  # drop the bad file unless a writer has already replaced it
                    if os.stat(p).st_ino == st.st_ino:
                        p.unlink()
                except OSError:
                    pass
                self._forget(key)
            return None
        with self._lock:
            ts = self._now_ns()
            try:
                os.utime(p, ns=(ts, ts))
            except OSError:
                pass
            if key in self._index:
                self._index.move_to_end(key)
            else:  # written by another process since our scan
                self._index[key] = (fn, len(buf))
                self._total += len(buf)
                self._evict(keep=key)
            self._n.hits += 1
        return record

    def delete(self, key: str) -> None:
        _check_key(key)
        with self._lock:
            (self.path / self._filename(key)).unlink(missing_ok=True)
            self._forget(key)

    def keys(self) -> list[str]:
        """All keys, least recently used first (re-scans the directory)."""
        with self._lock:
            self._scan()
            return list(self._index)

    def stats(self) -> dict:
        with self._lock:
            n = self._n
            return {"backend": "dir", "path": str(self.path), "entries": len(self._index), "bytes": self._total,
                    "hits": n.hits, "misses": n.misses, "corrupt": n.corrupt, "evictions": n.evictions,
                    "capacity_bytes": self.capacity_bytes}

    def __repr__(self) -> str:
        return f"DirStore({str(self.path)!r}, capacity_bytes={self.capacity_bytes})"


# ----------------------------------------------------------------------------- RedisStore

# KEYS: lru zset, sizes hash, clock counter. ARGV: key, size, capacity (-1 = none), entry prefix.
# Runs in the same MULTI as the SET of the blob, so blob + bookkeeping + eviction are atomic.
_LUA_PUT = """
local key, size, cap, eprefix = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
redis.call('HSET', KEYS[2], key, size)
redis.call('ZADD', KEYS[1], redis.call('INCR', KEYS[3]), key)
local evicted = {}
if cap >= 0 then
  local total = 0
  local vals = redis.call('HVALS', KEYS[2])
  for i = 1, #vals do total = total + tonumber(vals[i]) end
  while total > cap do
    local oldest = redis.call('ZRANGE', KEYS[1], 0, 1)
    local victim = oldest[1]
    if victim == key then victim = oldest[2] end
    if victim == nil then break end
    total = total - tonumber(redis.call('HGET', KEYS[2], victim) or '0')
    redis.call('DEL', eprefix .. victim)
    redis.call('HDEL', KEYS[2], victim)
    redis.call('ZREM', KEYS[1], victim)
    table.insert(evicted, victim)
  end
end
return evicted
"""

# KEYS: blob, lru zset, sizes hash. ARGV: key. Drop bookkeeping of a blob that is gone (e.g. evicted
# by the server's maxmemory policy) -- atomically, so a concurrent put is never orphaned.
_LUA_FORGET_MISSING = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
end
return 0
"""

# KEYS: lru zset, clock counter. ARGV: key. Touch only entries still present (XX).
_LUA_TOUCH = """
return redis.call('ZADD', KEYS[1], 'XX', redis.call('INCR', KEYS[2]), ARGV[1])
"""


def _redact(url: str) -> str:
    return re.sub(r"(//[^:/@]*:)[^@/]*@", r"\1***@", url)


class RedisStore:
    """The same blobs as Redis string values under ``<prefix>e:<key>``.

    Bookkeeping lives beside them: ``<prefix>lru`` (sorted set key -> logical access time from the
    server-side counter ``<prefix>clock``, bumped on put and hit), ``<prefix>sizes`` (hash key ->
    blob bytes). A put is one MULTI (SET + a Lua script that records size/time and evicts least
    recently used entries until the summed sizes fit ``capacity_bytes``), so it is atomic for all
    clients. hits/misses/corrupt/evictions in ``stats()`` count this client's operations; entries
    and bytes are the server's. Blobs are limited by Redis's proto-max-bulk-len (512 MB default).
    """

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", prefix: str = "cedlm:",
                 capacity_bytes: int | None = None, socket_timeout: float | None = 30.0):
        try:
            import redis
        except ImportError as e:
            raise ImportError("RedisStore needs the 'redis' package (pip install redis)") from e
        self._redis_mod = redis
        self.url = url
        self.prefix = prefix
        self.capacity_bytes = _check_capacity(capacity_bytes)
        self._n = _Counters()
        self._lock = threading.Lock()
        try:
            self._r = redis.Redis.from_url(url, socket_connect_timeout=5.0, socket_timeout=socket_timeout)
            self._r.ping()
        except (redis.exceptions.RedisError, OSError, ValueError) as e:
            raise StoreConnectionError(f"cannot connect to Redis at {_redact(url)}: {type(e).__name__}: {e}") from e
        self._lru, self._sizes, self._clockkey = prefix + "lru", prefix + "sizes", prefix + "clock"
        self._eprefix = prefix + "e:"
        self._put_script = self._r.register_script(_LUA_PUT)
        self._touch_script = self._r.register_script(_LUA_TOUCH)
        self._forget_script = self._r.register_script(_LUA_FORGET_MISSING)

    def _bkey(self, key: str) -> str:
        return self._eprefix + key

    def _drop(self, key: str) -> None:
        p = self._r.pipeline(transaction=True)
        p.delete(self._bkey(key))
        p.hdel(self._sizes, key)
        p.zrem(self._lru, key)
        p.execute()

    def put(self, key: str, record: Record) -> None:
        _check_key(key)
        enc = _Encoded(record, key)
        if self.capacity_bytes is not None and enc.size > self.capacity_bytes:
            raise _too_big(enc.size, self.capacity_bytes, key)
        blob = enc.tobytes()
        p = self._r.pipeline(transaction=True)
        p.set(self._bkey(key), blob)
        self._put_script(keys=[self._lru, self._sizes, self._clockkey],
                         args=[key, len(blob), -1 if self.capacity_bytes is None else self.capacity_bytes,
                               self._eprefix], client=p)
        _, evicted = p.execute()
        with self._lock:
            self._n.evictions += len(evicted)

    def get(self, key: str) -> Record | None:
        _check_key(key)
        blob = self._r.get(self._bkey(key))
        if blob is None:
            with self._lock:
                self._n.misses += 1
            self._forget_script(keys=[self._bkey(key), self._lru, self._sizes], args=[key])
            return None
        try:
            record, _ = decode_record(bytearray(blob), expect_key=key)
        except CorruptRecord:
            with self._lock:
                self._n.corrupt += 1
                self._n.misses += 1
            # Delete only if nobody has replaced it meanwhile.
            with self._r.pipeline(transaction=True) as p:
                try:
                    p.watch(self._bkey(key))
                    if p.get(self._bkey(key)) == blob:
                        p.multi()
                        p.delete(self._bkey(key))
                        p.hdel(self._sizes, key)
                        p.zrem(self._lru, key)
                        p.execute()
                except self._redis_mod.exceptions.WatchError:
                    pass
            return None
        self._touch_script(keys=[self._lru, self._clockkey], args=[key])
        with self._lock:
            self._n.hits += 1
        return record

    def delete(self, key: str) -> None:
        _check_key(key)
        self._drop(key)

    def keys(self) -> list[str]:
        """All keys, least recently used first."""
        return [k.decode() for k in self._r.zrange(self._lru, 0, -1)]

    def stats(self) -> dict:
        sizes = self._r.hvals(self._sizes)
        with self._lock:
            n = self._n
            return {"backend": "redis", "url": _redact(self.url), "prefix": self.prefix, "entries": len(sizes),
                    "bytes": sum(int(s) for s in sizes), "hits": n.hits, "misses": n.misses,
                    "corrupt": n.corrupt, "evictions": n.evictions, "capacity_bytes": self.capacity_bytes}

    def close(self) -> None:
        self._r.close()

    def __repr__(self) -> str:
        return f"RedisStore({_redact(self.url)!r}, prefix={self.prefix!r}, capacity_bytes={self.capacity_bytes})"


# ----------------------------------------------------------------------------- open_store

DEFAULT_STORE_DIR = "~/.cache/cedlm/store"


def open_store(spec: str | os.PathLike | None = None, *, capacity_bytes: int | None = None) -> DirStore | RedisStore:
    """``"redis://..."`` / ``"rediss://..."`` / ``"unix://..."`` -> RedisStore; ``"dir:PATH"`` or a
    plain path -> DirStore; None -> DirStore at ``~/.cache/cedlm/store``."""
    if spec is None:
        return DirStore(Path(DEFAULT_STORE_DIR).expanduser(), capacity_bytes=capacity_bytes)
    s = os.fspath(spec)
    if s.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(s, capacity_bytes=capacity_bytes)
    if s.startswith("dir:"):
        s = s[len("dir:"):]
    if not s:
        raise ValueError("open_store: empty path")
    return DirStore(s, capacity_bytes=capacity_bytes)


__all__ = ["MAGIC", "VERSION", "Record", "Store", "DirStore", "RedisStore", "open_store", "encode_record",
           "decode_record", "CorruptRecord", "StoreConnectionError", "DEFAULT_STORE_DIR"]
