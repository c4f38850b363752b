"""Accounting and capacity planner: the numbers of DESIGN.md / kv-layouts.md, pinned to what the
code allocates (SequenceState) and builds (CEDModel)."""

import json
import math
import re
from pathlib import Path

import pytest
import torch

from cedlm import plan as P
from cedlm.config import CONFIG_DIR, ModelConfig
from cedlm.model import CEDModel

GIB = 1 << 30
WEIGHT_NAMES = Path(__file__).resolve().parent / "fixtures" / "v41-weight-names.txt"


@pytest.fixture(scope="module")
def v41():
    return ModelConfig.preset("deepseek-v4.1-flash")


@pytest.fixture(scope="module")
def v41_plan(v41):
    return P.plan(v41, context=1 << 20, memory_gib=80, name="deepseek-v4.1-flash")


# ----------------------------------------------------------------------------- KV bytes
def test_v41_kv_bytes_per_token(v41):
    kv = P.kv_bytes_per_token(v41)
    assert kv["total"] == 890 and isinstance(kv["total"], int)
    got = [(p["part"], p["ratio"], p["layers"], p["bytes_per_token"]) for p in kv["parts"]]
    assert got == [("main_kv", 2, [2, 8, 14], 432), ("main_kv", 1, [20], 288),
                   ("index_keys", 2, [2, 8, 14], 102), ("index_keys", 1, [20], 68)]
    assert 3 * 288 / 2 + 288 + 3 * 68 / 2 + 68 == 890


def test_v41_windows(v41):
    w = P.window_bytes_per_sequence(v41)
    assert w["window"] == 40 * 128 * 528 == 2_703_360
    assert w["dspark_window"] == 3 * 128 * 528 == 202_752
    assert w["compressor_state"] == 3 * 1 * 2 * 512 * 4          # three ratio-2 sources


def test_llama_67b():
    cfg = ModelConfig.preset("deepseek-llm-67b")
    assert P.kv_bytes_per_token(cfg)["total"] == 2 * 95 * 8 * 128 * 2 == 389_120
    w = P.window_bytes_per_sequence(cfg)
    assert w["window"] == w["dspark_window"] == w["compressor_state"] == 0


def test_v4_flash_from_schedule():
    ratios = json.loads((CONFIG_DIR / "deepseek-v4-flash.config.json").read_text())["compress_ratios"]
    layers = ratios[:43]
    n4, n128 = layers.count(4), layers.count(128)
    assert (n4, n128) == (21, 20)
    # main KV: 584 B (448 FP8 NoPE + 64 BF16 RoPE + 7 UE8M0 + 1 pad) / ratio; index keys 68 B
    # (FP4 assumption) on the ratio-4 layers only.
    expected = n4 * 584 / 4 + n128 * 584 / 128 + n4 * 68 / 4
    assert expected == 3514.25
    kv = P.kv_bytes_per_token(ModelConfig.preset("deepseek-v4-flash"))
    assert kv["total"] == expected
    assert any("index" in a and "68" in a for a in kv["assumptions"])


def test_v3_mla():
    kv = P.kv_bytes_per_token(ModelConfig.preset("deepseek-v3"))
    assert kv["total"] == 656 * 61
    assert kv["alternatives"]["mla_bf16"] == 576 * 2 * 61
    assert "656" in kv["headline"] or "FP8" in kv["headline"]


# ----------------------------------------------------------------------------- parameters
@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_params_equal_built_model(preset):
    cfg = ModelConfig.preset(preset)
    model = CEDModel(cfg)
    assert P.param_counts(cfg)["total"] == model.num_parameters()
    built = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert {t.name: t.shape for t in P.param_inventory(cfg, as_built=True)} == built
    engram = sum(p.numel() for n, p in model.named_parameters() if ".engram.embed." in n)
    assert P.param_counts(cfg)["engram"] == engram


