"""The supervised chat stage (`cedlm train chat`): its data builder, a tiny end-to-end run, the CLI's
errors, and a bare `openai` chat call to a server on the chat model ending its turn.

The server test runs on the default model (cedlm/assets/model) or on the model dir named by
CEDLM_CHAT_TEST_MODEL (e.g. runs/chat/export); it is skipped, saying so, while that model has no
chat stage recorded in its summary.json.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from cedlm import checkpoint as ck
from cedlm.config import ModelConfig
from cedlm.model.model import CEDModel
from cedlm.text.chat import encode_chat_ids
from cedlm.text.documents import write_documents
from cedlm.text.special_tokens import EOS, THINK_END
from cedlm.train import chat_data as D

PROSE = ("Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition, seemed "
         "to unite some of the best blessings of existence. She had lived nearly twenty-one years in the "
         "world with very little to distress or vex her. She was the youngest of the two daughters of a "
         "most affectionate, indulgent father. Her mother had died too long ago for her to have more than "
         "an indistinct remembrance of her caresses.")
MOBY = ("Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my "
        "purse, I thought I would sail about a little and see the watery part of the world. It is a way I "
        "have of driving off the spleen and regulating the circulation. Whenever I find myself growing grim "
        "about the mouth, I account it high time to get to sea as soon as I can.")
SOTU = ("Fellow-Citizens of the Senate and House of Representatives: In meeting you again I feel much "
        "satisfaction in being able to repeat my congratulations. The abundant fruits of another year have "
        "blessed our country with plenty. The progress of public credit is witnessed by a considerable rise "
        "of American stock abroad as well as at home.")
KJV = ("Genesis 1\n\n1 In the beginning God created the heaven and the earth.\n2 And the earth was without "
       "form, and void; and darkness was upon the face of the deep.\n3 And God said, Let there be light: "
       "and there was light.\n4 And God saw the light, that it was good.")
CODE = ('import os\n\n\ndef join_words(words, sep=" "):\n    """Join the words with a separator.\n\n'
        '    Longer explanation here.\n    """\n    out = sep.join(words)\n    return out.strip()\n\n\n'
        'def _helper(x):\n    """Return twice the value of x."""\n    return 2 * x\n')
PYDOC = ("Built-in Functions\n==================\n\nThe Python interpreter has a number of functions and "
         "types built into it that are always available.\nThey are listed here in alphabetical order.\n"
         "Each entry says what it returns.\nSee also the library reference.\n")


def save_tiny_checkpoint(directory: Path, tok) -> Path:
    """A `tiny`-preset model directory on tokenizer `tok` (seed 0): the training stages' --init."""
    from cedlm import checkpoint as ck
    from cedlm.config import ModelConfig
    from cedlm.model import CEDModel
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny").replace(vocab_size=tok.vocab_size, engram_compressed_vocab_size=tok.vocab_size,
                                             dspark_noise_token_id=tok.vocab_size - 1)
    model = CEDModel(cfg)
    ck.set_token_map(model, tok)
    return ck.save_checkpoint(directory, model, tok)


def make_corpus(root: Path, repeat: int = 3) -> Path:
    """A corpus dir in the layout of `cedlm data prepare` (train.txt, val.txt, manifest.json)."""
    srcs = {"austen": [PROSE * 10], "kjv": [KJV], "pydoc": [PYDOC * 3], "pystdlib": [CODE * 3],
            "sotu": [SOTU * 10], "moby": [MOBY * 10]}
    root.mkdir(parents=True, exist_ok=True)
    manifest = {"sources": {}}
    train, val = [], []
    for name, docs in srcs.items():
        train += docs * repeat
        val += docs
        manifest["sources"][name] = {"train_docs": len(docs) * repeat, "val_docs": len(docs)}
    for fname, docs in (("train.txt", train), ("val.txt", val)):
        with open(root / fname, "w", encoding="utf-8", newline="\n") as f:
            write_documents(f, docs)
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("chat_corpus"))


@pytest.fixture(scope="module")
def examples(corpus, tok):
    return D.build_examples(D.corpus_documents(corpus, "train"), tok, 60, seed=3, max_len=160,
                            multi_turn=0.3, system=0.3, thinking=0.3)


# ----------------------------------------------------------------------------- data builder


def test_corpus_documents_sources_and_mismatch(corpus, tmp_path):
    docs = D.corpus_documents(corpus, "train")
    assert [s for s, _ in docs][:3] == ["austen"] * 3 and docs[3][0] == "kjv" and docs[-1][0] == "moby"
    bad = make_corpus(tmp_path / "bad")
    m = json.loads((bad / "manifest.json").read_text())
    m["sources"]["moby"]["train_docs"] += 1
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="manifest lists"):
        D.corpus_documents(bad, "train")


def test_functions_take_the_first_docstring_sentence():
    got = {name: (code, what) for name, code, what in D.functions(CODE)}
    assert got["join_words"][1] == "Join the words with a separator."
    assert '"""' not in got["join_words"][0] and "return out.strip()" in got["join_words"][0]
    assert got["_helper"][1] == "Return twice the value of x."


