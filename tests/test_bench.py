"""The benchmark suite runs and reports (never timed: no assertion is about speed).

The cheap figures (kv_bytes, capacity, formats) run in quick mode in the default suite; they
assert formula == allocation themselves and write JSON with the documented keys. The whole
`cedlm bench --quick` smoke run is below too (the peer figure is skipped unless transformers is
already installed: --no-install).
"""
from __future__ import annotations

import json

import pytest
import torch

from cedlm.bench import cli
from cedlm.bench.common import Ctx, synth_ced_state, v4_style_config
from cedlm.bench.report import update_md
from cedlm.bench.runner import FIGURES, run_figures, select
from cedlm.config import ModelConfig

TOP_KEYS = {"name", "title", "schema", "quick", "env", "config", "rows", "target", "elapsed_s", "plot"}
ENV_KEYS = {"torch", "python", "threads", "cpu", "cpu_count", "platform", "date", "git_commit",
            "git_dirty", "loadavg_at_start"}
TARGET_KEYS = {"metric", "op", "value", "measured", "met", "note"}
ROW_KEYS = {
    "kv_bytes": {"model", "source", "bytes_per_token", "formula_bytes_per_token", "x_v41"},
    "capacity": {"model", "context", "bytes_per_sequence", "sequences", "global_kv_bytes",
                 "window_bytes", "compressor_state_bytes", "allocated_bytes",
                 "plan_bytes_per_sequence", "kv_bytes_per_token"},
    "prefill": {"model", "prompt_tokens", "median_s", "min_s", "max_s", "n", "spread",
                "tokens_per_s", "ratio_vs_decoder_only"},
    "decode": {"context", "ced_median_s", "decoder_only_median_s", "ced_spread", "decoder_only_spread",
               "ced_over_decoder_only", "ced_vs_first", "decoder_only_vs_first"},
    "resume": {"store", "context", "bytes", "bytes_per_token", "ced_over_this"},
    "formats": {"format", "dim", "entries", "encoded_bytes", "input_bytes", "encode_s", "decode_s",
                "memcpy_s", "memcpy_input_s", "codec_gbps", "memcpy_gbps", "ratio",
                "ratio_vs_input_memcpy", "spread", "v41"},
    "peer": {"batch", "context", "new_tokens", "ced_s", "hf_s", "ced_tokens_per_s",
             "hf_tokens_per_s", "ratio", "spread"},
    "dspark": {"batch", "config", "decode_s", "decode_tokens", "tokens_per_s", "speedup", "identical"},
}


def check_json(out, name):
    res = json.loads((out / f"{name}.json").read_text())
    assert TOP_KEYS <= set(res), set(TOP_KEYS) - set(res)
    assert res["name"] == name and res["schema"] == 1 and res["quick"] is True
    assert ENV_KEYS <= set(res["env"])
    assert TARGET_KEYS <= set(res["target"])
    assert "error" not in res, res.get("error")
    if not res.get("skipped"):
        assert res["rows"], name
        for r in res["rows"]:
            assert ROW_KEYS[name] <= set(r), (name, ROW_KEYS[name] - set(r))
        assert res["plot"] == f"{name}.png" and (out / res["plot"]).stat().st_size > 0
    return res


def test_cheap_figures_quick(tmp_path):
    out, md = tmp_path / "results", tmp_path / "BENCHMARKS.md"
    ctx = Ctx(quick=True, out=out, threads=1, install=False, profile=False, log=lambda s: None)
    run_figures(["kv_bytes", "capacity", "formats"], ctx, md)
    kv = check_json(out, "kv_bytes")
    assert kv["formula_equals_allocation"] is True and kv["target"]["met"] is True
    for r in kv["rows"]:
        assert r["bytes_per_token"] == r["formula_bytes_per_token"]
    by = {r["model"]: r["bytes_per_token"] for r in kv["rows"]}
    assert by["DeepSeek V4.1-Flash"] == 890 and by["DeepSeek LLM 67B"] == 389120
    assert by["DeepSeek V3.2 (656 B FP8 sparse)"] == 656 * 61
    assert by["CED-small"] == 212 and by["decoder-only BF16 baseline (small)"] == 6144
    cap = check_json(out, "capacity")
    for r in cap["rows"]:
        assert r["bytes_per_sequence"] == r["plan_bytes_per_sequence"]
        assert r["sequences"] * r["bytes_per_sequence"] <= cap["config"]["budget_bytes"]
        assert (r["sequences"] + 1) * r["bytes_per_sequence"] > cap["config"]["budget_bytes"]
    assert set(cap["ratios"]) == {"4096", "32768"} == set(cap["ratios_small40"])
    # live allocations, official schedules at small width: the official planner's 4.0x and more
    assert all(r["vs_v4_flash"] >= 3.9 for r in cap["ratios_small40"].values())
    assert {"CED-small40", "V4-Flash-small40"} <= {r["model"] for r in cap["rows"]}
    fm = check_json(out, "formats")
    assert {r["format"] for r in fm["rows"]} == {"kv_fp4", "index_fp4", "window_fp8", "v4_fp8"}
    text = md.read_text()
    for name in FIGURES:
        assert f"<!-- bench:{name}:start -->" in text and f"<!-- bench:{name}:end -->" in text
    assert "kv_bytes.png" in text and "| kv_bytes |" in text


