"""Small shared helpers (atomic file and directory writes, seeding)."""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


def _user_cache() -> Path:
    """This user's own cache folder: ~/.cache/cedlm."""
    return Path(os.path.expanduser("~")) / ".cache" / "cedlm"


def cache_root() -> Path:
    """cedlm's cache folder: $CEDLM_CACHE_DIR, else ~/.cache/cedlm."""
    d = os.environ.get("CEDLM_CACHE_DIR")
    return Path(d) if d else _user_cache()


def inductor_cache_dir() -> Path:
    """Where torch.compile's artefacts go unless TORCHINDUCTOR_CACHE_DIR says: `inductor/` in
    cedlm's cache folder, beside the graph store, so that one CEDLM_CACHE_DIR shared by several
    users (a group-writable folder) or checkouts holds both. Inductor takes file locks and writes
    while it loads, so where this user may not write that folder (another user's cache, read
    only), their own `~/.cache/cedlm/inductor` instead: the stored graphs still load, their C++
    built again there."""
    d = cache_root() / "inductor"
    probe = d if d.exists() else cache_root()
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        return _user_cache() / "inductor"
    return d


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temp file in the same directory, fsync, then rename: never a half-written file
    (with the permissions a plain ``open`` would give it: ``atomic_open``)."""
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


@contextmanager
def atomic_open(path: str | Path, mode: str = "w", encoding: str | None = "utf-8"):
    """Open a temp file beside ``path``; on success fsync and rename it over ``path``.

    On an exception the temp file is removed and ``path`` is left as it was. The file gets the
    permissions a plain ``open`` would give it (0o666 less the umask).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        kw = {} if "b" in mode else {"encoding": encoding, "newline": "\n"}
        with os.fdopen(fd, mode, **kw) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


@contextmanager
def atomic_directory(path: str | Path):
    """Build a directory in a temp directory beside ``path``, then swap it in for ``path``.

    Yields the temp directory (``.NAME.tmp-*``) to write into. On success its files and folders
    get the permissions a plain ``open`` / ``mkdir`` would give them (``mkstemp`` / ``mkdtemp``
    make them owner-only), an existing ``path`` is renamed aside, the temp directory renamed to
    ``path`` and the old one removed: a reader sees the old directory or the new one, never a
    half-written one. On an exception the temp directory is removed and ``path`` is left as it
    was. Used by every writer of a model or checkpoint directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    try:
        yield tmp
        mask = _umask()
        for root, dirs, files in os.walk(tmp):
            for d in dirs:
                os.chmod(os.path.join(root, d), 0o777 & ~mask)
            for f in files:
                os.chmod(os.path.join(root, f), 0o666 & ~mask)
        os.chmod(tmp, 0o777 & ~mask)
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old-{os.getpid()}"
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    """The process's umask. Linux reports it in /proc; elsewhere it is read by setting it and
    putting it back, which for that instant gives a file another thread creates the wrong mode."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---------------------------------------------------------------------------------------------
# the device option (--device, LLM(device=...)): one resolver for every command
# ---------------------------------------------------------------------------------------------

CUDA_INSTALL_HINT = ("install the CUDA build of the same torch: `.venv/bin/pip install torch==2.13.0 "
                     "--index-url https://download.pytorch.org/whl/cu128` (docs/gpu.md)")


def resolve_device(name=None, field: str = "device"):
    """The ``torch.device`` a command runs on. ``None`` or ``"auto"``: CUDA when this torch build
    sees a GPU, else the CPU. ``"cpu"``, ``"cuda"`` or ``"cuda:N"``: that device, or a ValueError
    naming ``field`` (the CPU wheel has no CUDA; N must be a visible GPU). Other kinds (mps, xpu)
    are refused: cedlm's exactness tests have only run on CPU and CUDA."""
    import torch
    if isinstance(name, torch.device):
        name = str(name)
    if name is None or str(name).strip().lower() in ("", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    text = str(name).strip().lower()
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise ValueError(f"{field}: {name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"{field}: {name!r} is not supported; use auto, cpu, cuda or cuda:N")
    if not torch.backends.cuda.is_built():
        raise ValueError(f"{field}: {name!r} needs a CUDA build of torch, and this one is the CPU "
                         f"wheel ({torch.__version__}); {CUDA_INSTALL_HINT}")
    if not torch.cuda.is_available():
        raise ValueError(f"{field}: {name!r} requested but no CUDA device is visible "
                         f"(torch.cuda.is_available() is False)")
    n = torch.cuda.device_count()
    if dev.index is not None and dev.index >= n:
        raise ValueError(f"{field}: {name!r} but only {n} CUDA device(s) are visible")
    return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())


def describe_device(dev) -> str:
    """One line for the start-up log: the device and what it is (GPU name and memory)."""
    import torch
    dev = torch.device(dev)
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        return f"{dev} ({p.name}, {p.total_memory / 2**30:.0f} GiB)"
    return f"cpu ({torch.get_num_threads()} torch threads)"


# A serving process runs a full collection at most once per this many collections of the middle
# generation (the interpreter's default is 10): with 16,000-18,000 connections open each full pass
# held the GIL 0.2-0.33 s and freed nothing (their objects go by reference counting); at 100 one
# came about every 25 s under that load (RELIABILITY.md, slow bodies), at 1,000 ten times rarer.
SERVE_FULL_COLLECTION_EVERY = 1000


def collect_fully_less_often(every: int = SERVE_FULL_COLLECTION_EVERY) -> None:
    """Make the garbage collector's full passes rarer in a serving process. An open connection's
    objects outlive the young collections and land in the oldest generation; with thousands of
    connections opening and closing, the interpreter's rule (a full pass once 25 % more objects
    have reached it, and at least every 10 middle collections) ran one every few seconds, each
    walking every open connection's objects while holding the GIL (about 0.2 s at 16,000
    connections) and stalling `/health` and every stream (RELIABILITY.md, slow bodies). Closed
    connections are freed by reference counting, so little waits for a full pass; the young
    collections are unchanged."""
    import gc
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, every)


def freeze_heap(collect: bool = True) -> None:
    """Move every object alive now out of the garbage collector's reach (`gc.freeze`), after
    collecting what is garbage already (`collect`): the model, its modules and the imported
    libraries live as long as the process, and without this each full collection walks them all
    again while holding the GIL (about 0.4 s in a serving process, every few seconds while many
    connections allocate), stalling every stream. Later garbage is still collected; objects
    reachable from the frozen ones are freed by reference counting as usual."""
    import gc
    if collect:
        gc.collect()
    gc.freeze()