def test_loss_mask_covers_exactly_the_assistant_turns_and_their_eos(examples, tok):
    modes, turns = set(), set()
    for e in examples:
        msgs = [{k: v for k, v in m.items() if not k.startswith("_")} for m in e.messages]
        assert e.ids == encode_chat_ids(msgs, tok, e.thinking_mode)      # the server's encoder
        assert len(e.mask) == len(e.ids) and set(e.mask) <= {0, 1}
        want = ""
        for m in msgs:
            if m["role"] == "assistant":
                if e.thinking_mode == "thinking":
                    want += m["reasoning_content"] + THINK_END
                want += m["content"] + EOS
        assert tok.decode([i for i, k in zip(e.ids, e.mask) if k]) == want
        n_turns = sum(m["role"] == "assistant" for m in msgs)
        assert sum(1 for i, k in zip(e.ids, e.mask) if k and i == tok.eos_id) == n_turns
        assert e.ids[-1] == tok.eos_id and e.mask[-1] == 1 and e.mask[0] == 0
        # the prompt of the last turn is what a client's messages encode to
        first = max(j for j in range(len(e.ids)) if not e.mask[j]) + 1
        assert e.ids[:first] == encode_chat_ids(e.prompt_messages, tok, e.thinking_mode)
        modes.add(e.thinking_mode)
        turns.add(n_turns)
    assert modes == {"chat", "thinking"} and {1, 2} <= turns
    tasks = {t for e in examples for t in e.tasks}
    assert tasks == set(D.DEFAULT_WEIGHTS)      # the other tasks are drawn only when weighted
    src = [e for e in examples if e.source]
    assert src and all(D.SOURCE_NAMES[e.source][0] in e.reply for e in src)


def test_builder_is_deterministic(corpus, tok, examples):
    docs = D.corpus_documents(corpus, "train")
    again = D.build_examples(docs, tok, 60, seed=3, max_len=160, multi_turn=0.3, system=0.3, thinking=0.3)
    assert [e.ids for e in again] == [e.ids for e in examples]
    other = D.build_examples(docs, tok, 60, seed=4, max_len=160, multi_turn=0.3, system=0.3, thinking=0.3)
    assert [e.ids for e in other] != [e.ids for e in examples]
    assert all(len(e.ids) <= 64 for e in D.build_examples(docs, tok, 20, seed=3, max_len=64))
    with pytest.raises(ValueError, match="weights"):
        D.build_examples(docs, tok, 2, seed=0, weights={"poetry": 1.0})


def test_batches_pad_mask_and_text_rows(corpus, tok, examples):
    docs = D.corpus_documents(corpus, "train")
    b1 = D.ChatBatches(examples, docs, tok, 8, 160, 0.25, seed=1)
    b2 = D.ChatBatches(examples, docs, tok, 8, 160, 0.25, seed=1)
    for _ in range(3):
        ids, mask, is_text = b1.next_batch()
        ids2, mask2, _ = b2.next_batch()
        assert torch.equal(ids, ids2) and torch.equal(mask, mask2)
        assert ids.shape == mask.shape and ids.shape[0] == 8 and is_text.tolist() == [False] * 6 + [True] * 2
        assert mask[is_text].all()                                    # text rows: every token
        pads = ids[~is_text] == tok.pad_id
        assert not (mask[~is_text].bool() & pads).any()               # padding is never a target
        by_ids = {tuple(e.ids): e.mask for e in examples}
        for row, m in zip(ids[~is_text].tolist(), mask[~is_text].tolist()):
            n = len(row) - next((k for k, t in enumerate(reversed(row)) if t != tok.pad_id), 0)
            assert by_ids[tuple(row[:n])] == m[:n]


def test_right_padding_leaves_a_row_unchanged(examples, tok):
    """The stage pads rows on the right: under causal attention (window, compressed entries, index
    top-k, Engram history) the logits of the real tokens must not depend on what follows."""
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny").replace(vocab_size=tok.vocab_size,
                                             engram_compressed_vocab_size=tok.vocab_size)
    model = CEDModel(cfg).eval()
    ids = torch.tensor([examples[0].ids])
    n = ids.shape[1]
    padded = torch.cat([ids, torch.full((1, 37), tok.pad_id)], 1)
    with torch.no_grad():
        a, b = model(ids), model(padded)[:, :n]
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()


# ----------------------------------------------------------------------------- stage end to end


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tok):
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny").replace(vocab_size=tok.vocab_size,
                                             engram_compressed_vocab_size=tok.vocab_size)
    model = CEDModel(cfg)
    ck.set_token_map(model, tok)
    d = ck.save_checkpoint(tmp_path_factory.mktemp("tiny") / "model", model, tok)
    (d / "summary.json").write_text(json.dumps({"preset": "tiny", "val_perplexity": 4000.0,
                                                "val_bits_per_byte": 12.0,
                                                "commands": ["cedlm train --preset tiny"]}))
    return d


