"""Synthetic batches shared by train_copy.py and distil_eval.py.

- `far`: blocks of [r, filler, r]; r = L random tokens, so each copy sits L + gap tokens back
  (beyond a 32-token window for gap >= 17). Found by position: the copy is always the same
  distance back.
- `recall`: associative recall (key -> value lookup by content). n pairs `k v` with distinct
  keys, then `gap` filler tokens, then the same keys again in a new order, each followed by its
  value. A value in the query part can only come from finding its key among the records, at a
  distance of gap + 1 .. gap + 4n - 1 tokens: beyond the window when gap >= window. Keys come
  from [lo, mid), values from [mid, hi), mid = (lo + hi) // 2. The filler is random tokens from
  [hi, hi + 64) or, with `text` (a 1-D int tensor of corpus token ids), a stretch of real text.

Each returns (x, y, first, second): inputs, targets (x shifted by one) and two masks over the
targets: `first` = targets that are random (the records' values / the first copy; floor
ln(range)), `second` = targets predictable only by retrieval (the query part's values / the
second copy, except its first token).
"""
from __future__ import annotations

import torch


def far(g: torch.Generator, B: int, L: int, blocks: int, gap: int, lo: int, hi: int,
        skip_first: bool = False):
    """skip_first: leave the second copy's first token (it follows the filler, so it cannot be
    predicted) out of `second`, as distil_eval.py scores it; train_copy.py logs it in."""
    parts, first, second = [], [], []
    k = int(skip_first)
    for _ in range(blocks):
        r = torch.randint(lo, hi, (B, L), generator=g)
        parts += [r, torch.randint(lo, hi, (B, gap), generator=g), r]
        first += [torch.ones(L, dtype=torch.bool), torch.zeros(gap + L, dtype=torch.bool)]
        second += [torch.zeros(L + gap + k, dtype=torch.bool), torch.ones(L - k, dtype=torch.bool)]
    seq = torch.cat(parts, 1)
    f, s = torch.cat(first).expand(B, -1), torch.cat(second).expand(B, -1)
    return seq[:, :-1], seq[:, 1:], f[:, 1:], s[:, 1:]


def recall(g: torch.Generator, B: int, pairs: int, gap: int, lo: int, hi: int,
           text: torch.Tensor | None = None):
    mid = (lo + hi) // 2
    if mid - lo < pairs:
        raise ValueError(f"pairs: {pairs} distinct keys need lo..hi to hold {2 * pairs} tokens")
    keys = torch.stack([torch.randperm(mid - lo, generator=g)[:pairs] for _ in range(B)]) + lo
    vals = torch.randint(mid, hi, (B, pairs), generator=g)
    order = torch.stack([torch.randperm(pairs, generator=g) for _ in range(B)])
    qk, qv = keys.gather(1, order), vals.gather(1, order)
    if text is None:
        fill = torch.randint(hi, hi + 64, (B, gap), generator=g)
    else:
        start = torch.randint(0, len(text) - gap, (B,), generator=g)
        fill = torch.stack([text[int(s): int(s) + gap] for s in start]).long()
    records = torch.stack((keys, vals), 2).flatten(1)             # k1 v1 k2 v2 ...
    queries = torch.stack((qk, qv), 2).flatten(1)
    seq = torch.cat((records, fill, queries), 1)
    is_val = (torch.arange(2 * pairs) % 2 == 1)
    none = torch.zeros(gap, dtype=torch.bool)
    z = torch.zeros(2 * pairs, dtype=torch.bool)
    first = torch.cat((is_val, none, z)).expand(B, -1)
    second = torch.cat((z, none, is_val)).expand(B, -1)
    return seq[:, :-1], seq[:, 1:], first[:, 1:], second[:, 1:]


def passkey(rng, B: int, length: int, min_gap: int, tokens, tokenizer, max_gap: int | None = None):
    """Passkey retrieval in real text (`cedlm.data.retrieval.eval_sample`, kind passkey): `length`
    tokens of corpus filler with one record " The pass key is N. Remember it. N is the pass key. "
    and, at the end, the query " What is the pass key? The pass key is" and the answer " N". A gap
    G drawn in min_gap..max_gap puts the record at depth 1 - G / (length - 30) of the filler; the
    filler is shorter than length - 30 (about 90 tokens at length 128), so about 0.9 G filler tokens
    separate the record from the query (measured at 128: G = 16 / 48 / 80 -> 14 / 43 / 71). rng: a
    numpy Generator; tokens: corpus token ids. `first` = every target that is not an answer token
    (the language-modelling targets), `second` = the answer tokens."""
    import numpy as np
    from cedlm.data.retrieval import eval_sample
    seqs, second = [], torch.zeros(B, length, dtype=torch.bool)
    for b in range(B):
        # eval_sample places the record at depth * its real filler length; length - 30 overestimates it
        n_fill = length - 30
        hi = n_fill if max_gap is None else min(n_fill, max_gap)
        gap = int(rng.integers(min_gap, hi + 1))
        ids, n_ans = eval_sample(rng, tokens, tokenizer, length, "passkey", max(0.0, 1.0 - gap / n_fill))
        seqs.append(torch.from_numpy(np.asarray(ids, dtype=np.int64)))
        second[b, length - n_ans:] = True
    seq = torch.stack(seqs)
    return seq[:, :-1], seq[:, 1:], ~second[:, 1:], second[:, 1:]
