"""Evaluation: perplexity / bits per byte under a model, the unigram baseline, the eval CLI."""
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cedlm.config import ModelConfig
from cedlm.eval.cli import main as eval_main
from cedlm.eval.ppl import evaluate_ppl, evaluate_unigram, fit_unigram, unigram_baseline
from cedlm.model.model import CEDModel
from cedlm.checkpoint import save_checkpoint, set_token_map

TEXT = (Path(__file__).parent / "fixtures" / "corpus" / "pystdlib" / "bisect.py").read_text()[:3000]
TEXT += "\nCafé, naïve — 日本語 ✓\n"   # multi-byte characters: bytes != characters


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    m = CEDModel(ModelConfig.preset("tiny").replace(vocab_size=tok.vocab_size,
                                                    engram_compressed_vocab_size=tok.vocab_size))
    set_token_map(m, tok)
    return m.eval()


def test_random_model_ppl_near_vocab_size(model, tok):
    res = evaluate_ppl(model, tok, TEXT, seq_len=64, batch_size=4)
    V = tok.vocab_size
    assert 0.7 * V < res["perplexity"] < 1.5 * V
    assert res["tokens"] == len(tok.encode(TEXT))
    assert res["bytes"] == len(TEXT.encode("utf-8")) > len(TEXT)
    assert res["perplexity"] == pytest.approx(math.exp(res["nats"] / res["tokens"]))
    assert res["bits_per_byte"] == pytest.approx(res["nats"] / math.log(2) / res["bytes"])
    assert {"perplexity", "bits_per_byte", "tokens", "bytes", "model"} <= set(res)


def test_windows_score_every_token_once(model, tok):
    """One window covering the text equals a direct forward over [EOS] + ids; batching changes nothing."""
    text = TEXT[:400]
    ids = tok.encode(text)
    seq = torch.tensor([[tok.eos_id] + ids])
    with torch.no_grad():
        nats = F.cross_entropy(model(seq[:, :-1])[0], seq[0, 1:], reduction="sum").item()
    one = evaluate_ppl(model, tok, text, seq_len=len(ids) + 5)
    assert one["nats"] == pytest.approx(nats, rel=1e-5)
    # non-overlapping windows of 16: the same total whatever the batch size
    a = evaluate_ppl(model, tok, text, seq_len=16, batch_size=1)
    b = evaluate_ppl(model, tok, text, seq_len=16, batch_size=5)
    # [5, 16] and [1, 16] GEMMs round differently on some CPUs (1.1e-6 relative seen with
    # ATEN_CPU_CAPABILITY=default); a windowing error would move the total by whole-token losses
    assert a["nats"] == pytest.approx(b["nats"], rel=1e-4) and a["tokens"] == len(ids)
    # manual windows: window k scores targets seq[16k+1 : 16k+17] with its own prefix only
    manual = 0.0
    with torch.no_grad():
        for s in range(0, len(ids), 16):
            x, y = seq[:, s: s + 16], seq[0, s + 1: s + 17]
            manual += F.cross_entropy(model(x[:, : len(y)])[0], y, reduction="sum").item()
    assert a["nats"] == pytest.approx(manual, rel=1e-5)


class ToyTokenizer:
    """Characters a, b, c -> ids 0, 1, 2 (vocab 3)."""
    vocab_size = 3

    def encode(self, text):
        return ["abc".index(c) for c in text]


def test_unigram_hand_checked():
    logp = fit_unigram([0, 0, 1], vocab_size=3)             # counts 2, 1, 0 -> (c+1) / (3+3)
    assert np.allclose(np.exp(logp), [3 / 6, 2 / 6, 1 / 6])
    res = evaluate_unigram(logp, ToyTokenizer(), "ac")      # nats = ln 2 + ln 6 = ln 12
    assert res["tokens"] == 2 and res["bytes"] == 2
    assert res["nats"] == pytest.approx(math.log(12))
    assert res["perplexity"] == pytest.approx(math.sqrt(12))
    assert res["bits_per_byte"] == pytest.approx(math.log2(12) / 2)


def test_unigram_cli(tmp_path, tok, capsys):
    train = tmp_path / "train.txt"
    train.write_text("the cat sat on the mat. " * 20)
    text = tmp_path / "val.txt"
    text.write_text("the mat sat.")
    assert eval_main(["unigram", "--train", str(train), "--text", str(text), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    ids = tok.encode(train.read_text()) + [tok.eos_id]     # one document + its EOS
    counts = np.bincount(ids, minlength=tok.vocab_size)
    p = (counts + 1) / (len(ids) + tok.vocab_size)
    nats = -sum(math.log(p[i]) for i in tok.encode("the mat sat."))
    assert res["bits_per_byte"] == pytest.approx(nats / math.log(2) / 12)
    assert res["perplexity"] == pytest.approx(math.exp(nats / res["tokens"]))
    assert res["train_tokens"] == len(ids)
    direct = unigram_baseline(train, "the mat sat.", tok)
    assert direct["perplexity"] == pytest.approx(res["perplexity"])


def test_ppl_cli_json(tmp_path, model, tok, capsys):
    save_checkpoint(tmp_path / "ckpt", model, tok)
    f = tmp_path / "t.txt"
    f.write_text(TEXT[:500])
    assert eval_main(["ppl", "--text", str(f), "--model", str(tmp_path / "ckpt"), "--json",
                      "--seq-len", "32", "--batch-size", "2"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert {"perplexity", "bits_per_byte", "tokens", "bytes", "model"} <= set(res)
    ref = evaluate_ppl(model, tok, TEXT[:500], seq_len=32, batch_size=2)   # the CLI's batches: same sums
    assert res["perplexity"] == pytest.approx(ref["perplexity"], rel=1e-6)
    assert res["bytes"] == len(TEXT[:500].encode("utf-8"))
