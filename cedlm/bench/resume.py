"""Figure 5: persistence (stored bytes per token) and resume time of a long session.

Stored bytes: what a DirStore actually holds (encoded record sizes: header, alignment and
checksum included), divided by the session's tokens, for
* CED-small session (`cedlm.engine.session`): global KV + index keys + token ids + compressor
  pending rows; window rings are never stored (rebuilt by replay);
* CED-small + its window rings (the same record plus every layer's ring, once per session);
* the V4-Flash-style baseline, session record (its global KV + index keys + ids + pending) plus its
  window rings once (resumable at the session's end only);
* the V4-Flash-style baseline as a prefix store that keeps window state: its session record plus the
  window KV of every token of every layer (what a paged prefix cache with SWA layers keeps so it
  can resume at any block boundary without replay: one ring snapshot per n_win tokens). This is
  the target's baseline.
The sessions are built directly at the context (global KV rows of random valid encodings,
random ids; see common.synth_ced_state); the bytes are sizes, not values.

Resume time of a session of that length, same CED-small model: `restore_session` from the store
(read + checksum + state rebuild + replay) with bounded replay (last n_win tokens) and exact
replay (last L x (n_win - 1) + 1 tokens), vs a full re-prefill of the same token ids (bounded
prefill in chunks of 512, the engine default: the cheapest way to rebuild without a store).
"""
from __future__ import annotations

import tempfile

import torch

from cedlm.bench.common import (Ctx, md_table, measure, plt, save_plot,
                               stats, synth_ced_state, target)

NAME = "resume"
TITLE = "Persistence and resume"


def _record_bytes(store, key, rec) -> int:
    before = store.stats()["bytes"]
    store.put(key, rec)
    return store.stats()["bytes"] - before


def run(ctx: Ctx) -> dict:
    from cedlm.cache.prefix import model_fingerprint
    from cedlm.cache.store import DirStore, Record
    from cedlm.engine.session import SESSION_PREFIX, restore_session, save_session, session_record

    C = ctx.size(32768, 2048)
    reps = ctx.size(5, 1)
    ced, v4 = ctx.ced(), ctx.v4()
    fp = model_fingerprint(ced.cfg.to_dict(), ced.state_dict())
    fp4 = model_fingerprint(v4.cfg.to_dict(), None)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cedlm-bench-") as tmp:
        store = DirStore(tmp)
        st = synth_ced_state(ced, C, seed=ctx.seed)
        b_ced = _record_bytes(store, SESSION_PREFIX + "ced", session_record(st, fp))
        assert store.get(SESSION_PREFIX + "ced") is not None
        rings = {f"win.{l}": st.window[l].cpu() for l in st.window}      # a record's arrays: host
        rings.update({f"winpos.{l}": st.window_pos[l].cpu() for l in st.window_pos})
        b_ced_rings = _record_bytes(store, "rings:ced", Record(meta={"kind": "rings"}, arrays=rings))
        s4 = synth_ced_state(v4, C, seed=ctx.seed)
        b_v4 = _record_bytes(store, SESSION_PREFIX + "v4", session_record(s4, fp4))
        rings4 = {f"win.{l}": s4.window[l].cpu() for l in s4.window}
        rings4.update({f"winpos.{l}": s4.window_pos[l].cpu() for l in s4.window_pos})
        b_v4_rings = _record_bytes(store, "rings:v4", Record(meta={"kind": "rings"}, arrays=rings4))
        wb = s4.window[0].shape[1]
        g = torch.Generator().manual_seed(1)
        every = {f"win.{l}": torch.randint(0, 255, (C, wb), dtype=torch.uint8, generator=g, device="cpu")
                 for l in range(v4.cfg.n_layers)}
        b_v4_every = _record_bytes(store, "windows:v4", Record(meta={"kind": "windows"}, arrays=every))
        del every, s4
        rows = [
            {"store": "CED-small session (global KV + index keys + ids)", "bytes": b_ced},
            {"store": "CED-small session + window rings", "bytes": b_ced + b_ced_rings},
            {"store": "V4-Flash-style baseline session + window rings", "bytes": b_v4 + b_v4_rings},
            {"store": "V4-Flash-style baseline + window KV of every token", "bytes": b_v4 + b_v4_every},
        ]
        for r in rows:
            r["context"] = C
            r["bytes_per_token"] = r["bytes"] / C
            r["ced_over_this"] = b_ced / r["bytes"]
        ratio = rows[0]["bytes"] / rows[3]["bytes"]
        ctx.log("  stored B/token: " + ", ".join(f"{r['bytes_per_token']:.0f}" for r in rows))

        # ------------------------------------------------------------ resume vs re-prefill
        save_session(ced, store, "ced", st, fp)
        ids = list(st.token_ids)
        del st
        restore_session(ced, store, "ced", fp, "bounded")                      # warm-up
        times = {}
        for mode in ("bounded", "exact"):
            times[f"restore_{mode}"] = measure(
                lambda: restore_session(ced, store, "ced", fp, mode), reps, 0, device=ctx.device)
            ctx.log(f"  restore {mode}: {min(times[f'restore_{mode}']):.2f} s")
        # the store read alone (no replay), for the breakdown
        from cedlm.engine.session import state_from_record
        times["store_read"] = measure(
            lambda: state_from_record(ced, store.get(SESSION_PREFIX + "ced"), fp), reps, 0,
            device=ctx.device)
        n_pre = ctx.size(2, 1)
        times["reprefill"] = measure(lambda s: ced.prefill(ids, s, "bounded", chunk_size=512),
                                     n_pre, 0, ced.new_state, device=ctx.device)
        ctx.log(f"  re-prefill {C}: {times['reprefill'][0]:.1f} s")
    st_ = {k: stats(v) for k, v in times.items()}
    pre = st_["reprefill"]["median_s"]
    timing = [{"method": k, "context": C, "replayed_tokens": {
                   "restore_bounded": ced.replay_tokens("bounded"),
                   "restore_exact": min(C, ced.replay_tokens("exact")),
                   "store_read": 0, "reprefill": C}[k],
               **{x: v[x] for x in ("median_s", "min_s", "max_s", "n", "spread")},
               "speedup_vs_reprefill": pre / v["median_s"]} for k, v in st_.items()]
    speed = pre / st_["restore_bounded"]["median_s"]
    from cedlm.config import ModelConfig
    from cedlm.plan import kv_bytes_per_token, window_bytes_per_sequence
    v41 = ModelConfig.preset("deepseek-v4.1-flash")
    v4f = ModelConfig.preset("deepseek-v4-flash")
    w4 = window_bytes_per_sequence(v4f)
    official = {
        "v41_bytes_per_token": kv_bytes_per_token(v41)["total"] + 4,
        "v4_flash_with_every_token_windows_bytes_per_token":
            kv_bytes_per_token(v4f)["total"] + 4 + v4f.n_layers * w4["window_entry_bytes"],
    }
    official["ratio"] = official["v41_bytes_per_token"] / \
        official["v4_flash_with_every_token_windows_bytes_per_token"]
    return {
        "config": {"context": C, "repeats": reps, "reprefill_runs": n_pre, "device": str(ctx.device),
                   "sessions": "built directly (random valid global KV, random ids); replay and "
                               "re-prefill are real",
                   "window_tokens": ced.cfg.sliding_window, "n_layers": ced.cfg.n_layers},
        "rows": rows,
        "timing": timing,
        "official_planner": official,
        "targets": {
            "bytes": target("stored B/token: CED session / V4-Flash-style store with window KV "
                            "of every token", "<=", 1 / 8, ratio),
            "resume": target("re-prefill time / bounded restore time", ">=", 20, speed),
        },
        "target": target("bytes <= 1/8 and resume >= 20x (both)", "==", True,
                         bool(ratio <= 1 / 8 and speed >= 20)),
        "notes": [
            f"bounded restore: {speed:.1f}x faster than re-prefill; exact restore: "
            f"{pre / st_['restore_exact']['median_s']:.1f}x.",
            "Official configs (planner): V4.1 global KV + 4 B token id per token vs V4-Flash "
            "global KV + ids + window KV of every token of every layer (config window format): "
            f"{official['ratio']:.3f}.",
        ],
    }


