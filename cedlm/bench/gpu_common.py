"""Device helpers shared by the GPU figures (gpu_capacity, gpu_decode, gpu_exact, gpu).

Every figure takes a `torch.device` and runs on the CPU as well (tiny sizes, for the tests), so
what differs between devices is kept here: waiting for the device (`sync`), counting live bytes
(`LiveBytes`: the CUDA caching allocator's `memory_allocated`, or the sum of the tensors' storages
where the device has no allocator statistics), describing the device (`device_info`) and a
wall-clock cap on one piece of work (`time_cap`, SIGALRM: a slow loop is interrupted between two torch calls).
"""
from __future__ import annotations

import contextlib
import signal
import time

import torch


def sync(device: torch.device) -> None:
    """Wait until the device has finished the work queued on it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tensors_of(obj, _depth: int = 0) -> list[torch.Tensor]:
    """The tensors `obj` holds: itself, the items of lists, tuples and dicts, and the attributes of
    a plain object (one level of objects: a state's tensors, not the pool its paged rows point to)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v, _depth)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_of(v, _depth)]
    if _depth == 0 and hasattr(obj, "__dict__"):
        return [t for v in vars(obj).values() for t in tensors_of(v, 1)]
    return []


def storage_bytes(objs) -> int:
    """Bytes of the distinct storages under `objs` (views of one tensor count once)."""
    seen: dict[tuple, int] = {}
    for t in tensors_of(list(objs)):
        s = t.untyped_storage()
        seen[(t.device.type, t.device.index, s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def tensors_on(objs, device: torch.device, what: str) -> None:
    """Raise when a tensor of `objs` is not on `device` (a constructor ignored the device)."""
    for t in tensors_of(list(objs)):
        if t.device.type != device.type:
            raise RuntimeError(f"{what}: a tensor landed on {t.device}, not {device} "
                               f"(shape {tuple(t.shape)}, {t.dtype})")


class LiveBytes:
    """Live bytes on a device. CUDA: `torch.cuda.memory_allocated` (every tensor alive on the
    device, at the allocator's granularity); `counter` says which. Elsewhere there are no
    allocator statistics and `read()` is None: the figures then count their tensors' storages."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.counter = ("torch.cuda.memory_allocated" if self.cuda
                        else "storage bytes of the allocated tensors (no allocator statistics on "
                             f"{device.type})")

    def read(self) -> int | None:
        if not self.cuda:
            return None
        sync(self.device)
        return torch.cuda.memory_allocated(self.device)

    def release(self) -> None:
        """Return cached blocks to the device after a figure's tensors were dropped."""
        import gc
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def device_info(device: torch.device) -> dict:
    """What the JSON says about the device: name, memory, capability, torch and CUDA versions."""
    from cedlm.util import describe_device
    out = {"device": str(device), "type": device.type, "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
           "gpu_name": None, "total_memory_bytes": None, "capability": None,
           "multi_processors": None, "device_count": None}
    try:
        out["description"] = describe_device(device)
    except Exception as e:                    # a broken driver must not lose the rest of the JSON
        out["description"] = f"{device} (describe_device failed: {type(e).__name__}: {e})"
    if device.type == "cuda":
        try:
            p = torch.cuda.get_device_properties(device)
            out.update(gpu_name=torch.cuda.get_device_name(device), total_memory_bytes=p.total_memory,
                       capability=f"{p.major}.{p.minor}", multi_processors=p.multi_processor_count,
                       device_count=torch.cuda.device_count())
            out["cudnn"] = torch.backends.cudnn.version()
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
    return out


class TimeCapExceeded(Exception):
    """A piece of work ran past its wall-clock cap (`time_cap`)."""


@contextlib.contextmanager
def time_cap(seconds: float | None, what: str):
    """Raise TimeCapExceeded inside the block after `seconds` (SIGALRM; main thread only, else no
    cap). A call that does not return to the interpreter (one long kernel) is cut at its end; the
    shell script's per-phase `timeout` is the last resort."""
    usable = (seconds is not None and seconds > 0 and hasattr(signal, "setitimer")
              and _main_thread())
    if not usable:
        yield
        return

    def fire(signum, frame):
        raise TimeCapExceeded(f"{what}: over its cap of {seconds:.0f} s")
    prev = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, prev)


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


class Clock:
    """Seconds since a start and left of a budget (a phase's time, or a figure's)."""

    def __init__(self, budget_s: float | None = None):
        self.t0, self.budget_s = time.perf_counter(), budget_s

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    @property
    def left(self) -> float:
        return float("inf") if self.budget_s is None else self.budget_s - self.elapsed
