"""Retrieval items inserted into real corpus text: passkey and key-value recall.

Every item is a *record* placed somewhere in a stretch of corpus tokens and a *query* later on,
whose answer (a random number) can only come from the record:

    passkey   record " The pass key is 73914. Remember it. 73914 is the pass key. "
              query  " What is the pass key? The pass key is"  answer " 73914"
    kv        records " The value of key 4821 is 93716. " (several, distinct keys)
              query  " What is the value of key 4821? The value of key 4821 is"  answer " 93716"

Work is at the token level: the corpus is the prepared token cache (`cedlm.data.tokens`), and
records and queries are tokenised on their own and spliced in between corpus tokens.

- `eval_sample` builds one evaluation sequence of exactly `length` tokens ending with the query
  and its answer (the answer tokens are the last ones; teacher-forced argmax on all of them =
  greedy generation of the answer). The record sits at a given depth, so retrieval is at least
  `length * (1 - depth)` tokens back, beyond any window shorter than that.
- `training_sequence` builds one training sequence of `seq_len + 1` tokens with several
  records and, after each at a distance of at least `min_gap` tokens, its query and answer; the
  answer positions are returned as a mask (for an answer loss and answer accuracy).
- `repeat_sequence` builds one training sequence of corpus text in which a stretch recurs
  verbatim further on: every token of the copy after its first can be predicted by copying from
  the context (an induction pattern), the skill the retrieval items need, with far more signal
  per sequence than a few answer tokens.
"""
from __future__ import annotations

import numpy as np

KINDS = ("passkey", "kv")


def _number(rng: np.random.Generator, digits: int) -> str:
    return str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))


def _item(rng: np.random.Generator, kind: str, n_kv: int = 4):
    """-> (record texts [str], query text, answer text); the first record is the queried one."""
    if kind == "passkey":
        v = _number(rng, 5)
        return ([f" The pass key is {v}. Remember it. {v} is the pass key. "],
                " What is the pass key? The pass key is", f" {v}")
    if kind == "kv":
        keys = rng.choice(np.arange(1000, 10000), size=n_kv, replace=False)
        vals = [_number(rng, 5) for _ in keys]
        recs = [f" The value of key {k} is {v}. " for k, v in zip(keys, vals)]
        return recs, f" What is the value of key {keys[0]}? The value of key {keys[0]} is", f" {vals[0]}"
    raise ValueError(f"retrieval kind: {kind!r} is not one of {KINDS}")


def _filler(rng: np.random.Generator, tokens: np.ndarray, n: int) -> np.ndarray:
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    if len(tokens) < n + 1:
        raise ValueError(f"data: {len(tokens)} corpus tokens is too few for {n} filler tokens")
    s = int(rng.integers(0, len(tokens) - n))
    return np.asarray(tokens[s: s + n], dtype=np.int64)


def eval_sample(rng: np.random.Generator, tokens: np.ndarray, tokenizer, length: int, kind: str,
                depth: float) -> tuple[np.ndarray, int]:
    """One sequence of exactly `length` tokens: corpus filler with the record(s) at `depth`
    (0 = start, 1 = just before the query; extra kv records spread at random), then the query
    and the answer. Returns (ids int64 [length], number of answer tokens at the end)."""
    recs, query, answer = _item(rng, kind)
    enc = lambda s: np.asarray(tokenizer.encode(s), dtype=np.int64)   # noqa: E731
    rec_ids = [enc(r) for r in recs]
    q_ids, a_ids = enc(query), enc(answer)
    n_fill = length - sum(len(r) for r in rec_ids) - len(q_ids) - len(a_ids)
    if n_fill < 0:
        raise ValueError(f"length: {length} tokens cannot hold a {kind} item")
    fill = _filler(rng, tokens, n_fill)
    at = [int(round(depth * n_fill))] + sorted(int(x) for x in rng.integers(0, n_fill + 1, len(rec_ids) - 1))
    order = sorted(zip(at, range(len(rec_ids))))
    parts, prev = [], 0
    for pos, i in order:
        parts += [fill[prev:pos], rec_ids[i]]
        prev = pos
    parts += [fill[prev:], q_ids, a_ids]
    ids = np.concatenate(parts)
    assert len(ids) == length
    return ids, len(a_ids)