def test_v4_style_baseline_params_equal_built_model():
    """A shrunk V4-Flash schema: the as-built inventory matches what CEDModel builds."""
    d = json.loads((CONFIG_DIR / "deepseek-v4-flash.config.json").read_text())
    d.update(vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=7,
             num_attention_heads=4, head_dim=96, qk_rope_head_dim=32, q_lora_rank=32,
             o_lora_rank=16, o_groups=2, n_routed_experts=4, num_experts_per_tok=2,
             index_n_heads=2, index_head_dim=32, index_topk=4, sliding_window=8, hc_mult=2,
             compress_ratios=[0, 0, 4, 128, 4, 128, 4, 0])
    cfg = ModelConfig.from_dict(d)
    model = CEDModel(cfg)
    built = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert {t.name: t.shape for t in P.param_inventory(cfg, as_built=True)} == built
    # The checkpoint-style count adds V4's extras (ape, overlap, indexer compressor, hc_head).
    assert P.param_counts(cfg)["total"] > model.num_parameters()


def test_v41_param_counts(v41):
    pc = P.param_counts(v41)
    assert pc["engram"] == (384006168 + 384016682) * 256
    non_engram = pc["total"] - pc["engram"]
    assert 551e9 < non_engram < 553e9                      # "552B MoE"
    assert 196e9 < pc["engram"] < 197e9                   # "196B Engram"
    assert 7.5e9 < pc["active_prefill"] < 8.5e9           # "8B activated" (prefill)
    assert 15.5e9 < pc["active_decode"] < 16.5e9          # "16B activated" (decode)
    # Routed experts of the 40 layers: 384 x 3 x 5120 x 2304 each.
    assert pc["detail"]["routed_expert"] == 40 * 384 * 3 * 5120 * 2304
    # Vision: patch + 32 blocks + norm + aligner + 3 delimiter rows (weight-name formulas).
    block = 2 * 1024 + 3072 * 1024 + 3072 + 1024 * 1024 + 1024 + 5632 * 1024 + 1024 * 2816
    assert pc["vision"] == (1024 * 588 + 1024 + 32 * block + 1024 + 5120 * 9216 + 5120
                            + 5120 * 5120 + 5120 + 3 * 5120)


def test_active_prefill_convention():
    """Prefill per token = decode minus the decoder (except the global-KV parts) and the head."""
    cfg = ModelConfig.preset("tiny")
    inv = P.param_inventory(cfg)
    ds = cfg.decoder_start
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    buckets = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads

    def active(t):
        if t.group == "routed_expert":
            return math.prod(t.shape) * k // E
        if t.group in ("embed", "engram_table"):
            return t.shape[1] * (buckets if t.group == "engram_table" else 1)
        return math.prod(t.shape)

    pre = sum(active(t) for t in inv if t.group == "embed" or (t.layer is not None and t.layer < ds))
    glob = [t for t in inv if t.layer == ds and re.match(
        rf"layers\.{ds}\.(attn_norm|attn\.wkv|attn\.kv_norm|attn\.compressor|attn\.indexer\.wk|"
        r"attn\.indexer\.k_norm)", t.name)]
    assert {t.name.split(".", 2)[2] for t in glob} == {
        "attn_norm.weight", "attn.wkv.weight", "attn.kv_norm.weight", "attn.compressor.wkv.weight",
        "attn.compressor.norm.weight", "attn.indexer.wk.weight", "attn.indexer.k_norm.weight"}
    pc = P.param_counts(cfg)
    assert pc["active_prefill"] == pre + sum(math.prod(t.shape) for t in glob)
    assert pc["active_decode"] == sum(active(t) for t in inv)


