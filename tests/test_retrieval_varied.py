"""Varied retrieval items (`cedlm.data.retrieval`, kind `varied`) and the chat tasks that answer
from the corpus (`cedlm.train.chat_data`: `novel`, `fact`, `names`).

The train / held-out split is pinned: the two halves of every list are disjoint, items of one
split draw nothing from the other's half (values, keys, record and query wordings), the mixture
trains on the training half and its held-out check reads the held-out half.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from cedlm.data import retrieval as R
from cedlm.train import chat_data as D
from cedlm.train.joint import retrieval_eval
from cedlm.train.mixture import MixtureBatches, MixtureConfig

ROOT = Path(__file__).resolve().parents[1]


def _template_re(t: str) -> re.Pattern:
    """A record / query template as a regex matching any filled-in copy of it."""
    parts = re.split(r"(\{k\}|\{v\})", t)
    return re.compile("^" + "".join(".+?" if p in ("{k}", "{v}") else re.escape(p) for p in parts) + "$")


def _items(split: str, n: int = 400, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [R.varied_item(rng, split) for _ in range(n)]


def test_halves_are_disjoint_and_cover_every_list():
    for name, items in R.VARIED_SPLITS.items():
        train, held = R._half(items, "train"), R._half(items, "heldout")
        assert train and held, name
        assert not set(map(str, train)) & set(map(str, held)), name
        assert sorted(map(str, train + held)) == sorted(map(str, items)), name
    with pytest.raises(ValueError, match="split"):
        R._half(R._V_WORDS, "test")


@pytest.mark.parametrize("split, other", [("train", "heldout"), ("heldout", "train")])
def test_items_draw_only_from_their_half(split, other):
    mine_r = [_template_re(t) for t in R._half(R._V_RECORDS, split)]
    other_r = [_template_re(t) for t in R._half(R._V_RECORDS, other)]
    mine_q = [_template_re(t) for t in R._half(R._V_QUERIES, split)]
    other_words = set(R._half(R._V_WORDS, other))
    other_names = set(R._half(R._V_FIRST, other)) | set(R._half(R._V_LAST, other))
    other_places = set(R._half(R._V_PLACES, other))
    n_dis = set()
    for recs, query, answer in _items(split):
        n_dis.add(len(recs) - 1)
        for r in recs:
            assert any(p.match(r) for p in mine_r), r
            # a record never reads as a template of the other half (their fixed words differ)
            assert not any(p.match(r) and p.pattern not in {q.pattern for q in mine_r} for p in other_r), r
        assert any(p.match(query) for p in mine_q), query
        text = " ".join(recs) + query
        words = set(re.findall(r"[A-Za-z]+", text))
        assert not words & other_words and not words & other_names, (text, words & (other_words | other_names))
        assert not any(p in text for p in other_places), text
        assert answer.startswith(" ") and answer.strip() in recs[0]
        assert recs[0].count(answer.strip()) >= 1 and all(answer.strip() not in r for r in recs[1:])
    assert n_dis == {0, 1, 2}


def test_items_vary_and_are_deterministic():
    a, b = _items("train", 300, seed=5), _items("train", 300, seed=5)
    assert a == b and a != _items("train", 300, seed=6)
    answers = [x[2].strip() for x in a]
    assert any(s.isdigit() for s in answers) and any(s in R._V_WORDS for s in answers)
    assert any(" " in s for s in answers) and any("-" in s for s in answers)     # names, codes
    assert len({x[1] for x in a}) > 50


def test_training_sequence_and_eval_sample(tok):
    tokens = np.asarray(tok.encode((ROOT / "README.md").read_text("utf-8")), dtype=np.int64)
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids, mask = R.training_sequence(rng, tokens, tok, 511, 1, 128, ("varied",))
        assert len(ids) == 512 and 1 <= mask.sum() <= 12
        first = int(np.argmax(mask))
        assert mask[first: first + mask.sum()].all()          # one contiguous answer
    with pytest.raises(ValueError, match="n_items"):
        R.training_sequence(rng, tokens, tok, 511, 2, 128, ("varied",))
    ids, n = R.varied_eval_sample(np.random.default_rng(1), tokens, tok, 600, 0.1)
    assert len(ids) == 600 and 1 <= n <= 12
    answer = tok.decode(ids[-n:].tolist()).strip()
    assert answer in tok.decode(ids[: len(ids) // 3].tolist())   # the record sits near the start


def test_mixture_trains_on_train_half_and_checks_held_out(tok):
    tokens = np.asarray(tok.encode((ROOT / "README.md").read_text("utf-8")), dtype=np.uint16)
    cfg = MixtureConfig(weights={"retrieval": 1.0}, retrieval_kinds=("varied",), curriculum=((0, 512),),
                        chat_tasks={"fact": 1.0}, seed=2)
    assert MixtureConfig.from_dict(cfg.to_dict()) == cfg
    assert "chat_tasks" not in MixtureConfig().to_dict()       # files without the field read the same
    m = MixtureBatches(cfg, tokens, tok, 64)
    held_q = [_template_re(t) for t in R._half(R._V_QUERIES, "heldout")]
    b = m.batch(0, 8)
    for i in range(8):
        text = tok.decode(b.ids[i][b.answer_mask[i]].tolist())
        assert text.strip()
    m.retrieval_split = "heldout"
    ids, _, ans = m.retrieval_row(m.rng_for(3, 0), 513)
    q_end = int(np.argmax(ans))
    window = tok.decode(ids[max(0, q_end - 40): q_end].tolist())
    assert any(p.pattern.split(r"\.")[0][1:] in "^" + window for p in held_q) or any(
        w in window for w in ("recall", "remember", "Tell me", "repeat", "learnt", "mentioned", "Which was",
                              "What was", "Question", "What is"))
    with pytest.raises(ValueError, match="^retrieval_kinds"):
        MixtureConfig(retrieval_kinds=("varied", "needle"))
    for bad in ({"poetry": 1.0}, {"fact": -1}, {"fact": 0}, {}):
        with pytest.raises(ValueError, match="^chat_tasks"):
            MixtureConfig(chat_tasks=bad)


def test_retrieval_eval_reads_the_held_out_half(tok, monkeypatch):
    """The training-time held-out check builds its items from the held-out half."""
    tokens = np.asarray(tok.encode((ROOT / "README.md").read_text("utf-8")), dtype=np.uint16)
    seen = []
    real = R.varied_item

    def spy(rng, split="train", max_distractors=2):
        seen.append(split)
        return real(rng, split, max_distractors)
    monkeypatch.setattr(R, "varied_item", spy)

    class Joint:
        source = MixtureBatches(MixtureConfig(weights={"retrieval": 1.0}, retrieval_kinds=("varied",),
                                              curriculum=((0, 512),)), tokens, tok, 64)

    class Model:
        training = False
        cfg = None

        def eval(self):
            pass

        def train(self, _):
            pass

        def __call__(self, t):
            import torch
            return torch.zeros(*t.shape, tok.vocab_size)
    out = retrieval_eval(Model(), Joint(), tokens, 512, 3, "cpu")
    assert seen == ["heldout"] * 3 and out["val_retrieval_len"] == 512


# ----------------------------------------------------------------------------- chat tasks

AUSTEN = ("EMMA\n\nBy Jane Austen\n\nCHAPTER I\n\nEmma Woodhouse, handsome, clever, and rich, with a "
          "comfortable home and happy disposition, seemed to unite some of the best blessings of existence; "
          "and she had lived nearly twenty-one years in the world with very little to distress or vex her. "
          "She was the youngest of the two daughters of a most affectionate, indulgent father, Mr. Woodhouse, "
          "and had, in consequence of her sister's marriage with Mr. Knightley, been mistress of his house.")
MOBY = ("CHAPTER 1. Loomings.\n\nCall me Ishmael. Some years ago, never mind how long precisely, having "
        "little or no money in my purse, I thought I would sail about a little with Queequeg and see the "
        "watery part of the world near Nantucket. It is a way I have of driving off the spleen.")
CODE = ('def join_words(words, sep=" "):\n    """Join the words with a separator.\n\n    More.\n    """\n'
        '    out = sep.join(words)\n    return out.strip()\n')
PYDOC = ("Built-in Functions\n==================\n\nThe Python interpreter has a number of functions and "
         "types built into it that are always available.\n\nMore text here.\n")


def test_chat_tasks_answer_from_the_corpus(tok):
    docs = [("austen", AUSTEN), ("moby", MOBY), ("pystdlib", CODE), ("pydoc", PYDOC),
            ("kjv", "Genesis 1\n\n1 In the beginning God created the heaven and the earth in Eden.\n"),
            ("sotu", "Fellow-Citizens: The progress of Congress in Washington was good this year. " * 3)]
    ex = D.build_examples(docs, tok, 80, seed=0, max_len=256, weights={"novel": 1, "fact": 1, "names": 1})
    assert {t for e in ex for t in e.tasks} == {"novel", "fact", "names"}
    replies = [m["content"] for e in ex for m in e.messages if m["role"] == "assistant"]
    assert any(r == "It is from Emma, a novel by Jane Austen." for r in replies)
    assert any(r == 'It is from chapter 1, "Loomings" of Moby-Dick.' for r in replies)
    assert any(r.startswith("`join_words`: join the words") for r in replies)
    assert any(r.endswith("written by Jane Austen.") or r.endswith("written by Herman Melville.") for r in replies)
    assert any(r.startswith("The Python interpreter has a number of functions") for r in replies)
    assert any(r.startswith("It names ") for r in replies)
    for e in ex:
        assert e.ids[-1] == tok.eos_id and e.mask[-1] == 1      # every reply ends its turn
    # the held-out conversations (`heldout_examples`) draw only the default tasks
    assert set(D.DEFAULT_WEIGHTS) == set(D.TASKS[:5])
