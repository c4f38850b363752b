"""The DSpark draft step with static shapes: one block's hidden rows and base logits for B
sequences in one compiled call, the drafter's counterpart of the decode and verify steps.

`dspark.draft_block` (the reference, and the fallback) decodes each stage's window ring from its
bytes, concatenates the block's own window rows, and attends densely through the modules. This
function computes the same from tensors whose shapes do not depend on the data:

- context: every stage's ring bytes [S, B, W, wb] and their positions [B, W] (the same slots in
  every stage); a ring slot counts when P - sliding_window <= kp < P (`dspark.window_visible`),
  the same for every row of the block;
- the block: the anchor and N - 1 noise tokens at positions P .. P + N - 1; each stage's window
  rows of the block are encoded to the window format and attended with the ring's rows by one
  `attend_packed` kernel (non-causal inside the block), which decodes them in its loop;
- MoE: the router's top-k experts over stacked weights (`step.routed_moe`, as the decode step).

Nothing is stored. The Markov pass that follows (`dspark.markov_decode`) stays on the host: each
draft feeds the next row's bias, and a sampled row draws from its own generator.

    ds = DraftStep.of(CompiledDecode.of(model))
    h, base = ds(states, anchors, P)        # DraftState per sequence; h [B, N, D], base [B, N, V]

Modes follow the decode step's (`CompiledDecode.mode`): "compiled" compiles this function (its
own graphs: batch 1 and batch >= 2), "static" and "cudagraph" run it uncompiled, "eager" (or a
reason in `why_not`) sends the caller to `dspark.draft_block` (`usable` is False).
`tests/test_draft_step.py` compares h, base and the experts with `draft_block`.
"""
from __future__ import annotations

import weakref

import torch

from cedlm.model import dspark
from cedlm.model import step as step_
from cedlm.model.compiled_step import (CompiledDecode, compile_step, graph_name, mark_dynamic,
                                       run_step)
from cedlm.model.mhc import collapse, expand, first_pre
from cedlm.model.norm import rms

cedlm_ops = torch.ops.cedlm


def draft_step(model, fmt: str, rings, ring_pos, anchors, P):
    """rings [S, B, W, wb] uint8 (every draft stage's window ring), ring_pos [B, W] int64 (-1: an
    empty slot), anchors [B], P [B] (the context holds positions < P); fmt: the window format.
    Returns (h [B, N, D] the pre-norm hidden, base [B, N, V] fp32 logits before the Markov bias,
    experts {stage: [B * N, k]})."""
    cfg = model.cfg
    N, W = cfg.dspark_block_size, cfg.sliding_window
    B, S = ring_pos.shape
    dev = anchors.device
    ids = dspark.block_ids(cfg, anchors)
    pos = P.view(B, 1) + torch.arange(N, device=dev)                              # [B, N]
    # keys: the ring's rows (slot order), then the block's own; the same visibility for each row
    win_idx = torch.cat((torch.arange(B * S, device=dev).view(B, S),
                         B * S + torch.arange(B * N, device=dev).view(B, N)), 1)  # [B, S + N]
    seen = torch.cat((dspark.window_visible(ring_pos, P.view(B, 1), W),
                      torch.ones(B, N, dtype=torch.bool, device=dev)), 1)
    win_valid = seen.unsqueeze(1).expand(B, N, S + N)
    experts: dict[int, torch.Tensor] = {}
    out = {"experts": experts}
    x = model.embed(ids).unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1)
    pre = first_pre(x)
    for s, st in enumerate(model.mtp):             # the order of `dspark.blocks_forward`
        pre_a, post, comb = st.mixes(x, "attn")
        a = _attention(st.attn, st.attn_norm(collapse(x, pre)), pos, rings[s], win_idx, win_valid, fmt)
        x = expand(x, a, post, comb)
        pre, post, comb = st.mixes(x, "ffn")
        x = expand(x, step_.routed_moe(st.ffn, st.ffn_norm(collapse(x, pre_a)), None, out, s), post, comb)
    h = collapse(x, pre)
    return h, dspark.base_logits(model, h), experts


