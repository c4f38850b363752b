"""MoE: sqrtsoftplus router with a selection-only bias (aux-loss-free balancing), a shared expert,
clamped SwiGLU experts, normalised top-k weights times `routed_scaling_factor`.

Three formulations of the routed sum, one per use: grouped by expert (`_routed`: training,
prefill and the eager decode; each expert once over the tokens that chose it), gathered from
stacked weights (`step`: the static decode, verify and draft steps; shapes independent of the
routing) and dense (`forward_reference`: every expert on every token, a test oracle).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cedlm.config import ModelConfig
from cedlm.model.linear import concat_weights


class Expert(nn.Module):
    """SwiGLU with clamp: gate clamped above at `limit`, up clamped to [-limit, limit]."""

    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(dim, inter, bias=False)
        self.w2 = nn.Linear(inter, dim, bias=False)
        self.w3 = nn.Linear(dim, inter, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x), self.w3(x)
        if self.limit:
            gate = gate.clamp(max=self.limit)
            up = up.clamp(-self.limit, self.limit)
        return self.w2(F.silu(gate) * up)


class Gate(nn.Module):
    decisions = None    # a cedlm.model.decisions.Decisions recording or replaying the routing

    def __init__(self, cfg: ModelConfig, n_experts: int, topk: int):
        super().__init__()
        self.topk, self.func = topk, cfg.scoring_func
        self.norm, self.route_scale = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(n_experts, cfg.hidden_size))
        # Selection bias: shifts which experts are chosen, never the weights. Updated from load.
        self.register_buffer("bias", torch.zeros(n_experts))
        self.register_buffer("bias_vl", torch.zeros(n_experts))   # image-span tokens (vision)
        nn.init.normal_(self.weight, std=cfg.initializer_range)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        logits = x.float() @ self.weight.float().t()
        if self.func == "sqrtsoftplus":
            return F.softplus(logits).sqrt()
        if self.func == "sigmoid":
            return logits.sigmoid()
        return logits.softmax(-1)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None):
        """x [N, D] -> (weights [N, k] fp32, expert ids [N, k])."""
        s = self.scores(x)
        bias = self.bias if image_mask is None else torch.where(
            image_mask[:, None], self.bias_vl, self.bias)
        ids = (s + bias).topk(self.topk, dim=-1).indices
        if self.decisions is not None:                   # recorded / replayed (decisions.py)
            ids = self.decisions.take(self.decision_key, ids, row_dim=0)
        w = s.gather(-1, ids)
        if self.norm:
            w = w / w.sum(-1, keepdim=True)
        return w * self.route_scale, ids

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float) -> None:
        """Aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded."""
        self.bias += rate * torch.sign(load.float().mean() - load.float())


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, n_experts: int | None = None, topk: int | None = None):
        super().__init__()
        n_experts = n_experts or cfg.n_routed_experts
        D, I, lim = cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit
        self.gate = Gate(cfg, n_experts, topk or cfg.num_experts_per_tok)
        self.experts = nn.ModuleList(Expert(D, I, lim) for _ in range(n_experts))
        self.shared_experts = Expert(D, I * cfg.n_shared_experts, lim) if cfg.n_shared_experts else None
        self.register_buffer("load", torch.zeros(n_experts), persistent=False)  # tokens per expert

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """image_mask (same leading shape as x, bool): image-span tokens route with `bias_vl`."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                   # [N, D]
        w, ids = self.gate(x, None if image_mask is None else image_mask.reshape(-1))
        out = self._routed(x, w, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x).float()
        return out.to(x.dtype).reshape(shape)

    @torch.compiler.disable
    def _routed(self, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum [N, D] fp32, grouped by expert: each expert runs once on the
        tokens that chose it. Its shapes depend on the routing, so torch.compile leaves it
        eager (one graph break per layer; the rest of the layer is compiled around it)."""
        out = torch.zeros_like(x, dtype=torch.float32)
        counts = torch.bincount(ids.flatten(), minlength=len(self.experts))
        if self.training:
            self.load += counts.to(self.load.dtype)
        for e in torch.nonzero(counts).flatten().tolist():            # grouped by expert
            tok, slot = torch.where(ids == e)
            y = self.experts[e](x[tok])
            out.index_add_(0, tok, y.float() * w[tok, slot, None])
        return out

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """Dense reference: every expert on every token, combined by the routing weights."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, ids = self.gate(x)
        dense = torch.zeros(x.shape[0], len(self.experts), device=x.device)
        dense.scatter_(1, ids, w)
        out = sum(dense[:, e:e + 1] * self.experts[e](x).float() for e in range(len(self.experts)))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x).float()
        return out.to(x.dtype).reshape(shape)

    # ---------------------------------------------------------------- the static step
    def step(self, x: torch.Tensor, image: torch.Tensor | None = None):
        """The routed experts from stacked weights (`stack`) + the shared expert, shapes
        independent of the routing: x [B, T, D] -> ([B, T, D], expert ids [B * T, k])."""
        B = x.shape[0] * x.shape[1]
        xf = x.reshape(B, -1)
        w, ids = self.gate(xf, None if image is None else image.reshape(-1))
        chosen = ids
        ids, order = ids.sort(-1)                         # ascending expert id, as `_routed` adds
        w = torch.gather(w, 1, order)
        W1, W2, W3 = self.stacked
        lim = self.experts[0].limit
        # Each matrix-vector product written as multiply-and-sum over the gathered expert rows:
        # inductor fuses the gather into the reduction and reads each selected expert's weights
        # once (a bmm over W[ids] would first copy them).
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
        if self.shared_experts is not None:               # `Expert.forward`, w1 and w3 in one product
            sh = self.shared_experts
            W, sizes = self.fused_shared
            g, u = F.linear(xf, W).split(sizes, -1)
            if sh.limit:
                g, u = g.clamp(max=sh.limit), u.clamp(-sh.limit, sh.limit)
            o = o + sh.w2(F.silu(g) * u).float()
        return o.to(x.dtype).view(x.shape), chosen

    def stack(self) -> None:
        """Stacked expert weights ([E, out, in] per projection, `stacked`) whose slices ARE the
        experts' parameters (same storage: a later load writes both), and the shared expert's w1
        and w3 as one matrix (`fused_shared`), for `step`."""
        if getattr(self, "stacked", None) is not None:
            return
        stacks = []
        for name in ("w1", "w2", "w3"):
            W, sizes = concat_weights([getattr(e, name) for e in self.experts])
            stacks.append(W.view(len(sizes), sizes[0], -1))
        self.stacked = tuple(stacks)
        sh = self.shared_experts
        self.fused_shared = None if sh is None else concat_weights([sh.w1, sh.w3])

