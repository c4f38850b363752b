"""The pretraining mixture (`cedlm.train.mixture`): curriculum, config errors, determinism per
(seed, step), the realised mix, and what each kind of row holds (retrieval: one answerable record
beyond the gap, its answer masked in; chat: V4.1-encoded conversations with assistant-only loss).

No corpus download: the corpus is README.md tokenised with the shipped tokenizer, the chat
conversations are built by `build_examples` from README.md and docs/architecture.md.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from cedlm.train import chat_data as D
from cedlm.train.mixture import KINDS, MixtureBatches, MixtureConfig, curriculum_seq_len

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 64                      # the shipped model's sliding window


def _doc(path: Path) -> str:
    """A repository text without the control-token strings it quotes (`<｜User｜>`, the image
    token ...): message content with the image token is refused by the chat encoder."""
    return re.sub(r"<｜[^｜<>]*｜>", "", path.read_text("utf-8"))


@pytest.fixture(scope="module")
def tokens(tok):
    return np.asarray(tok.encode(_doc(ROOT / "README.md")), dtype=np.uint16)


@pytest.fixture(scope="module")
def examples(tok):
    docs = [("austen", _doc(ROOT / "README.md")), ("moby", _doc(ROOT / "docs" / "architecture.md"))]
    return D.build_examples(docs, tok, 40, seed=1, max_len=160, weights={"smalltalk": 0.5, "source": 0.5},
                            multi_turn=0.3, system=0.3, thinking=0.3)


def make(tokens, tok, examples, **kw) -> MixtureBatches:
    cfg = MixtureConfig(**{"curriculum": ((0, 64), (4, 256), (8, 512)), "seed": 3, **kw})
    return MixtureBatches(cfg, tokens, tok, WINDOW, examples)


# ----------------------------------------------------------------------------- config


def test_curriculum_stages():
    cfg = MixtureConfig(curriculum=((0, 64), (10, 128), (20, 4096)))
    assert [curriculum_seq_len(cfg, s) for s in (0, 9, 10, 19, 20, 10_000)] == [64, 64, 128, 128, 4096, 4096]
    assert curriculum_seq_len(MixtureConfig(), 123) == 256
    with pytest.raises(ValueError, match="step"):
        curriculum_seq_len(cfg, -1)


@pytest.mark.parametrize("kw, field", [
    ({"weights": {"poetry": 1.0}}, "weights"),
    ({"weights": {"chat": -1.0}}, "weights.chat"),
    ({"weights": {"chat": float("nan")}}, "weights.chat"),
    ({"weights": {"corpus": 0.0, "chat": 0}}, "weights"),
    ({"curriculum": ()}, "curriculum"),
    ({"curriculum": ((5, 256),)}, r"curriculum\[0\]"),
    ({"curriculum": ((0, 32),)}, r"curriculum\[0\]"),
    ({"curriculum": ((0, 256), (0, 512))}, r"curriculum\[1\]"),
    ({"curriculum": ((0, 256), (10, 256))}, r"curriculum\[1\]"),
    ({"curriculum": ((0, 256), (10, 128))}, r"curriculum\[1\]"),
    ({"curriculum": ((0, 256.0),)}, r"curriculum\[0\]"),
    ({"min_gap_windows": 0}, "min_gap_windows"),
    ({"retrieval_loss": "some"}, "retrieval_loss"),
    ({"answer_weight": 0}, "answer_weight"),
    ({"answer_weight": float("inf")}, "answer_weight"),
    ({"answer_weight": True}, "answer_weight"),
    ({"retrieval_kinds": ()}, "retrieval_kinds"),
    ({"retrieval_kinds": "passkey"}, "retrieval_kinds"),
    ({"retrieval_kinds": ("passkey", "needle")}, "retrieval_kinds"),
    ({"retrieval_kinds": ("kv", "kv")}, "retrieval_kinds"),
    ({"seed": -1}, "seed"),
])
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        MixtureConfig(**kw)


def test_config_round_trip():
    cfg = MixtureConfig(curriculum=((0, 64), (10, 128)), seed=7, weights={"corpus": 1.0, "chat": 0.5})
    assert MixtureConfig.from_dict(cfg.to_dict()) == cfg
    cfg = MixtureConfig(retrieval_kinds=("passkey",))
    assert MixtureConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="mixture"):
        MixtureConfig.from_dict({"sead": 1})


def test_source_errors(tokens, tok, examples):
    cfg = MixtureConfig(curriculum=((0, 256),))
    with pytest.raises(ValueError, match="^chat_examples"):
        MixtureBatches(cfg, tokens, tok, WINDOW, [])
    with pytest.raises(ValueError, match="^window"):
        MixtureBatches(cfg, tokens, tok, 0, examples)
    with pytest.raises(ValueError, match="^data"):
        MixtureBatches(cfg, tokens[:100], tok, WINDOW, examples)
    with pytest.raises(ValueError, match="^min_gap_windows"):     # no stage holds a retrieval item
        MixtureBatches(MixtureConfig(curriculum=((0, 128),)), tokens, tok, WINDOW, examples)
    MixtureBatches(MixtureConfig(curriculum=((0, 128),), weights={"corpus": 1.0}), tokens, tok, WINDOW)
    m = MixtureBatches(cfg, tokens, tok, WINDOW, examples)
    with pytest.raises(ValueError, match="^batch_size"):
        m.batch(0, 3, world_size=2)
    with pytest.raises(ValueError, match="^rank"):
        m.batch(0, 4, rank=2, world_size=2)


# ----------------------------------------------------------------------------- batches


def test_shapes_per_stage(tokens, tok, examples):
    m = make(tokens, tok, examples)
    for step, L in ((0, 64), (3, 64), (4, 256), (8, 512), (50, 512)):
        b = m.batch(step, 6)
        assert b.seq_len == L
        assert b.ids.shape == b.loss_mask.shape == b.answer_mask.shape == (6, L + 1)
        assert b.ids.dtype == torch.int64 and b.loss_mask.dtype == b.answer_mask.dtype == torch.bool
        assert len(b.kinds) == 6 and sum(b.mix.values()) == 6 and set(b.mix) == set(KINDS)
        assert not b.loss_mask[:, 0].any()
        x, y, mask = b.inputs_targets()
        assert x.shape == y.shape == mask.shape == (6, L)
    # at 64 tokens a retrieval item cannot be 128 tokens from its record: its share goes to corpus
    assert m.stage_weights(64)["retrieval"] == 0 and m.stage_weights(256)["retrieval"] == pytest.approx(0.15)
    assert all(k != "retrieval" for s in range(4) for k in m.batch(s, 8).kinds)


def test_deterministic_per_seed_and_step(tokens, tok, examples):
    a, b = make(tokens, tok, examples), make(tokens, tok, examples)
    for s in range(6):                  # `a` draws steps 0..5 in order, `b` (a resumed run) only step 5
        a.batch(s, 8)
    x, y = a.batch(5, 8), b.batch(5, 8)
    assert torch.equal(x.ids, y.ids) and torch.equal(x.loss_mask, y.loss_mask)
    assert torch.equal(x.answer_mask, y.answer_mask) and x.kinds == y.kinds
    assert not torch.equal(a.batch(6, 8).ids, x.ids)
    other = make(tokens, tok, examples, seed=4).batch(5, 8)
    assert not torch.equal(other.ids, x.ids)
    # a DDP rank builds exactly its slice of the global batch
    half = b.batch(5, 8, rank=1, world_size=2)
    assert torch.equal(half.ids, x.ids[4:]) and half.kinds == x.kinds[4:]


def test_mix_proportions(tokens, tok, examples):
    weights = {"corpus": 0.5, "chat": 0.25, "retrieval": 0.15, "repeat": 0.1}
    m = MixtureBatches(MixtureConfig(weights=weights, curriculum=((0, 256),), seed=11), tokens, tok, WINDOW, examples)
    counts = dict.fromkeys(KINDS, 0)
    n_steps, B = 400, 6
    for s in range(n_steps):
        kinds = m.kinds_for(s, B)
        for k in KINDS:                 # every batch gets the floor or ceiling of its expected count
            assert abs(kinds.count(k) - B * weights[k]) < 1
            counts[k] += kinds.count(k)
    for k in KINDS:
        assert abs(counts[k] / (n_steps * B) - weights[k]) < 0.02, (k, counts)
    assert m.batch(0, B).mix == {k: m.kinds_for(0, B).count(k) for k in KINDS}


def _rows(m, kind, steps, B=8):
    for s in steps:
        b = m.batch(s, B)
        for i, k in enumerate(b.kinds):
            if k == kind:
                yield b, i


def test_retrieval_rows(tokens, tok, examples):
    m = make(tokens, tok, examples, weights={"corpus": 0.2, "retrieval": 0.8})
    n = 0
    for b, i in _rows(m, "retrieval", range(4, 14)):
        ids, ans = b.ids[i].tolist(), b.answer_mask[i]
        assert b.loss_mask[i, 1:].all()                       # retrieval_loss "all": the filler is text too
        pos = ans.nonzero().flatten().tolist()
        a0, a1 = pos[0], pos[-1] + 1
        assert pos == list(range(a0, a1))                    # one answer, contiguous
        answer = tok.decode(ids[a0:a1])
        assert re.fullmatch(r" \d{5}", answer)
        text = tok.decode(ids[:a0])
        assert text.count("What is the") == 1                # one query per sequence
        q = re.search(r"What is the (pass key|value of key (\d{4}))\? The (pass key|value of key \d{4}) is$", text)
        assert q, text[-120:]
        if q.group(2) is None:                               # passkey: one record, no other
            assert text.count(f"The pass key is{answer}. Remember it.") == 1
            assert text.count("Remember it.") == 1
        else:                                                # kv: one record for the queried key
            assert text.count(f"The value of key {q.group(2)} is ") == 1
            assert text.count(f"The value of key {q.group(2)} is{answer}.") == 1
        # the record's last mention of the value is at least min_gap tokens before the answer
        val = tok.encode(answer)
        where = [j for j in range(a0 - len(val) + 1) if ids[j: j + len(val)] == val]
        assert where and a0 - (where[-1] + len(val)) >= m.min_gap == 2 * WINDOW
        n += 1
    assert n >= 10
    only = make(tokens, tok, examples, weights={"retrieval": 1.0}, retrieval_loss="answer").batch(4, 2)
    assert torch.equal(only.loss_mask, only.answer_mask)


@pytest.mark.parametrize("kinds, query", [(("passkey",), "What is the pass key?"),
                                          (("kv",), "What is the value of key")])
def test_retrieval_kinds(tokens, tok, examples, kinds, query):
    m = make(tokens, tok, examples, weights={"retrieval": 1.0}, retrieval_kinds=kinds)
    b = m.batch(5, 12)                                   # a 256-token stage
    assert b.kinds == ["retrieval"] * 12
    for i in range(12):
        assert tok.decode(b.ids[i].tolist()).count(query) == 1


def test_chat_rows(tokens, tok, examples):
    m = make(tokens, tok, examples, weights={"corpus": 0.2, "chat": 0.8})
    user, assistant = tok.token_to_id("<｜User｜>"), tok.token_to_id("<｜Assistant｜>")
    pool = [e.ids for e in examples]
    n = 0
    for b, i in _rows(m, "chat", range(0, 12)):
        ids, mask = b.ids[i].tolist(), b.loss_mask[i].tolist()
        text = tok.decode(ids)
        assert text.startswith("<｜begin▁of▁sentence｜>") and "<｜User｜>" in text
        assert any(ids[: len(p)] == p[: len(ids)] for p in pool)    # a whole conversation, as encoded
        # every masked span is an assistant turn: after the generation prompt, ends with EOS
        # (or at the row's end), holds no user or assistant marker
        spans, j = [], 0
        while j < len(mask):
            if mask[j]:
                k = j
                while k < len(mask) and mask[k]:
                    k += 1
                spans.append((j, k))
                j = k
            else:
                j += 1
        assert spans or b.seq_len == 64
        for j, k in spans:
            assert tok.decode(ids[:j]).endswith(("<｜Assistant｜></think>", "<think>"))
            assert ids[k - 1] == tok.eos_id or k == len(ids)
            assert user not in ids[j:k] and assistant not in ids[j:k]
        # and every assistant turn is masked: the token after each "</think>" of a chat-mode
        # generation prompt is a target
        for j in range(1, len(ids) - 1):
            if ids[j - 1] == assistant and tok.decode([ids[j]]) == "</think>":
                assert mask[j + 1]
        assert not any(b.answer_mask[i].tolist())
        n += 1
    assert n >= 10


def test_corpus_and_repeat_rows(tokens, tok, examples):
    m = make(tokens, tok, examples, weights={"corpus": 0.5, "repeat": 0.5})
    seen = set()
    for b, i in _rows(m, "corpus", range(4, 8)):
        row = b.ids[i].numpy()
        starts = [s for s in range(len(tokens) - len(row) + 1) if tokens[s] == row[0]
                  and np.array_equal(tokens[s: s + len(row)], row)]
        assert starts and b.loss_mask[i, 1:].all() and not b.answer_mask[i].any()
        seen.add("corpus")
    for b, i in _rows(m, "repeat", range(4, 8)):
        assert b.loss_mask[i, 1:].all() and 8 <= int(b.answer_mask[i].sum()) <= 64
        seen.add("repeat")
    assert seen == {"corpus", "repeat"}
