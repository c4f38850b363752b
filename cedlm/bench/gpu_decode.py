"""GPU figure (b): decode tokens/s on one device, CED against the HF Llama of equal parameters.

CED: the `small` preset (random seeded weights) decoding through the engine's decode step
(`ced_decode_fn`: on CUDA the engine's default is the static step captured as CUDA graphs; the
mode is recorded), greedy, on B sequences of C tokens each. The peer: the HF `LlamaForCausalLM`
the CPU peer figure builds (`peer.llama_for`: CED's width, depth and vocabulary, MLP width solved
for CED's parameter count without its Engram tables; float32, SDPA), moved to the same device,
decoding with `generate` from a DynamicCache already holding C tokens. Both caches are built
directly on the device with random values (CED: `device_states`, valid encodings in the engine's
block pool; HF: `DynamicCache.update`): decode cost depends on sizes, not values.

A cell is one (batch, context, engine): one warm-up run (its time, which includes compiling or
capturing the step's graph for a new shape, is `first_call_s`), then up to `repeats` timed runs
of `new_tokens` tokens, stopped early at `cell_cap_s`; tokens/s = B x new_tokens / median run.
Cells run in order of cost (contexts ascending, then batches); a cell is skipped, with its
reason, when the figure's budget is spent, when its cache would not fit `memory_cap_bytes`, or
when transformers is absent (HF). A cell that raises or runs past its cap is recorded as failed
and the next one runs. `on_row` receives the result so far after every cell (the phase writes it
to disk, so a phase killed by its timeout still leaves the cells it finished).
"""
from __future__ import annotations

import statistics
import time

import torch

from cedlm.bench.common import GIB, ced_decode_fn, md_table
from cedlm.bench.gpu_common import Clock, sync, time_cap

NAME = "decode"
BATCHES = (1, 8, 64)
CONTEXTS = (512, 2048, 8192, 32768)
BLOCK_TOKENS = 64                       # the engine's default block size


