"""GPU figure (a): concurrent sequences in a fixed KV budget of real device memory.

`small40` (the official V4.1 40-layer schedule and KV geometry at small width) against its
V4-Flash counterpart `small40-v4flash` (the same width, V4-Flash's 43-layer schedule: CSA ratio 4
with index keys and HCA ratio 128, v4_fp8 main KV), at 32k and 128k context, in a budget of 40 GiB
(the seeds: about 4x the sequences).

The bytes are the engine's own allocations, counted live on the device, not the planner's sum:
the engine's KV layout (`model.kv_layout` = `KVLayout.from_config`), its block pool (`BlockPool`,
sized as the engine sizes it: `blocks_for_budget`), a block table per sequence and a
`SequenceState` per sequence over its paged rows (the window rings and their positions), with
every ratio-r source's compressor pending rows at their largest (r - 1 fp32 rows of kv and gate,
as a group one token short of complete leaves them). No model weights are needed: the caches are
sized by the config alone.

Per (preset, context):
1. one sequence's fixed bytes (rings, ring positions, pending rows) and the bytes of a block,
   measured on the device (CUDA: `torch.cuda.memory_allocated` before / after; CPU: the storages);
2. S = budget // (blocks x live block bytes + live fixed bytes);
3. the real thing: the pool the engine builds for S sequences in that budget, S tables that take
   their blocks (NoFreeBlocks if they do not fit) and S states; the live bytes of it all are
   checked against the budget (if over, S shrinks and step 3 runs again, at most twice);
4. beside it, the planner's prediction (`KVLayout.sequence_bytes`, `cedlm.plan.sequence_bytes`).
"""
from __future__ import annotations

import time

import torch

from cedlm.bench.common import GIB, md_table
from cedlm.bench.gpu_common import LiveBytes, storage_bytes, tensors_on

NAME = "capacity"
PRESETS = ("small40", "small40-v4flash")
CONTEXTS = (32768, 131072)
BUDGET_BYTES = 40 * GIB
BLOCK_TOKENS = 128
PROBE_BLOCKS = 1024
TARGET_RATIO = 3.9                      # the seeds' "about 4x" (the CPU capacity figure's target)


def _new_state(layout, pool, device):
    """One sequence as the engine holds it: a block table in `pool`, a state over its paged rows,
    the compressor pending rows at their largest."""
    from cedlm.cache.block_pool import BlockTable
    from cedlm.model.state import SequenceState
    table = BlockTable(pool)
    st = SequenceState(layout, pool.rows(table), device=device)
    st.pending = {s: (torch.zeros(r - 1, d, device=device), torch.zeros(r - 1, d, device=device))
                  for s, r, d in layout.pending}
    return table, st


def _measure(live: LiveBytes, make):
    """(object made, live bytes it took: the allocator's delta, or its storages on the CPU)."""
    before = live.read()
    obj = make()
    after = live.read()
    return obj, (after - before if before is not None else storage_bytes([obj]))


def _probe(layout, bt: int, device, live: LiveBytes, probe_blocks: int) -> dict:
    """Live bytes of one block (a pool of `probe_blocks`, divided) and of one sequence's fixed
    state, with the layout's prediction of each."""
    from cedlm.cache.block_pool import BlockPool
    pool, pool_bytes = _measure(live, lambda: BlockPool(layout, probe_blocks, bt, device=device))
    tensors_on([pool.data], device, "BlockPool")
    (_, st), fixed = _measure(live, lambda: _new_state(layout, pool, device))
    tensors_on([st], device, "SequenceState")
    return {"live_bytes_per_block": pool_bytes / probe_blocks, "live_fixed_bytes": fixed,
            "tensor_fixed_bytes": storage_bytes([st]),
            "planned_bytes_per_block": layout.bytes_per_block(bt),
            "planned_fixed_bytes": layout.window_bytes_per_sequence + layout.max_pending_bytes}


