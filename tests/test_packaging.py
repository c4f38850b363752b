"""cedlm is pinned like a library and installed like an application.

pyproject.toml states ranges, so that `pip install cedlm` resolves beside other packages without
moving them (torch is the one exact pin: the compiled kernels build against it); requirements.lock
holds the exact set the suite runs with, the whole closure (setup.sh installs it with --no-deps),
and each of its versions lies inside pyproject's ranges. setup.sh picks the CPU torch build on a
machine without an NVIDIA GPU, and falls back to the default index when PyTorch's is unreachable.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("cedlm_lock", ROOT / ".ci" / "lock.py")
lock = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lock)

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["project"]


def all_requirements() -> list[Requirement]:
    return lock.top_level()


def test_dependencies_are_ranges_but_torch():
    for r in all_requirements():
        pins = [s for s in r.specifier if s.operator in ("==", "===")]
        if lock.canon(r.name) == "torch":
            assert [str(s) for s in r.specifier] == ["==2.13.0"], r
        else:
            assert not pins, f"{r}: a range, not a pin (the exact version belongs in requirements.lock)"
            assert r.specifier, f"{r}: give a lower bound"


def Requirement_list(reqs):
    return [Requirement(r) for r in reqs]


def test_no_transitive_pins():
    names = {lock.canon(r.name) for r in Requirement_list(PROJECT["dependencies"])}
    assert not names & {"pydantic-core", "starlette", "anyio", "h11"}, names


def test_heavy_evaluation_tools_are_in_their_own_extra():
    extras = PROJECT["optional-dependencies"]
    heavy = {"lm-eval", "transformers", "schemathesis", "guidellm"}
    assert heavy <= {lock.canon(r.name) for r in Requirement_list(extras["eval"])}
    for name in ("test", "redis", "train", "deepseek"):
        assert not heavy & {lock.canon(r.name) for r in Requirement_list(extras[name])}, name
    assert not heavy & {lock.canon(r.name) for r in Requirement_list(PROJECT["dependencies"])}


def test_lock_versions_lie_in_the_ranges():
    pins = lock.read_lock()
    for r in all_requirements():
        name = lock.canon(r.name)
        assert name in pins, f"requirements.lock lacks {name}"
        assert r.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} outside {r}"


def test_lock_is_exact_and_sorted():
    lines = [ln for ln in (ROOT / "requirements.lock").read_text("utf-8").splitlines()
             if ln and not ln.startswith("#")]
    assert all(re.fullmatch(r"[a-z0-9-]+==[0-9][0-9A-Za-z.]*", ln) for ln in lines), lines
    names = [ln.split("==")[0] for ln in lines]
    assert names == sorted(names) and len(set(names)) == len(names)
    assert "+" not in "".join(lines)            # the release, not a build (+cpu): the index picks it


def test_lock_covers_the_installed_closure():
    """Every package that cedlm's requirements reach in this environment is in the lock (so that
    `pip install --no-deps -r requirements.lock` installs a complete set)."""
    try:
        pins = lock.closure()
    except SystemExit as e:                     # an extra's package is not installed here
        pytest.skip(str(e))
    missing = sorted(set(pins) - set(lock.read_lock()))
    assert not missing, f"requirements.lock lacks {missing}: run .ci/lock.py"


def test_lock_leaves_out_only_what_it_says():
    pins = lock.read_lock()
    assert not set(pins) & lock.SKIP
    assert {"guidellm", "lm-eval", "schemathesis", "transformers", "pytest", "torch"} <= set(pins)


# ----------------------------------------------------------------------------- setup.sh's torch index

def _torch_line(tmp_path, *, nvidia: bool, reachable: bool, override: str | None = None) -> str:
    """Run setup.sh's torch choice with a stub pip / curl / nvidia-smi; return what pip got."""
    root = tmp_path / "repo"
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / "setup.sh").write_text((ROOT / "setup.sh").read_text("utf-8"))
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    log = tmp_path / "pip.log"
    stub = {
        root / ".venv" / "bin" / "python": "#!/bin/sh\nexit 1\n",           # no torch yet
        root / ".venv" / "bin" / "pip": f'#!/bin/sh\necho "$@" >> {log}\nexit 0\n',
        bin_ / "curl": f"#!/bin/sh\nexit {0 if reachable else 28}\n",
        bin_ / "uname": "#!/bin/sh\necho Linux\n",
    }
    if nvidia:
        stub[bin_ / "nvidia-smi"] = "#!/bin/sh\nexit 0\n"
    for path, text in stub.items():
        path.write_text(text)
        path.chmod(0o755)
    env = {"PATH": f"{bin_}:/usr/bin:/bin", "HOME": str(tmp_path)}
    if override:
        env["TORCH_INDEX_URL"] = override
    # the kernel build step runs the stub python (exit 1): setup.sh says so and carries on
    r = subprocess.run(["bash", str(root / "setup.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return next(ln for ln in log.read_text().splitlines() if "torch==2.13.0" in ln)


def test_setup_picks_the_cpu_torch_without_a_gpu(tmp_path):
    if Path("/proc/driver/nvidia").exists():
        pytest.skip("this machine has an NVIDIA driver")
    assert "--index-url https://download.pytorch.org/whl/cpu" in _torch_line(tmp_path, nvidia=False, reachable=True)


def test_setup_falls_back_to_the_default_index(tmp_path):
    assert "--index-url" not in _torch_line(tmp_path, nvidia=False, reachable=False)
    assert "--index-url" not in _torch_line(tmp_path / "gpu", nvidia=True, reachable=True)


def test_setup_keeps_the_override(tmp_path):
    url = "https://download.pytorch.org/whl/cu128"
    assert f"--index-url {url}" in _torch_line(tmp_path, nvidia=False, reachable=True, override=url)


def test_setup_installs_the_lock():
    text = (ROOT / "setup.sh").read_text("utf-8")
    assert "--no-deps -r requirements.lock" in text and "--no-deps -e ." in text
    assert "pytest" in (ROOT / ".ci" / "run").read_text("utf-8")
    assert sys.version_info >= (3, 11)