def _attention(attn, x, pos, ring, win_idx, win_valid, fmt: str):
    """`dspark.draft_attention` over the ring's bytes ring [B, W, wb] and the block's rows."""
    cfg = attn.cfg
    B, T = pos.shape
    P = step_.project(attn.fused_x, x)                     # wq_a and wkv in one product
    q = attn.wq_b(attn.q_norm(P["wq_a"])).unflatten(-1, (attn.H, attn.hd))
    if cfg.q_head_norm:
        q = rms(q, cfg.rms_norm_eps)
    q = attn.rope.apply(q, pos.unsqueeze(-1))
    row = step_.encode_rows(attn.rope.apply(attn.kv_norm(P["wkv"]), pos), fmt)           # [B, T, wb]
    rows = step_.unwords(torch.cat((step_.words(ring).reshape(B * ring.shape[1], -1),
                                    step_.words(row).reshape(B * T, -1))))
    o = cedlm_ops.attend_packed(q.float(), rows, win_idx, win_valid, fmt, rows[:1],
                                torch.zeros(B, T, 0, dtype=torch.int64, device=x.device),
                                torch.zeros(B, T, 0, dtype=torch.bool, device=x.device), fmt,
                                attn.attn_sink.float(), attn.hd ** -0.5)
    return attn.output(o, pos, x.dtype)


# decode step -> DraftStep; weak, so the graphs go with the model's decode step
_STEPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class DraftStep:
    @classmethod
    def of(cls, decoder: CompiledDecode, log=None) -> "DraftStep":
        """The draft step of `decoder`'s model, made once (engines built one after another share
        its graphs)."""
        if decoder not in _STEPS:
            _STEPS[decoder] = cls(decoder, log=log)
        return _STEPS[decoder]

    def __init__(self, decoder: CompiledDecode, log=None):
        if not hasattr(decoder.model, "mtp"):
            raise ValueError("draft step: this model has no DSpark drafter (no mtp.* weights)")
        self.decoder, self.model = decoder, decoder.model
        self.fmt = self.model.kv_layout.window_fmt
        self.compile = decoder.mode == "compiled"
        self.uncompiled = draft_step
        self.fn = compile_step(decoder.device, draft_step) if self.compile else draft_step
        self.compile_s: dict[str, float] = {}
        self.log = log

    @property
    def usable(self) -> bool:
        """Whether this step runs now (else the caller takes `dspark.draft_block`)."""
        return self.decoder.mode != "eager" and self.decoder.why_not() is None

    @torch.no_grad()
    def __call__(self, states: list[dspark.DraftState], anchors: torch.Tensor, P: torch.Tensor,
                 with_experts: bool = False):
        """One block per sequence: anchors [B] at positions P [B] (its context holds positions
        < P) -> (h [B, N, D], base [B, N, V]), as `dspark.draft_block`; with_experts: also the
        experts each stage chose ({stage: [B * N, k]}, for a test)."""
        B = len(states)
        if anchors.shape != (B,) or P.shape != (B,):
            raise ValueError(f"draft step: anchors {tuple(anchors.shape)} and P {tuple(P.shape)} "
                             f"must both be [{B}] (one per state)")
        if B == 1:
            rings, ring_pos = states[0].window.unsqueeze(1), states[0].window_pos[:1]
        else:
            rings = torch.stack([st.window for st in states], 1)
            ring_pos = torch.stack([st.window_pos[0] for st in states])
        args = (self.model, self.fmt, rings, ring_pos, anchors, P)
        if self.compile and B > 1:                 # one graph for every batch size >= 2
            mark_dynamic((rings, 1), (ring_pos, 0), (anchors, 0), (P, 0))
        h, base, experts = run_step(self, "draft step", draft_step, args, graph_name(B, False))
        return (h, base, experts) if with_experts else (h, base)

    @torch.no_grad()
    def warm_up(self, batch_sizes: tuple[int, ...] = (1, 2)) -> dict[str, float]:
        """Compile the graphs before a request, on empty draft states."""
        if not self.compile or not self.usable:
            return {}
        dev = self.decoder.device
        for B in batch_sizes:
            states = [dspark.DraftState(self.model.kv_layout, len(self.model.mtp), device=dev)
                      for _ in range(B)]
            self(states, torch.full((B,), 3, device=dev), torch.zeros(B, dtype=torch.int64, device=dev))
        return dict(self.compile_s)