def test_tiny_stage_run_writes_a_checkpoint_that_loads(tiny_model_dir, corpus, tmp_path, capsys):
    from cedlm.cli import main
    out = tmp_path / "run"
    rc = main(["train", "chat", "--init", str(tiny_model_dir), "--out", str(out), "--data", str(corpus),
               "--steps", "3", "--batch-size", "4", "--max-len", "160", "--examples", "12",
               "--heldout", "2", "--eval-max-tokens", "3", "--no-eval-before", "--export", str(out / "export")])
    assert rc == 0, capsys.readouterr().err
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["chat_loss"] > 0 for r in rows)
    model, tok2 = ck.load_model(out)
    base, _ = ck.load_model(tiny_model_dir)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, base.state_dict()[k])]
    assert changed, "the stage did not change any weight"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["chat_steps"] == 3 and summary["preset"] == "tiny"
    assert summary["chat_base_val_perplexity"] == 4000.0 and "val_perplexity" not in summary
    assert summary["commands"][0] == "cedlm train --preset tiny" and "train chat" in summary["commands"][-1]
    assert 0 <= summary["chat_after_finished_greedy"] <= 1 and summary["chat_after_n_heldout"] == 2
    args = json.loads((out / "checkpoint" / "training_args.json").read_text())
    assert args["chat_stage"]["steps"] == 3
    exported, _ = ck.load_model(out / "export")
    assert set(exported.state_dict()) == set(model.state_dict())
    card = (out / "export" / "README.md").read_text()
    assert "## Chat stage" in card and "No chat or instruction fine-tune" not in card
    assert "the same model before its chat stage | 4000.0" in card and "| this model |" not in card

    # the perplexity of the result, measured by `cedlm eval ppl`, recorded for the card
    capsys.readouterr()
    assert main(["eval", "ppl", "--text", str(corpus / "val.txt"), "--model", str(out), "--json",
                 "--seq-len", "64"]) == 0
    ppl = json.loads(capsys.readouterr().out)
    (tmp_path / "ppl.json").write_text(json.dumps(ppl))
    assert main(["train", "chat", "--out", str(out), "--data", str(corpus), "--record-ppl",
                 str(tmp_path / "ppl.json"), "--export", str(out / "export")]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_perplexity"] == ppl["perplexity"] and "eval ppl" in summary["commands"][-1]
    assert f"| this model | {ppl['perplexity']:.1f} |" in (out / "export" / "README.md").read_text()
    (tmp_path / "other.json").write_text(json.dumps({**ppl, "model": str(tiny_model_dir)}))
    assert main(["train", "chat", "--out", str(out), "--record-ppl", str(tmp_path / "other.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --record-ppl:") and "scored" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("flags, msg", [
    (["--steps", "0"], "--steps: must be >= 1"),
    (["--text-fraction", "1.5"], "--text-fraction: must be in [0, 1)"),
    (["--lr", "-1"], "--lr: must be a positive number"),
    (["--data", "/nonexistent"], "--data: no train.txt"),
])
def test_cli_bad_flags_are_one_error_line(tmp_path, capsys, flags, msg):
    from cedlm.cli import main
    rc = main(["train", "chat", "--out", str(tmp_path / "r"), *flags])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: ") and msg in err and len(err.splitlines()) == 1
    assert not (tmp_path / "r").exists()


# ----------------------------------------------------------------------------- server


REPO = Path(__file__).resolve().parent.parent
CHAT_MODEL = Path(os.environ.get("CEDLM_CHAT_TEST_MODEL") or REPO / "cedlm" / "assets" / "model")


def _has_chat_stage(d: Path) -> bool:
    f = d / "summary.json"
    return f.exists() and any(k.startswith(("chat", "sft")) for k in json.loads(f.read_text()))


@pytest.mark.skipif(not _has_chat_stage(CHAT_MODEL),
                    reason=f"{CHAT_MODEL} has no chat stage yet (install runs/chat/export, or set "
                           "CEDLM_CHAT_TEST_MODEL)")
@pytest.mark.parametrize("content", ["Hello", "Which book is this from? Call me Ishmael."])
def test_bare_openai_chat_call_ends_its_turn(content):
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from cedlm.engine.llm import LLM
    from cedlm.server.app import create_app
    from tests.test_server import serve
    llm = LLM(str(CHAT_MODEL), num_threads=1)
    with serve(create_app(llm, served_model_name="cedlm")) as base:
        oc = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        t0 = time.monotonic()
        # no max_tokens, default sampling (temperature 1); the seed only makes the draw repeatable
        r = oc.chat.completions.create(model="cedlm", messages=[{"role": "user", "content": content}],
                                       seed=0)
        dt = time.monotonic() - t0
    choice = r.choices[0]
    assert choice.finish_reason == "stop", (choice.finish_reason, choice.message.content)
    assert choice.message.content and dt < 30, (dt, r.usage)
