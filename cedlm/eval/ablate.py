"""`cedlm eval ablate`: the fidelity table, one switch at a time, written to FIDELITY.md with plots.

Every row is the same weights under one configuration (`cedlm.eval.fidelity.Setting`), measured
against the reference (BF16 KV, full prefill, dense attention over every compressed entry):
KL of the next-token distributions, perplexity change, top-1 agreement, retrieval accuracy per
context length, and the KV bytes per token of the row's configuration (`KVLayout`).

Rows (the model's own config supplies index_topk, candidate pool and window "as shipped"):
- storage, from the reference: main KV FP8 (E4M3 + UE8M0 per 32 dims, the window's format) /
  FP4 (kv_fp4); window FP8;
- sparse selection on (index_topk and candidate pool as shipped), from the reference: index keys
  BF16 / FP8 / FP4; index_topk sweep; candidate pool sweep; the indexer at initialisation;
- prefill exact / bounded, restore by exact / bounded replay, from the reference;
- window size sweep (dense), from the reference;
- everything as shipped, with the trained indexer and with the indexer at initialisation.
CSA2 sharing vs every compressed layer its own Full source needs weights that the model does not
have (one compressor and indexer per layer), so it is listed as not measured.

The JSON of every row goes to OUT/fidelity.json as each row finishes (a run cut short keeps the
rows it measured); FIDELITY.md and the plots are rewritten after each row.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from cedlm.data.retrieval import KINDS
from cedlm.eval.fidelity import REFERENCE, Measurement, Setting, reference


def csa2_unshared(cfg):
    """CSA2 sharing off: every compressed encoder layer its own Full source (its own compressed KV and
    index keys) and every compressed layer its own indexer; the decoder keeps its one global KV (the
    CED design has a single ratio-1 source)."""
    comp = [i for i in range(cfg.n_layers) if cfg.compress_ratios[i] > 0]
    kv = sorted({i for i in comp if cfg.compress_ratios[i] > 1} | ({cfg.decoder_start} & set(comp)))
    return cfg.replace(kv_source_layer_ids=kv, index_source_layer_ids=comp)


# (row, why not measured, the row's config: its KV bytes are reported)
NOT_MEASURED = [("CSA2 sharing -> every compressed layer its own Full source",
                 "needs a compressor and an indexer per compressed layer, which the model was not "
                 "trained with; copying the source's weights would measure an untrained layout. "
                 "Its KV bytes (the cost CSA2 saves) are in the byte columns", csa2_unshared)]


def initial_indexer(model, seed: int) -> dict:
    """The indexer weights of a freshly built model of the same config (its initialisation)."""
    from cedlm.model import build_model
    torch.manual_seed(seed)
    fresh = build_model(model.cfg)
    return {k: v for k, v in fresh.state_dict().items() if ".indexer." in k}


def rows(model, init_indexer: dict, quick: bool = False) -> list[tuple[str, Setting]]:
    """(group, setting) in the order they are measured (most telling first)."""
    c = model.cfg
    k, pool, win = c.index_topk, c.candidate_topk_blocks, c.sliding_window
    sparse = {"index_topk": k, "candidate_topk_blocks": pool}
    R = dict(REFERENCE)

    def s(name, over=None, **kw):
        return Setting(name, {**R, **(over or {})}, **kw)
    out = [
        ("reference", reference()),
        ("shipped", Setting("as shipped (model's indexer)", {}, note=f"{c.main_kv_format} / "
                            f"{c.index_kv_format} / {c.window_kv_format}, top-{k}, pool {pool}")),
        ("shipped", Setting("as shipped, indexer at initialisation", {}, indexer_state=init_indexer)),
        ("storage", s("main KV FP8", {"main_kv_format": "window_fp8"})),
        ("storage", s("main KV FP4", {"main_kv_format": "kv_fp4"})),
        ("storage", s("window FP8", {"window_kv_format": "window_fp8"})),
        ("selection", s(f"sparse top-{k}, index keys BF16", sparse)),
        ("selection", s(f"sparse top-{k}, index keys FP8", {**sparse, "index_kv_format": "window_fp8"})),
        ("selection", s(f"sparse top-{k}, index keys FP4", {**sparse, "index_kv_format": "index_fp4"})),
        ("selection", s(f"sparse top-{k}, index keys FP4, indexer at initialisation",
                        {**sparse, "index_kv_format": "index_fp4"}, indexer_state=init_indexer)),
        ("prefill", s("prefill exact", prefill="exact")),
        ("prefill", s("prefill bounded", prefill="bounded")),
        ("restore", s("restore: exact replay", restore="exact")),
        ("restore", s("restore: bounded replay", restore="bounded")),
    ]
    for kk in sorted({max(1, k // 4), max(1, k // 2), 2 * k} - {k}):
        out.append(("index_topk", s(f"index_topk {kk}", {**sparse, "index_kv_format": "index_fp4",
                                                          "index_topk": kk})))
    for pp in sorted({max(1, pool // 4), max(1, pool // 2), 2 * pool} - {pool}):
        out.append(("pool", s(f"candidate pool {pp} blocks", {**sparse, "index_kv_format": "index_fp4",
                                                               "candidate_topk_blocks": pp})))
    for ww in sorted({max(2, win // 2), 2 * win} - {win}):
        out.append(("window", s(f"window {ww}", {"sliding_window": ww})))
    return out


def run_ablation(model, tokenizer, tokens, out: Path, text_lengths, n_text, retrieval_lengths,
                 n_retrieval: dict, long_rows: set[str] | None = None, tail: int = 128,
                 progress: bool = True, seed: int = 1337, command: str = "", model_name: str = "",
                 only: list[str] | None = None, report: Path | None = None,
                 long_from: int | None = None, kinds: tuple[str, ...] = KINDS) -> list[dict]:
    """Measure every row; `long_rows` (names): the only rows measured at retrieval lengths
    >= `long_from` (long contexts are slow on a CPU; None: every row at every length)."""
    out.mkdir(parents=True, exist_ok=True)
    meas = Measurement(model, tokenizer, tokens, text_lengths, n_text, retrieval_lengths, n_retrieval,
                       tail=tail, progress=progress, kinds=kinds)
    init = initial_indexer(model, seed)
    table = rows(model, init)
    if only:
        table = [r for r in table if any(o.lower() in r[1].name.lower() for o in only)]
    long_lengths = {L for L in retrieval_lengths if long_from is not None and L >= long_from}
    results = []
    t0 = time.time()
    for group, setting in table:
        skip = set() if long_rows is None or setting.name in long_rows else long_lengths
        r = meas.run(setting, skip_retrieval=skip)
        r["group"] = group
        results.append(r)
        if progress:
            print(f"{setting.name}: kl {r['kl']:.5f} d_ppl {r['d_ppl_pct']:+.2f}% top1 {r['top1']:.3f} "
                  f"retrieval {r['retrieval']} ({r['wall_s']:.0f} s)", file=sys.stderr)
        meta = {"model": model_name, "command": command, "wall_s": time.time() - t0,
                "text_lengths": text_lengths, "text_samples": n_text, "tail": tail,
                "retrieval_lengths": retrieval_lengths, "retrieval_samples": n_retrieval,
                "retrieval_kinds": list(kinds),
                "threads": torch.get_num_threads()}
        (out / "fidelity.json").write_text(json.dumps({"meta": meta, "rows": results}, indent=2) + "\n")
        from cedlm.eval.fidelity_report import write_report
        write_report(out, meta, results, model.cfg, NOT_MEASURED, report)
    return results
