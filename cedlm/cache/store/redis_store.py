"""`RedisStore`: record blobs as Redis string values, with server-side LRU bookkeeping and
eviction. A blob that fails validation is a miss (counted in ``stats()["corrupt"]``) and is
deleted."""

from __future__ import annotations

import re
import threading

from cedlm.cache.store.base import Counters, check_capacity, check_fits, check_key
from cedlm.cache.store.record import CorruptRecord, Encoded, Record, decode_record


class StoreConnectionError(ConnectionError):
    """The store's backend could not be reached (raised at construction)."""


DEFAULT_SOCKET_TIMEOUT_S = 1.0   # one command's send + reply
DEFAULT_CONNECT_TIMEOUT_S = 1.0


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

    Every call is bounded: ``connect_timeout`` for (re)connecting and ``socket_timeout`` for each
    command (default 1 s each; query parameters in the URL, e.g. ``?socket_timeout=0.5``, win),
    with no client-side retry; a server that is down or hung raises ``redis`` ConnectionError /
    TimeoutError after at most that long. ``check_connection=False`` skips the PING at
    construction (the client connects on first use), for callers that tolerate an absent store.
    """

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", prefix: str = "cedlm:",
                 capacity_bytes: int | None = None, socket_timeout: float | None = DEFAULT_SOCKET_TIMEOUT_S,
                 connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT_S, check_connection: bool = True):
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as e:
            raise ImportError("RedisStore needs the 'redis' package (pip install redis)") from e
        for name, v in (("socket_timeout", socket_timeout), ("connect_timeout", connect_timeout)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise ValueError(f"{name}: must be a positive number of seconds or None, got {v!r}")
        self._redis_mod = redis
        self.url = url
        self.prefix = prefix
        self.capacity_bytes = check_capacity(capacity_bytes)
        self.socket_timeout, self.connect_timeout = socket_timeout, connect_timeout
        self._n = Counters()
        self._lock = threading.Lock()
        try:
            # No client-side retries: one call costs at most one timeout, and the caller decides
            # (StoreGuard: a miss, and its circuit breaker stops calling a store that keeps failing).
            self._r = redis.Redis.from_url(url, socket_connect_timeout=connect_timeout,
                                           socket_timeout=socket_timeout, retry=Retry(NoBackoff(), 0))
            if check_connection:
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

    def _queue_drop(self, p, key: str) -> None:
        """Queue the deletion of a blob and its bookkeeping on a transactional pipeline."""
        p.delete(self._bkey(key))
        p.hdel(self._sizes, key)
        p.zrem(self._lru, key)

    def put(self, key: str, record: Record) -> None:
        check_key(key)
        enc = Encoded(record, key)
        check_fits(enc.size, self.capacity_bytes, key)
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
        check_key(key)
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
                        self._queue_drop(p, key)
                        p.execute()
                except self._redis_mod.exceptions.WatchError:
                    pass
            return None
        self._touch_script(keys=[self._lru, self._clockkey], args=[key])
        with self._lock:
            self._n.hits += 1
        return record

    def delete(self, key: str) -> None:
        check_key(key)
        p = self._r.pipeline(transaction=True)
        self._queue_drop(p, key)
        p.execute()

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