def device_states(model, context: int, batch: int, device, seed: int = 0, margin: int = 64) -> list:
    """`batch` SequenceStates of `context` tokens in one block pool on `device`, as after a real
    prefill: every row kind holds context // ratio valid encodings (512 random N(0,1) rows encoded
    on the device, tiled), every window ring is full, the pending compressor rows of the
    incomplete group are random; room for `margin` more tokens each."""
    from cedlm.cache.block_pool import BlockPool, BlockTable
    from cedlm.kernels import encode
    from cedlm.model.state import SequenceState
    cfg, layout = model.cfg, model.kv_layout
    bt = layout.round_block_tokens(BLOCK_TOKENS)
    blocks = -(-(context + margin) // bt)
    pool = BlockPool(layout, batch * blocks, bt, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    host = torch.Generator().manual_seed(seed)
    base = {}

    def tiled(n: int, dim: int, fmt: str) -> torch.Tensor:
        if (fmt, dim) not in base:
            base[fmt, dim] = encode(torch.randn(512, dim, generator=g, device=device), fmt)
        b = base[fmt, dim]
        return b.repeat(-(-n // b.shape[0]), 1)[:n]
    win = cfg.sliding_window
    pos = torch.arange(max(0, context - win), context, device=device)
    states = []
    for _ in range(batch):
        table = BlockTable(pool)
        st = SequenceState(layout, pool.rows(table), device=device)
        table.ensure(-(-context // bt))
        ids = torch.tensor(table.blocks, dtype=torch.int64, device=device)
        for spec in layout.rows:
            rows = (st.kv if spec.kind == "kv" else st.index)[spec.layer]
            n, per = context // spec.ratio, pool.per_block[spec.key]
            nb = -(-n // per)
            if nb:
                pool.data[spec.key][ids[:nb]] = tiled(nb * per, spec.dim, spec.fmt).view(nb, per, spec.width)
            rows.set_len(n)
        for s, r, d in layout.pending:
            k = context % r
            st.pending[s] = (torch.randn(k, d, generator=g, device=device),
                             torch.randn(k, d, generator=g, device=device))
        slots = pos % win
        st.window_all[:, slots] = tiled(pos.numel(), layout.window_dim, layout.window_fmt)
        st.window_pos_all[:, slots] = pos
        st.set_tokens(torch.randint(0, cfg.vocab_size, (context,), generator=host, device="cpu").tolist())
        states.append(st)
    return states


def _hf_cache(tf, hf, B: int, C: int, device):
    """A DynamicCache of B x C random tokens drawn on the device itself (peer._hf_cache draws on
    the host for CPU-reproducible values; here gigabytes at 32k x 64 would cost the time budget)."""
    c = hf.config
    hd = c.hidden_size // c.num_attention_heads
    cache = tf.DynamicCache()
    for l in range(c.num_hidden_layers):
        cache.update(torch.randn(B, c.num_key_value_heads, C, hd, device=device),
                     torch.randn(B, c.num_key_value_heads, C, hd, device=device), l)
    return cache


def hf_cache_bytes(hf, B: int, C: int) -> int:
    """fp32 K and V of every layer for B sequences of C tokens."""
    c = hf.config
    hd = c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers * 2 * B * c.num_key_value_heads * C * hd * 4


def _ced_runner(model, step, B: int, C: int, new: int, margin: int, device, seed: int):
    states = device_states(model, C, B, device, seed=seed, margin=margin)
    tok = torch.full((B,), 7, dtype=torch.int64, device=device)

    def run():
        nonlocal tok
        for _ in range(new):
            tok = step(tok, states).argmax(-1)
    return run


def _hf_runner(tf, hf, B: int, C: int, new: int, device, seed: int):
    from cedlm.bench.peer import hf_generate_from_cache
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, hf.config.vocab_size, (B, C + 1), generator=g, device="cpu").to(device)
    mask = torch.ones_like(ids)
    cache = _hf_cache(tf, hf, B, C, device)

    def run():
        hf_generate_from_cache(hf, ids, mask, cache, C, new)
    return run


def _timed(run, device, repeats: int, cap_s: float) -> dict:
    """Warm-up run, then up to `repeats` timed runs (at least one), stopping at `cap_s`."""
    sync(device)
    t0 = time.perf_counter()
    run()
    sync(device)
    first = time.perf_counter() - t0
    times, start = [], time.perf_counter()
    while len(times) < repeats:
        t0 = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > cap_s:
            break
    return {"first_call_s": first, "runs_s": times, "median_s": statistics.median(times)}


def _release(device) -> None:
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _cell(name: str, make, B: int, new: int, device, repeats: int, cap_s: float,
          hard_s: float | None = None) -> dict:
    """One engine's cell: build (make), warm up, time; failed (with the error) when it raises or
    runs past `hard_s` (default 3 x cap + 30 s: room for a first call that captures a graph)."""
    t0 = time.perf_counter()
    try:
        with time_cap(hard_s or cap_s * 3 + 30, f"{name} cell"):
            run = make()
            setup = time.perf_counter() - t0
            r = _timed(run, device, repeats, cap_s)
        r.update(status="measured", setup_s=setup, tokens_per_s=B * new / r["median_s"])
    except Exception as e:                  # TimeCapExceeded, an OOM, a step that fails
        r = {"status": "failed", "error": f"{type(e).__name__}: {str(e)[:400]}"}
    r["wall_s"] = time.perf_counter() - t0
    _release(device)
    return r


def decode_throughput(device: torch.device, batches=BATCHES, contexts=CONTEXTS, new_tokens: int = 16,
                      repeats: int = 3, cell_cap_s: float = 20.0, budget_s: float = 150.0,
                      preset: str = "small", decode_step: str | None = None,
                      memory_cap_bytes: int = 64 * GIB, seed: int = 0, log=print, on_row=None) -> dict:
    """The grid of cells (see the module docstring); the result so far goes to `on_row` after
    every cell."""
    from cedlm.bench.peer import ensure_transformers, llama_for
    from cedlm.config import ModelConfig
    from cedlm.model import CEDModel
    if new_tokens < 1 or repeats < 1:
        raise ValueError(f"new_tokens, repeats: must be >= 1, got {new_tokens}, {repeats}")
    clock = Clock(budget_s)
    torch.manual_seed(seed)
    ced = CEDModel(ModelConfig.preset(preset)).eval().to(device)
    params = ced.num_parameters(exclude_engram=True)
    step, step_error = None, None
    try:
        step = ced_decode_fn(ced, decode_step)
    except Exception as e:                  # a bad mode, a step that cannot be set up here
        step_error = f"the CED decode step could not be made: {type(e).__name__}: {e}"
    tf, how = ensure_transformers(False, log)
    hf = None
    if tf is not None:
        try:
            hf = llama_for(tf, params, ced.cfg, max(contexts) + new_tokens + 512).to(device)
        except Exception as e:              # the CED cells still run
            how = f"the HF Llama could not be built: {type(e).__name__}: {e}"
    margin = new_tokens * (repeats + 2) + 64
    res = {"config": {"device": str(device), "preset": preset, "batches": list(batches),
                      "contexts": list(contexts), "new_tokens": new_tokens, "repeats": repeats,
                      "cell_cap_s": cell_cap_s, "budget_s": budget_s,
                      "memory_cap_bytes": memory_cap_bytes,
                      "ced_decode_step": step.mode if step is not None else step_error,
                      "ced_params_without_engram_tables": params, "transformers": how,
                      "hf_params": sum(p.numel() for p in hf.parameters()) if hf is not None else None},
           "rows": [], "status": "running"}
    cost = {"ced": 5.0, "hf": 5.0}             # the last cell's wall time per engine (an estimate)
    for C in sorted(contexts):
        for B in sorted(batches):
            row = {"batch": B, "context": C, "new_tokens": new_tokens}
            for eng in ("ced", "hf"):
                layout_bytes = ced.kv_layout.sequence_bytes(C + margin) * B
                # HF's DynamicCache grows by torch.cat, one layer at a time: ~1 layer extra
                need = layout_bytes if eng == "ced" else (5 * hf_cache_bytes(hf, B, C) // 4 if hf else 0)
                if eng == "hf" and hf is None:
                    row[eng] = {"status": "skipped", "reason": how}
                elif eng == "ced" and step is None:
                    row[eng] = {"status": "failed", "error": step_error}
                elif need > memory_cap_bytes:
                    row[eng] = {"status": "skipped", "reason": f"cache {need / GIB:.1f} GiB > the "
                                f"cap of {memory_cap_bytes / GIB:.0f} GiB"}
                elif clock.left < 1.5 * cost[eng]:
                    row[eng] = {"status": "skipped", "reason": f"decode budget spent ({clock.left:.0f} "
                                f"s left of {budget_s:.0f}; this cell ~{cost[eng]:.0f} s)"}
                else:
                    make = ((lambda: _ced_runner(ced, step, B, C, new_tokens, margin, device, seed))
                            if eng == "ced" else (lambda: _hf_runner(tf, hf, B, C, new_tokens, device, seed)))
                    cap = min(cell_cap_s, max(clock.left, 1.0))
                    hard = max(5.0, min(cell_cap_s * 3 + 30, clock.left))
                    row[eng] = _cell(eng, make, B, new_tokens, device, repeats, cap, hard)
                    cost[eng] = max(row[eng]["wall_s"] - row[eng].get("first_call_s", 0.0),
                                    row[eng]["wall_s"] / 4)
            c, h = row["ced"].get("tokens_per_s"), row["hf"].get("tokens_per_s")
            row["ced_over_hf"] = c / h if c and h else None
            res["rows"].append(row)
            log(f"  decode B={B} C={C}: CED {_tps(row['ced'])}, HF {_tps(row['hf'])}"
                + (f" ({row['ced_over_hf']:.2f}x)" if row["ced_over_hf"] else ""))
            if on_row is not None:
                on_row(res)
    res["config"]["ced_compile_s"] = dict(getattr(step, "compile_s", {}))
    res["status"] = "done"
    res["elapsed_s"] = clock.elapsed
    return res


def _tps(r: dict) -> str:
    if r.get("status") == "measured":
        return f"{r['tokens_per_s']:.1f} tok/s"
    return f"{r.get('status')} ({r.get('reason') or r.get('error')})"


def table(res: dict) -> str:
    def cell(r):
        if r.get("status") == "measured":
            return r["tokens_per_s"]
        return f"{r.get('status')}: {r.get('reason') or r.get('error')}"
    body = [[r["context"], r["batch"], cell(r["ced"]), cell(r["hf"]),
             f"{r['ced_over_hf']:.2f}x" if r["ced_over_hf"] else "n/a",
             r["ced"].get("first_call_s", "n/a")] for r in res["rows"]]
    c = res["config"]
    return (md_table(["context", "batch", "CED tokens/s", "HF Llama tokens/s", "CED / HF",
                      "CED first run s (compile/capture)"], body)
            + f"\n\nCED `{c['preset']}` ({c['ced_params_without_engram_tables']:,} parameters without "
              f"Engram tables), decode step `{c['ced_decode_step']}`; HF Llama "
              f"{c['hf_params'] or 'n/a'} parameters ({c['transformers']}); {c['new_tokens']} new "
              f"tokens per run, median of up to {c['repeats']} runs.")