def table(res: dict) -> str:
    body = [[r["store"], r["context"], r["bytes"], r["bytes_per_token"], f"{r['ced_over_this']:.3f}"]
            for r in res["rows"]]
    t = md_table(["store", "context", "stored bytes", "B/token", "CED session / this"], body)
    body2 = [[r["method"], r["context"], r["replayed_tokens"], r["median_s"], r["spread"],
              f"{r['speedup_vs_reprefill']:.1f}x"] for r in res["timing"]]
    t += "\n\n" + md_table(["resume by", "context", "tokens run", "median s", "spread",
                            "re-prefill / this"], body2)
    return t


def plot(res: dict, path) -> bool:
    pyplot = plt()
    if pyplot is None:
        return False
    fig, (a, b) = pyplot.subplots(1, 2, figsize=(11, 4.5))
    names = [r["store"].replace(" (", "\n(").replace(" + ", "\n+ ") for r in res["rows"]]
    vals = [r["bytes_per_token"] for r in res["rows"]]
    a.barh(range(len(vals)), vals, color=["#1f77b4", "#aec7e8", "#bbbbbb", "#888888"])
    a.set_yticks(range(len(vals)), names, fontsize=7)
    a.invert_yaxis()
    for i, v in enumerate(vals):
        a.text(v, i, f" {v:,.0f}", va="center", fontsize=8)
    a.set_xlabel("stored bytes per token")
    a.set_title(f"Persistence at {res['config']['context']:,} tokens")
    t = [r for r in res["timing"] if r["method"] != "store_read"]
    b.bar([r["method"] for r in t], [r["median_s"] for r in t], color=["#1f77b4", "#ff7f0e", "#888888"])
    b.set_yscale("log")
    for i, r in enumerate(t):
        b.text(i, r["median_s"], f"{r['median_s']:.2f} s", ha="center", va="bottom", fontsize=8)
    b.set_ylabel("seconds (log)")
    b.set_title(f"Resume a {res['config']['context']:,}-token session")
    return save_plot(pyplot, fig, path)