def training_sequence(rng: np.random.Generator, tokens: np.ndarray, tokenizer, seq_len: int,
                      n_items: int, min_gap: int, kinds: tuple = KINDS) -> tuple[np.ndarray, np.ndarray]:
    """seq_len + 1 tokens of corpus text carrying `n_items` retrieval items, each query at least
    `min_gap` tokens after its record(s); each item's kind is drawn from `kinds`. At most one item
    is a passkey (every passkey query would otherwise match every passkey record); the rest are
    key-value items. Returns (ids int64 [seq_len + 1], answer mask bool
    [seq_len + 1], True on answer tokens)."""
    kinds = tuple(kinds)
    if not kinds or any(k not in KINDS for k in kinds):
        raise ValueError(f"kinds: must be a non-empty subset of {KINDS}, got {kinds!r}")
    if kinds == ("passkey",) and n_items > 1:
        raise ValueError(f"n_items: {n_items} passkey items would make every query ambiguous (at most 1)")
    enc = lambda s: np.asarray(tokenizer.encode(s), dtype=np.int64)   # noqa: E731
    L = seq_len + 1
    events: list[tuple[int, np.ndarray, bool]] = []     # (position in filler, ids, is answer part)
    used = 0
    items = []
    passkey_used = False        # one passkey per sequence: a second record would make the answer ambiguous
    for _ in range(n_items):
        kind = "kv" if passkey_used else kinds[int(rng.integers(0, len(kinds)))]
        passkey_used |= kind == "passkey"
        recs, query, answer = _item(rng, kind, n_kv=2)
        r = [enc(x) for x in recs]
        q, a = enc(query), enc(answer)
        items.append((r, q, a))
        used += sum(len(x) for x in r) + len(q) + len(a)
    n_fill = L - used
    if n_fill <= min_gap:
        raise ValueError(f"seq_len: {seq_len} is too short for {n_items} items {min_gap} tokens apart")
    for r, q, a in items:
        rpos = int(rng.integers(0, n_fill - min_gap))
        qpos = int(rng.integers(rpos + min_gap, n_fill + 1))
        for x in r:
            events.append((rpos, x, False))
        events.append((qpos, np.concatenate((q, a)), len(a)))
    fill = _filler(rng, tokens, n_fill)
    ids, mask, prev = [], [], 0
    for pos, x, n_ans in sorted(events, key=lambda e: e[0]):
        ids += [fill[prev:pos], x]
        m = np.zeros(len(x), dtype=bool)
        if n_ans:
            m[len(x) - n_ans:] = True
        mask += [np.zeros(pos - prev, dtype=bool), m]
        prev = pos
    ids.append(fill[prev:])
    mask.append(np.zeros(n_fill - prev, dtype=bool))
    out, m = np.concatenate(ids), np.concatenate(mask)
    assert len(out) == L
    return out, m


def repeat_sequence(rng: np.random.Generator, tokens: np.ndarray, seq_len: int, min_span: int = 8,
                    max_span: int = 64, kind: str = "text") -> tuple[np.ndarray, np.ndarray]:
    """seq_len + 1 tokens of corpus text in which a stretch of min_span..max_span tokens (at most a
    third of the sequence) recurs verbatim later, at any distance. kind "random": the tokens are
    drawn independently from the corpus (no text to predict them by, only the copy). Returns (ids
    int64 [seq_len + 1], copy mask bool [seq_len + 1], True on the repeated tokens)."""
    if kind not in ("text", "random"):
        raise ValueError(f"repeat kind: {kind!r} is not 'text' or 'random'")
    L = seq_len + 1
    hi = min(max_span, L // 3)
    if hi < max(1, min_span):
        raise ValueError(f"seq_len: {seq_len} is too short for a repeated stretch of {min_span} tokens")
    span = int(rng.integers(max(1, min_span), hi + 1))
    fill = (_filler(rng, tokens, L - span) if kind == "text" else
            np.asarray(tokens[rng.integers(0, len(tokens), L - span)], dtype=np.int64))
    src = int(rng.integers(0, L - 2 * span + 1))           # the stretch fill[src: src + span] ...
    at = int(rng.integers(src + span, L - span + 1))        # ... recurs at `at`, after its end
    out = np.concatenate((fill[:at], fill[src: src + span], fill[at:]))
    mask = np.zeros(L, dtype=bool)
    mask[at: at + span] = True
    assert len(out) == L
    return out, mask
