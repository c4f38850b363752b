"""The compiled kernels build and load from an installed wheel, not only from a checkout.

A wheel is built from a copy of the checkout's files (so no stale ``build/lib`` of an earlier
build can leak into it), installed with ``pip install --target`` (torch and the rest come from
this interpreter's environment), and run from a directory outside the checkout with
``PYTHONPATH`` at the install and ``CEDLM_KERNEL_DIR`` at a fresh directory: the wheel ships the
C++ sources, ``python -m cedlm.kernels.build`` compiles them into that directory (1-2 minutes),
nothing lands in ``site-packages/build``, the installed package loads the compiled module, and
``cedlm generate --max-tokens 4`` runs on it without the "unavailable" line; then the installed
``cedlm serve`` (``--version``, a completion, ``/version``, the chat page shipped as package
data). About 100 seconds on two cores (most of it the compile); not marked slow: it is the only
check that an installed package, not the checkout, can build its kernels and serve.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _copy_checkout(dst: Path) -> None:
    """The checkout's tracked and untracked-but-not-ignored files, tests and results aside."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, check=True).stdout.decode()
    for rel in filter(None, out.split("\0")):
        if rel.split("/")[0] in ("tests", "bench", "experiments", ".ci"):
            continue
        src = ROOT / rel
        if src.is_file():                      # a file deleted in the work tree is skipped
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


@pytest.mark.ahead
def test_kernels_build_and_load_from_an_installed_wheel(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout to list its files")
    src, wheels, site, kdir, run_dir = (tmp_path / d for d in ("src", "wheels", "site", "kcache",
                                                                  "elsewhere"))
    for d in (src, run_dir):
        d.mkdir()
    _copy_checkout(src)
    py = sys.executable
    subprocess.run([py, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(src)], check=True, timeout=300, capture_output=True)
    (wheel,) = wheels.glob("cedlm-*.whl")
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                    str(wheel)], check=True, timeout=300, capture_output=True)
    assert (site / "cedlm" / "kernels" / "csrc" / "codecs.cpp").is_file()
    assert not (site / "build").exists()

    env = {k: v for k, v in os.environ.items() if k not in ("CEDLM_KERNEL_ISA",
                                                             "CEDLM_REFERENCE_KERNELS")}
    env.update(PYTHONPATH=str(site), CEDLM_KERNEL_DIR=str(kdir))

    def run(*args, timeout=600):
        return subprocess.run([py, *args], cwd=run_dir, env=env, capture_output=True, text=True,
                              timeout=timeout)

    built = run("-m", "cedlm.kernels.build")
    assert built.returncode == 0, built.stderr[-3000:]
    sos = list(kdir.glob("*/cedlm_kernels.so"))
    assert len(sos) == 1, sos
    assert not (site / "build").exists()

    probe = run("-c", "import cedlm, sys; from cedlm.kernels import build, gate; "
                      "print(cedlm.__file__); print(gate.active_backend()); "
                      "print(gate.compiled_status())")
    assert probe.returncode == 0, probe.stderr[-3000:]
    where, backend, status = probe.stdout.splitlines()[:3]
    assert Path(where).is_relative_to(site)                  # the installed copy, not the checkout
    assert backend == "ext" and str(sos[0]) in status, probe.stdout

    cli = site / "bin" / "cedlm"                             # the wheel's console script
    assert cli.is_file()
    gen = subprocess.run([str(cli), "generate", "--prompt", "Hello", "--max-tokens", "4",
                          "--threads", "1"], cwd=run_dir, env=env, capture_output=True, text=True,
                         timeout=600)
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert gen.stdout.strip()
    assert "unavailable" not in gen.stderr, gen.stderr[-3000:]

    # the server from the wheel: --version, and `cedlm serve` answers a completion, /version and
    # the chat page (package data: cedlm/server/ui/index.html)
    assert (site / "cedlm" / "server" / "ui" / "index.html").is_file()
    ver = subprocess.run([str(cli), "serve", "--version"], cwd=run_dir, env=env, capture_output=True,
                         text=True, timeout=120)
    assert ver.returncode == 0 and ver.stdout.startswith("cedlm "), ver
    import httpx
    from conftest import _free_port, stop_process, wait_healthy
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([str(cli), "serve", "--port", str(port), "--threads", "1", "--log-level", "warning"],
                            cwd=run_dir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert wait_healthy(base, lambda: proc.poll() is None, 120, 0.2), "the installed cedlm serve did not start"
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        assert httpx.get(f"{base}/version").json()["version"] == ver.stdout.split()[1]
        page = httpx.get(f"{base}/")
        assert page.status_code == 200 and "/v1/chat/completions" in page.text
    finally:
        stop_process(proc, 15)
    assert "unavailable" not in proc.stderr.read().decode(errors="replace")
