"""Build a deterministic train/validation text corpus from the registry sources.

Layout of ``DIR`` (default ``data/corpus``): ``train.txt``, ``val.txt`` (UTF-8) and ``manifest.json``.
Documents are separated by a line holding only the EOS token string (``DOC_SEPARATOR``), so
``tokenizer.encode(file_text)`` yields EOS ids at document boundaries, and ``iter_documents`` splits
a file back into documents.

Split rule: long documents are first cut into chunks of about ``chunk_chars`` characters at
paragraph boundaries; a chunk ``source:doc_id#k`` goes to validation when the first 8 bytes of
sha256 of that key, as a big-endian integer, mod 10000 is below ``val_fraction * 10000``; a source
where no chunk qualifies sends its smallest-hash chunk instead. It depends only on the keys, so the
split is stable across runs and machines, and validation chunks are never dropped by the cap.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import unicodedata
from pathlib import Path
from typing import Iterable

from cedlm.text.documents import DOC_SEPARATOR, iter_documents, write_documents  # noqa: F401
from cedlm.util import atomic_open

from .sources import SOURCES, Source, SourceError, deb_versions

DEFAULT_OUT = "data/corpus"
DEFAULT_CACHE = "data/cache"
DEFAULT_MAX_MB = 40.0
DEFAULT_VAL_FRACTION = 0.01
DEFAULT_CHUNK_CHARS = 32_768
MANIFEST_VERSION = 1

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\u200b\ufeff\ufffe]")
_BLANKS = re.compile(r"\n{4,}")


# ----------------------------------------------------------------------------- cleaning


def clean_text(text: str) -> str:
    """Generic cleaning applied to every document.

    NFC-normalise; unify line endings; drop control characters (tab and newline stay), BOMs and
    zero-width spaces; strip trailing whitespace on each line (leading indentation is kept, code
    needs it); collapse runs of more than two blank lines; trim blank lines at both ends; remove
    any occurrence of the document separator.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = unicodedata.normalize("NFC", text)
    text = _CONTROL.sub("", text).replace(DOC_SEPARATOR, "")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = _BLANKS.sub("\n\n\n", text)
    return text.strip("\n")


def chunk_document(text: str, chunk_chars: int = DEFAULT_CHUNK_CHARS) -> list[str]:
    """Cut a long document into pieces of about ``chunk_chars`` at paragraph (blank line) boundaries.

    A single paragraph longer than ``2 * chunk_chars`` is cut at line boundaries. Joining the
    pieces with ``"\\n\\n"`` restores the text up to whitespace between paragraphs.
    """
    if len(text) <= 2 * chunk_chars:
        return [text]
    paras = re.split(r"\n{2,}", text)
    pieces: list[str] = []
    cur: list[str] = []
    size = 0
    for para in paras:
        units = [para] if len(para) <= 2 * chunk_chars else para.split("\n")
        for u in units:
            if size and size + len(u) > chunk_chars:
                pieces.append("\n\n".join(cur))
                cur, size = [], 0
            cur.append(u)
            size += len(u) + 2
    if cur:
        pieces.append("\n\n".join(cur))
    return [p for p in pieces if p.strip()]


def split_of(key: str, val_fraction: float = DEFAULT_VAL_FRACTION) -> str:
    """'val' or 'train' for a chunk key, by sha256 (see module docstring)."""
    h = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")
    return "val" if h % 10_000 < round(val_fraction * 10_000) else "train"


def assign_splits(keys: list[str], val_fraction: float = DEFAULT_VAL_FRACTION) -> dict[str, str]:
    """``split_of`` for every key of one source, plus a floor: when no key of the source falls in
    validation (and there are at least two), the key with the smallest sha256 goes there."""
    parts = {k: split_of(k, val_fraction) for k in keys}
    if val_fraction > 0 and len(keys) > 1 and "val" not in parts.values():
        parts[min(keys, key=lambda k: hashlib.sha256(k.encode("utf-8")).digest())] = "val"
    return parts


def _rank(key: str) -> bytes:
    return hashlib.sha256(b"keep:" + key.encode("utf-8")).digest()


def cap_sizes(sizes: dict[str, int], cap: int) -> dict[str, int]:
    """Per-source byte budgets: water-filling so that small sources stay whole and the rest share
    what is left equally, with the total at most ``cap``."""
    if sum(sizes.values()) <= cap:
        return dict(sizes)
    budgets: dict[str, int] = {}
    left, todo = cap, sorted(sizes, key=lambda k: sizes[k])
    while todo:
        share = left // len(todo)
        name = todo[0]
        if sizes[name] <= share:
            budgets[name] = sizes[name]
            left -= sizes[name]
            todo.pop(0)
        else:
            for n in todo:
                budgets[n] = share
            break
    return budgets


# ----------------------------------------------------------------------------- atomic writes


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_open(path) as f:
        f.write(text)


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------- prepare


