"""Shared pytest fixtures."""

import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

# The suite's tensors are small: one intra-op thread avoids OpenMP spin contention with other
# processes on a shared 2-core machine (measured: 20x slower decode with 2 threads under load).
torch.set_num_threads(1)

# Engines in the suite run the static decode step WITHOUT torch.compile (its logic, exercised by
# every engine test, at no compile cost per model); tests/test_compiled_step.py compiles it and
# compares it with the eager reference. A subprocess (cedlm serve) inherits the choice.
os.environ.setdefault("CEDLM_DECODE_STEP", "static")
# Training runs in the suite are tiny and many: eager, whatever the caller's environment says
# (--compile is off by default); tests/test_train_compile.py compiles one and compares it.
os.environ.setdefault("CEDLM_TRAIN_COMPILE", "off")
# The `compiled` tests check what a compiled graph computes, not how fast g++ made it: their C++
# is built at -O1 (CEDLM_COMPILE_OPT; about 6x less g++ time than -O3 on the decode graph), a value
# the caller set is kept. tests/test_compiled_step.py::test_compile_opt_level_knob checks the knob.
os.environ.setdefault("CEDLM_COMPILE_OPT", "O1")

_ahead = None       # tests/ahead.py: the background run on the second core


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """A background process on the second core runs the `ahead` tests and shares the test files
    with this one (tests/ahead.py); here the `ahead` tests come last, and they and the shared
    files' tests that the background claims report that run's outcomes."""
    global _ahead
    from tests import ahead
    if not ahead.wanted(config):
        return
    os.environ[ahead.ENV] = "0"         # a pytest a test starts (gpu_check.sh's phases) runs alone
    ids = ahead.ahead_last(items)
    shared = ahead.shareable(items)
    several_files = len({ahead.file_of(it.nodeid) for it in items}) > 1
    if (ids or shared) and len(ids) < len(items) and several_files and _ahead is None:
        import tempfile
        _ahead = ahead.Ahead(Path(config.rootpath), ids, Path(tempfile.mkdtemp(prefix="cedlm-ahead-")),
                             shared)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if _ahead is not None and _ahead.theirs(item.nodeid):
        from tests import ahead
        ahead.replay(_ahead, item)
        return True
    return None


def pytest_terminal_summary(terminalreporter):
    if _ahead is not None:
        terminalreporter.write_sep("=", "the background process (tests/ahead.py)")
        for line in _ahead.summary():
            terminalreporter.write_line(line)


def pytest_sessionfinish(session, exitstatus):
    if _ahead is not None:
        _ahead.stop()


