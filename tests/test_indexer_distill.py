"""Lightning-indexer distillation (probe, loss, stage), retrieval data and the fidelity measurement."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cedlm.checkpoint import load_model, save_checkpoint
from cedlm.data.retrieval import eval_sample, training_sequence
from cedlm.engine.loader import load_any
from cedlm.eval.fidelity import Measurement, REFERENCE, Setting, reference, variant_model
from cedlm.model.probe import IndexerProbe, distill_kl, topk_recall
from cedlm.kernels import decode, encode, quant_dequant
from cedlm.quant import bytes_per_entry
from conftest import run_indexer_stage  # noqa: E402  (the suite's helper)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_any("tiny", seed=3)


@pytest.fixture(scope="module")
def text_tokens(tiny):
    _, tok = tiny
    return np.asarray(tok.encode((REPO / "README.md").read_text(encoding="utf-8")), dtype=np.int64)


def _ids(model, S=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.cfg.vocab_size, (2, S), generator=g)


def test_probe_off_and_on_give_the_same_logits(tiny):
    model, _ = tiny
    x = _ids(model)
    with torch.no_grad():
        a = model(x)
        b = model(x, probe=IndexerProbe(dense=False))
    assert torch.equal(a, b)


def test_indexer_weights_move_under_distillation_and_nothing_else(tiny):
    model, _ = tiny
    model = variant_model(model, tiny[1], Setting("copy"))
    model.train()
    x = _ids(model)
    probe = IndexerProbe(dense=True)
    model(x, probe=probe)
    kl, per = distill_kl(probe, sparse=False)
    assert kl.item() > 0 and set(per) == set(model.cfg.index_source_layer_ids)
    assert set(topk_recall(probe, model.cfg.index_topk)) == set(per)
    kl.backward()
    moved = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert moved and all(".indexer." in n for n in moved)
    # every indexer projection gets a gradient; weights move under an optimizer step
    assert any(".indexer.wk." in n for n in moved) and any(".indexer.weights_proj." in n for n in moved)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == moved


def test_lm_loss_reaches_no_indexer_weight_and_kl_no_main_weight(tiny):
    model, tok = tiny
    model = variant_model(model, tok, Setting("copy"))
    model.train()
    x = _ids(model)
    probe = IndexerProbe(dense=False)
    logits = model(x, probe=probe)
    F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()).backward(retain_graph=True)
    assert all(p.grad is None for n, p in model.named_parameters() if ".indexer." in n)
    model.zero_grad(set_to_none=True)
    kl, _ = distill_kl(probe, sparse=True)
    kl.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if ".indexer." not in n)
    # with sparse selection the KL is over the selected entries only: 0 when there is one
    assert kl.item() >= 0


def test_dense_probe_selects_every_visible_entry(tiny):
    model, _ = tiny
    probe = IndexerProbe(dense=True)
    with torch.no_grad():
        model(_ids(model), probe=probe)
    for l in probe.layers:
        # the attention target covers every visible entry: mass outside them is zero
        assert (probe.target[l][~probe.visible[l]] == 0).all()
        assert (probe.target[l].sum(-1) > 0).any()


def test_dense_config_reads_entries_densely_like_the_gather(tiny):
    """A config whose index_topk covers any context takes the dense path; one just below the
    bound gathers every entry per query: the same attention."""
    model, tok = tiny
    cap = model.cfg.max_position_embeddings
    ids = _ids(model, S=80)[0]
    out = []
    for k in (cap, cap - 1):
        m = variant_model(model, tok, Setting("k", {"index_topk": k, "candidate_topk_blocks": 1 << 20}))
        out.append(m.prefill(ids, m.new_state(), "full"))
    assert torch.allclose(out[0], out[1], rtol=1e-4, atol=1e-4)


def test_kl_is_exactly_zero_for_identical_configurations(tiny, text_tokens):
    model, tok = tiny
    meas = Measurement(model, tok, text_tokens, [96], 2, [96], 1, tail=24)
    same = meas.run(Setting("reference, run again", dict(REFERENCE)))      # not the cached logits
    assert same["kl"] == 0.0 and same["top1"] == 1.0 and same["d_ppl_pct"] == 0.0
    fp4 = meas.run(Setting("fp4", {**REFERENCE, "main_kv_format": "kv_fp4"}))
    assert fp4["kl"] > 0 and fp4["bytes_per_token"] < same["bytes_per_token"]
    assert set(fp4["retrieval"]) == {"96"}


def test_variant_model_keeps_the_dspark_drafter(tiny):
    """A model that ships mtp.safetensors (the default model) rebuilds with its drafter: its
    state has mtp.* tensors, which a drafter-less build would reject."""
    from cedlm.model import build_model
    model, tok = tiny
    torch.manual_seed(0)
    with_mtp = build_model(model.cfg, dspark=True).eval()
    m = variant_model(with_mtp, tok, Setting("fp4", {**REFERENCE, "main_kv_format": "kv_fp4"}))
    assert m.mtp is not None and m.cfg.main_kv_format == "kv_fp4"
    assert torch.equal(m.state_dict()["mtp.0.main_proj.weight"], with_mtp.state_dict()["mtp.0.main_proj.weight"])


def test_retrieval_samples_are_exact_and_answer_last(tiny, text_tokens):
    _, tok = tiny
    rng = np.random.Generator(np.random.PCG64(0))
    for kind in ("passkey", "kv"):
        ids, n = eval_sample(rng, text_tokens, tok, 300, kind, 0.1)
        assert len(ids) == 300 and 0 < n < 10
        txt = tok.decode(ids.tolist())
        answer = tok.decode(ids[-n:].tolist()).strip()
        assert answer.isdigit() and txt.count(answer) >= 2        # the record holds the answer
    with pytest.raises(ValueError, match="length"):
        eval_sample(rng, text_tokens, tok, 10, "kv", 0.5)
    ids, mask = training_sequence(rng, text_tokens, tok, 400, 3, 64)
    assert len(ids) == 401 and mask.sum() >= 3
    assert tok.decode(ids[mask].tolist()).replace(" ", "").isdigit()
    for seed in range(20):      # several items: never two passkey records (the answer would be ambiguous)
        ids, _ = training_sequence(np.random.Generator(np.random.PCG64(seed)), text_tokens, tok, 600, 4, 32)
        assert tok.decode(ids.tolist()).count("Remember it.") <= 1


def test_bf16_format_round_trips():
    x = torch.randn(5, 128)
    b = encode(x, "bf16")
    assert b.shape == (5, 256) and bytes_per_entry("bf16", 128) == 256
    assert torch.equal(decode(b, "bf16", 128), quant_dequant(x, "bf16"))
    assert torch.equal(quant_dequant(x, "bf16"), x.to(torch.bfloat16).float())


def test_indexer_stage_trains_and_saves(tiny, tmp_path):
    from cedlm.cli import main
    model, tok = tiny
    rc, recs = run_indexer_stage(model, tok, tmp_path, "--warmup-steps", "2", "--steps", "1")
    assert rc == 0
    assert [r["phase"] for r in recs] == ["dense", "dense", "sparse"]
    assert all(any(k.startswith("recall_") for k in r) for r in recs)
    trained, _ = load_model(tmp_path / "run")
    a, b = model.state_dict(), trained.state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a if ".indexer." in k)
    assert (tmp_path / "run" / "loss.png").exists() and (tmp_path / "run" / "summary.json").exists()
    # --take-indexer: the init model's weights with the run's indexer, nothing trained
    rc = main(["train", "indexer", "--init", str(tmp_path / "init"), "--take-indexer", str(tmp_path / "run"),
               "--out", str(tmp_path / "only")])
    assert rc == 0
    only = load_model(tmp_path / "only")[0].state_dict()
    assert all(torch.equal(only[k], (b if ".indexer." in k else a)[k]) for k in a)


def test_ablate_quick_runs(tmp_path):
    from cedlm.cli import main
    rc = main(["eval", "ablate", "--quick", "--out", str(tmp_path), "--text", str(REPO / "README.md"),
               "--threads", "1"])
    assert rc == 0
    res = json.loads((tmp_path / "fidelity.json").read_text())
    names = [r["name"] for r in res["rows"]]
    assert names[0] == "reference" and res["rows"][0]["kl"] == 0.0
    assert any("initialisation" in n for n in names) and any("prefill" in n for n in names)
    md = (tmp_path / "FIDELITY.md").read_text()
    assert "| reference |" in md and "fidelity_kl.png" in md
    assert (tmp_path / "fidelity_kl.png").exists() and (tmp_path / "fidelity_retrieval.png").exists()
    notes = tmp_path / "notes.md"
    notes.write_text("## Extra notes\n")
    assert main(["eval", "ablate", "--out", str(tmp_path), "--report-only", "--notes", str(notes),
                 "--report", str(tmp_path / "F.md")]) == 0
    assert "## Extra notes" in (tmp_path / "F.md").read_text() and "| reference |" in (tmp_path / "F.md").read_text()


def test_fidelity_cli_rejects_unknown_field(capsys):
    from cedlm.cli import main
    rc = main(["eval", "fidelity", "--model", "tiny", "--set", "no_such_field=1", "--text",
               str(REPO / "README.md")])
    assert rc == 2 and "no_such_field" in capsys.readouterr().err


def test_fidelity_cli_rejects_a_bad_value(capsys):
    from cedlm.cli import main
    rc = main(["eval", "fidelity", "--model", "tiny", "--set", "index_topk=0", "--text",
               str(REPO / "README.md")])
    assert rc == 2 and "index_topk: must be positive" in capsys.readouterr().err


def test_retrieval_kinds_choose_the_items(tiny, text_tokens, capsys):
    from cedlm.cli import main
    from cedlm.eval.fidelity import retrieval_samples
    _, tok = tiny
    for kinds, needle in ((("passkey",), "pass key"), (("kv",), "value of key")):
        items = retrieval_samples(text_tokens, tok, 200, 3, kinds=kinds)
        assert all(needle in tok.decode(ids.tolist()) for ids, _ in items)
    rc = main(["eval", "fidelity", "--model", "tiny", "--lengths", "128", "--samples", "1", "--retrieval-samples",
               "128:2", "--retrieval-kinds", "passkey", "--text", str(REPO / "README.md"), "--json", "--threads", "1"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["retrieval_kinds"] == ["passkey"]
    with pytest.raises(SystemExit):
        main(["eval", "fidelity", "--model", "tiny", "--retrieval-kinds", "passkey,nope"])
    assert "--retrieval-kinds" in capsys.readouterr().err


def test_csa2_row_reports_the_unshared_layouts_bytes(tmp_path):
    """The CSA2 row is not measured (no weights for it), but its KV bytes are: every compressed
    encoder layer its own KV and index-key source, every compressed layer its own indexer, the
    decoder's one global KV kept (the shipped small config: 212 -> 318 B/token)."""
    from cedlm.config import ModelConfig
    from cedlm.eval.ablate import NOT_MEASURED, csa2_unshared
    from cedlm.eval.fidelity_report import write_report
    from cedlm.kv_layout import KVLayout

    cfg = ModelConfig.from_json(REPO / "cedlm" / "assets" / "model" / "config.json")
    un = csa2_unshared(cfg)
    comp = [i for i in range(cfg.n_layers) if cfg.compress_ratios[i] > 0]
    assert un.index_source_layer_ids == comp and un.decoder_start == cfg.decoder_start
    assert [un.role(i) for i in comp] == ["full" if i <= cfg.decoder_start else "reindex" for i in comp]
    shared, own = KVLayout.from_config(cfg), KVLayout.from_config(un)
    assert own.bytes_per_token > shared.bytes_per_token
    assert own.window_bytes_per_sequence == shared.window_bytes_per_sequence
    md = (write_report(tmp_path, {"model": "m", "tail": 8, "retrieval_lengths": [],
                                                  "retrieval_samples": {}, "command": "c", "wall_s": 60, "threads": 1},
                       [{"name": "reference", "group": "reference", "overrides": {}, "prefill": "full",
                         "restore": None, "indexer": "model", "kl": 0.0, "d_ppl_pct": 0.0, "top1": 1.0,
                         "retrieval": {}, "bytes_per_token": 768, "text_samples": {"8": 1}, "ref_ppl": 9.0}],
                       cfg, NOT_MEASURED)).read_text()
    row = next(l for l in md.splitlines() if "CSA2 sharing" in l)
    assert f"| {float(own.bytes_per_token):.0f} | {own.window_bytes_per_sequence:,} |  |" in row