def test_report_keeps_text_outside_markers(tmp_path):
    out, md = tmp_path / "r", tmp_path / "B.md"
    ctx = Ctx(quick=True, out=out, threads=1, install=False, profile=False, log=lambda s: None)
    run_figures(["kv_bytes"], ctx, md)
    md.write_text(md.read_text().replace("<!-- bench:kv_bytes:end -->",
                                         "<!-- bench:kv_bytes:end -->\n\nHand-written analysis."))
    res = json.loads((out / "kv_bytes.json").read_text())
    update_md(md, out, [(res, FIGURES["kv_bytes"])], FIGURES)
    text = md.read_text()
    assert "Hand-written analysis." in text and text.count("<!-- bench:kv_bytes:start -->") == 1


def test_select_and_cli_errors():
    assert select(None) == list(FIGURES)
    assert select("peer,kv_bytes") == ["kv_bytes", "peer"]
    with pytest.raises(ValueError, match="unknown"):
        select("nope")
    with pytest.raises(SystemExit):
        cli.main(["--only", "nope"])


def test_v4_style_baseline_config_and_state():
    cfg = v4_style_config(ModelConfig.preset("small"))
    assert cfg.compress_ratios[:cfg.n_layers] == [0, 0] + [4, 128] * 5
    assert cfg.kv_source_layer_ids == list(range(2, 12))
    assert cfg.index_source_layer_ids == [2, 4, 6, 8, 10] and cfg.candidate_source_layer_id is None
    assert cfg.main_kv_format == "v4_fp8" and cfg.decoder_start == cfg.n_layers
    assert cfg.to_dict()["main_kv_format"] == "v4_fp8"
    from cedlm.model import CEDModel
    from cedlm.plan import kv_bytes_per_token
    torch.manual_seed(0)
    m = CEDModel(cfg).eval()
    st = m.new_state()
    m.prefill(torch.randint(0, cfg.vocab_size, (256,)), st, "full")
    nb = st.nbytes()
    assert nb["main_kv"] + nb["index_keys"] == kv_bytes_per_token(cfg)["total"] * 256
    assert torch.isfinite(m.decode([3], [st])).all()


def test_synthetic_state_matches_prefilled_shapes():
    from cedlm.model import CEDModel
    torch.manual_seed(0)
    m = CEDModel(ModelConfig.preset("tiny")).eval()
    C = 37
    real = m.new_state()
    m.prefill(torch.randint(0, 512, (C,)), real, "bounded")
    syn = synth_ced_state(m, C)
    assert syn.nbytes() == real.nbytes()
    assert syn.num_tokens == real.num_tokens == len(syn.token_ids)
    for l in real.window_pos:
        assert torch.equal(syn.window_pos[l].sort().values, real.window_pos[l].sort().values)
    assert torch.isfinite(m.decode([5], [syn])).all()


def test_quick_smoke(tmp_path, capsys):
    """`cedlm bench --quick` end to end (about half a minute on one core)."""
    out = tmp_path / "quick"
    rc = cli.main(["--quick", "--out", str(out), "--no-install", "--threads", "1"])
    assert rc == 0
    for name in FIGURES:
        res = check_json(out, name)
        if name == "peer" and res.get("skipped"):
            assert "transformers" in res["skipped"]
        if name == "dspark":                 # the shipped drafter (cedlm/assets/model/mtp.safetensors)
            assert not res.get("skipped"), res.get("skipped")
            assert res["rows"], res
    assert (out / "BENCHMARKS.md").exists()
    assert "results:" in capsys.readouterr().out


def test_engine_options_reach_the_figures_or_say_why_not():
    """`cedlm bench` takes the engine's flags (one options surface with serve / generate / LLM):
    a flag the user set reaches the figures' engines; one a figure fixes is reported, not dropped."""
    from cedlm.bench.common import Ctx
    lines = []
    ctx = Ctx(quick=True, log=lines.append, engine_options={"prefill_chunk": 128, "max_num_seqs": 3})
    cfg = ctx.engine_config("kv_bytes", kv_budget_bytes=64 << 20, max_num_seqs=1)
    assert cfg.prefill_chunk == 128 and cfg.max_num_seqs == 1 and cfg.kv_budget_bytes == 64 << 20
    assert lines == ["kv_bytes: --max-num-seqs 3 not applied (the figure fixes max_num_seqs = 1)"]
    with pytest.raises(SystemExit, match="max_num_seqs: must be positive"):
        cli.main(["--only", "kv_bytes", "--max-num-seqs", "0"])
