"""Capacity: bytes per sequence at a context, sequences that fit, the whole plan."""
from __future__ import annotations

from fractions import Fraction

from cedlm.config import ModelConfig
from cedlm.plan.kvbytes import GIB, _num, kv_bytes_per_token, window_bytes_per_sequence
from cedlm.plan.params import param_counts


# The concurrency example: one accelerator's memory given entirely to KV (weights excluded: they
# live on other devices of an expert/tensor-parallel group, or in host memory), minus a reserve
# for the runtime, activations and workspace. Memory is the nominal HBM size in GiB.
DEVICES = {
    "NVIDIA H100 80GB": {"memory_gib": 80, "reserve_fraction": 0.10},
    "Ascend 910B 64GB": {"memory_gib": 64, "reserve_fraction": 0.10},
}
EXAMPLE_MODELS = ("deepseek-v4.1-flash", "deepseek-v4-flash", "deepseek-llm-67b")
EXAMPLE_CONTEXTS = (1 << 20, 128 * 1024)

PLAN_KEYS = (
    "model", "family", "kv_bytes_per_token", "kv_bytes_per_token_parts", "kv_bytes_alternatives",
    "window_bytes_per_sequence", "dspark_window_bytes_per_sequence",
    "compressor_state_bytes_per_sequence", "params_total", "params_engram", "params_dspark",
    "params_vision", "params_active_prefill", "params_active_decode", "params_detail", "context",
    "memory_gib", "bytes_per_sequence", "max_sequences", "assumptions", "concurrency_example",
)



