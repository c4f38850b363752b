"""The decode step with static shapes: one new token for each of B sequences, as one function of
tensors that torch.compile captures whole (`compiled_step.py` compiles it and feeds it).

`CEDModel.decode` (the eager path, the oracle) walks Python objects: per-sequence window rings,
growing byte rows, pending compressor rows, data-dependent entry counts. This function computes
the same token's logits from tensors whose shapes do not depend on the data:

- window: every layer's ring bytes [B, S, wb] and positions [B, S] as they were before the step;
  the new row replaces slot pos % S (a ring slot is overwritten only by a position S later, which
  the window mask excludes anyway), and a mask (kp >= 0, kp <= pos, kp > pos - sliding_window)
  says which slots count. The keys are attended in slot order, not position order: same set,
  another summation order.
- compressed entries: each row kind is a pool of blocks [nblocks, per_block, width] read through
  the batch's block table [B, nb]; the table always has a spare column (block 0 where nothing is
  allocated), so entry n (the one this token may complete) has a place. The completed entry is
  not stored yet: its index score and its main-KV bytes are put in at index n with a mask;
  entries j < n + emit are visible.
- compressor: the pending rows of an incomplete group arrive padded [B, r-1, hd]; the group is
  pooled when this token completes it (pos % r == r-1), else the token joins the pending rows.
- attention: one kernel over the packed bytes (`attend_packed`): the window ring rows (FP8) and
  the selected entries (FP4, gathered: k rows) are decoded inside its loop.
- indexer: scores over every slot of the padded pool (-inf where invisible), a fixed top-k with a
  validity mask; the candidate pool as in `indexer.py`, a Reindex layer scoring only the pool's
  entries (gathered: candidate_topk_blocks x candidate_block_size keys, not the context).
- MoE: the router's top-k experts gathered from stacked weights ([E, ...] per projection).

Nothing here synchronises with the host (no .item(), .tolist() or branch on a value). The host
writes back what the step returns: the new window rows, the completed entries' bytes, the new
pending rows. The step also returns its discrete decisions (top-k entries, experts) so a test can
replay them on the eager path and compare the continuous math (`decisions.py`).

Kernels kept opaque (torch.ops.cedlm: codecs, index scores, top-k, attention) are custom ops
(`cedlm/kernels/ops.py`); everything else is the modules' own torch code, traced.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from cedlm.kernels import ops as _ops  # noqa: F401  (registers torch.ops.cedlm.*)
from cedlm.model.indexer import NEG, candidate_entries
from cedlm.model.mhc import collapse, expand, first_pre
from cedlm.model.norm import rms

cedlm_ops = torch.ops.cedlm


def _round(x: torch.Tensor, fmt: str | None) -> torch.Tensor:
    """The stored value of x in `fmt` (quantise-dequantise), float32."""
    if fmt is None or fmt == "none":
        return x.float()
    return cedlm_ops.quant_dequant(x.float().contiguous(), fmt)


def encode_rows(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return cedlm_ops.encode(x.float().contiguous(), fmt)


def words(b: torch.Tensor) -> torch.Tensor:
    """Packed rows uint8 [..., w] viewed as the widest integers that tile a row (int64, int32 or
    int16; w = 72 kv_fp4 and 132 window_fp8 bytes at the small presets' widths), for the step's
    gathers, selects and concatenations of rows: the same bytes moved, but inductor's CPU code
    handles a byte lane at a time where it moves whole words (measured: gathering and selecting
    64 rows of 72 bytes, 29 us as bytes, 5.6 us as int32). ``unwords`` views them back."""
    w = b.shape[-1]
    for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if w % size == 0:
            return b.view(dt)
    return b


def unwords(t: torch.Tensor) -> torch.Tensor:
    """The uint8 rows of ``words(b)``."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _gather_rows(pool: torch.Tensor, table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows at entry indices idx [B, ...] of a block pool [nblocks, per_block, width] through the
    block table [B, nb] -> [B, ..., width] (idx past the table is clamped; callers mask it)."""
    per = pool.shape[1]
    col = (idx // per).clamp(max=table.shape[1] - 1)
    blocks = torch.gather(table, 1, col.flatten(1)).view(col.shape)
    return pool[blocks, idx % per]


def _all_rows(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Every slot the table covers: [B, nb * per_block, width]."""
    B, nb = table.shape
    return unwords(words(pool)[table]).reshape(B, nb * pool.shape[1], pool.shape[2])


class StepShapes:
    """What the step's shapes depend on, per model: roles, sources, formats (read once), and
    whether this call's rows are one contiguous buffer (`flat`; a graph of its own), and whether
    it returns the DSpark taps (`taps`: the verify step's)."""

    flat = False
    taps = False

    def __init__(self, model):
        cfg = model.cfg
        self.cfg, self.model = cfg, model
        lay = model.kv_layout
        self.window_fmt, self.window_dim = lay.window_fmt, lay.window_dim
        self.sources = list(cfg.kv_source_layer_ids)
        self.key_sources = set(cfg.index_key_layer_ids)
        self.kv_fmt = {s: lay.row("kv", s).fmt for s in self.sources}
        self.idx_fmt = {s: lay.row("idx", s).fmt for s in self.key_sources}
        self.ratio = {s: cfg.compress_ratios[s] for s in self.sources}
        self.row_width = {s: lay.row("kv", s).width for s in self.sources}


def decode_step(shapes: StepShapes, ids, pos, hist, rings, ring_pos, pools, table, counts, pending,
                engram=None):
    """One token per sequence (`shapes.flat`: one sequence whose rows are one contiguous buffer,
    the pool [1, capacity, width], read without the table). With ids [B, T] (T >= 2), the DSpark
    verify step: T tokens per sequence at positions pos .. pos + T - 1, each row attending to the
    cache as it was plus the block's earlier rows; nothing is stored, so the host keeps any prefix
    of the block (`verify_step.py`); the shapes of `out` then carry a T (or G: the entries the
    block may complete) dimension, see `verify_step.VerifyStep.commit`.

    ids [B] (or [B, T]), pos [B] int64 (the first position); hist [B, h] the h previous token
    ids (Engram; pad id before position 0);
    rings [L, B, S, wb] uint8 and ring_pos [L, B, S] int64 (the windows before this step);
    pools: {("kv"|"idx", src): [nblocks, per_block, width] uint8}; table [B, nb] int64 block ids
    (a spare column at the end); counts {src: [B] int64 entries stored}; pending {src: (kv, gate)
    [B, r-1, hd] fp32, rows < pos % r valid}; engram: {layer: [B, 1, width]} the Engram rows
    looked up before the step (`engram_rows`; a table offloaded to host memory is read on the
    host), or None: looked up here from ids and hist.
    Returns (logits [B, vocab] fp32, out) with out = {"window": [L, B, wb] new ring rows,
    "entries": {src: (kv bytes [B, w], idx bytes [B, w'] or None, emit [B] bool)},
    "pending": {src: (kv, gate)}, "topk": {layer: (idx, valid)}, "experts": {layer: ids}}.
    """
    model, cfg = shapes.model, shapes.cfg
    B = ids.shape[0]
    ids = ids.view(B, -1)
    T = ids.shape[1]
    p1 = pos.view(B, 1) + torch.arange(T, device=pos.device)                     # [B, T]
    out = {"window": [], "entries": {}, "pending": {}, "topk": {}, "experts": {}}
    taps = {}
    image = None if model.image_token_id is None else (ids == model.image_token_id)
    comp: dict[int, tuple] = {}          # src -> (n visible [B], n stored [B], new kv bytes, emit)
    pool_sel = None

    x = model.embed(ids).view(B, T, 1, -1).expand(-1, -1, cfg.hc_mult, -1)
    pre = first_pre(x)
    if engram is None:
        engram = engram_rows(model, ids, hist) if cfg.engram_layer_ids else {}
    for l, layer in enumerate(model.layers):
        if shapes.taps and l in cfg.dspark_target_layer_ids:    # `rollback.capture`'s taps
            taps[l] = x.float().mean(2)
        if hasattr(layer, "engram"):
            x = layer.engram(x, engram[l], None if image is None else image)
        pre_a, post, comb = layer.mixes(x, "attn")
        h = layer.attn_norm(collapse(x, pre))                                   # [B, 1, D]
        a, pool_sel = _attention(shapes, layer.attn, h, p1, rings[l], ring_pos[l], pools, table,
                                 counts, pending, comp, pool_sel, out)
        x = expand(x, a, post, comb)
        pre_f, post, comb = layer.mixes(x, "ffn")
        f = routed_moe(layer.ffn, layer.ffn_norm(collapse(x, pre_a)), image, out, l)
        x = expand(x, f, post, comb)
        pre = pre_f
    logits = model.head(model.norm(collapse(x, pre))).float()
    out["window"] = torch.stack(out["window"])
    if shapes.taps:                                                # [B, T, taps * D]
        out["taps"] = torch.cat([taps[t] for t in cfg.dspark_target_layer_ids], -1)
    return (logits[:, 0] if T == 1 else logits), out


def engram_rows(model, ids, hist):
    """{Engram layer: [B, T, width] its looked-up rows} for token ids [B] (T = 1) or [B, T]
    after history [B, h]."""
    cfg = model.cfg
    h = hist.shape[1]
    full = torch.cat((hist, ids.view(hist.shape[0], -1)), 1)
    cids = model.engram_token_map[full]
    dead = model.image_mask(full)
    pad = model.engram_token_map[cfg.engram_pad_token_id]
    rows = {}
    for l in cfg.engram_layer_ids:
        eng = model.layers[l].engram
        r = eng.hasher.rows(cids, h) if dead is None else eng.hasher.rows(cids, h, dead, pad)
        rows[l] = eng.lookup(r)
    return rows


def _attention(shapes, attn, x, p1, ring, ring_pos, pools, table, counts, pending, comp, pool_sel, out):
    """One layer's attention for the step (see `Attention.forward`); returns ([B, T, D], pool).
    p1 [B, T]: the rows' positions."""
    cfg = shapes.cfg
    B, T = p1.shape
    P = project(attn.fused_x, x)                     # every projection of x in one product
    qr = attn.q_norm(P["wq_a"])
    P.update(project(attn.fused_qr, qr))             # and of qr
    q = P["wq_b"].unflatten(-1, (attn.H, attn.hd))                               # [B, 1, H, hd]
    if cfg.q_head_norm:
        q = rms(q, cfg.rms_norm_eps)
    q = attn.rope.apply(q, p1.unsqueeze(-1))
    # window: this token's row into the ring (slot order), the mask from positions
    row = encode_rows(attn.rope.apply(attn.kv_norm(P["wkv"]), p1), shapes.window_fmt)    # [B, T, wb]
    S = ring.shape[1]
    dev = x.device
    if T == 1:
        row = row[:, 0]
        at = (torch.arange(S, device=dev) == (p1 % S))                           # [B, S]
        ring = unwords(torch.where(at.unsqueeze(-1), words(row).unsqueeze(1), words(ring)))  # = stored x
        win_idx = torch.arange(B * S, device=dev).view(B, S)  # rows of ring.view(B * S, wb)
        kp = torch.where(at, p1, ring_pos)
        win_valid = ((kp >= 0) & (kp <= p1) & (kp > p1 - cfg.sliding_window)).unsqueeze(1)  # [B, 1, S]
    else:   # the ring as it was, then the block's rows (a ring slot the block would overwrite
        # may still be in an earlier row's window); row t sees the keys in (p_t - window, p_t]
        ring = unwords(torch.cat((words(ring).reshape(B * S, -1), words(row).reshape(B * T, -1))))
        win_idx = torch.cat((torch.arange(B * S, device=dev).view(B, S),
                             B * S + torch.arange(B * T, device=dev).view(B, T)), 1)   # [B, S + T]
        kp = torch.cat((ring_pos, p1), 1).unsqueeze(1)                           # [B, 1, S + T]
        q_at = p1.unsqueeze(-1)
        win_valid = (kp >= 0) & (kp <= q_at) & (kp > q_at - cfg.sliding_window)  # [B, T, S + T]
    out["window"].append(row)
    if attn.role == "full":
        comp[attn.layer_id] = _compress(shapes, attn, P, p1, pools, table, counts, pending, out)
    kv_fmt = shapes.kv_fmt.get(attn.src, shapes.window_fmt)
    comp_rows = ring.new_zeros(1, shapes.row_width.get(attn.src, ring.shape[-1]))
    comp_idx = torch.zeros(B, T, 0, dtype=torch.int64, device=dev)
    comp_valid = torch.zeros(B, T, 0, dtype=torch.bool, device=dev)
    if attn.ratio > 0:
        n_vis, n, main, emit = comp[attn.src]           # n_vis [B, T]; main [B, G, w], emit [B, G]
        kv_pool = pools[("kv", attn.src)]
        if attn.sparse:
            if attn.role in ("full", "reindex"):
                pool_sel = _select(shapes, attn.indexer, P, p1, comp, pool_sel, out)
            idx, valid = out["topk"][attn.isrc]                                  # [B, T, k]
        else:                                   # every visible entry, gathered once for the rows
            N = table.shape[1] * kv_pool.shape[1]
            idx = torch.arange(N, device=dev).expand(B, 1, N)
            valid = idx < n_vis.view(B, T, 1)
        rows = _gather_rows(words(kv_pool), table, idx.reshape(B, -1))           # [B, k, w]
        # the entries this call made (not stored yet) at their indices n, n + 1, ...
        G, made = main.shape[1], words(main)
        off = idx.reshape(B, -1) - n.view(B, 1)
        new = (off >= 0) & (off < G)
        made = made.gather(1, off.clamp(0, G - 1).unsqueeze(-1).expand(-1, -1, made.shape[-1]))
        rows = unwords(torch.where(new.unsqueeze(-1), made, rows))
        k = rows.shape[1]
        comp_rows, comp_valid = rows.reshape(B * k, -1), valid.expand(B, T, -1)
        comp_idx = torch.arange(B * k, device=dev).view(B, -1, idx.shape[-1]).expand(B, T, -1)
    # one kernel: the FP8 window rows and the selected FP4 entries decoded inside its loop
    o = cedlm_ops.attend_packed(q.float(), ring.reshape(-1, ring.shape[-1]), win_idx, win_valid, shapes.window_fmt,
                                comp_rows, comp_idx, comp_valid, kv_fmt, attn.attn_sink.float(),
                                attn.hd ** -0.5)
    return attn.output(o, p1, x.dtype), pool_sel


def _compress(shapes, attn, P, p1, pools, table, counts, pending, out):
    """The source's entries completed by the call's rows; returns (n visible [B, T] (row t sees
    entries < n_vis[:, t]), n stored [B], the new entries' main-KV bytes [B, G, w], emit [B, G]):
    G the groups the rows may complete, entry n + g made when emit[:, g]. Their index keys go
    with the source's stored index rows (out["idx_rows"], what the indexers score). The pending
    rows returned ("pending"): the old ones followed by the rows' projections, [B, r - 1 + T, hd]
    (see `verify_step.VerifyStep.commit`; for T = 1 the first r - 1, the token put at its phase)."""
    src, comp, r = attn.layer_id, attn.compressor, shapes.ratio[attn.layer_id]
    B, T = p1.shape
    dev = p1.device
    pos = p1[:, 0]
    kv, gate = P["c_wkv"].float(), P["c_wgate"].float() if r > 1 else None       # [B, T, hd]
    if r == 1:                                  # every row makes an entry
        lat, start = comp.norm(kv), p1
        emit = torch.ones(B, T, dtype=torch.bool, device=dev)
        made = torch.arange(1, T + 1, device=dev).expand(B, T)       # entries made by row t
    else:
        pk, pg = pending[src]                                                    # [B, r-1, hd]
        phase = (pos % r).view(B, 1)
        if T == 1:
            slot = (torch.arange(r - 1, device=dev) == phase).unsqueeze(-1)      # where it waits
            kvs, gates = torch.cat((pk, kv), 1), torch.cat((pg, gate), 1)
            out["pending"][src] = (torch.where(slot, kv, pk), torch.where(slot, gate, pg))
        else:   # slot i: pending row i below the phase, else the row i - phase of the call
            L = -(-(r - 1 + T) // r) * r
            i = torch.arange(L, device=dev).view(1, L)
            at = (i - phase).clamp(0, T - 1).unsqueeze(-1).expand(B, L, kv.shape[-1])
            old = (i < phase).unsqueeze(-1)
            pad = kv.new_zeros(B, L - (r - 1), kv.shape[-1])
            kvs = torch.where(old, torch.cat((pk, pad), 1), kv.gather(1, at))
            gates = torch.where(old, torch.cat((pg, pad), 1), gate.gather(1, at))
            out["pending"][src] = (kvs, gates)
        lat = comp.pool(kvs, gates)                                              # [B, G, hd]
        G = lat.shape[1]
        start = (pos - phase[:, 0]).view(B, 1) + r * torch.arange(G, device=dev)
        emit = (torch.arange(1, G + 1, device=dev) * r).view(1, G) <= phase + T
        made = (phase + torch.arange(1, T + 1, device=dev)) // r
    main = encode_rows(comp.rope.apply(lat, start), shapes.kv_fmt[src])              # [B, G, w]
    idx_bytes = None
    n = counts[src]
    if src in shapes.key_sources:
        ix = attn.indexer
        key = _round(ix.rope.apply(ix.keys(lat), start), shapes.idx_fmt[src])  # [B, G, d]
        idx_bytes = encode_rows(key, shapes.idx_fmt[src])
        raw = pools[("idx", src)] if shapes.flat else _all_rows(pools[("idx", src)], table)
        out.setdefault("idx_rows", {})[src] = (raw, key, n)
    out["entries"][src] = (main, idx_bytes, emit)
    return n.view(B, 1) + made, n, main, emit


def _select(shapes, ix, P, p1, comp, pool_sel, out):
    """`Indexer.select` for the call's query rows (one per token), over the padded entries. On a
    Reindex layer only the candidate pool's entries are scored (`pool_sel`: the candidate
    source's `candidate_entries`); the reference scores every entry and masks all but the pool:
    the same scores for the pool's entries (a score depends on its key alone), so the same
    selection, at the pool's cost instead of the context's."""
    cfg = shapes.cfg
    src = ix.keys_src
    n_vis = comp[src][0]                                                         # [B, T]
    raw, key, n = out["idx_rows"][src]
    B, T = n_vis.shape
    q = P["ix_q"].unflatten(-1, (ix.h, ix.d))                  # `Indexer.queries`, from the products
    w = P["ix_w"].float() * (ix.d ** -0.5 * ix.h ** -0.5)
    q = _round(ix.rope.apply(q, p1.unsqueeze(-1)), shapes.idx_fmt[src]).contiguous()
    reindex = pool_sel is not None and ix.in_pool
    # the stored keys straight from their bytes; the keys this call completed (not stored yet)
    # scored here and put at their indices n, n + 1, ... for the rows that see them
    if reindex:
        at, ok = pool_sel                                                        # [B, T, M]
        M, wk = at.shape[-1], words(raw)
        keys = unwords(wk.gather(1, at.reshape(B, T * M, 1).expand(-1, -1, wk.shape[-1])))
        stored = (ok & (at < n.view(-1, 1, 1))).reshape(B * T, 1, M)
        score = cedlm_ops.index_score(q.reshape(B * T, 1, ix.h, ix.d), w.reshape(B * T, 1, ix.h),
                                      keys.reshape(B * T, M, -1), stored,
                                      shapes.idx_fmt[src]).view(B, T, M)
    else:
        N = raw.shape[1]
        at = torch.arange(N, device=raw.device).view(1, 1, N)
        score = cedlm_ops.index_score(q, w, raw, (at < n.view(-1, 1, 1)).expand(B, T, N),
                                      shapes.idx_fmt[src])
    new = (torch.einsum("bthd,bgd->btgh", q, key).relu() * w.unsqueeze(2)).sum(-1)   # [B, T, G]
    off = at - n.view(-1, 1, 1)                                                  # [B, 1 or T, N or M]
    seen = (off >= 0) & (off < (n_vis - n.view(-1, 1)).unsqueeze(-1))             # [B, T, N or M]
    made = new.gather(-1, off.clamp(0, new.shape[-1] - 1).expand(B, T, -1))
    score = torch.where(seen, made, score)
    if reindex:
        score = score.masked_fill(~ok, NEG)
    elif ix.layer_id == cfg.candidate_source_layer_id:
        pool_sel = candidate_entries(score, n_vis, cfg.candidate_block_size, cfg.candidate_topk_blocks)
    idx, vals = cedlm_ops.stable_topk(score.contiguous(), min(cfg.index_topk, score.shape[-1]))
    if reindex:
        idx = at.gather(-1, idx)                                 # pool slots -> entry indices
    out["topk"][ix.layer_id] = (idx, vals > NEG)
    return pool_sel


def routed_moe(moe, x, image, out, l):
    """Routed experts from stacked weights + the shared expert; x [B, T, D] -> [B, T, D]."""
    B = x.shape[0] * x.shape[1]
    xf = x.reshape(B, -1)
    w, ids = moe.gate(xf, None if image is None else image.reshape(-1))
    out["experts"][l] = ids
    ids, order = ids.sort(-1)                         # ascending expert id, as the eager loop adds
    w = torch.gather(w, 1, order)
    W1, W2, W3 = moe.stacked
    lim = moe.experts[0].limit
    # Each matrix-vector product written as multiply-and-sum over the gathered expert rows:
    # inductor fuses the gather into the reduction and reads each selected expert's weights once
    # (a bmm over W[ids] would first copy them).
    xe = xf.view(B, 1, 1, -1)
    g = (xe * W1[ids]).sum(-1)                                                   # [B, k, I]
    u = (xe * W3[ids]).sum(-1)
    if lim:
        g, u = g.clamp(max=lim), u.clamp(-lim, lim)
    h = (F.silu(g) * u).unsqueeze(-2)                                            # [B, k, 1, I]
    y = (h * W2[ids]).sum(-1).float() * w.unsqueeze(-1)                          # [B, k, D]
    o = y[:, 0]
    for j in range(1, y.shape[1]):
        o = o + y[:, j]
    if moe.shared_experts is not None:                # `Expert.forward`, w1 and w3 in one product
        sh = moe.shared_experts
        g, u = project(moe.fused_shared, xf).values()
        if sh.limit:
            g, u = g.clamp(max=sh.limit), u.clamp(-sh.limit, sh.limit)
        o = o + sh.w2(F.silu(g) * u).float()
    return o.to(x.dtype).view(x.shape)


def project(fused, x):
    """fused = (weight [sum of outs, in], names, sizes): {name: x @ its rows^T} from one product."""
    W, names, sizes = fused
    return dict(zip(names, F.linear(x, W).split(sizes, -1)))


def fuse_projections(model) -> None:
    """Per layer, the weights that multiply the same input concatenated into one matrix, the
    modules' parameters made views of it (same storage, nothing copied twice): of the attention
    input x (wq_a, wkv, the compressor's wkv and wgate, the indexer's weights_proj), of qr (wq_b,
    the indexer's wq_b), of the MoE input (the shared expert's w1 and w3). One matrix product
    instead of up to five (the step's own layout; the modules compute the same products). The
    DSpark drafter's layers (`model.mtp`) too: the draft step (`draft_step.py`) reads them so."""
    for layer in _stacks(model):
        a = layer.attn
        if getattr(a, "fused_x", None) is not None:
            continue
        xs = [("wq_a", a.wq_a), ("wkv", a.wkv)]
        if a.role == "full":
            xs.append(("c_wkv", a.compressor.wkv))
            if a.compressor.wgate is not None:
                xs.append(("c_wgate", a.compressor.wgate))
        qrs = [("wq_b", a.wq_b)]
        if hasattr(a, "indexer"):
            xs.append(("ix_w", a.indexer.weights_proj))
            qrs.append(("ix_q", a.indexer.wq_b))
        a.fused_x, a.fused_qr = _concat(xs), _concat(qrs)
        sh = layer.ffn.shared_experts
        layer.ffn.fused_shared = None if sh is None else _concat([("w1", sh.w1), ("w3", sh.w3)])


def stack_experts(model) -> None:
    """Give every MoE stacked expert weights ([E, out, in] per projection, `moe.stacked`) whose
    slices ARE the experts' parameters (`_concat`: same storage, a later load writes both); the
    drafter's layers' too."""
    for layer in _stacks(model):
        moe = layer.ffn
        if getattr(moe, "stacked", None) is not None:
            continue
        stacks = []
        for name in ("w1", "w2", "w3"):
            W, _, sizes = _concat([(str(i), getattr(e, name)) for i, e in enumerate(moe.experts)])
            stacks.append(W.view(len(sizes), sizes[0], -1))
        moe.stacked = tuple(stacks)


def _stacks(model):
    """The target's layers, then the DSpark drafter's (when the model has one)."""
    return [*model.layers, *getattr(model, "mtp", ())]


def _concat(named):
    """The modules' weights concatenated along their output dim, each module's weight made a view
    of its rows: (weight [sum of outs, in], names, sizes)."""
    W = torch.cat([m.weight.detach() for _, m in named])
    sizes, at = [], 0
    for _, m in named:
        n = m.weight.shape[0]
        m.weight.data = W[at: at + n]
        sizes.append(n)
        at += n
    return W, [name for name, _ in named], sizes
