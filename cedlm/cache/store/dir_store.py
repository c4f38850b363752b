"""`DirStore`: record blobs as files in one directory, written atomically, evicted least recently
used first under a byte budget (``capacity_bytes``, ``DEFAULT_CAPACITY_BYTES`` unless given; None:
no budget), and when the disk fills up before the budget is reached. A blob that fails
validation is a miss (counted in ``stats()["corrupt"]``) and is deleted.

Only regular files named like the store's own entries (``<40 hex digits>.kv``) are ever read as
entries or deleted. Anything else in the directory -- a directory or FIFO named ``*.kv``, a
symlink, a file that cannot be opened, a ``*.kv`` file under another name -- is skipped and
reported (``stats()["skipped"]``, ``skipped()``, one log line per newly seen name), never opened
when it is not a regular file (a FIFO would block the reader) and never deleted."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import socket
import stat
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path

from cedlm.cache.store.base import Counters, check_capacity, check_fits, check_key
from cedlm.cache.store.record import CorruptRecord, Encoded, Record, decode_record, read_header

_ENTRY_SUFFIX = ".kv"
_TMP_PREFIX = ".tmp-"
_TMP_SUFFIX = ".partial"
_STALE_TMP_S = 3600.0  # a temp file this old is garbage whoever wrote it
DEFAULT_CAPACITY_BYTES = 8 << 30   # the byte budget of a store opened without one
DISK_FULL_HOLD_S = 600.0           # how long the size at which the disk filled up caps the store
_DISK_FULL = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})
_ENTRY_NAME = re.compile(r"[0-9a-f]{40}" + re.escape(_ENTRY_SUFFIX))
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)

log = logging.getLogger(__name__)


class NotRegularFile(OSError):
    """The path is a directory, FIFO, socket, device or symlink: not something the store wrote."""


def _open_regular(p) -> int:
    """A read-only fd on ``p`` if it is a regular file. Never follows a symlink and never blocks
    on a FIFO (``O_NONBLOCK``; callers also ``lstat`` first so FIFOs are not opened at all)."""
    try:
        fd = os.open(p, _OPEN_FLAGS)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotRegularFile(errno.ELOOP, "a symlink, not a store entry", str(p)) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(errno.EINVAL, "not a regular file", str(p))
        if hasattr(os, "O_NONBLOCK"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


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
    """Write every part to the open file. `DirStore.put` calls the one the package
    `cedlm.cache.store` exposes, so tests can replace it there to simulate a slow writer."""
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
    exceeds ``capacity_bytes`` (default ``DEFAULT_CAPACITY_BYTES``, 8 GiB; None: unbounded) the
    least recently used entries are deleted. Thread-safe within a process; other processes sharing
    the directory are safe (atomic files) but their puts are only counted towards capacity after
    this process re-scans (``keys()`` or a new ``DirStore``).

    A full disk (ENOSPC / EDQUOT while writing) does not stop the store: ``put`` deletes least
    recently used entries until the new one's size is free and writes it again, and for
    ``DISK_FULL_HOLD_S`` seconds keeps the store within the size it held when the disk filled
    (``stats()["disk_full_bytes"]``), making room before each write instead of failing one first.
    Only when there is nothing left to delete does ``put`` raise the ``OSError`` (the temp file
    removed, the old entry untouched). I/O is local, so there is no timeout; other I/O errors raise
    ``OSError`` too (an entry that cannot be read on ``get``: EACCES, EIO...). The engine wraps
    every store in a `StoreGuard`, which makes any of them a counted cache miss.
    """

    def __init__(self, path: str | os.PathLike, capacity_bytes: int | None = DEFAULT_CAPACITY_BYTES):
        self.path = Path(path).expanduser()
        self.capacity_bytes = check_capacity(capacity_bytes)
        self._disk_full: tuple[int, float] | None = None    # (bytes held when the disk filled, since)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._n = Counters()
        self._index: OrderedDict[str, tuple[str, int]] = OrderedDict()  # key -> (filename, size), LRU first
        self._total = 0
        self._clock = 0
        self._skipped: dict[str, str] = {}
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
                st = p.lstat()
                if not stat.S_ISREG(st.st_mode):
                    continue                         # not a temp file we could have written
                mine = len(parts) >= 3 and parts[0] == host
                dead = mine and not _pid_alive(int(parts[1]))
                old = now - st.st_mtime > _STALE_TMP_S
                if dead or old:
                    p.unlink()
            except (OSError, ValueError):
                continue

    def _inspect(self, name: str) -> tuple[str, object]:
        """Classify one ``*.kv`` directory entry without blocking and without deleting anything:
        ("ok", (key, stat)), ("corrupt", reason) for our own name with a bad header, or
        ("skip", reason) for anything the store did not write or cannot read."""
        p = self.path / name
        try:
            st = p.lstat()
        except FileNotFoundError:
            return "gone", None
        except OSError as e:
            return "skip", f"cannot stat: {e.strerror or e}"
        if not stat.S_ISREG(st.st_mode):           # directory, FIFO, socket, device, symlink
            return "skip", "not a regular file"
        if not _ENTRY_NAME.fullmatch(name):
            return "skip", "not a store entry name"
        try:
            fd = _open_regular(p)
        except FileNotFoundError:
            return "gone", None
        except OSError as e:
            return "skip", f"cannot open: {e.strerror or e}"
        try:
            with os.fdopen(fd, "rb") as f:
                header = read_header(f)
        except CorruptRecord as e:
            return "corrupt", str(e)
        except OSError as e:
            return "skip", f"cannot read: {e.strerror or e}"
        key = header.get("key")
        if not isinstance(key, str) or self._filename(key) != name:
            return "skip", "entry name does not match the key it holds"
        return "ok", (key, st)

    def _scan(self) -> None:
        found, skipped = [], {}
        try:
            names = sorted(e.name for e in os.scandir(self.path))
        except OSError as e:
            raise OSError(e.errno, f"cannot list the store directory: {e.strerror}", str(self.path)) from e
        for name in names:
            if name.startswith(".") or not name.endswith(_ENTRY_SUFFIX):
                continue
            kind, info = self._inspect(name)
            if kind == "ok":
                key, st = info
                found.append((st.st_mtime_ns, key, name, st.st_size))
            elif kind == "corrupt":                 # our name, garbage inside: drop it
                self._n.corrupt += 1
                try:
                    (self.path / name).unlink()
                except FileNotFoundError:
                    pass
                except OSError as e:
                    skipped[name] = f"corrupt, and cannot delete it: {e.strerror or e}"
            elif kind == "skip":
                skipped[name] = info
        new = {n: r for n, r in skipped.items() if self._skipped.get(n) != r}
        self._skipped = skipped
        if new:
            shown = "; ".join(f"{n}: {r}" for n, r in list(new.items())[:5])
            log.warning("store %s: skipped %d entr%s the store did not write or cannot read (left in place): %s%s",
                        self.path, len(new), "y" if len(new) == 1 else "ies", shown,
                        f"; and {len(new) - 5} more" if len(new) > 5 else "")
        found.sort()
        self._index = OrderedDict((k, (fn, size)) for _, k, fn, size in found)
        self._total = sum(size for _, _, _, size in found)
        if found:
            self._clock = max(self._clock, found[-1][0])

    def skipped(self) -> dict[str, str]:
        """Names in the directory that the last scan skipped, with the reason (left in place)."""
        with self._lock:
            return dict(self._skipped)

    def _forget(self, key: str) -> None:
        entry = self._index.pop(key, None)
        if entry is not None:
            self._total -= entry[1]

    def _evict(self, keep: str | None, limit: int | None = None) -> None:
        """Delete least recently used entries (never `keep`) until the total is within `limit`
        (default: the capacity, and the disk-full size while it holds)."""
        if limit is None:
            limit = self._limit()
            if limit is None:
                return
        while self._total > limit:
            victim = next((k for k in self._index if k != keep), None)
            if victim is None:
                break
            fn, _ = self._index[victim]
            try:
                (self.path / fn).unlink(missing_ok=True)
            except OSError as e:                     # cannot free it: stop counting it anyway
                log.debug("store %s: could not evict %s: %s", self.path, fn, e)
            self._forget(victim)
            self._n.evictions += 1

    def _limit(self) -> int | None:
        """The size the store keeps within: its capacity, and the disk-full size while it holds."""
        full = self._disk_full
        if full is not None and time.monotonic() - full[1] > DISK_FULL_HOLD_S:
            self._disk_full = full = None            # the disk may have room again: try the capacity
        if full is None:
            return self.capacity_bytes
        return full[0] if self.capacity_bytes is None else min(full[0], self.capacity_bytes)

    def _room_for(self, size: int, key: str) -> None:
        """Before a write while the disk-full size holds: evict until `size` more bytes fit
        (the entry's old version, replaced by the write, counts as free)."""
        if self._disk_full is None:
            return
        limit = self._limit()
        if limit is not None:
            old = self._index.get(key, (None, 0))[1]
            self._evict(keep=key, limit=max(limit - size + old, 0))

    def _write_temp(self, enc: Encoded) -> str:
        """The blob written and fsynced to a new temp file in the directory (its path); the temp
        file is removed if writing fails."""
        write_parts = sys.modules[__package__]._write_parts
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=f"{_TMP_PREFIX}{_host_tag()}-{os.getpid()}-",
                                   suffix=_TMP_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                write_parts(f, enc.parts())
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return tmp

    def _write_temp_making_room(self, enc: Encoded, key: str) -> str:
        """`_write_temp`; on a full disk, evict least recently used entries until the blob's
        size is free and write it again (see the class docstring)."""
        with self._lock:
            self._room_for(enc.size, key)
        try:
            return self._write_temp(enc)
        except OSError as e:
            if e.errno not in _DISK_FULL:
                raise
            with self._lock:
                held = self._total
                if not self._index:
                    raise                            # nothing of ours to delete: the disk is full of others'
                old = self._index.get(key, (None, 0))[1]
                self._disk_full = (held, time.monotonic())
                self._evict(keep=None, limit=max(held - enc.size, 0))
                log.warning("store %s: the disk is full at %d bytes held; evicted least recently used entries "
                            "down to %d bytes to write %d (old version: %d)", self.path, held, self._total,
                            enc.size, old)
            return self._write_temp(enc)

    # -- Store API
    def put(self, key: str, record: Record) -> None:
        check_key(key)
        enc = Encoded(record, key)
        check_fits(enc.size, self.capacity_bytes, key)
        tmp = self._write_temp_making_room(enc, key)
        try:
            with self._lock:
                fn = self._filename(key)
                try:
                    if not stat.S_ISREG((self.path / fn).lstat().st_mode):
                        raise NotRegularFile(errno.EEXIST, "something the store did not write sits at the "
                                             "entry's name; left in place", str(self.path / fn))
                except FileNotFoundError:
                    pass
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
        check_key(key)
        fn = self._filename(key)
        p = self.path / fn
        # Read and verify outside the lock (hashing a big blob takes a while); the file we opened is
        # a complete blob whatever writers do meanwhile, because they only ever os.replace it.
        try:
            with open(_open_regular(p), "rb", buffering=0) as f:
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
        except NotRegularFile:                       # something else sits at the name: not ours, a miss
            with self._lock:
                self._n.misses += 1
            return None
        # Any other OSError (EACCES, EIO...) propagates: a caller that treats the store as a cache
        # (StoreGuard) counts it and makes it a miss.
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
        check_key(key)
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
            self._limit()                            # (drops a disk-full size that no longer holds)
            n = self._n
            return {"backend": "dir", "path": str(self.path), "entries": len(self._index), "bytes": self._total,
                    "hits": n.hits, "misses": n.misses, "corrupt": n.corrupt, "evictions": n.evictions,
                    "skipped": len(self._skipped), "capacity_bytes": self.capacity_bytes,
                    "disk_full_bytes": self._disk_full[0] if self._disk_full is not None else None}

    def __repr__(self) -> str:
        return f"DirStore({str(self.path)!r}, capacity_bytes={self.capacity_bytes})"
