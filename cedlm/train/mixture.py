"""The pretraining mixture: one batch source that mixes, per training sequence, corpus text, chat
conversations in the V4.1 encoding and retrieval items, with a sequence-length curriculum.

It reuses the builders that exist and adds only the mixing:

- corpus rows: plain windows of the prepared token cache (`cedlm.data.tokens`), loss on every token,
  as `cedlm.train.data.BatchSampler` draws them;
- chat rows: conversations of `cedlm.train.chat_data.build_examples` (ids and assistant-only loss
  masks of `encode_example`, the V4.1 encoding the server uses), *packed*: whole conversations one
  after the other, each starting with its BOS, the last one cut at the row's end. Packing rather
  than padding because conversations are a few dozen tokens and the curriculum reaches thousands: a
  padded 4,096-token row would be > 95 % pad. Loss only on assistant tokens, as `ChatBatches`;
- retrieval rows: `cedlm.data.retrieval.training_sequence` with ONE item (a passkey, or a key-value
  query with one distractor record: one answerable record per sequence), the query at least
  `min_gap` tokens after its record, `min_gap` = `min_gap_windows` x the model's sliding window, so
  the answer is beyond any window layer's reach;
- repeat rows: `cedlm.data.retrieval.repeat_sequence` (a stretch of text recurs verbatim: the
  copying skill retrieval needs, with more signal per sequence).

A batch is `MixtureBatch`: ids int64 [B, L + 1], a loss mask bool [B, L + 1] in the convention of
`cedlm.train.chat.masked_loss` (mask[:, t] = token t is a target, predicted from tokens < t; column 0
is never one), an answer mask (the retrieval answers, the repeated tokens: for answer accuracy), the
kind of each row and the realised mix. It is a pure function of (config, step): every row draws from
its own generator seeded by (seed, step, row), so a resumed run draws exactly the batches the
uninterrupted run would have (no sampler state to save), and a DDP rank builds only its own rows of
the global batch.

Curriculum: `curriculum` is a list of (step, seq_len) stages, each held until the next starts. At a
stage too short for a retrieval item at `min_gap` (see `MixtureBatches.stage_weights`) the retrieval
share goes to corpus rows; a configuration in which no stage can hold one is an error.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from cedlm.data.retrieval import ALL_KINDS as RETRIEVAL_KINDS_ALL
from cedlm.data.retrieval import KINDS as RETRIEVAL_KINDS
from cedlm.data.retrieval import repeat_sequence, training_sequence

KINDS = ("corpus", "chat", "retrieval", "repeat")
MIN_SEQ_LEN = 64
RETRIEVAL_LOSS = ("all", "answer")
VARIED_ROOM = 200          # tokens a `varied` item may take besides its gap


def _default_weights() -> dict[str, float]:
    return {"corpus": 0.6, "chat": 0.2, "retrieval": 0.15, "repeat": 0.05}


@dataclass(frozen=True)
class MixtureConfig:
    """What the mixture draws.

    weights: kind -> share of the rows (normalised; kinds of `KINDS`, missing ones are 0).
    curriculum: (step, seq_len) stages; the first starts at step 0, steps and lengths increase,
        lengths >= 64; each stage holds until the next, the last one for the rest of the run.
    min_gap_windows: a retrieval query comes at least this many sliding windows after its record.
    retrieval_loss: "all" (retrieval rows train on every token, the filler is corpus text) or
        "answer" (only on the answer tokens).
    answer_weight: the loss weight of an answer token (retrieval answers, repeated tokens) against
        1 for every other target; the loss is the weighted mean. Retrieval's signal is a handful of
        tokens per row: > 1 strengthens it without more rows (the passkey experiment used 5).
    retrieval_kinds: the kinds of retrieval item drawn, with equal odds ("passkey": one record, its
        query and a 5-digit answer; "kv": key-value records with a distractor, lookup by key;
        "varied": numbers, words, names or codes under varied keys and wordings with 0-2
        distractor records, from the training half of `cedlm.data.retrieval`'s lists; the
        held-out check of `cedlm.train.joint.retrieval_eval` draws from the held-out half).
    chat_tasks: the chat tasks' weights (`cedlm.train.chat_data.TASKS` -> weight) of the
        conversations packed into chat rows; None: `chat_data.DEFAULT_WEIGHTS`.
    seed: with the step, it fixes every batch.
    """
    weights: dict = field(default_factory=_default_weights)
    curriculum: tuple = ((0, 256),)
    min_gap_windows: float = 2.0
    retrieval_loss: str = "all"
    answer_weight: float = 1.0
    retrieval_kinds: tuple = RETRIEVAL_KINDS
    chat_tasks: dict | None = None
    seed: int = 0

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field of the first bad value."""
        if not isinstance(self.weights, dict) or not self.weights:
            raise ValueError(f"weights: must be a non-empty dict of {KINDS}, got {self.weights!r}")
        for k, w in self.weights.items():
            if k not in KINDS:
                raise ValueError(f"weights: unknown kind {k!r}; known: {', '.join(KINDS)}")
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
                raise ValueError(f"weights.{k}: must be a finite number >= 0, got {w!r}")
        if sum(self.weights.values()) <= 0:
            raise ValueError("weights: all weights are 0")
        stages = list(self.curriculum) if isinstance(self.curriculum, (list, tuple)) else None
        if not stages:
            raise ValueError(f"curriculum: must be a non-empty list of (step, seq_len), got {self.curriculum!r}")
        for i, st in enumerate(stages):
            if (not isinstance(st, (list, tuple)) or len(st) != 2
                    or not all(isinstance(v, int) and not isinstance(v, bool) for v in st)):
                raise ValueError(f"curriculum[{i}]: must be a pair of ints (step, seq_len), got {st!r}")
            step, length = st
            if length < MIN_SEQ_LEN:
                raise ValueError(f"curriculum[{i}]: seq_len {length} is below {MIN_SEQ_LEN}")
            if i == 0 and step != 0:
                raise ValueError(f"curriculum[0]: the first stage must start at step 0, got {step}")
            if i and step <= stages[i - 1][0]:
                raise ValueError(f"curriculum[{i}]: step {step} does not come after step {stages[i - 1][0]}")
            if i and length <= stages[i - 1][1]:
                raise ValueError(f"curriculum[{i}]: seq_len {length} is not longer than {stages[i - 1][1]}")
        m = self.min_gap_windows
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) or m <= 0:
            raise ValueError(f"min_gap_windows: must be a number > 0, got {m!r}")
        if self.retrieval_loss not in RETRIEVAL_LOSS:
            raise ValueError(f"retrieval_loss: {self.retrieval_loss!r} is not one of {RETRIEVAL_LOSS}")
        w = self.answer_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise ValueError(f"answer_weight: must be a finite number > 0, got {w!r}")
        rk = self.retrieval_kinds
        if (isinstance(rk, str) or not isinstance(rk, (list, tuple)) or not rk
                or any(k not in RETRIEVAL_KINDS_ALL for k in rk) or len(set(rk)) != len(rk)):
            raise ValueError(f"retrieval_kinds: must be a non-empty list of distinct kinds of "
                             f"{RETRIEVAL_KINDS_ALL}, got {rk!r}")
        ct = self.chat_tasks
        if ct is not None:
            from cedlm.train.chat_data import TASKS as CHAT_TASKS
            if not isinstance(ct, dict) or not ct:
                raise ValueError(f"chat_tasks: must be a non-empty dict of {CHAT_TASKS}, got {ct!r}")
            for k, w in ct.items():
                if k not in CHAT_TASKS:
                    raise ValueError(f"chat_tasks: unknown task {k!r}; known: {', '.join(CHAT_TASKS)}")
                if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
                    raise ValueError(f"chat_tasks.{k}: must be a finite number >= 0, got {w!r}")
            if sum(ct.values()) <= 0:
                raise ValueError("chat_tasks: all weights are 0")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed: must be an int >= 0, got {self.seed!r}")

    def weight(self, kind: str) -> float:
        return float(self.weights.get(kind, 0.0))

    @property
    def max_seq_len(self) -> int:
        return self.curriculum[-1][1]

    def to_dict(self) -> dict:
        """JSON-ready (training_args.json); `MixtureConfig(**d)` reads it back."""
        d = asdict(self)
        d["curriculum"] = [list(s) for s in self.curriculum]
        d["retrieval_kinds"] = list(self.retrieval_kinds)
        if d["chat_tasks"] is None:
            del d["chat_tasks"]            # the files written before the field read the same
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "MixtureConfig":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"mixture: unknown field(s) {sorted(unknown)}")
        d = dict(d)
        if "curriculum" in d and isinstance(d["curriculum"], (list, tuple)):
            d["curriculum"] = tuple(tuple(s) if isinstance(s, list) else s for s in d["curriculum"])
        if isinstance(d.get("retrieval_kinds"), list):
            d["retrieval_kinds"] = tuple(d["retrieval_kinds"])
        return cls(**d)


