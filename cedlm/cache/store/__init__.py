"""Persistent store for per-sequence cache entries (global KV rows, index keys, token ids, compressor
state): one self-describing, checksummed blob per key (`record`), in a directory (`dir_store`) or
in Redis (`redis_store`); `open_store` picks the backend from a spec string.

A blob that fails validation is a miss for every backend (counted in ``stats()["corrupt"]``) and
the bad entry is deleted. Window (SWA) state is deliberately not part of any record: it is rebuilt
by replaying tokens.

The backends raise on I/O failures (a full disk, an unreachable or hung Redis after its socket
timeout); `StoreGuard` (``guard``) turns every failure into a counted, rate-limited-logged cache
miss and skips a store that keeps failing (circuit breaker). The engine always uses a store
through a guard.
"""

from __future__ import annotations

import os
from pathlib import Path

from cedlm.cache.store.base import Store
from cedlm.cache.store.dir_store import (DEFAULT_CAPACITY_BYTES, DirStore, NotRegularFile,  # noqa: F401 - test seams
                                         _host_tag, _write_parts)
from cedlm.cache.store.guard import StoreGuard, guard_store
from cedlm.cache.store.record import MAGIC, VERSION, CorruptRecord, Record, decode_record, encode_record
from cedlm.cache.store.redis_store import (DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_SOCKET_TIMEOUT_S, RedisStore,
                                          StoreConnectionError)

DEFAULT_STORE_DIR = "~/.cache/cedlm/store"


def open_store(spec: str | os.PathLike | None = None, *, capacity_bytes: int | None = None,
               socket_timeout: float | None = DEFAULT_SOCKET_TIMEOUT_S,
               connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT_S,
               check_connection: bool = True) -> DirStore | RedisStore:
    """``"redis://..."`` / ``"rediss://..."`` / ``"unix://..."`` -> RedisStore; ``"dir:PATH"`` or a
    plain path -> DirStore; None -> DirStore at ``~/.cache/cedlm/store``.

    ``capacity_bytes``: the store's byte budget (least recently used entries are evicted beyond
    it); None: the backend's default, ``DEFAULT_CAPACITY_BYTES`` (8 GiB) for a directory store and
    no budget for Redis (bounded by its own ``maxmemory``). An unbounded directory store:
    ``DirStore(path, capacity_bytes=None)``.

    ``socket_timeout`` / ``connect_timeout`` (seconds) bound every Redis call, and
    ``check_connection=False`` opens a Redis store without reaching the server (it connects on
    first use); a directory store's I/O is local and ignores them."""
    dir_capacity = DEFAULT_CAPACITY_BYTES if capacity_bytes is None else capacity_bytes
    if spec is None:
        return DirStore(Path(DEFAULT_STORE_DIR).expanduser(), capacity_bytes=dir_capacity)
    s = os.fspath(spec)
    if s.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(s, capacity_bytes=capacity_bytes, socket_timeout=socket_timeout,
                          connect_timeout=connect_timeout, check_connection=check_connection)
    if s.startswith("dir:"):
        s = s[len("dir:"):]
    if not s:
        raise ValueError("open_store: empty path")
    return DirStore(s, capacity_bytes=dir_capacity)


__all__ = ["MAGIC", "VERSION", "Record", "Store", "DirStore", "DEFAULT_CAPACITY_BYTES", "RedisStore", "open_store",
           "encode_record",
           "decode_record", "CorruptRecord", "StoreConnectionError", "DEFAULT_STORE_DIR", "StoreGuard",
           "guard_store", "NotRegularFile"]
