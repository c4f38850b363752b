"""Write requirements.lock: the exact versions, from the running environment, of cedlm's
dependencies with every extra, and of everything those need in turn.

    .venv/bin/python .ci/lock.py            # rewrite requirements.lock from .venv
    .venv/bin/python .ci/lock.py --check    # exit 1 when the lock lacks a package of the closure

pyproject.toml states ranges (cedlm installs beside other packages); the lock is the one set the
test suite runs with. `setup.sh` installs it with `pip install --no-deps -r requirements.lock`, so
it must be the whole closure: `closure()` walks the installed packages' own requirements (markers
evaluated for this interpreter) from cedlm's. What it leaves out on purpose is in SKIP.
"""
from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.lock"
# guidellm requires sanic (only its mock server). pip is the installer itself.
SKIP = {"sanic", "pip"}

HEADER = """\
# The exact set cedlm's test suite runs with: cedlm's dependencies with every extra and everything
# they need, from CPython 3.11 on Linux x86-64. Written by `python .ci/lock.py` (never by hand);
# installed by setup.sh with `pip install --no-deps -r requirements.lock` after torch.
# pyproject.toml holds the ranges a `pip install cedlm` accepts.
"""


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def top_level() -> list[Requirement]:
    """cedlm's requirements with every extra, from pyproject.toml."""
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["project"]
    reqs = list(proj["dependencies"])
    for extra in proj.get("optional-dependencies", {}).values():
        reqs += extra
    return [Requirement(r) for r in reqs]


def closure(skip: set[str] = SKIP) -> dict[str, str]:
    """{canonical name: installed version} of every package the requirements reach."""
    seen: dict[str, str] = {}
    done: set[tuple[str, frozenset]] = set()
    todo = top_level()
    while todo:
        req = todo.pop()
        name, extras = canon(req.name), frozenset(canon(e) for e in req.extras)
        if name in skip or name == "cedlm" or (name, extras) in done:   # cedlm: a self-reference
            continue
        done.add((name, extras))
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"lock: {req.name} is not installed in {sys.prefix}") from None
        seen[name] = dist.version
        envs = [{"extra": e} for e in extras] or [{"extra": ""}]
        for s in dist.requires or []:
            sub = Requirement(s)
            if sub.marker is None or any(sub.marker.evaluate(env) for env in envs):
                todo.append(sub)
    return seen


def public(version: str) -> str:
    """2.13.0+cpu -> 2.13.0: the lock names the release; the index picks the build."""
    return version.split("+", 1)[0]


def render(pins: dict[str, str]) -> str:
    return HEADER + "".join(f"{n}=={public(v)}\n" for n, v in sorted(pins.items()))


def read_lock(path: Path = LOCK) -> dict[str, str]:
    out = {}
    for line in path.read_text("utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[canon(name)] = version
    return out


def main(argv: list[str]) -> int:
    pins = closure()
    if "--check" in argv:
        missing = sorted(set(pins) - set(read_lock()))
        if missing:
            print("requirements.lock lacks:", " ".join(missing))
            return 1
        return 0
    LOCK.write_text(render(pins), "utf-8")
    print(f"wrote {LOCK.relative_to(ROOT)}: {len(pins)} packages")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