def curriculum_seq_len(cfg: MixtureConfig, step: int) -> int:
    """The sequence length at `step` (0-based): the last stage that started at or before it."""
    if step < 0:
        raise ValueError(f"step: must be >= 0, got {step}")
    length = cfg.curriculum[0][1]
    for start, n in cfg.curriculum:
        if start <= step:
            length = n
    return length


@dataclass
class MixtureBatch:
    """One batch (this rank's rows), on the host.

    ids: int64 [B, L + 1]; loss_mask: bool [B, L + 1], True where the token is a target (column 0
    never); answer_mask: bool [B, L + 1], True on retrieval answers and repeated tokens; kinds: the
    kind of each row."""
    step: int
    seq_len: int
    ids: torch.Tensor
    loss_mask: torch.Tensor
    answer_mask: torch.Tensor
    kinds: list

    @property
    def mix(self) -> dict[str, int]:
        """Rows of each kind in this batch (every kind, 0 included)."""
        c = Counter(self.kinds)
        return {k: c.get(k, 0) for k in KINDS}

    def inputs_targets(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x [B, L], y [B, L], target mask of y [B, L]): what a masked loss reads."""
        return self.ids[:, :-1], self.ids[:, 1:], self.loss_mask[:, 1:]


class MixtureBatches:
    """The batch source: `batch(step, batch_size)` -> `MixtureBatch` (see the module docstring).

    tokens: the corpus token ids (the prepared token cache, or any int array); tokenizer: the
    model's; window: the model's sliding window (`cfg.sliding_window`); chat_examples: the
    conversations to pack (objects with `.ids` and `.mask`, e.g. `build_examples`' ChatExample)."""

    def __init__(self, cfg: MixtureConfig, tokens: np.ndarray, tokenizer, window: int,
                 chat_examples=()):
        cfg.validate()
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window: must be the model's sliding window (an int >= 1), got {window!r}")
        self.cfg, self.tokens, self.tok, self.window = cfg, tokens, tokenizer, window
        self.retrieval_split = "train"      # the half of the `varied` lists drawn (held-out checks: "heldout")
        self.min_gap = int(math.ceil(cfg.min_gap_windows * window))
        need = cfg.max_seq_len + 2
        if len(tokens) < need:
            raise ValueError(f"data: {len(tokens)} corpus tokens is too few for seq_len {cfg.max_seq_len}")
        self.chat = [(np.asarray(e.ids, dtype=np.int64), np.asarray(e.mask, dtype=bool)) for e in chat_examples]
        if cfg.weight("chat") > 0:
            if not self.chat:
                raise ValueError("chat_examples: weights.chat > 0 but no conversations were given")
            bad = next((i for i, (ids, m) in enumerate(self.chat) if len(ids) != len(m) or not len(ids)), None)
            if bad is not None:
                raise ValueError(f"chat_examples[{bad}]: ids and mask must be non-empty and of one length")
        # room for one item besides the gap: twice a key-value item with its distractor (the longest)
        sample = (" The value of key 4821 is 93716. " * 2
                  + " What is the value of key 4821? The value of key 4821 is 93716")
        self.retrieval_room = 2 * len(tokenizer.encode(sample))
        if "varied" in cfg.retrieval_kinds:     # up to 3 records of the longest wordings (~170 tokens)
            self.retrieval_room = max(self.retrieval_room, VARIED_ROOM)
        if cfg.weight("retrieval") > 0 and not self.retrieval_fits(cfg.max_seq_len):
            raise ValueError(f"min_gap_windows: a gap of {self.min_gap} tokens ({cfg.min_gap_windows} x window "
                             f"{window}) leaves no curriculum stage room for a retrieval item "
                             f"(needs seq_len >= {self.min_gap + self.retrieval_room})")

    # ------------------------------------------------------------------ the plan
    def retrieval_fits(self, seq_len: int) -> bool:
        """Whether a row of `seq_len` holds a retrieval item with its query `min_gap` tokens on."""
        return seq_len + 1 >= self.min_gap + self.retrieval_room

    def stage_weights(self, seq_len: int) -> dict[str, float]:
        """The normalised row shares at a length: retrieval's goes to corpus where it does not fit."""
        w = {k: self.cfg.weight(k) for k in KINDS}
        if not self.retrieval_fits(seq_len):
            w["corpus"] += w["retrieval"]
            w["retrieval"] = 0.0
        total = sum(w.values())
        return {k: v / total for k, v in w.items()}

    def plan(self) -> list[dict]:
        """Per curriculum stage: its start step, seq_len and row shares (for the run's log)."""
        return [{"step": s, "seq_len": n, "weights": self.stage_weights(n)} for s, n in self.cfg.curriculum]

    def rng_for(self, step: int, row: int | None = None) -> np.random.Generator:
        """The generator of the row kinds at `step` (row None) or of one row, seeded by
        (seed, step[, row]): the same draws in every run and on every rank."""
        key = (step,) if row is None else (step, row)
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence(self.cfg.seed, spawn_key=key)))

    def kinds_for(self, step: int, batch_size: int) -> list[str]:
        """The kind of every row of the global batch at `step`: each kind gets the floor or the
        ceiling of its expected count (systematic sampling, the right mean), in a random order."""
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        rng = self.rng_for(step)
        w = self.stage_weights(curriculum_seq_len(self.cfg, step))
        u = float(rng.random())
        kinds, cum = [], 0.0
        for k in KINDS:
            lo = math.floor(cum * batch_size + u)
            cum += w[k]
            hi = math.floor(cum * batch_size + u)
            kinds += [k] * (hi - lo)
        kinds = (kinds + [KINDS[0]] * batch_size)[:batch_size]      # float rounding at the very end
        return [kinds[i] for i in rng.permutation(batch_size)]

    # ------------------------------------------------------------------ rows
    def corpus_row(self, rng, L: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        s = int(rng.integers(0, len(self.tokens) - L + 1))
        ids = np.asarray(self.tokens[s: s + L], dtype=np.int64)
        return ids, np.ones(L, dtype=bool), np.zeros(L, dtype=bool)

    def chat_row(self, rng, L: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Whole conversations packed up to L tokens, the last one cut at the end."""
        ids, mask, n = [], [], 0
        while n < L:
            e_ids, e_mask = self.chat[int(rng.integers(0, len(self.chat)))]
            take = min(len(e_ids), L - n)
            ids.append(e_ids[:take])
            mask.append(e_mask[:take])
            n += take
        return np.concatenate(ids), np.concatenate(mask), np.zeros(L, dtype=bool)

    def retrieval_row(self, rng, L: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ids, ans = training_sequence(rng, self.tokens, self.tok, L - 1, 1, self.min_gap,
                                     self.cfg.retrieval_kinds, self.retrieval_split)
        loss = ans.copy() if self.cfg.retrieval_loss == "answer" else np.ones(L, dtype=bool)
        return ids, loss, ans

    def repeat_row(self, rng, L: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ids, copy = repeat_sequence(rng, self.tokens, L - 1)
        return ids, np.ones(L, dtype=bool), copy

    def row(self, step: int, index: int, kind: str, seq_len: int):
        """(ids, loss mask, answer mask) of row `index` of the batch at `step`, each [seq_len + 1]."""
        builder = {"corpus": self.corpus_row, "chat": self.chat_row,
                   "retrieval": self.retrieval_row, "repeat": self.repeat_row}[kind]
        ids, loss, ans = builder(self.rng_for(step, index), seq_len + 1)
        loss = loss.copy()
        loss[0] = False                  # the first token is never a target
        return ids, loss, ans

    # ------------------------------------------------------------------ batches
    def batch(self, step: int, batch_size: int, rank: int = 0, world_size: int = 1) -> MixtureBatch:
        """This rank's rows of the global batch of `batch_size` rows at `step` (a contiguous slice,
        as `BatchSampler`), all of the curriculum length at that step."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank: {rank} is not a rank of {world_size}")
        if batch_size % world_size:
            raise ValueError(f"batch_size: {batch_size} is not divisible by {world_size} ranks")
        L = curriculum_seq_len(self.cfg, step)
        kinds = self.kinds_for(step, batch_size)
        b = batch_size // world_size
        rows = range(rank * b, (rank + 1) * b)
        built = [self.row(step, i, kinds[i], L) for i in rows]
        stack = lambda j, dt: torch.from_numpy(np.stack([r[j] for r in built]).astype(dt))  # noqa: E731
        return MixtureBatch(step, L, stack(0, np.int64), stack(1, bool), stack(2, bool),
                            [kinds[i] for i in rows])
