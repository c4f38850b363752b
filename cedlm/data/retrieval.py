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

The `varied` kind draws what is retrieved (a number, a word, a name, a code), what it is called
(a pass key, a secret word, a key-value record about a person or a place), how the record and the
question are worded and how many distractor records surround it, from template and vocabulary
lists split in two: `split="train"` draws only from the training halves, `split="heldout"` only
from the held-out halves (`VARIED_SPLITS`), so a model trained on the first is measured on
wordings, words and names it never saw (the filler is the caller's: the validation tokens for a
measurement). `varied_eval_sample` builds a held-out sequence that ends with the answer, as
`eval_sample`.
"""
from __future__ import annotations

import numpy as np

KINDS = ("passkey", "kv")
# every kind `training_sequence` builds; the default draws (KINDS) leave `varied` out
ALL_KINDS = KINDS + ("varied",)
SPLITS = ("train", "heldout")

# Varied items. Each list is split by position: even entries are the training half, odd entries
# the held-out half (`_half`). {k}: what the value is called; {v}: the value.
_V_WORDS = ["apple", "river", "candle", "garden", "silver", "window", "thunder", "meadow", "saffron",
            "lantern", "marble", "forest", "pepper", "violet", "castle", "feather", "orange", "mirror",
            "falcon", "blanket", "copper", "island", "basket", "winter", "saddle", "crystal", "ladder",
            "pillow", "anchor", "velvet", "tiger", "cherry", "rocket", "button", "walnut", "dragon",
            "pebble", "summer", "hammer", "ribbon"]
_V_FIRST = ["Anna", "Thomas", "Clara", "Henry", "Lucy", "Walter", "Edith", "George", "Martha", "Samuel",
            "Alice", "Robert", "Jane", "Arthur", "Helen", "Frederick", "Rose", "Charles", "Agnes", "Philip",
            "Grace", "Edward", "Mary", "Francis", "Julia", "Peter", "Susan", "Richard", "Emily", "Oliver"]
_V_LAST = ["Baker", "Fletcher", "Morgan", "Hale", "Turner", "Price", "Carter", "Webb", "Lowell", "Grant",
           "Foster", "Pryce", "Dalton", "Shaw", "Mercer", "Hayes", "Norris", "Blake", "Warren", "Cole"]
_V_PLACES = ["the library", "the mill", "the chapel", "the harbour office", "the north gate", "the bank",
             "the old tower", "the school", "the inn", "the station", "the museum", "the farm",
             "the bakery", "the post office", "the lighthouse", "the theatre"]
_V_ATTRS = ["room number", "ticket number", "favourite colour word", "locker code", "house number",
            "secret word", "account number", "badge number", "lucky number", "code name"]
# (what the value is called, the value's kind); {p}: a place, {n}: a name, {a}: an attribute
_V_KEYS = [("pass key", "number"), ("secret word", "word"), ("code of {p}", "code"),
           ("password of {p}", "word"), ("{a} of {n}", "any"), ("magic number", "number"),
           ("name of the visitor", "name"), ("key to {p}", "code"), ("number of {p}", "number"),
           ("name of the keeper of {p}", "name"), ("hidden word", "word"), ("combination of the safe", "number"),
           ("{a} of {n}", "any"), ("special number", "number"), ("watchword", "word"),
           ("guest of {p}", "name")]
_V_RECORDS = [" The {k} is {v}. Remember it. {v} is the {k}. ",
              " Remember this: the {k} is {v}. ",
              " (Note: the {k} is {v}.) ",
              " Keep in mind that the {k} is {v}. ",
              " Important: the {k} is {v}. Do not forget it. ",
              " It was agreed that the {k} would be {v}. ",
              " The {k}? It is {v}. ",
              " For the record, the {k} is {v}. ",
              " Write this down: the {k} is {v}. ",
              " Everyone was told that the {k} is {v}. "]
_V_QUERIES = [" What is the {k}? The {k} is",
              " Question: what is the {k}? Answer:",
              " Now recall the {k}. The {k} is",
              " Do you remember the {k}? It is",
              " Tell me the {k}. The {k} is",
              " What was the {k}? It was",
              " Which was the {k}? The answer is",
              " Earlier we learnt the {k}. It is",
              " The {k} mentioned above is",
              " Can you repeat the {k}? Yes: the {k} is"]
VARIED_SPLITS = {"words": _V_WORDS, "first names": _V_FIRST, "last names": _V_LAST, "places": _V_PLACES,
                 "attributes": _V_ATTRS, "keys": _V_KEYS, "record templates": _V_RECORDS,
                 "query templates": _V_QUERIES}


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


def _half(items: list, split: str) -> list:
    """The training half (even positions) or the held-out half (odd positions) of a list."""
    if split not in SPLITS:
        raise ValueError(f"split: {split!r} is not one of {SPLITS}")
    return items[0::2] if split == "train" else items[1::2]


def _pick(rng: np.random.Generator, items: list):
    return items[int(rng.integers(0, len(items)))]


def _varied_value(rng: np.random.Generator, kind: str, split: str) -> str:
    if kind == "any":
        kind = _pick(rng, ["number", "word", "name", "code"])
    if kind == "number":
        return _number(rng, int(rng.integers(3, 8)))
    if kind == "word":
        return _pick(rng, _half(_V_WORDS, split))
    if kind == "name":
        return f"{_pick(rng, _half(_V_FIRST, split))} {_pick(rng, _half(_V_LAST, split))}"
    letters = "ABCDEFGHJKLMNPRSTUVWXYZ"
    return (letters[int(rng.integers(0, len(letters)))] + letters[int(rng.integers(0, len(letters)))]
            + "-" + _number(rng, int(rng.integers(2, 5))))


def varied_item(rng: np.random.Generator, split: str = "train", max_distractors: int = 2):
    """One `varied` item -> (record texts [str], query text, answer text); the first record is the
    queried one, the others (0..max_distractors) are records of the same form about other keys
    with other values. Everything is drawn from the `split` half of the lists."""
    keys = _half(_V_KEYS, split)
    recs_t, qs_t = _half(_V_RECORDS, split), _half(_V_QUERIES, split)
    key_t, vkind = _pick(rng, keys)
    if vkind == "any":                      # one kind of value per item, distractors included
        vkind = _pick(rng, ["number", "word", "name", "code"])
    n_dis = int(rng.integers(0, max_distractors + 1))
    names, places, attrs = set(), set(), _half(_V_ATTRS, split)
    used_keys, recs, answer = [], [], None
    attr = _pick(rng, attrs)
    for i in range(1 + n_dis * 8):          # tries: distractors need distinct keys
        if len(recs) == 1 + n_dis:
            break
        n = f"{_pick(rng, _half(_V_FIRST, split))} {_pick(rng, _half(_V_LAST, split))}"
        p = _pick(rng, _half(_V_PLACES, split))
        k = key_t.format(p=p, n=n, a=attr)
        if k in used_keys or (i and "{" not in key_t):
            continue                      # a key without a slot has no distinct distractor
        names.add(n), places.add(p)
        v = _varied_value(rng, vkind, split)
        while answer is not None and v == answer:
            v = _varied_value(rng, vkind, split)
        used_keys.append(k)
        recs.append(_pick(rng, recs_t).format(k=k, v=v))
        answer = answer if answer is not None else v
    query = _pick(rng, qs_t).format(k=used_keys[0])
    return recs, query, f" {answer}"


def _filler(rng: np.random.Generator, tokens: np.ndarray, n: int) -> np.ndarray:
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    if len(tokens) < n + 1:
        raise ValueError(f"data: {len(tokens)} corpus tokens is too few for {n} filler tokens")
    s = int(rng.integers(0, len(tokens) - n))
    return np.asarray(tokens[s: s + n], dtype=np.int64)


def varied_eval_sample(rng: np.random.Generator, tokens: np.ndarray, tokenizer, length: int,
                       depth: float, split: str = "heldout") -> tuple[np.ndarray, int]:
    """`eval_sample` for a `varied` item of `split` (by default the held-out half): exactly
    `length` tokens ending with the query and its answer; the queried record at `depth`, its
    distractors at random places. Returns (ids int64 [length], number of answer tokens)."""
    return eval_sample(rng, tokens, tokenizer, length, "varied", depth, split)


def eval_sample(rng: np.random.Generator, tokens: np.ndarray, tokenizer, length: int, kind: str,
                depth: float, split: str = "heldout") -> tuple[np.ndarray, int]:
    """One sequence of exactly `length` tokens: corpus filler with the record(s) at `depth`
    (0 = start, 1 = just before the query; extra kv records spread at random), then the query
    and the answer (`split`: the half of the `varied` lists drawn from; other kinds ignore it).
    Returns (ids int64 [length], number of answer tokens at the end)."""
    recs, query, answer = varied_item(rng, split) if kind == "varied" else _item(rng, kind)
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
                      n_items: int, min_gap: int, kinds: tuple = KINDS,
                      split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """seq_len + 1 tokens of corpus text carrying `n_items` retrieval items, each query at least
    `min_gap` tokens after its record(s); each item's kind is drawn from `kinds`. At most one item
    is a passkey (every passkey query would otherwise match every passkey record); the rest are
    key-value items. `varied` items draw from the `split` half of their lists. Returns (ids int64
    [seq_len + 1], answer mask bool
    [seq_len + 1], True on answer tokens)."""
    kinds = tuple(kinds)
    if not kinds or any(k not in ALL_KINDS for k in kinds):
        raise ValueError(f"kinds: must be a non-empty subset of {ALL_KINDS}, got {kinds!r}")
    if all(k in ("passkey", "varied") for k in kinds) and n_items > 1:
        raise ValueError(f"n_items: {n_items} passkey items would make every query ambiguous (at most 1)")
    enc = lambda s: np.asarray(tokenizer.encode(s), dtype=np.int64)   # noqa: E731
    L = seq_len + 1
    events: list[tuple[int, np.ndarray, bool]] = []     # (position in filler, ids, is answer part)
    used = 0
    items = []
    passkey_used = False        # one passkey per sequence: a second record would make the answer ambiguous
    for _ in range(n_items):
        kind = "kv" if passkey_used else kinds[int(rng.integers(0, len(kinds)))]
        passkey_used |= kind in ("passkey", "varied")
        recs, query, answer = varied_item(rng, split) if kind == "varied" else _item(rng, kind, n_kv=2)
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