# Shapes copied from reference/v41-weight-names.txt (a subset), checked even without the file.
OFFICIAL_SHAPES = {
    "embed.weight": (129280, 5120), "head.weight": (129280, 5120), "norm.weight": (5120,),
    "layers.0.hc_attn_fn": (24, 20480), "layers.0.hc_attn_scale": (3,),
    "layers.39.attn.attn_sink": (64,), "layers.5.attn.wq_a.weight": (1280, 5120),
    "layers.5.attn.wq_b.weight": (32768, 1280), "layers.5.attn.wkv.weight": (512, 5120),
    "layers.5.attn.wo_a.weight": (8192, 4096), "layers.5.attn.wo_b.weight": (5120, 8192),
    "layers.5.ffn.gate.weight": (384, 5120), "layers.5.ffn.shared_experts.w2.weight": (5120, 2304),
    "layers.5.ffn.experts.383.w1.weight": (2304, 5120),
    "layers.8.attn.compressor.wgate.weight": (512, 5120),
    "layers.20.attn.compressor.wkv.weight": (512, 5120),
    "layers.20.attn.indexer.wk.weight": (128, 512), "layers.24.attn.indexer.wq_b.weight": (4096, 1280),
    "layers.24.attn.indexer.weights_proj.weight": (32, 5120),
    "layers.14.engram.embed.weight": (384016682, 256), "layers.1.engram.wkv.weight": (25600, 6144),
    "layers.1.engram.q_weight": (4, 5120),
    "mtp.1.ffn.gate.weight": (128, 5120), "mtp.0.main_proj.weight": (5120, 15360),
    "mtp.2.markov_head.head.weight": (129280, 256), "mtp.2.confidence_head.proj.weight": (1, 5376),
    "vision.blocks.31.mlp.w1.weight": (5632, 1024), "aligner.w1.weight": (5120, 9216),
}


def _official_inventory(cfg):
    inv = {}
    for part in ("main", "dspark", "vision"):
        inv.update({t.name: t.shape for t in P.param_inventory(cfg, part)})
    return inv


def test_official_shapes(v41):
    inv = _official_inventory(v41)
    for name, shape in OFFICIAL_SHAPES.items():
        assert inv[name] == shape, name
    # Role-specific absences (weight-name notes).
    assert "layers.20.attn.compressor.wgate.weight" not in inv
    assert "layers.24.attn.indexer.wk.weight" not in inv
    assert "layers.3.attn.compressor.wkv.weight" not in inv
    assert "hc_head_fn" not in inv


@pytest.mark.skipif(not WEIGHT_NAMES.exists(), reason="reference/v41-weight-names.txt not here")
def test_weight_name_file_shapes(v41):
    """Every representative BF16/F32/F8 key of the weight-name file (non-scale, non-buffer) is
    in the analytic inventory with the same shape; FP4 experts are stored [N, K/2]."""
    inv = _official_inventory(v41)
    layer_sets = {"Every decoder layer": [0, 20, 39], "KV-source": [2, 8, 14],
                  "Index-source": [2, 20, 24, 36], "Engram layers": [1, 14]}
    current, checked = [0], 0
    for line in WEIGHT_NAMES.read_text().splitlines():
        if line.startswith("## "):
            current = next((v for k, v in layer_sets.items() if k in line), [0])
            continue
        if line.startswith("#") or "|" not in line:
            continue
        key, dtype, shape = (c.strip() for c in line.split("|")[:3])
        if key.endswith((".scale", ".bias_vl", "gate.bias")) or not re.fullmatch(r"\[[\d, ]+\]", shape):
            continue
        shape = tuple(int(x) for x in shape.strip("[]").split(","))
        if dtype == "I8":                                   # two FP4 codes per byte
            shape = shape[:-1] + (shape[-1] * 2,)
        for L in current:
            for S in (0, 1, 2):
                E = 127 if key.startswith("mtp.") else 383
                name = key.replace("layers.L.", f"layers.{L}.").replace("mtp.S.", f"mtp.{S}.")
                name = name.replace(".E.", f".{E}.").replace("blocks.B.", "blocks.31.")
                assert inv.get(name) == shape, (name, inv.get(name), shape)
                checked += 1
    assert checked > 60


# ----------------------------------------------------------------------------- allocation
@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_planner_equals_sequence_state(preset):
    cfg = ModelConfig.preset(preset)
    torch.manual_seed(0)
    model = CEDModel(cfg).eval()
    ratios = {cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids}
    N = 64
    assert all(N % r == 0 for r in ratios)
    st = model.new_state()
    model.prefill(torch.randint(0, cfg.vocab_size, (N,)), st)
    nb = st.nbytes()
    kv = P.kv_bytes_per_token(cfg)["total"]
    assert nb["main_kv"] + nb["index_keys"] == kv * N
    w = P.window_bytes_per_sequence(cfg)
    assert nb["window"] == w["window"]
    # One token short of a group boundary: the compressor holds its largest pending state.
    st2 = model.new_state()
    model.prefill(torch.randint(0, cfg.vocab_size, (N - 1,)), st2)
    nb2 = st2.nbytes()
    assert nb2["compressor_state"] == w["compressor_state"] > 0
    # Everything the state holds == the planner's bytes per sequence (minus DSpark, not built).
    assert sum(nb2.values()) == P.sequence_bytes(cfg, N - 1) - w["dspark_window"]