def _allocate(layout, bt: int, device, live: LiveBytes, budget: int, S: int, blocks: int,
              fixed_extra: int) -> dict:
    """The engine's allocation for S sequences of `blocks` blocks in `budget`: its pool
    (blocks_for_budget, the budget less what the engine does not reserve: `fixed_extra` per
    sequence), S tables with their blocks, S states. Live bytes of all of it; freed after."""
    from cedlm.cache.block_pool import BlockPool, NoFreeBlocks
    from cedlm.cache.kv_cache_manager import blocks_for_budget
    t0 = time.perf_counter()
    base = live.read()
    n_blocks = blocks_for_budget(layout, budget - S * fixed_extra, S, bt)
    pool = BlockPool(layout, n_blocks, bt, device=device)
    seqs, fitted = [], True
    try:
        for _ in range(S):
            table, st = _new_state(layout, pool, device)
            table.ensure(blocks)
            seqs.append((table, st))
    except NoFreeBlocks:
        fitted = False
    after = live.read()
    tensor = storage_bytes([pool.data] + [st for _, st in seqs])
    out = {"sequences_allocated": len(seqs), "fitted": fitted, "pool_blocks": n_blocks,
           "blocks_used": pool.num_used, "blocks_free": pool.num_free,
           "allocated_bytes": after - base if base is not None else tensor, "tensor_bytes": tensor,
           "peak_allocated_bytes": (torch.cuda.max_memory_allocated(device) - base
                                    if base is not None else None),
           "alloc_s": time.perf_counter() - t0}
    for table, _ in seqs:
        table.free()
    del seqs, pool
    live.release()
    return out


