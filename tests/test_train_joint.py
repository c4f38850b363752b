"""Joint pretraining (`cedlm train pretrain --mixture`, cedlm/train/joint.py): the mixture file,
rows per stage at constant tokens, the masked loss (= the chat stage's; traced = eager in
tests/test_train_compile.py), the
indexer's KL reaching only the indexer, the curriculum and phases in the metrics, exact resume,
and one-line CLI errors naming the field."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from cedlm.config import ModelConfig
from cedlm.model.model import CEDModel
from cedlm.model.probe import IndexerProbe, distill_kl
from cedlm.train.chat import masked_loss
from cedlm.train.compile import training_loss
from cedlm.train.joint import JointData, joint_loss, load_mixture, loss_weights, masked_ce, rows_at
from cedlm.train.mixture import MixtureConfig
from cedlm.train.train import build_parser, main, train
from test_chat_stage import make_corpus

MIX = {"weights": {"corpus": 0.4, "chat": 0.2, "retrieval": 0.3, "repeat": 0.1},
       "curriculum": [[0, 64], [2, 160]], "min_gap_windows": 2.0, "seed": 5}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("joint_corpus"))


@pytest.fixture(scope="module")
def mix_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("mix") / "mixture.json"
    p.write_text(json.dumps(MIX))
    return p


def run_args(corpus, mix_file, out, *extra):
    argv = ["--preset", "tiny", "--data", str(corpus), "--out", str(out), "--mixture", str(mix_file),
            "--batch-size", "4", "--seq-len", "16", "--eval-batches", "1", "--eval-every", "2",
            "--warmup", "1", "--lr", "3e-3", "--threads", "1", "--no-progress", "--chat-examples", "20",
            "--compile", "off", *map(str, extra)]
    return build_parser().parse_args(argv)


def tiny_model(tok) -> CEDModel:
    torch.manual_seed(0)
    return CEDModel(ModelConfig.preset("tiny").replace(vocab_size=tok.vocab_size))


# ----------------------------------------------------------------------------- settings


def test_load_mixture_file_and_errors(tmp_path, mix_file):
    d = load_mixture(str(mix_file))
    assert d == MixtureConfig.from_dict(MIX).to_dict() and load_mixture(d) == d
    with pytest.raises(ValueError, match="^mixture: .*no such file"):
        load_mixture(str(tmp_path / "none.json"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="^mixture: .*not JSON"):
        load_mixture(str(tmp_path / "bad.json"))
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match="^mixture: .*JSON object"):
        load_mixture(str(tmp_path / "list.json"))
    with pytest.raises(ValueError, match="^mixture: .*unknown field"):
        load_mixture({**MIX, "colour": 1})
    with pytest.raises(ValueError, match="^mixture: weights.chat"):
        load_mixture({**MIX, "weights": {"chat": -1}})


def test_rows_keep_tokens_per_step():
    assert rows_at(16, 256, 256, 1) == 16
    assert rows_at(16, 256, 1024, 1) == 4
    assert rows_at(16, 256, 4096, 1) == 1
    assert rows_at(16, 256, 8192, 1) == 1           # at least one row
    assert rows_at(16, 256, 1024, 2) == 4 and rows_at(6, 256, 1024, 2) == 2   # multiple of ranks


def test_tokens_through_is_the_sum_of_steps(corpus, tok):
    from cedlm.data.tokens import token_cache
    toks = token_cache(corpus / "train.txt", tok)
    cfg = {**MIX, "weights": {"corpus": 1.0}, "curriculum": [[0, 64], [3, 128], [7, 256]]}
    j = JointData(cfg, toks, tok, 8, corpus, batch_size=8, chat_examples=0, seed=0)
    for n in (0, 1, 3, 5, 7, 12):
        assert j.tokens_through(n) == sum(j.rows(s) * j.seq_len(s) for s in range(n))
    b = j.batch(4)
    assert b.ids.shape == (4, 129) and b.seq_len == 128
    with pytest.raises(ValueError, match="chat_examples"):
        JointData(MIX, toks, tok, 8, corpus, batch_size=8, chat_examples=0, seed=0)


# ----------------------------------------------------------------------------- the loss


def test_masked_loss_matches_chat_stage(tok):
    model = tiny_model(tok).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, tok.vocab_size, (3, 21), generator=g)
    mask = torch.rand(3, 21, generator=g) < 0.6
    mask[:, 0] = False
    x, y, m = ids[:, :-1], ids[:, 1:], mask[:, 1:]
    ref, _ = masked_loss(model, ids, mask)
    lm, ce = masked_ce(model(x), y, m)
    assert torch.allclose(lm, ref, rtol=1e-6, atol=1e-6)
    # the eager training loss_fn; through torch.compile (aot_eager) it equals this one:
    # test_train_compile.test_traced_training_matches_eager, whose traced graphs it reuses
    assert torch.allclose(training_loss(model, False)(x, y, m), ref, rtol=1e-6, atol=1e-6)
    # all-ones mask = the plain mean cross-entropy
    full, _ = masked_ce(model(x), y, torch.ones_like(m))
    assert torch.allclose(full, F.cross_entropy(model(x).flatten(0, 1), y.flatten()), rtol=1e-6)
    # a target outside the mask does not move the loss
    y2 = y.clone()
    y2[~m] = (y2[~m] + 1) % tok.vocab_size
    assert torch.allclose(masked_ce(model(x), y2, m)[0], lm, rtol=1e-6)


@pytest.mark.parametrize("dense", [True, False])
def test_kl_reaches_only_the_indexer(tok, dense):
    """The LM loss gives the indexer no gradient; the KL gives only the indexer one."""
    model = tiny_model(tok).train()
    x = torch.randint(0, tok.vocab_size, (2, 48), generator=torch.Generator().manual_seed(2))
    y, m = x.roll(-1, 1), torch.ones(2, 48, dtype=torch.bool)
    loss, rec = joint_loss(model, x, y, m, m & False, ["corpus", "corpus"], 0.0, dense)
    loss.backward()
    idx = {n for n, _ in model.named_parameters() if ".indexer." in n}
    assert idx
    for n, p in model.named_parameters():
        if n in idx:
            assert p.grad is None or not p.grad.any(), n
    assert ("kl" in rec) == dense        # the dense phase runs the probe even without the KL
    # the KL alone: a gradient on the indexer and nowhere else
    model.zero_grad(set_to_none=True)
    probe = IndexerProbe(dense=dense)
    model(x, probe=probe)
    distill_kl(probe, sparse=not dense)[0].backward()
    got = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.any()}
    assert got and got <= idx, sorted(got - idx)[:3]


# ----------------------------------------------------------------------------- the run


def test_joint_run_curriculum_phases_and_exact_resume(corpus, mix_file, tmp_path):
    straight = train(run_args(corpus, mix_file, tmp_path / "a", "--steps", "4",
                              "--indexer-kl-weight", "1", "--dense-steps", "1"))
    recs = [json.loads(l) for l in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["seq_len"] for r in recs] == [64, 64, 160, 160]
    assert [r["rows"] for r in recs] == [4, 4, 1, 1]         # 4 x 64 tokens per step, then 1 x 160
    assert [r["phase"] for r in recs] == ["dense", "sparse", "sparse", "sparse"]
    assert [r["tokens"] for r in recs] == [256, 512, 672, 832]
    assert all("kl" in r and "lm_loss" in r for r in recs)
    assert sum(r["rows_chat"] + r["rows_retrieval"] + r["rows_repeat"] for r in recs) > 0
    assert "val_ppl" in recs[-1]
    # held-out retrieval at the stage's length where an item fits (160 here, not 64)
    assert "val_retrieval_acc" not in recs[1] and recs[-1]["val_retrieval_len"] == 160
    assert 0 <= recs[-1]["val_retrieval_exact"] <= 1 and 0 <= recs[-1]["val_retrieval_acc"] <= 1

    half = train(run_args(corpus, mix_file, tmp_path / "b", "--steps", "4", "--indexer-kl-weight", "1",
                          "--dense-steps", "1", "--stop-at-step", "2"))
    assert half["step"] == 2
    resumed = train(build_parser().parse_args(["--resume", str(tmp_path / "b"), "--threads", "1",
                                               "--no-progress", "--compile", "off"]))
    assert resumed["step"] == 4 and resumed["loss"] == straight["loss"]
    sa, sb = straight["model"].state_dict(), resumed["model"].state_dict()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    saved = json.loads((tmp_path / "b" / "checkpoint" / "training_args.json").read_text())
    assert saved["mixture"] == load_mixture(MIX) and saved["dense_steps"] == 1


def test_answer_weight_is_the_weighted_mean(tok):
    """answer_weight w: the LM loss is sum(ce * weight) / sum(weight), weight 1 on a target and w
    on an answer target (eager = compiled); w = 1 is the plain masked mean, bit for bit."""
    torch.manual_seed(1)
    model = tiny_model(tok).train()
    x = torch.randint(5, tok.vocab_size, (2, 12))
    y = torch.randint(5, tok.vocab_size, (2, 12))
    mask = torch.rand(2, 12) > 0.3
    answer = (torch.rand(2, 12) > 0.6) & mask
    answer[0, 3] = mask[0, 3] = True
    assert loss_weights(mask, answer, 1.0) is mask
    w = loss_weights(mask, answer, 5.0)
    assert w.dtype == torch.float32 and w[0, 3] == 5 and (w[~mask] == 0).all()
    assert ((w == 1) == (mask & ~answer)).all()
    with torch.no_grad():
        ce = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none").view_as(y)
        want = (ce * w).sum() / w.sum()
        plain, _ = joint_loss(model, x, y, mask, answer, ["corpus", "retrieval"], 0.0, False)
        weighted, _ = joint_loss(model, x, y, mask, answer, ["corpus", "retrieval"], 0.0, False,
                                 answer_weight=5.0)
        compiled, _ = joint_loss(model, x, y, mask, answer, ["corpus", "retrieval"], 0.0, False,
                                 training_loss(model, False), answer_weight=5.0)
    torch.testing.assert_close(weighted, want)
    torch.testing.assert_close(compiled, want)
    assert torch.equal(plain, masked_ce(model(x), y, mask)[0])
    assert not torch.allclose(plain, weighted)


def test_init_from_starts_a_new_run_from_weights(corpus, mix_file, tmp_path, capsys):
    """--init-from: step 0, fresh schedule, the checkpoint's weights (in --config's model when
    given: here the same shapes with float32 RoPE); a shape mismatch is a one-line error."""
    first = train(run_args(corpus, mix_file, tmp_path / "a", "--steps", "2"))
    ck = tmp_path / "a" / "checkpoint"
    cfg = json.loads((ck / "config.json").read_text())
    cfg.get("cedlm", {}).pop("rope_precision", None)
    (tmp_path / "f32.json").write_text(json.dumps(cfg))
    a = run_args(corpus, mix_file, tmp_path / "b", "--steps", "1", "--init-from", ck,
                 "--config", tmp_path / "f32.json")
    a.preset = None                       # the checkpoint's model: --preset is refused with --init-from
    from cedlm.train.train import setup
    run = setup(a)
    assert run.step == 0 and run.model.cfg.rope_precision == "float32"
    for k, v in first["model"].state_dict().items():
        if k in run.model.state_dict() and "rope" not in k and "cos" not in k and "sin" not in k:
            assert torch.equal(v, run.model.state_dict()[k]), k
    assert not run.opt.state                                  # a fresh optimizer
    second = train(a)
    assert second["step"] == 1
    saved = json.loads((tmp_path / "b" / "checkpoint" / "training_args.json").read_text())
    assert saved["init_from"] == str(ck)
    cfg["text_config"]["hidden_size"] = 2 * cfg["text_config"]["hidden_size"]
    (tmp_path / "wide.json").write_text(json.dumps(cfg))
    argv = ["--data", str(corpus), "--out", str(tmp_path / "c"), "--steps", "1",
            "--seq-len", "16", "--batch-size", "2", "--threads", "1", "--no-progress",
            "--init-from", str(ck), "--config", str(tmp_path / "wide.json")]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "cedlm train pretrain: error: init_from: parameter")
    assert main(argv[:-2] + ["--preset", "tiny"]) == 2           # not silently ignored
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "cedlm train pretrain: error: preset: not used with --init-from")


class _Copier(torch.nn.Module):
    """An oracle that retrieves: at each position it predicts the token that followed the longest
    earlier match of the text so far (what a perfect induction head does)."""
    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab

    def forward(self, x):
        seq = x[0].tolist()
        out = torch.zeros(1, len(seq), self.vocab)
        for j in range(len(seq)):
            for m in range(min(16, j + 1), 0, -1):
                hit = [i for i in range(m - 1, j) if seq[i - m + 1: i + 1] == seq[j - m + 1: j + 1]]
                if hit:
                    out[0, j, seq[hit[-1] + 1]] = 1.0
                    break
        return out


def test_retrieval_eval_scores_an_oracle_and_a_constant(corpus, tok):
    from cedlm.data.tokens import token_cache
    from cedlm.train.joint import retrieval_eval
    toks = token_cache(corpus / "train.txt", tok)
    val = token_cache(corpus / "val.txt", tok)
    j = JointData({**MIX, "weights": {"corpus": 0.5, "retrieval": 0.5}}, toks, tok, 8, corpus,
                  batch_size=4, chat_examples=0, seed=0)
    good = retrieval_eval(_Copier(tok.vocab_size), j, val, 160, 6, "cpu")
    assert good == retrieval_eval(_Copier(tok.vocab_size), j, val, 160, 6, "cpu")     # fixed rows
    assert good["val_retrieval_acc"] == 1.0 and good["val_retrieval_exact"] == 1.0, good
    const = torch.nn.Module()
    const.forward = lambda x: torch.zeros(*x.shape, tok.vocab_size)
    bad = retrieval_eval(const, j, val, 160, 6, "cpu")
    assert bad["val_retrieval_exact"] == 0.0 and bad["val_retrieval_acc"] < 0.2, bad
    assert retrieval_eval(const, j, val, 64, 6, "cpu") == {}                 # no item fits at 64


@pytest.mark.parametrize("extra, field", [
    (["--mixture", "/nonexistent/mix.json"], "mixture"),
    (["--indexer-kl-weight", "-1"], "indexer_kl_weight"),
    (["--dense-steps", "-2"], "dense_steps"),
    (["--eval-retrieval", "-1"], "eval_retrieval"),
    (["--indexer-kl-weight", "1", "--compile", "on"], "compile"),
    (["--indexer-kl-weight", "1", "--arch", "decoder_only"], "indexer_kl_weight"),
    (["--init-from", "/nonexistent/run"], "init_from"),
])
def test_cli_errors_are_one_line(corpus, tmp_path, capsys, extra, field):
    argv = ["--preset", "tiny", "--data", str(corpus), "--out", str(tmp_path / "r"), "--steps", "1",
            "--seq-len", "16", "--batch-size", "2", "--threads", "1", "--no-progress", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"cedlm train pretrain: error: {field}"), err
    assert not any("Traceback" in l for l in err)
