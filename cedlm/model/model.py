"""The CED stack: embedding -> encoder layers -> global-KV projection -> decoder layers -> head.

Parameter names follow the official checkpoint (`embed.weight`, `layers.L.attn.wq_a.weight`,
`layers.L.hc_attn_fn`, `layers.L.ffn.experts.E.w1.weight`, ...), so a state dict in the official
naming loads without renaming (DSpark `mtp.*` and vision tensors are not built here).

One code path serves training and inference: a call runs an encoder pass over every new token
(layers < decoder_start, then the global-KV source writes its window rows and global entries)
and a decoder pass over the rows that need it (all of them in training and `full` prefill; the
trailing ones in `exact`/`bounded` prefill; the new token at decode). `Step` carries the caches.
"""
from __future__ import annotations

import torch
from torch import nn

from cedlm.config import ConfigError, ModelConfig, RUNNABLE_FAMILIES
from cedlm.model.attention import Attention
from cedlm.model.engram import Engram
from cedlm.model.mhc import collapse, expand, first_pre, hc_mixes, init_hc
from cedlm.model.moe import MoE
from cedlm.model.norm import RMSNorm
from cedlm.model.state import SequenceState
from cedlm.model.step import Step

PREFILL_MODES = ("full", "exact", "bounded")


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        D, n = cfg.hidden_size, cfg.hc_mult
        self.attn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(D, cfg.rms_norm_eps)
        for sub in ("attn", "ffn"):
            fn, base, scale = init_hc(n, D)
            setattr(self, f"hc_{sub}_fn", nn.Parameter(fn))
            setattr(self, f"hc_{sub}_base", nn.Parameter(base))
            setattr(self, f"hc_{sub}_scale", nn.Parameter(scale))
        self.attn = Attention(cfg, layer_id)
        self.ffn = MoE(cfg)
        if layer_id in cfg.engram_layer_ids:
            self.engram = Engram(cfg, layer_id)

    def mixes(self, x: torch.Tensor, sub: str):
        c = self.cfg
        return hc_mixes(x, getattr(self, f"hc_{sub}_fn"), getattr(self, f"hc_{sub}_base"),
                        getattr(self, f"hc_{sub}_scale"), c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters)

    def forward(self, x: torch.Tensor, pre: torch.Tensor, step: Step):
        """x: mHC copies [B, T, n, D]; pre: the previous sub-layer's pre [B, T, n]."""
        if hasattr(self, "engram"):
            x = self.engram(x, step.engram_emb[self.layer_id])
        pre_a, post, comb = self.mixes(x, "attn")
        x = expand(x, self.attn(self.attn_norm(collapse(x, pre)), step), post, comb)
        pre_f, post, comb = self.mixes(x, "ffn")
        x = expand(x, self.ffn(self.ffn_norm(collapse(x, pre_a))), post, comb)
        return x, pre_f

    def write_global(self, x: torch.Tensor, pre: torch.Tensor, step: Step) -> None:
        self.attn.write_global(self.attn_norm(collapse(x, pre)), step)


class CEDModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.family not in RUNNABLE_FAMILIES:
            raise ConfigError(f"family: {cfg.family!r} configs are for accounting only "
                              f"(runnable: {RUNNABLE_FAMILIES})")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Token id -> Engram compressed id (set from the tokenizer; identity by default).
        self.register_buffer("engram_token_map", torch.arange(cfg.vocab_size) % max(
            cfg.engram_compressed_vocab_size, 1), persistent=False)
        self._init_weights()

    def _init_weights(self):
        std = self.cfg.initializer_range
        for name, p in self.named_parameters():
            if name.endswith(".weight") and p.dim() == 2 and "hc_" not in name:
                nn.init.normal_(p, std=std)

    # ---------------------------------------------------------------- passes
    def _engram_rows(self, ids: torch.Tensor, history: torch.Tensor, step: Step) -> None:
        """Rows of every Engram layer, from token ids alone, before any layer runs."""
        step.engram_emb = {}
        if not self.cfg.engram_layer_ids:
            return
        cids = self.engram_token_map[torch.cat((history, ids), 1)]
        for l in self.cfg.engram_layer_ids:
            eng = self.layers[l].engram
            rows = eng.hasher.rows(cids, history.shape[1])
            step.engram_emb[l] = eng.lookup(rows)

    def _history(self, ids: torch.Tensor, step: Step) -> torch.Tensor:
        h = max(self.cfg.engram_max_ngram_size - 1, 0) if self.cfg.engram_layer_ids else 0
        out = torch.full((ids.shape[0], h), self.cfg.engram_pad_token_id, dtype=torch.int64)
        if step.states is not None and h:
            for b, st in enumerate(step.states):
                prev = st.token_ids[max(0, int(step.pos[b, 0]) - h): int(step.pos[b, 0])]
                if prev:
                    out[b, h - len(prev):] = torch.tensor(prev)
        return out

    def encoder_pass(self, ids: torch.Tensor, pos: torch.Tensor, step: Step):
        """Every new token through layers < decoder_start, then the global-KV projection."""
        step.begin_pass(pos)
        self._engram_rows(ids, self._history(ids, step), step)
        x = self.embed(ids).unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1)   # [B, T, n, D]
        pre = first_pre(x)
        ds = self.cfg.decoder_start
        for layer in self.layers[:ds]:
            x, pre = layer(x, pre, step)
        if ds < self.cfg.n_layers:
            self.layers[ds].write_global(x, pre, step)
        return x, pre

    def decoder_pass(self, x: torch.Tensor, pre: torch.Tensor, pos: torch.Tensor, step: Step):
        step.begin_pass(pos)
        for layer in self.layers[self.cfg.decoder_start:]:
            x, pre = layer(x, pre, step)
        return self.head(self.norm(collapse(x, pre))).float()

    # ---------------------------------------------------------------- training forward
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full causal forward: input_ids [B, S] -> logits [B, S, vocab] (fp32)."""
        B, S = input_ids.shape
        pos = torch.arange(S).expand(B, S)
        step = Step(self.cfg, input_ids)
        x, pre = self.encoder_pass(input_ids, pos, step)
        return self.decoder_pass(x, pre, pos, step)

    # ---------------------------------------------------------------- inference
    def new_state(self) -> SequenceState:
        return SequenceState(self.cfg)

    def decoder_rows(self, n_new: int, mode: str) -> int:
        if mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode: {mode!r} is not one of {PREFILL_MODES}")
        if mode == "full" or self.cfg.decoder_start >= self.cfg.n_layers:
            return n_new
        m = self.cfg.exact_prefill_tokens if mode == "exact" else self.cfg.sliding_window
        return min(n_new, m)

    @torch.no_grad()
    def prefill(self, input_ids, state: SequenceState, mode: str = "full",
                chunk_size: int | None = None) -> torch.Tensor:
        """Append a prompt (1-D token ids) to `state`; returns logits [M, vocab] of the rows the
        decoder ran on (the last row predicts the next token). The encoder sees every token
        (in chunks of `chunk_size`); the decoder sees the trailing M rows (by `mode`)."""
        it = self.prefill_steps(input_ids, state, mode, chunk_size)
        while True:
            try:
                next(it)
            except StopIteration as done:
                return done.value

    def prefill_steps(self, input_ids, state: SequenceState, mode: str = "full",
                      chunk_size: int | None = None):
        """Generator form of `prefill`: yields the number of encoder tokens after each chunk, so a
        scheduler can interleave a long prompt with other work; returns the logits."""
        ids = torch.as_tensor(input_ids, dtype=torch.int64).flatten()
        S = ids.numel()
        if S == 0:
            raise ValueError("input_ids: empty prompt")
        if chunk_size is not None and chunk_size <= 0:
            raise ValueError(f"chunk_size: must be positive, got {chunk_size}")
        M = self.decoder_rows(S, mode)
        p0 = state.num_tokens
        step = Step(self.cfg, ids[None], [state])
        step.stash_from = p0 + S - M - self.cfg.sliding_window + 1
        xs, pres = [], []
        chunk = chunk_size or S
        with torch.no_grad():
            for c0 in range(0, S, chunk):
                part = ids[c0: c0 + chunk][None]
                T = part.shape[1]
                pos = torch.arange(state.num_tokens, state.num_tokens + T)[None]
                state.token_ids.extend(part[0].tolist())
                x, pre = self.encoder_pass(part, pos, step)
                state.num_tokens += T
                keep = min(T, max(0, c0 + T - (S - M)))          # rows of this chunk in the tail
                if keep:
                    xs.append(x[:, -keep:]), pres.append(pre[:, -keep:])
                if c0 + T < S:
                    yield c0 + T
            pos = torch.arange(p0 + S - M, p0 + S)[None]
            return self.decoder_pass(torch.cat(xs, 1), torch.cat(pres, 1), pos, step)[0]

    def replay_tokens(self, mode: str) -> int:
        """Tokens to replay to rebuild every window: n_win (bounded) or L * (n_win - 1) + 1
        (exact: the receptive field of L stacked windows)."""
        if mode == "bounded":
            return self.cfg.sliding_window
        if mode == "exact":
            return self.cfg.n_layers * (self.cfg.sliding_window - 1) + 1
        raise ValueError(f"replay mode: {mode!r} is not 'exact' or 'bounded'")

    @torch.no_grad()
    def replay(self, state: SequenceState, mode: str = "exact") -> torch.Tensor:
        """Rebuild the window rings of a state restored from global KV + token ids (windows are
        never persisted) by re-running its last tokens through every layer; the global entries
        already exist and are not written again. Returns the next-token logits [vocab]."""
        P = state.num_tokens
        if P == 0:
            raise ValueError("replay: the state holds no tokens")
        R = min(P, self.replay_tokens(mode))
        ids = torch.tensor(state.token_ids[P - R: P])[None]
        pos = torch.arange(P - R, P)[None]
        step = Step(self.cfg, ids, [state])
        step.replay = True
        step.stash_from = P - R - self.cfg.sliding_window + 1
        x, pre = self.encoder_pass(ids, pos, step)
        return self.decoder_pass(x, pre, pos, step)[0, -1]

    @torch.no_grad()
    def decode(self, input_ids, states: list[SequenceState]) -> torch.Tensor:
        """One new token per sequence: input_ids [B] -> next-token logits [B, vocab]."""
        ids = torch.as_tensor(input_ids, dtype=torch.int64).view(-1, 1)
        if ids.shape[0] != len(states):
            raise ValueError(f"input_ids: {ids.shape[0]} tokens for {len(states)} states")
        pos = torch.tensor([[st.num_tokens] for st in states])
        step = Step(self.cfg, ids, states)
        step.stash_from = 0
        for b, st in enumerate(states):
            st.token_ids.append(int(ids[b, 0]))
        x, pre = self.encoder_pass(ids, pos, step)
        for st in states:
            st.num_tokens += 1
        return self.decoder_pass(x, pre, pos, step)[:, -1]

    def offload_engram(self, directory) -> None:
        """Memory-map every Engram table from `directory` (written there first)."""
        from pathlib import Path
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        for l in self.cfg.engram_layer_ids:
            self.layers[l].engram.offload(d / f"engram.{l}.npy")

    def num_parameters(self, exclude_engram: bool = False) -> int:
        return sum(p.numel() for n, p in self.named_parameters()
                   if not (exclude_engram and ".engram.embed." in n))
