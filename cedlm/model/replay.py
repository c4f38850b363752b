"""Prefill modes, receptive fields and replay: which rows run through the decoder, and how
window rings that were never stored are rebuilt.

Prefill of S new tokens: the encoder sees every token (in chunks); the decoder sees
- `full`:    every row;
- `exact`:   the trailing `exact_prefill_tokens` rows: the receptive field of the stacked decoder
             windows, so the next-token logits and every cache are exactly those of `full`;
- `bounded`: the trailing `sliding_window` rows (approximate: the decoder's windows see nothing
             earlier; about half the prefill work of a decoder-only model).
Replay rebuilds the window rings of a sequence restored from its global entries and token ids
(windows are never persisted) by re-running its last tokens through every layer without writing
global entries again: `exact` replays L * (n_win - 1) + 1 tokens (the receptive field of L
stacked windows: the rings and the logits equal the uninterrupted run), `bounded` replays n_win.
"""
from __future__ import annotations

import torch

from cedlm.config import ModelConfig
from cedlm.config.modes import PREFILL_MODES, REPLAY_MODES  # noqa: F401  (re-exported)
from cedlm.model.kv_cache import ByteKVCache
from cedlm.model.state import SequenceState


def decoder_rows(cfg: ModelConfig, n_new: int, mode: str) -> int:
    """Rows of an n_new-token prefill that run through the decoder in `mode`."""
    if mode not in PREFILL_MODES:
        raise ValueError(f"prefill_mode: {mode!r} is not one of {PREFILL_MODES}")
    if mode == "full" or cfg.decoder_start >= cfg.n_layers:
        return n_new
    m = cfg.exact_prefill_tokens if mode == "exact" else cfg.sliding_window
    return min(n_new, m)


def replay_tokens(cfg: ModelConfig, mode: str) -> int:
    """Tokens to replay to rebuild every window: n_win (bounded) or L * (n_win - 1) + 1 (exact)."""
    if mode == "bounded":
        return cfg.sliding_window
    if mode == "exact":
        return cfg.n_layers * (cfg.sliding_window - 1) + 1
    raise ValueError(f"replay mode: {mode!r} is not one of {REPLAY_MODES}")