def source_chunks(src: Source, root: Path, chunk_chars: int = DEFAULT_CHUNK_CHARS) -> list[tuple[str, str]]:
    """Cleaned, chunked ``(key, text)`` pairs of one source, in the source's natural order."""
    out = []
    try:
        for doc_id, raw in src.documents(root):
            text = clean_text(src.clean(raw))
            if not text.strip():
                continue
            pieces = chunk_document(text, chunk_chars)
            for k, piece in enumerate(pieces):
                key = f"{src.name}:{doc_id}" + (f"#{k}" if len(pieces) > 1 else "")
                out.append((key, piece))
    except SourceError:
        raise
    except (OSError, ValueError) as e:
        raise SourceError(f"source '{src.name}': reading {root} failed: {e}") from e
    if not out:
        raise SourceError(f"source '{src.name}': no documents found under {root}")
    return out


def prepare(
    out_dir: str | Path = DEFAULT_OUT,
    sources: Iterable[str] | None = None,
    max_mb: float = DEFAULT_MAX_MB,
    cache_dir: str | Path = DEFAULT_CACHE,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    chunk_chars: int = DEFAULT_CHUNK_CHARS,
    roots: dict[str, str | Path] | None = None,
    log=print,
) -> dict:
    """Fetch, clean, cap, split and write the corpus; returns the manifest dict.

    ``roots`` maps a source name to an already-extracted raw folder (skips its fetch step; tests use
    the fixtures this way). ``max_mb`` caps the total UTF-8 size of the documents (MiB = 2**20 bytes).
    """
    names = list(sources) if sources is not None else list(SOURCES)
    unknown = [n for n in names if n not in SOURCES]
    if unknown:
        raise SourceError(f"unknown source(s) {unknown}; known: {', '.join(SOURCES)}")
    if not names:
        raise SourceError("no sources selected")
    out_dir, cache_dir = Path(out_dir), Path(cache_dir)
    roots = dict(roots or {})

    chunks: dict[str, list[tuple[str, str]]] = {}
    info: dict[str, dict] = {}
    for name in names:
        src = SOURCES[name]
        if name in roots:
            root = Path(roots[name])
        else:
            log(f"[{name}] fetching: {src.origin}")
            root = src.fetch(cache_dir / name)
        chunks[name] = source_chunks(src, root, chunk_chars)
        info[name] = {"origin": src.origin, "license": src.license, "kind": src.kind}

        versions = deb_versions(cache_dir / name) if name not in roots else {}
        if versions:
            info[name]["packages"] = versions
        if name == "pystdlib":
            info[name]["python"] = platform.python_version()

    sizes = {n: sum(len(t.encode("utf-8")) + 1 for _, t in c) for n, c in chunks.items()}
    budgets = cap_sizes(sizes, int(max_mb * 2**20))

    train_docs: list[str] = []
    val_docs: list[str] = []
    for name in names:
        parts = assign_splits([k for k, _ in chunks[name]], val_fraction)
        keep = set()
        used = 0
        # Validation chunks are always kept (so the split does not move with the cap); train chunks
        # fill the rest of the budget in hash order, a fair sample of the source.
        ordered = sorted(chunks[name], key=lambda kt: (parts[kt[0]] != "val", _rank(kt[0])))
        for key, text in ordered:
            n = len(text.encode("utf-8")) + 1
            if parts[key] == "train" and used + n > budgets[name]:
                continue
            keep.add(key)
            used += n
        st = {"docs_available": len(chunks[name]), "bytes_available": sizes[name], "docs": 0,
              "train_docs": 0, "val_docs": 0, "train_bytes": 0, "val_bytes": 0}
        for key, text in chunks[name]:  # natural order in the output
            if key not in keep:
                continue
            part = parts[key]
            (val_docs if part == "val" else train_docs).append(text)
            st["docs"] += 1
            st[f"{part}_docs"] += 1
            st[f"{part}_bytes"] += len(text.encode("utf-8"))
        st["bytes"] = st["train_bytes"] + st["val_bytes"]
        st["truncated"] = len(keep) < len(chunks[name])
        info[name].update(st)
        log(f"[{name}] {st['docs']} docs, {st['bytes'] / 2**20:.2f} MiB "
            f"(train {st['train_docs']}, val {st['val_docs']}{', capped' if st['truncated'] else ''})")

    out_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    for fname, docs in (("train.txt", train_docs), ("val.txt", val_docs)):
        with atomic_open(out_dir / fname) as f:
            write_documents(f, docs)
        files[fname] = {"bytes": (out_dir / fname).stat().st_size, "sha256": sha256_file(out_dir / fname),
                        "docs": len(docs)}
    manifest = {
        "version": MANIFEST_VERSION,
        "doc_separator": DOC_SEPARATOR + "\\n (a line of its own after each document)",
        "split": {
            "rule": "chunk key 'source:doc_id[#k]'; val iff int.from_bytes(sha256(key)[:8], 'big') % 10000 "
                    "< val_fraction*10000; "
                    "a source with no such chunk sends its smallest-sha256 chunk to val",
            "val_fraction": val_fraction,
            "chunk_chars": chunk_chars,
        },
        "cap": {"max_mb": max_mb, "rule": "water-filling per source; kept chunks chosen in sha256('keep:'+key) order"},
        "sources": info,
        "files": files,
    }
    atomic_write_text(out_dir / "manifest.json", json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    return manifest