def tool_unavailable(require_var: str, reason: str):
    """An outside program a test needs is missing: fail when CI demands it (`require_var`=1, as
    .ci/run sets CEDLM_REQUIRE_REDIS / _CHROMIUM / _GUIDELLM after installing them), skip otherwise."""
    if os.environ.get(require_var) == "1":
        pytest.fail(f"{require_var}=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def _redis_unavailable(reason: str):
    tool_unavailable("CEDLM_REQUIRE_REDIS", reason)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """Terminate `proc`; kill it when it has not exited within `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def cedlm_serve(log_path):
    """`cedlm serve` (the shipped default model, 1 thread) as a subprocess on a free loopback
    port, its output in `log_path`; yields its base URL once /health answers, stops it after."""
    port = _free_port()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "cedlm.cli", "serve", "--port", str(port),
                                 "--threads", "1", "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            if not wait_healthy(base, lambda: proc.poll() is None, 60, 0.1):
                pytest.fail(f"cedlm serve did not start:\n{Path(log_path).read_text(errors='replace')[-3000:]}")
            yield base
        finally:
            stop_process(proc, 15)


def wait_healthy(base: str, alive, timeout: float, poll: float) -> bool:
    """Poll GET `base`/health: True once it answers 200, False as soon as `alive()` is False or
    `timeout` seconds have passed (callers fail with their own message)."""
    import httpx
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if not alive() or time.monotonic() > deadline:
            return False
        time.sleep(poll)


def run_indexer_stage(model, tok, tmp_path, *flags: str) -> tuple[int, list[dict]]:
    """`cedlm train indexer` on a tiny model saved to tmp_path/init, with the repository's README
    as its corpus and 128-token sequences, plus `flags`; -> (exit code, metrics.jsonl records of
    tmp_path/run)."""
    import json
    from pathlib import Path

    from cedlm.checkpoint import save_checkpoint
    from cedlm.cli import main
    save_checkpoint(tmp_path / "init", model, tok)
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.txt").write_text((Path(__file__).resolve().parents[1] / "README.md")
                                    .read_text(encoding="utf-8"))
    rc = main(["train", "indexer", "--init", str(tmp_path / "init"), "--out", str(tmp_path / "run"),
               "--data", str(data), "--seq-len", "128", "--items", "1", "--min-gap", "16",
               "--no-progress", *flags])
    metrics = tmp_path / "run" / "metrics.jsonl"
    recs = [json.loads(l) for l in metrics.read_text().splitlines()] if metrics.exists() else []
    return rc, recs


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """URL of a throwaway `redis-server` on a free loopback port (no persistence), for the session.

    Without the `redis-server` binary or the `redis` Python client: skipped, or failed when the
    environment sets CEDLM_REQUIRE_REDIS=1 (CI)."""
    exe = shutil.which("redis-server")
    if exe is None:
        _redis_unavailable("the redis-server binary is not on PATH (Debian/Ubuntu: apt-get install -y redis-server)")
    if importlib.util.find_spec("redis") is None:
        _redis_unavailable("the 'redis' Python client is not installed (pip install redis)")
    workdir = tmp_path_factory.mktemp("redis")
    last_err = ""
    for _ in range(5):  # the free port can be taken between probe and bind: retry
        port = _free_port()
        log = open(workdir / f"redis-{port}.log", "wb")
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(workdir), "--daemonize", "no"],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and proc.poll() is None and not _ping(port):
            time.sleep(0.05)
        if proc.poll() is None and _ping(port):
            try:
                yield f"redis://127.0.0.1:{port}/0"
            finally:
                stop_process(proc, 10)
                log.close()
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()
        last_err = (workdir / f"redis-{port}.log").read_text(errors="replace")[-2000:]
    pytest.fail(f"could not start redis-server ({exe}):\n{last_err}", pytrace=False)


@pytest.fixture(scope="module")
def tok():
    """The shipped 4096-token tokenizer (training and evaluation tests)."""
    from cedlm.text.tokenizer import load_tokenizer
    return load_tokenizer("default")


def portability_rerun_repeats(kernels: str) -> str | None:
    """Inside a portability re-run (tests/test_portability.py: CEDLM_PORTABILITY_SWEEP=1 and one
    forced path), why a computation with every kernel forced to `kernels` ("fast" or "reference")
    is the same as in the suite's own run; None where the path can change it. The reference
    kernels do not depend on the compiled kernels' instruction set or on the reference switch; the
    fast ones (forced on) not on the switch; MKL's code path changes both."""
    if os.environ.get("CEDLM_PORTABILITY_SWEEP") != "1" or os.environ.get("MKL_ENABLE_INSTRUCTIONS"):
        return None
    if kernels == "reference":
        return "reference kernels forced: this re-run's path does not change them (the suite's own run ran it)"
    if os.environ.get("CEDLM_KERNEL_ISA", "auto").strip().lower() in ("", "auto"):
        return "fast kernels forced: the reference switch does not change them (the suite's own run ran it)"
    return None


@pytest.fixture(params=["fast", "reference"])
def kernels(request):
    """Run the test twice: with the inference fast paths (compiled kernels, the default) and with
    every reference kernel forced (CEDLM_REFERENCE_KERNELS=1's switch): the exactness tests must
    hold either way."""
    from cedlm.kernels.gate import reference_kernels_forced
    repeat = portability_rerun_repeats(request.param)
    if repeat:
        pytest.skip(repeat)
    with reference_kernels_forced(request.param == "reference"):
        yield request.param


@pytest.fixture(scope="session")
def bench_quick(tmp_path_factory):
    """One `cedlm bench --quick` run of every figure (static decode step, no installs, 1 thread),
    shared by the tests that check its output (tests/test_bench.py, tests/test_bench_device.py):
    (exit code, output directory, what it printed). It runs under `implicit_device_guard()`
    (tests/devices.py), where a tensor made without a device lands on `meta` and fails: a run
    that passes there runs the same on the CPU unguarded, so one run serves both files."""
    import contextlib
    import io

    from cedlm.bench import cli
    from tests.devices import implicit_device_guard
    out = tmp_path_factory.mktemp("bench") / "quick"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), implicit_device_guard():
        rc = cli.main(["--quick", "--out", str(out), "--no-install", "--threads", "1",
                       "--decode-step", "static"])
    return rc, out, printed.getvalue()