# ----------------------------------------------------------------------------- capacity
def test_max_sequences_hand_computed(v41_plan):
    p = v41_plan
    per_seq = 890 * 1_048_576 + 2_703_360 + 202_752 + 12_288
    assert p["bytes_per_sequence"] == per_seq == 936_151_040
    assert p["max_sequences"] == 80 * 2 ** 30 // per_seq == 91
    q = P.plan(ModelConfig.preset("deepseek-llm-67b"), context=4096, memory_gib=1, example=False)
    assert q["bytes_per_sequence"] == 389_120 * 4096
    assert q["max_sequences"] == 0
    q = P.plan(ModelConfig.preset("deepseek-llm-67b"), context=4096, memory_gib=10, example=False)
    assert q["max_sequences"] == 10 * GIB // (389_120 * 4096) == 6
    assert P.plan(ModelConfig.preset("tiny"), context=100, example=False)["max_sequences"] is None
    assert P.plan(ModelConfig.preset("tiny"), memory_gib=1, example=False)["bytes_per_sequence"] is None


def test_plan_keys_and_json(v41_plan):
    for k in ("model", "family", "kv_bytes_per_token", "kv_bytes_per_token_parts",
              "window_bytes_per_sequence", "dspark_window_bytes_per_sequence",
              "compressor_state_bytes_per_sequence", "params_total", "params_engram",
              "params_dspark", "params_vision", "params_active_prefill", "params_active_decode",
              "context", "memory_gib", "bytes_per_sequence", "max_sequences", "assumptions"):
        assert k in v41_plan, k
    assert json.loads(json.dumps(v41_plan)) == v41_plan
    assert v41_plan["params_dspark"] > 0 and v41_plan["params_vision"] > 0


def test_concurrency_example(v41_plan):
    ex = v41_plan["concurrency_example"]
    rows = {(r["model"], r["context"]): r for r in ex["rows"]}
    r = rows[("deepseek-v4.1-flash", 1 << 20)]
    for dev, d in P.DEVICES.items():
        kv_mem = d["memory_gib"] * (1 - d["reserve_fraction"]) * GIB
        assert r["sequences"][dev] == int(kv_mem // 936_151_040)
    assert rows[("deepseek-llm-67b", 1 << 20)]["sequences"]["NVIDIA H100 80GB"] == 0
    text = P.format_plan(v41_plan)
    assert "Concurrency example" in text and "deepseek-v4-flash" in text
    assert "890 B" in text and "2,703,360 B" in text and "936,151,040 B" in text


# ----------------------------------------------------------------------------- CLI
def test_cli_requires_exactly_one_source(capsys):
    with pytest.raises(SystemExit):
        P.main(["--config", "x.json", "--preset", "tiny"])
    err = capsys.readouterr().err
    assert "--config" in err and "--preset" in err
    with pytest.raises(SystemExit):
        P.main([])
    err = capsys.readouterr().err
    assert "--config" in err and "--preset" in err


def test_cli_json(capsys):
    assert P.main(["--preset", "tiny", "--context", "1k", "--memory-gib", "0.5", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["model"] == "tiny" and p["context"] == 1024 and p["memory_gib"] == 0.5
    assert p["max_sequences"] == int(0.5 * GIB // p["bytes_per_sequence"])
    assert set(P.PLAN_KEYS) <= set(p)


def test_cli_config_path_and_subparser(capsys, tmp_path):
    import argparse
    parser = argparse.ArgumentParser(prog="cedlm")
    P.add_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["plan", "--config", str(CONFIG_DIR / "deepseek-v4.1-flash.config.json")])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "deepseek-v4.1-flash" in out and "890 B" in out
    with pytest.raises(SystemExit) as e:
        P.main(["--config", str(tmp_path / "missing.json")])
    assert "missing.json" in str(e.value)
