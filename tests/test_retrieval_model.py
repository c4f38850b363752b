"""The `retrieval` preset and `cedlm train indexer --selection dense` (FIDELITY.md, "Retrieval beyond
the window: a model that can retrieve")."""
from __future__ import annotations

import argparse
import json

import pytest
import torch
import torch.nn.functional as F

from cedlm.checkpoint import load_model, save_checkpoint
from cedlm.config import ModelConfig
from cedlm.engine.loader import load_any
from cedlm.eval.fidelity import DENSE, Setting, variant_model
from cedlm.model import build_model
from cedlm.train.indexer import indexer_params, step
from conftest import run_indexer_stage  # noqa: E402  (the suite's helper)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_any("tiny", seed=3)


def test_retrieval_preset_keeps_the_csa2_roles_and_builds():
    cfg = ModelConfig.preset("retrieval")
    roles = cfg.roles
    d = cfg.decoder_start
    assert roles[0] == "swa" and roles[d] == "full" and cfg.compress_ratios[d] == 1
    assert {"swa", "full", "reuse", "reindex"} <= set(roles)
    assert "reindex" in roles[d:] and "reuse" in roles[d:] and "full" in roles[:d]
    assert cfg.candidate_source_layer_id == d and cfg.engram_layer_ids and cfg.hc_mult >= 2
    # a short window and a small top-k: at 256+ tokens most entries are not selected
    assert cfg.sliding_window == 32 and cfg.index_topk == 16
    assert cfg.candidate_topk_blocks * cfg.candidate_block_size < 256
    assert ModelConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    assert model.num_parameters() < 10e6
    with torch.no_grad():
        out = model(torch.randint(0, cfg.vocab_size, (1, 80)))
    assert out.shape == (1, 80, cfg.vocab_size) and torch.isfinite(out).all()


def test_dense_selection_trains_the_model_on_every_visible_entry(tiny):
    """A whole-model step with dense=True sees the logits of the dense configuration (index_topk
    and the pool beyond the context), not the model's sparse ones; kl_weight 0 keeps the indexer."""
    base, tok = tiny
    model = variant_model(base, tok, Setting("copy")).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 97), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    ans = torch.zeros_like(y, dtype=torch.bool)
    dense_model = variant_model(base, tok, Setting("dense", {"index_topk": DENSE,
                                                             "candidate_topk_blocks": DENSE})).train()
    with torch.no_grad():
        ce_dense = F.cross_entropy(dense_model(x).flatten(0, 1), y.flatten()).item()
        ce_sparse = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    assert abs(ce_dense - ce_sparse) > 1e-4                      # the selection matters here
    idx = {id(p) for p in indexer_params(model)}
    opt = torch.optim.AdamW([{"params": indexer_params(model), "name": "indexer", "weight_decay": 0.0},
                             {"params": [p for p in model.parameters() if id(p) not in idx],
                              "name": "main", "weight_decay": 0.0}])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    a = argparse.Namespace(kl_weight=0.0, answer_weight=1.0, grad_clip=1.0)
    rec = step(model, opt, x, y, ans, a, True, 1e-3, 1e-3, dense=True)
    assert rec["phase"] == "whole-dense"
    assert rec["lm_loss"] == pytest.approx(ce_dense, abs=1e-5)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and not any(".indexer." in n for n in changed)
    # the default whole-model step is sparse: the model's own selection
    model2 = variant_model(base, tok, Setting("copy")).train()
    opt2 = torch.optim.AdamW([{"params": list(model2.parameters()), "name": "main"}])
    rec2 = step(model2, opt2, x, y, ans, a, True, 0.0, 0.0)
    assert rec2["phase"] == "sparse" and rec2["lm_loss"] == pytest.approx(ce_sparse, abs=1e-5)


def test_indexer_stage_selection_dense_flag(tiny, tmp_path):
    model, tok = tiny
    rc, recs = run_indexer_stage(model, tok, tmp_path, "--warmup-steps", "0", "--steps", "2",
                                 "--selection", "dense", "--kl-weight", "0",
                                 "--retrieval-fraction", "0.5", "--repeat-fraction", "0.5")
    assert rc == 0
    assert [r["phase"] for r in recs] == ["whole-dense", "whole-dense"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["cost"]["whole-dense"]["steps"] == 2
    a, b = load_model(tmp_path / "init")[0].state_dict(), load_model(tmp_path / "run")[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a if ".indexer." in k)
    assert any(not torch.equal(a[k], b[k]) for k in a if ".indexer." not in k)


def test_repeat_sequence_repeats_a_stretch_verbatim():
    import numpy as np
    from cedlm.data.retrieval import repeat_sequence
    tokens = np.arange(10_000, dtype=np.int64)                # distinct ids: the copy is findable
    rng = np.random.Generator(np.random.PCG64(0))
    spans = set()
    for _ in range(50):
        ids, m = repeat_sequence(rng, tokens, 128)
        assert ids.shape == m.shape == (129,) and m.any()
        at = int(np.argmax(m))
        n = int(m.sum())
        assert 8 <= n <= 43 and m[at: at + n].all()
        copy = ids[at: at + n]
        rest = np.concatenate((ids[:at], ids[at + n:]))
        assert np.all(np.diff(rest) == 1)                      # the text around it is contiguous
        src = int(np.flatnonzero(rest == copy[0])[0])
        assert src + n <= at and np.array_equal(rest[src: src + n], copy)
        spans.add(n)
    assert len(spans) > 5
    with pytest.raises(ValueError, match="seq_len"):
        repeat_sequence(rng, tokens, 12)


def test_indexer_stage_repeat_fraction_is_checked(tiny, tmp_path, capsys):
    from cedlm.cli import main
    model, tok = tiny
    save_checkpoint(tmp_path / "init", model, tok)
    rc = main(["train", "indexer", "--init", str(tmp_path / "init"), "--out", str(tmp_path / "run"),
               "--retrieval-fraction", "0.8", "--repeat-fraction", "0.5", "--no-progress"])
    assert rc == 2 and "--repeat-fraction" in capsys.readouterr().err


def test_repeat_sequence_random_kind():
    """kind="random": tokens drawn independently from the corpus, with one stretch copied later."""
    import numpy as np
    from cedlm.data.retrieval import repeat_sequence
    tokens = np.arange(100_000, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(1))
    ids, m = repeat_sequence(rng, tokens, 256, kind="random")
    at, n = int(np.argmax(m)), int(m.sum())
    copy = ids[at: at + n]
    assert not np.all(np.diff(np.concatenate((ids[:at], ids[at + n:]))) == 1)   # not a text stretch
    src = int(np.flatnonzero(ids[:at] == copy[0])[0])
    assert np.array_equal(ids[src: src + n], copy)
    with pytest.raises(ValueError, match="repeat kind"):
        repeat_sequence(rng, tokens, 256, kind="nope")