class PrefillRun:
    """A prompt appended to one sequence, one encoder chunk per `step()`, so that a scheduler can
    interleave a long prompt with other work. After the last chunk the decoder runs over the
    trailing rows and `logits` ([M, vocab], the last row predicts the next token) is set.

    Prompt scoring (`on_rows`, mode `full` only): every chunk runs the encoder and then the
    decoder over its own rows, as a decode step of several tokens does (a fresh cache per chunk:
    the window rows before the chunk come from the rings). `on_rows(logits [T, vocab], first)` gets
    each chunk's logits (rows first .. first + T - 1 of the prompt) and `logits` keeps only the
    last row [1, vocab]. Memory is then linear in the prompt (the one-shot decoder pass attends
    from every row to every row of its stash: quadratic); the logits equal the one-shot pass's
    up to float rounding (other matrix shapes)."""

    def __init__(self, model, input_ids, state: SequenceState, mode: str = "full",
                 chunk_size: int | None = None, on_rows=None):
        # the prompt stays on the host (token ids are host-side bookkeeping); each chunk moves to
        # the model's device as it runs
        ids = torch.as_tensor(input_ids, dtype=torch.int64, device="cpu").flatten()
        if ids.numel() == 0:
            raise ValueError("input_ids: empty prompt")
        if chunk_size is not None and chunk_size <= 0:
            raise ValueError(f"chunk_size: must be positive, got {chunk_size}")
        cfg = model.cfg
        self.model, self.ids, self.state = model, ids, state
        self.device = model.device
        self.S, self.M = ids.numel(), decoder_rows(cfg, ids.numel(), mode)
        self.chunk = chunk_size or self.S
        self.p0, self.done_tokens = state.num_tokens, 0
        self.cache = ByteKVCache(model.kv_layout, [state],
                                 keep_stash_from=self.p0 + self.S - self.M - cfg.sliding_window + 1)
        self.xs: list[torch.Tensor] = []
        self.pres: list[torch.Tensor] = []
        self.logits: torch.Tensor | None = None
        if on_rows is not None and self.M != self.S:
            raise ValueError(f"on_rows: prompt scoring needs every row through the decoder (mode 'full'), "
                             f"got mode {mode!r}")
        self.on_rows = on_rows

    @property
    def done(self) -> bool:
        return self.logits is not None

    @torch.no_grad()
    def step(self, num_tokens: int | None = None) -> bool:
        """Run the next encoder chunk of `num_tokens` tokens (the caller's scheduler decides;
        default `chunk_size`), and the decoder after the last; True when finished."""
        if self.done:
            return True
        if num_tokens is not None and num_tokens <= 0:
            raise ValueError(f"num_tokens: must be positive, got {num_tokens}")
        c0, st = self.done_tokens, self.state
        host = self.ids[c0: c0 + (num_tokens or self.chunk)]
        T, p0 = host.shape[0], st.num_tokens
        part = host.to(self.device, non_blocking=True)[None]
        pos = torch.arange(p0, p0 + T, device=self.device)[None]
        if self.on_rows is not None:
            return self._scored_step(part, pos)
        x, pre = self.model.encoder_pass(part, pos, self.cache, images=[st.images], first=(p0,))
        st.advance(host.tolist())
        self.done_tokens = c0 + T
        keep = min(T, max(0, c0 + T - (self.S - self.M)))          # rows of this chunk in the tail
        if keep:
            self.xs.append(x[:, -keep:]), self.pres.append(pre[:, -keep:])
        if self.done_tokens < self.S:
            return False
        pos = torch.arange(self.p0 + self.S - self.M, self.p0 + self.S, device=self.device)[None]
        tail = self.ids[self.S - self.M:].to(self.device, non_blocking=True)[None]
        self.logits = self.model.decoder_pass(torch.cat(self.xs, 1), torch.cat(self.pres, 1),
                                              pos, self.cache, ids=tail)[0]
        self.xs, self.pres = [], []
        return True

    def _scored_step(self, part: torch.Tensor, pos: torch.Tensor) -> bool:
        """One chunk through the encoder and the decoder (prompt scoring, see the class doc)."""
        st, c0, T = self.state, self.done_tokens, part.shape[1]
        p0 = st.num_tokens
        cache = ByteKVCache(self.model.kv_layout, [st], keep_stash_from=p0)
        x, pre = self.model.encoder_pass(part, pos, cache, images=[st.images], first=(p0,))
        st.advance(part[0].tolist())
        self.done_tokens = c0 + T
        logits = self.model.decoder_pass(x, pre, pos, cache, ids=part)[0]
        self.on_rows(logits, c0)
        if self.done_tokens < self.S:
            return False
        self.logits = logits[-1:]
        return True

    def run(self) -> torch.Tensor:
        while not self.step():
            pass
        return self.logits


def persisted_copy(model, state: SequenceState) -> SequenceState:
    """What persistence keeps of `state`, as a new state: the global KV and index-key rows, the
    compressor pending rows, token ids and images; no window rings (what `replay` rebuilds)."""
    new = model.new_state()
    new.set_tokens(state.token_ids)
    new.images = list(state.images)
    for s in state.kv:
        new.kv[s].append(state.kv[s].view().clone())
    for s in state.index:
        new.index[s].append(state.index[s].view().clone())
    new.pending = {k: (a.clone(), b.clone()) for k, (a, b) in state.pending.items()}
    return new


@torch.no_grad()
def replay(model, state: SequenceState, mode: str = "exact") -> torch.Tensor:
    """Rebuild the window rings of `state` (global entries and token ids present, windows
    empty); returns the next-token logits [vocab]."""
    cfg = model.cfg
    P = state.num_tokens
    if P == 0:
        raise ValueError("replay: the state holds no tokens")
    R = min(P, replay_tokens(cfg, mode))
    dev = model.device
    ids = torch.tensor(state.token_ids[P - R: P], dtype=torch.int64, device=dev)[None]
    pos = torch.arange(P - R, P, device=dev)[None]
    cache = ByteKVCache(model.kv_layout, [state], keep_stash_from=P - R - cfg.sliding_window + 1)
    x, pre = model.encoder_pass(ids, pos, cache, replay=True, images=[state.images], first=(P - R,))
    return model.decoder_pass(x, pre, pos, cache, replay=True, ids=ids)[0, -1]
