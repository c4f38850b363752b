"""Speculative verification: one target forward over several tokens per sequence, and the
rollback of everything the rejected ones touched.

`verify` appends T tokens to each sequence in one call (encoder pass, then the decoder over all
T rows) and returns the logits of every row (row j predicts the token after ids[:, j]) and, when
asked, the DSpark taps of every row. Before it runs, `mark` records what a later `rollback` needs;
`rollback(state, mark, n)` then makes the state exactly what it would be had only the first n
tokens been appended:
- token ids (Engram history) and `num_tokens` cut back;
- window rings: the slots of the rejected positions get back their old bytes and positions
  (a ring slot holds position p or p - window; T <= window);
- global rows (main KV and index keys of every row kind, contiguous or paged): the entry count
  of n tokens (`n_tokens // ratio`); rows past it are dead and overwritten by later appends;
- compressor pending rows of every ratio-r source: the old pending rows followed by the
  projections of the kept tokens, cut to the incomplete group. The projections are recomputed
  from the compressor's input captured during `verify`, with the same call shape, so they are
  the values the compressor itself computed.
Block-pool slots past the kept tokens are the cache manager's (`KVCacheManager.trim`), the stop
string state the engine's. `tests/test_rollback.py` compares every cache byte with a run that
never appended the rejected tokens.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from cedlm.model.kv_cache import ByteKVCache
from cedlm.model.state import SequenceState


@dataclass
class Mark:
    num_tokens: int
    T: int
    window: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]   # slots, bytes, positions
    pending: dict[int, tuple[torch.Tensor, torch.Tensor]]


def mark(state: SequenceState, T: int) -> Mark:
    """What `rollback` needs before T tokens are appended to `state`."""
    W = state.layout.window_slots
    if T > W:
        raise ValueError(f"verify: {T} tokens exceed the window ({W} slots); rollback needs T <= window")
    p0 = state.num_tokens
    slots = torch.arange(p0, p0 + T, device=state.device) % W
    win = {l: (slots, state.window[l][slots].clone(), state.window_pos[l][slots].clone())
           for l in state.window}
    pend = {s: (kv.clone(), g.clone()) for s, (kv, g) in state.pending.items()}
    return Mark(p0, T, win, pend)


@dataclass
class Captured:
    taps: torch.Tensor | None                       # [B, T, n_taps * D]
    comp_in: dict[int, torch.Tensor]                # ratio>1 source -> compressor input [B, T, D]


@contextmanager
def capture(model, taps: bool):
    """Record, during one model call, the DSpark taps (mean over the mHC copies of the residual
    stream entering each tap layer) and the input of every ratio>1 compressor."""
    cfg = model.cfg
    got: dict = {"taps": {}, "comp": {}}
    hooks = []
    if taps:
        for t in cfg.dspark_target_layer_ids:
            def tap(mod, args, t=t):
                got["taps"][t] = args[0].float().mean(2)
            hooks.append(model.layers[t].register_forward_pre_hook(tap))
    for s in cfg.kv_source_layer_ids:
        if cfg.compress_ratios[s] > 1:
            def comp(mod, args, s=s):
                got["comp"][s] = args[0]
            hooks.append(model.layers[s].attn.register_forward_pre_hook(comp))
    out = Captured(None, got["comp"])
    try:
        yield out
    finally:
        for h in hooks:
            h.remove()
    if taps and got["taps"]:
        out.taps = torch.cat([got["taps"][t] for t in cfg.dspark_target_layer_ids], -1)


@torch.no_grad()
def verify(model, input_ids, states: list[SequenceState], taps: bool = False):
    """Append input_ids [B, T] to the states in one call; every row runs the decoder.
    Returns (logits [B, T, vocab], Captured)."""
    host = torch.as_tensor(input_ids, dtype=torch.int64, device="cpu")      # token ids (host)
    B, T = host.shape
    if B != len(states):
        raise ValueError(f"input_ids: {B} rows for {len(states)} states")
    dev = model.device
    ids = host.to(dev, non_blocking=True)
    first = tuple(st.num_tokens for st in states)
    pos = (torch.tensor(first, dtype=torch.int64, device=dev).view(B, 1)
           + torch.arange(T, device=dev))
    cache = ByteKVCache(model.kv_layout, states)
    with capture(model, taps) as cap:
        x, pre = model.encoder_pass(ids, pos, cache, first=first)
        for st, row in zip(states, host.tolist()):
            st.advance(row)
        logits = model.decoder_pass(x, pre, pos, cache, ids=ids)
    return logits, cap


def rollback(model, state: SequenceState, m: Mark, n_keep: int, cap: Captured, b: int) -> None:
    """Keep the first n_keep of the m.T tokens appended since `m` (row b of the `verify` call
    that captured `cap`); every cache then holds exactly what n_keep appended tokens give."""
    if not 0 <= n_keep <= m.T:
        raise ValueError(f"rollback: n_keep {n_keep} not in [0, {m.T}]")
    if state.num_tokens != m.num_tokens + m.T:
        raise RuntimeError("rollback: the state moved since it was marked")
    if n_keep == m.T:
        return
    keep = m.num_tokens + n_keep
    state.truncate(keep)
    for l, (slots, w, wp) in m.window.items():
        rs = slots[n_keep:]
        state.window[l][rs] = w[n_keep:]
        state.window_pos[l][rs] = wp[n_keep:]
    for spec in state.layout.rows:
        (state.kv if spec.kind == "kv" else state.index)[spec.layer].set_len(keep // spec.ratio)
    cfg = model.cfg
    for s, (pk, pg) in m.pending.items():
        r = cfg.compress_ratios[s]
        if r <= 1:
            continue
        kv, gate = model.layers[s].attn.compressor.project(cap.comp_in[s][b])
        kv, gate = torch.cat((pk, kv[:n_keep])), torch.cat((pg, gate[:n_keep]))
        rem = keep % r
        state.pending[s] = (kv[kv.shape[0] - rem:].detach(), gate[gate.shape[0] - rem:].detach())
