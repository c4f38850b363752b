"""Minimal reader for R's serialization format (XDR, versions 2 and 3).

Enough to pull character vectors out of an installed R package's lazy-load data base
(``data/Rdata.rdx`` + ``data/Rdata.rdb``) without an R interpreter. Supports the value kinds
that data objects use: NULL, symbols, pairlists, character/logical/integer/double/raw vectors,
lists, attributes, references and the compact ALTREP forms R writes for strings and sequences.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RObject:
    """A value with R attributes (``attrs``: name -> value) or a non-vector R object."""

    kind: str
    value: object = None
    attrs: dict = field(default_factory=dict)


class _Reader:
    def __init__(self, data: bytes):
        self.b = data
        self.i = 0
        self.refs: list = []

    def take(self, n: int) -> bytes:
        out = self.b[self.i : self.i + n]
        if len(out) != n:
            raise ValueError("truncated R serialization stream")
        self.i += n
        return out

    def int(self) -> int:
        return struct.unpack(">i", self.take(4))[0]

    def header(self) -> None:
        fmt = self.take(2)
        if fmt != b"X\n":
            raise ValueError(f"unsupported R serialization format {fmt!r} (only XDR 'X' is supported)")
        version = self.int()
        self.int()  # writer R version
        self.int()  # minimal reader version
        if version == 3:
            n = self.int()
            self.take(n)  # native encoding name
        elif version != 2:
            raise ValueError(f"unsupported R serialization version {version}")

    def length(self) -> int:
        n = self.int()
        if n == -1:  # long vector: two more ints
            hi, lo = self.int(), self.int()
            n = (hi << 32) + lo
        return n

    def item(self):
        flags = self.int()
        t = flags & 0xFF
        has_attr = bool(flags & (1 << 9))
        has_tag = bool(flags & (1 << 10))
        if t == 254:  # NILVALUE
            return None
        if t in (253, 242, 241, 250, 251, 252):  # special environments / markers
            return RObject("special", t)
        if t == 255:  # REFSXP
            idx = flags >> 8
            if idx == 0:
                idx = self.int()
            return self.refs[idx - 1]
        if t in (247, 249, 248):  # PERSISTSXP / NAMESPACESXP / PACKAGESXP: a STRSXP "info"
            self.int()  # the 0 before the string vector
            info = self._strings(self.length())
            obj = RObject("namespace", info)
            self.refs.append(obj)
            return obj
        if t == 1:  # SYMSXP
            name = self.item()
            self.refs.append(name)
            return name
        if t == 9:  # CHARSXP
            n = self.int()
            return None if n == -1 else self.take(n).decode("utf-8", errors="replace")
        if t == 4:  # ENVSXP
            obj = RObject("env")
            self.refs.append(obj)
            self.int()  # locked
            enclos, frame, hashtab, attrs = self.item(), self.item(), self.item(), self.item()
            obj.value = {"enclos": enclos, "frame": frame, "hashtab": hashtab}
            return obj
        if t == 238:  # ALTREP_SXP: info, state, attributes
            info, state, attr = self.item(), self.item(), self.item()
            return self._altrep(info, state, attr)
        if t in (2, 3, 5, 6, 17, 239, 240):  # pairlist-like
            attrs = self.item() if has_attr else None
            tag = self.item() if has_tag else None
            car = self.item()
            cdr = self.item()
            node = RObject("pairlist", [(tag, car)])
            if isinstance(cdr, RObject) and cdr.kind == "pairlist":
                node.value.extend(cdr.value)
            if attrs is not None:
                node.attrs = _attrs(attrs)
            return node
        if t == 16:  # STRSXP
            val = self._strings(self.length())
        elif t in (10, 13):  # LGLSXP / INTSXP
            n = self.length()
            val = list(struct.unpack(f">{n}i", self.take(4 * n)))
        elif t == 14:  # REALSXP
            n = self.length()
            val = list(struct.unpack(f">{n}d", self.take(8 * n)))
        elif t == 24:  # RAWSXP
            val = self.take(self.length())
        elif t in (19, 20):  # VECSXP / EXPRSXP
            val = [self.item() for _ in range(self.length())]
        else:
            raise ValueError(f"unsupported R SEXP type {t}")
        if has_attr:
            return RObject("vector", val, _attrs(self.item()))
        return val

    def _strings(self, n: int) -> list:
        out = []
        for _ in range(n):
            self.int()  # CHARSXP flags
            k = self.int()
            out.append(None if k == -1 else self.take(k).decode("utf-8", errors="replace"))
        return out

    def _altrep(self, info, state, attr):
        cls = info.value[0][1] if isinstance(info, RObject) and info.kind == "pairlist" else info
        if cls == "compact_intseq" or cls == "compact_realseq":
            n, start, step = (state.value if isinstance(state, RObject) else state)[:3]
            val = [start + k * step for k in range(int(n))]
            if cls == "compact_intseq":
                val = [int(v) for v in val]
        elif cls in ("wrap_string", "wrap_integer", "wrap_real", "wrap_logical", "wrap_list"):
            val = state[0] if isinstance(state, list) else state.value[0]
            if isinstance(val, RObject):
                val = val.value
        elif cls == "deferred_string":
            arg = state.value[0][1] if isinstance(state, RObject) else state[0]
            val = [str(x) for x in (arg.value if isinstance(arg, RObject) else arg)]
        else:
            raise ValueError(f"unsupported ALTREP class {cls!r}")
        if attr is not None:
            return RObject("vector", val, _attrs(attr))
        return val


def _attrs(pairlist) -> dict:
    if not isinstance(pairlist, RObject) or pairlist.kind != "pairlist":
        return {}
    return {tag: val for tag, val in pairlist.value}


def _decompress(data: bytes) -> bytes:
    if data[:2] == b"\x1f\x8b":
        return gzip.decompress(data)
    if data[:3] == b"BZh":
        return bz2.decompress(data)
    if data[:6] == b"\xfd7zXZ\x00":
        return lzma.decompress(data)
    return data


def unserialize(data: bytes):
    """Parse one serialized R value (the body of an .rds file, already decompressed)."""
    r = _Reader(data)
    r.header()
    return r.item()


def read_rds(path: str | Path):
    """Read an .rds file (gzip, bzip2, xz or uncompressed)."""
    return unserialize(_decompress(Path(path).read_bytes()))


def _rdb_blob(blob: bytes) -> bytes:
    # R's lazy-load entries: 4-byte big-endian uncompressed length, then (type 1) zlib data, or
    # (types 2/3) one byte '2' (bzip2), 'Z' (xz) or '0' (stored) before the payload.
    n = struct.unpack(">I", blob[:4])[0]
    body = blob[4:]
    if body[:1] == b"Z":
        out = lzma.decompress(body[1:])
    elif body[:1] == b"2":
        out = bz2.decompress(body[1:])
    elif body[:1] == b"0":
        out = body[1:]
    else:
        out = zlib.decompress(body)
    if len(out) != n:
        raise ValueError("lazy-load entry length mismatch")
    return out


def read_lazyload_db(base: str | Path) -> dict:
    """Read every variable of an R lazy-load data base ``base.rdx`` + ``base.rdb``.

    Returns name -> value (character vectors come back as ``list[str]``).
    """
    base = Path(base)
    index = read_rds(base.with_suffix(".rdx"))
    names = index.attrs.get("names") if isinstance(index, RObject) else None
    parts = dict(zip(names, index.value)) if names else {}
    variables = parts.get("variables")
    if not isinstance(variables, RObject):
        raise ValueError(f"{base}.rdx: no 'variables' index")
    idx = dict(zip(variables.attrs["names"], variables.value))
    rdb = base.with_suffix(".rdb").read_bytes()
    out = {}
    for name, pos in idx.items():
        pos = pos.value if isinstance(pos, RObject) else pos
        off, ln = int(pos[0]), int(pos[1])
        out[name] = _strip(unserialize(_rdb_blob(rdb[off : off + ln])))
    return out


def _strip(v):
    return v.value if isinstance(v, RObject) and v.kind == "vector" else v