def _row(cfg_name: str, layout, C: int, bt: int, device, live: LiveBytes, budget: int,
         probe: dict) -> dict:
    from cedlm.config import ModelConfig
    from cedlm.plan import sequence_bytes, window_bytes_per_sequence
    blocks = -(-C // bt)
    per_seq = blocks * probe["live_bytes_per_block"] + probe["live_fixed_bytes"]
    S = int(budget // per_seq)
    fixed_extra = probe["live_fixed_bytes"] - layout.window_bytes_per_sequence
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    alloc = _allocate(layout, bt, device, live, budget, S, blocks, fixed_extra)
    retries = 0
    while S > 0 and (not alloc["fitted"] or alloc["allocated_bytes"] > budget) and retries < 2:
        over = max(alloc["allocated_bytes"] - budget, per_seq)
        S -= max(1, -(-int(over) // int(per_seq)))
        retries += 1
        alloc = _allocate(layout, bt, device, live, budget, S, blocks, fixed_extra)
    planned = layout.sequence_bytes(C, bt)
    cfg = ModelConfig.preset(cfg_name)
    planner = sequence_bytes(cfg, C) - window_bytes_per_sequence(cfg)["dspark_window"]
    return {"preset": cfg_name, "context": C, "block_tokens": bt, "blocks_per_sequence": blocks,
            "sequences_live": S if alloc["fitted"] else alloc["sequences_allocated"],
            "sequences_planned": budget // planned,
            "live_bytes_per_sequence": per_seq, "planned_bytes_per_sequence": planned,
            "planner_bytes_per_sequence": planner,
            "live_fixed_bytes_per_sequence": probe["live_fixed_bytes"],
            "planned_fixed_bytes_per_sequence": probe["planned_fixed_bytes"],
            "live_bytes_per_block": probe["live_bytes_per_block"],
            "planned_bytes_per_block": probe["planned_bytes_per_block"],
            "kv_bytes_per_token": float(layout.bytes_per_token),
            "within_budget": alloc["fitted"] and alloc["allocated_bytes"] <= budget,
            "retries": retries, **alloc}


def capacity(device: torch.device, budget_bytes: int = BUDGET_BYTES, contexts=CONTEXTS,
             presets=PRESETS, block_tokens: int = BLOCK_TOKENS, probe_blocks: int = PROBE_BLOCKS,
             log=print, on_row=None) -> dict:
    """Sequences of each preset that fit `budget_bytes` of live device memory at each context
    (see the module docstring); ratios of the first preset over the second. `on_row` receives
    {"rows": [...]} after every (preset, context), so a phase cut short keeps what it counted."""
    from cedlm.config import ModelConfig
    from cedlm.kv_layout import KVLayout
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes: must be positive, got {budget_bytes}")
    if len(presets) != 2:
        raise ValueError(f"presets: two names (CED, its V4-Flash counterpart), got {presets!r}")
    live = LiveBytes(device)
    probes = {}
    for name in presets:                     # both probes first: a run cut short keeps pairs
        layout = KVLayout.from_config(ModelConfig.preset(name))
        bt = layout.round_block_tokens(block_tokens)
        probes[name] = (layout, bt, _probe(layout, bt, device, live, probe_blocks))
        live.release()                       # the probe's pool and state are gone: free their cache
    config = {"budget_bytes": budget_bytes, "contexts": list(contexts), "presets": list(presets),
              "block_tokens": block_tokens, "probe_blocks": probe_blocks, "counted_by": live.counter}
    rows = []
    for C in contexts:
        for name in presets:
            layout, bt, probe = probes[name]
            r = _row(name, layout, C, bt, device, live, budget_bytes, probe)
            log(f"  capacity {name} @ {C}: {r['sequences_live']:,} sequences live "
                f"({r['live_bytes_per_sequence'] / 2**20:.1f} MiB each; planned "
                f"{r['sequences_planned']:,}), {r['allocated_bytes'] / GIB:.2f} GiB allocated "
                f"in {r['alloc_s']:.1f} s")
            rows.append(r)
            if on_row is not None:
                on_row(_result(config, rows, "running"))
    return _result(config, rows, "done")


def _result(config: dict, rows: list, status: str) -> dict:
    """The figure from the rows counted so far: ratios for every context both presets reached."""
    a, b = config["presets"]
    ratios = {}
    for C in config["contexts"]:
        ra = next((r for r in rows if r["preset"] == a and r["context"] == C), None)
        rb = next((r for r in rows if r["preset"] == b and r["context"] == C), None)
        if ra is None or rb is None:
            continue
        ratios[str(C)] = {
            "sequences_live": ra["sequences_live"] / rb["sequences_live"] if rb["sequences_live"] else None,
            "sequences_planned": (ra["sequences_planned"] / rb["sequences_planned"]
                                  if rb["sequences_planned"] else None),
            "bytes_per_sequence_live": rb["live_bytes_per_sequence"] / ra["live_bytes_per_sequence"]}
    measured = [v["sequences_live"] for v in ratios.values() if v["sequences_live"] is not None]
    return {"config": config, "status": status, "rows": rows, "ratios": ratios,
            "target": {"metric": f"sequences {a} / {b} in the budget (worst context)", "op": ">=",
                       "value": TARGET_RATIO, "measured": min(measured) if measured else None,
                       "met": (min(measured) >= TARGET_RATIO) if measured else None},
            "notes": ["Live fixed bytes include the ring positions (int64 per slot) and the "
                      "allocator's rounding, which the layout's window bytes leave out.",
                      "Compressor pending rows are allocated at their largest (r - 1 rows per "
                      "ratio-r source): what the engine's states reach between two entries."]}


def table(res: dict) -> str:
    body = [[r["preset"], r["context"], r["sequences_live"], r["sequences_planned"],
             r["live_bytes_per_sequence"], r["planned_bytes_per_sequence"],
             r["live_fixed_bytes_per_sequence"] - r["planned_fixed_bytes_per_sequence"],
             r["allocated_bytes"] / GIB, "yes" if r["within_budget"] else "**no**"]
            for r in res["rows"]]
    t = md_table(["preset", "context", "sequences (live)", "sequences (planned)",
                  "live B/sequence", "planned B/sequence", "live - planned fixed B/seq",
                  "GiB allocated", "within budget"], body)
    a, b = res["config"]["presets"]
    body2 = [[C, f"{v['sequences_live']:.2f}x" if v["sequences_live"] else "n/a",
              f"{v['sequences_planned']:.2f}x" if v["sequences_planned"] else "n/a",
              f"{v['bytes_per_sequence_live']:.2f}x"] for C, v in res["ratios"].items()]
    t += "\n\n" + md_table(["context", f"{a} / {b} (live)", f"{a} / {b} (planned)",
                            f"{b} / {a} bytes per sequence (live)"], body2)
    return t + (f"\n\nBudget {res['config']['budget_bytes'] / GIB:g} GiB, counted by "
                f"{res['config']['counted_by']}."
                + ("" if res.get("status", "done") == "done" else " (cut short: the rows it counted)"))
