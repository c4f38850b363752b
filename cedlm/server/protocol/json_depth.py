"""The nesting depth of JSON text, measured on the raw bytes before anything parses it.

Python's ``json`` module parses recursively: a body of 100,000 ``[`` costs a deep C recursion and
ends in a ``RecursionError``, and a JSON text carried inside a string field (``guided_json``,
``structured_outputs.json``, tool-call ``arguments``) reached ``json.loads`` inside a validator,
where that error was a 500. ``deeper_than(data, limit)`` finds the first bracket nested deeper
than ``limit`` levels (brackets inside strings do not count; escaped quotes are handled) without
recursion and without a Python loop over the bytes: a bracket count decides most bodies at once,
the rest go through numpy a megabyte at a time (about 10 ms for 8 MiB of brackets).
``containers_over(data, limit)`` counts the arrays and objects the same way (the server refuses a
body of more than ``MAX_CONTAINERS`` before the parser builds them).
``check_json_text(text, where)`` raises a ``ValueError`` naming ``where`` and the limit, for the
JSON texts in string fields; the server runs ``deeper_than`` on every JSON request body
(``cedlm.server.body_guard``), naming the top-level field the deep value sits in.
"""
from __future__ import annotations

import json
import re
from typing import NamedTuple

import numpy as np

from cedlm.server.protocol.params import MAX_DEPTH

_CHUNK = 1 << 20
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
# the key just before a top-level member's value: `"key" :` at the end of a short window
_KEY = re.compile(rb'"((?:[^"\\]|\\.){0,256})"\s*:\s*$')
_SURROGATE = re.compile("[\ud800-\udfff]")


class TooDeep(NamedTuple):
    offset: int               # byte offset of the first bracket past the limit
    key: str | None           # the top-level member it sits in (a root object's key), if known


def _brackets(data: bytes):
    """(chunk start, offsets of the brackets outside strings in that chunk, their steps: +1 open,
    -1 close) for each megabyte of `data` in turn."""
    buf = np.frombuffer(data, dtype=np.uint8)
    parity, bs_run = 0, 0
    for start in range(0, len(buf), _CHUNK):
        a = buf[start:start + _CHUNK]
        n = len(a)
        quotes = np.flatnonzero(a == _QUOTE)
        bs = a == _BACKSLASH
        if bs.any():
            idx = np.arange(n)
            last_plain = np.maximum.accumulate(np.where(bs, -1, idx))     # last non-backslash <= i
            if quotes.size:
                before = quotes - 1
                lp = np.where(before >= 0, last_plain[np.maximum(before, 0)], -1)
                run = before - lp                                         # backslashes just before
                run = np.where(lp < 0, run + bs_run, run)                 # run reaching the chunk start
                quotes = quotes[run % 2 == 0]
            tail = n - 1 - int(last_plain[-1])
            bs_run = tail + bs_run if tail == n else tail
        else:
            if bs_run % 2 and quotes.size and quotes[0] == 0:
                quotes = quotes[1:]                                       # escaped across the chunk edge
            bs_run = 0
        steps = _STEP[a]                                                  # +1 open, -1 close, 0 other
        br = np.flatnonzero(steps)
        if br.size and quotes.size:
            q = np.zeros(n, dtype=np.uint8)
            q[quotes] = 1
            inside = np.bitwise_xor.accumulate(q)                         # 1 within a string
            br = br[inside[br] == parity]
        elif br.size and parity:
            br = br[:0]                                                   # the whole chunk is in a string
        yield start, br, steps[br]
        parity = (parity + quotes.size) & 1


def deeper_than(data: bytes, limit: int = MAX_DEPTH) -> TooDeep | None:
    """Where `data` (JSON text) first nests deeper than `limit` arrays / objects, or None.

    Brackets inside strings are skipped (a quote preceded by an odd run of backslashes is
    escaped). Malformed text is measured as it is; the JSON parser reports what is wrong with it."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return None
    depth, last_top = 0, -1
    for start, br, step in _brackets(data):
        if br.size:
            d = depth + np.cumsum(step, dtype=np.int64)
            over = np.flatnonzero(d > limit)
            end = int(over[0]) if over.size else len(d)
            tops = np.flatnonzero((d[:end] == 2) & (step[:end] == 1))      # a top-level member's value opens
            if tops.size:
                last_top = start + int(br[tops[-1]])
            if over.size:
                return TooDeep(start + int(br[end]), _key_before(data, last_top))
            depth = int(d[-1])
    return None


def containers_over(data: bytes, limit: int) -> int | None:
    """The number of arrays and objects in `data` (JSON text; brackets in strings do not count)
    when it is more than `limit`, else None: a body of a few MB can hold hundreds of thousands of
    them, and the parser builds every one (holding the GIL) before any field is checked."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return None
    n = 0
    for _, _, step in _brackets(data):
        n += int(np.count_nonzero(step == 1))
    return n if n > limit else None


def _key_before(data: bytes, pos: int) -> str | None:
    if pos < 0:
        return None
    m = _KEY.search(data, max(0, pos - 600), pos)
    if m is None:
        return None
    try:
        key = json.loads(b'"' + m.group(1) + b'"')
    except ValueError:
        return None
    return _SURROGATE.sub(lambda c: f"\\u{ord(c.group()):04x}", key)   # a message must encode


def check_json_text(text: str, where: str, limit: int = MAX_DEPTH) -> None:
    """Raise ValueError naming `where` when the JSON text nests deeper than `limit` levels."""
    if deeper_than(text.encode("utf-8", "surrogatepass"), limit) is not None:
        raise ValueError(f"{where}: nested deeper than {limit} levels")