def sequence_bytes(cfg: ModelConfig, context: int) -> int:
    """Bytes one sequence of `context` tokens holds: the global entries allocated at that
    length (floor(context / r) per source, main KV + index keys), the SWA rings, the DSpark rings
    and the largest compressor pending state."""
    kv = kv_bytes_per_token(cfg)
    glob = 0
    for p in kv["parts"]:
        glob += (context // p["ratio"]) * p["entry_bytes"] * p["n_layers"]
    w = window_bytes_per_sequence(cfg)
    return glob + w["window"] + w["dspark_window"] + w["compressor_state"]


def max_sequences(memory_bytes: float, bytes_per_sequence: int) -> int:
    return int(memory_bytes // bytes_per_sequence) if bytes_per_sequence > 0 else 0


def concurrency_example(devices: dict = DEVICES, models=EXAMPLE_MODELS,
                        contexts=EXAMPLE_CONTEXTS) -> dict:
    """Sequences that fit on one accelerator, KV only: (memory - reserve) // bytes_per_sequence."""
    from cedlm.config.presets import PRESETS
    cfgs = {m: PRESETS[m]() for m in models}
    rows = []
    for m, cfg in cfgs.items():
        for ctx in contexts:
            b = sequence_bytes(cfg, ctx)
            row = {"model": m, "context": ctx, "bytes_per_sequence": b, "sequences": {}}
            for dev, d in devices.items():
                kv_mem = d["memory_gib"] * (1 - d["reserve_fraction"]) * GIB
                row["sequences"][dev] = max_sequences(kv_mem, b)
            rows.append(row)
    return {
        "devices": {dev: dict(d, kv_memory_gib=_num(Fraction(d["memory_gib"]) * (
            1 - Fraction(d["reserve_fraction"]).limit_denominator(1000)))) for dev, d in devices.items()},
        "rows": rows,
        "assumptions": [
            "one device; model weights excluded (held by other devices of an expert/tensor-"
            "parallel group or in host memory): KV memory = nominal HBM GiB x (1 - reserve)",
            "reserve (runtime, activations, workspace) = "
            + ", ".join(f"{int(d['reserve_fraction'] * 100)}% on {dev}" for dev, d in devices.items()),
            "bytes per sequence = global KV at the context + SWA/DSpark rings + compressor state "
            "(per each model's planner); one sequence's KV is not split across devices",
            "DeepSeek LLM 67B was trained at 4k context: its rows are memory arithmetic only",
        ],
    }


def plan(cfg: ModelConfig, context: int | None = None, memory_gib: float | None = None,
         name: str | None = None, example: bool = True) -> dict:
    """The whole account of `cfg` (JSON-stable keys, see PLAN_KEYS); max_sequences is
    floor(memory_gib GiB / bytes_per_sequence), None unless both context and memory are given."""
    if context is not None and context < 0:
        raise ValueError(f"context: must be >= 0, got {context}")
    if memory_gib is not None and memory_gib < 0:
        raise ValueError(f"memory_gib: must be >= 0, got {memory_gib}")
    kv = kv_bytes_per_token(cfg)
    win = window_bytes_per_sequence(cfg)
    pc = param_counts(cfg)
    assumptions = [
        "GiB = 2^30 bytes; global KV per token = sum over KV-source layers of entry bytes / "
        "compress ratio (main KV + owned index keys)",
        "bytes_per_sequence = allocated global entries at the context (floor(context/ratio) per "
        "source) + every layer's SWA ring + DSpark/MTP rings + the largest compressor pending "
        "state; token ids, ring positions and allocator slack excluded; weights excluded",
        "parameters: learnable weights (elements); router selection-bias buffers and checkpoint "
        ".scale tensors not counted; active decode = non-expert weights (head whole) + top-k "
        "routed + shared experts + only the embedding row and Engram rows a token reads; active "
        "prefill = per prompt token over a long prompt (decoder layers after the global-KV "
        "source, the final norm and the head run only on trailing tokens)",
    ] + kv["assumptions"] + win["assumptions"]
    if cfg.family == "v4":
        assumptions.append("V4-Flash parameters follow the V4 checkpoint layout "
                           "(overlapping ratio-4 compressor + ape, indexer compressor, hc_head); "
                           "its MTP block is counted V3-style (e_proj, h_proj, norms) plus a "
                           "full MoE SWA block")
    if cfg.family == "mla":
        assumptions.append("V3 MTP counted as one MoE layer + eh_proj + enorm/hnorm/shared_head "
                           "norm (embedding and head shared)")
    if cfg.family == "ced" and cfg.num_nextn_predict_layers:
        assumptions.append("DSpark drafter (cedlm/model/dspark.py, built when a model directory "
                           "ships mtp.safetensors): params_dspark from the mtp.* names and shapes; "
                           "its rings hold the context rows of the last sliding_window positions per "
                           "draft layer; a verification appends up to dspark_block_size + 1 tokens "
                           "(pool slots and the rollback copy of their ring slots are transient)")
    bps = sequence_bytes(cfg, context) if context is not None else None
    ms = (max_sequences(memory_gib * GIB, bps) if bps is not None and memory_gib is not None
          else None)
    out = {
        "model": name or cfg.model_type,
        "family": cfg.family,
        "kv_bytes_per_token": kv["total"],
        "kv_bytes_per_token_parts": kv["parts"],
        "kv_bytes_headline": kv["headline"],
        "kv_bytes_alternatives": kv["alternatives"],
        "window_bytes_per_sequence": win["window"],
        "window_entry_bytes": win.get("window_entry_bytes"),
        "sliding_window": cfg.sliding_window if cfg.family in ("ced", "v4") else None,
        "n_layers": cfg.n_layers,
        "dspark_layers": cfg.num_nextn_predict_layers if cfg.family in ("ced", "v4") else 0,
        "dspark_window_bytes_per_sequence": win["dspark_window"],
        "dspark": _dspark_plan(cfg, win.get("window_entry_bytes")),
        "compressor_state_bytes_per_sequence": win["compressor_state"],
        "params_total": pc["total"],
        "params_engram": pc["engram"],
        "params_dspark": pc["dspark"],
        "params_vision": pc["vision"],
        "params_active_prefill": pc["active_prefill"],
        "params_active_decode": pc["active_decode"],
        "params_detail": dict(pc["detail"], dspark_active=pc["dspark_active"]),
        "context": context,
        "memory_gib": memory_gib,
        "bytes_per_sequence": bps,
        "max_sequences": ms,
        "assumptions": assumptions,
        "concurrency_example": concurrency_example() if example else None,
    }
    return out


# ============================================================================ human table


def _dspark_plan(cfg, window_entry_bytes) -> dict | None:
    """The DSpark fields and what one speculative verification adds per sequence."""
    if cfg.family not in ("ced", "v4") or not cfg.num_nextn_predict_layers:
        return None
    T = cfg.dspark_block_size + 1                      # anchor + drafts, one target forward
    return {"draft_layers": cfg.num_nextn_predict_layers, "taps": list(cfg.dspark_target_layer_ids),
            "block_size": cfg.dspark_block_size, "noise_token_id": cfg.dspark_noise_token_id,
            "markov_rank": cfg.dspark_markov_rank, "n_routed_experts": cfg.dspark_n_routed_experts,
            "num_experts_per_tok": cfg.dspark_num_experts_per_tok,
            "draft_window": cfg.sliding_window, "max_verify_tokens": T,
            "rollback_ring_bytes": None if window_entry_bytes is None
            else T * cfg.n_layers * window_entry_bytes}

