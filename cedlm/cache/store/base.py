"""What every store backend shares: the `Store` protocol, key and capacity checks, and the
per-client operation counters reported by `stats()`."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from cedlm.cache.store.record import Record


@runtime_checkable
class Store(Protocol):
    def put(self, key: str, record: Record) -> None: ...
    def get(self, key: str) -> Record | None: ...
    def delete(self, key: str) -> None: ...
    def keys(self) -> list[str]: ...
    def stats(self) -> dict: ...


def check_key(key: str) -> None:
    if not isinstance(key, str) or not key:
        raise TypeError(f"store keys must be non-empty str, got {key!r}")


def check_capacity(capacity_bytes) -> int | None:
    if capacity_bytes is None:
        return None
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
        raise ValueError(f"capacity_bytes must be a positive int or None, got {capacity_bytes!r}")
    return capacity_bytes


def check_fits(size: int, capacity: int | None, key: str) -> None:
    """Raise ValueError when one entry of ``size`` bytes is larger than the whole store."""
    if capacity is not None and size > capacity:
        raise ValueError(f"entry {key!r} is {size} bytes, larger than the store's capacity_bytes={capacity}; "
                         "raise capacity_bytes or store less per entry")


class Counters:
    def __init__(self):
        self.hits = self.misses = self.corrupt = self.evictions = 0
