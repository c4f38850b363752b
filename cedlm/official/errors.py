"""The official loader's errors, and the byte sizes their messages print."""
from __future__ import annotations

GIB = 1 << 30


class OfficialCheckpointError(ValueError):
    """The directory does not hold a loadable official-layout checkpoint (the message lists why)."""


class CheckpointTooLargeError(MemoryError):
    """Loading would need more RAM (or disk) than this machine has; nothing was loaded."""


def size_text(n: float) -> str:
    """Bytes in GiB, MiB or KiB (whichever reads best)."""
    if n >= GIB // 10:
        return f"{n / GIB:,.2f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):,.2f} MiB"
    return f"{n / 1024:,.1f} KiB"
