"""mHC: manifold-constrained hyper-connections (n residual copies mixed by learned matrices).

The residual stream is `hc_mult` copies x: [B, T, n, D]. Per sub-layer, from one read of x:
  mixes = (flatten(x) @ fn^T) * rsqrt(mean(x^2) + eps)          [B, T, (2+n)n]
  pre   = sigmoid(a0 * m[:n] + b) + hc_eps                       collapse weights  [n]
  post  = 2 * sigmoid(a1 * m[n:2n] + b)                          expand weights    [n]
  comb  = Sinkhorn(softmax_row(a2 * m[2n:] + b) + hc_eps)        copy mixing       [n, n]
collapse: y = sum_i pre_i x_i ; expand: x'_j = post_j F(y) + sum_i comb[i, j] x_i.
V4.1 staggers this ("single pass"): sub-layer k computes post, comb and a pre from its input
stream, but collapses that stream with the pre carried from sub-layer k-1 (the first sub-layer
takes copy 0); its own pre goes to sub-layer k+1, and the head collapses with the last FFN's pre
(vLLM deepseek_v41 nvidia/model.py; V4.1 has no hc_head parameters).
"""
from __future__ import annotations

import torch
from torch import nn

from cedlm.kernels import mhc as kernels_mhc


def sinkhorn(m: torch.Tensor, iters: int, eps: float = 0.0) -> torch.Tensor:
    """Positive [..., n, n] (rows already softmax-normalised) -> doubly stochastic.

    A column normalisation, then `iters - 1` rounds of row then column normalisation, each
    denominator + eps (the order vLLM's V4.1 torch reference uses).
    """
    m = m / (m.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(-1, keepdim=True) + eps)
        m = m / (m.sum(-2, keepdim=True) + eps)
    return m


def init_hc(n: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Initial (fn [(2+n)n, n*dim], base [(2+n)n], scale [3]): pre ~ 1/n, post = 1, comb ~ I."""
    fn = torch.randn((2 + n) * n, n * dim) * (0.02 / n ** 0.5)
    base = torch.zeros((2 + n) * n)
    base[:n] = -torch.log(torch.tensor(float(max(n - 1, 1))))
    base[2 * n:] = (4.0 * torch.eye(n)).flatten()
    return fn, base, torch.ones(3)


def add_hc_params(module: nn.Module, n: int, dim: int) -> None:
    """Register a block's mHC parameters on `module` under the official names
    `hc_{attn,ffn}_{fn,base,scale}` (attention's first: the order their init draws random numbers)."""
    for sub in ("attn", "ffn"):
        fn, base, scale = init_hc(n, dim)
        setattr(module, f"hc_{sub}_fn", nn.Parameter(fn))
        setattr(module, f"hc_{sub}_base", nn.Parameter(base))
        setattr(module, f"hc_{sub}_scale", nn.Parameter(scale))


def sublayer_mixes(module: nn.Module, x: torch.Tensor, sub: str, cfg):
    """`hc_mixes` of sub-layer `sub` ("attn" or "ffn") of a block built with `add_hc_params`."""
    return hc_mixes(x, getattr(module, f"hc_{sub}_fn"), getattr(module, f"hc_{sub}_base"),
                    getattr(module, f"hc_{sub}_scale"), cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
             norm_eps: float, hc_eps: float, iters: int):
    """x: [B, T, n, D] -> pre [B,T,n], post [B,T,n], comb [B,T,n,n] (fp32)."""
    n = x.shape[-2]
    xf = x.flatten(-2).float()                                       # [B, T, n*D]
    m = (xf @ fn.float().t()) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm_eps)
    fast = kernels_mhc.mixes(m, base, scale, hc_eps, iters, n)   # compiled (mhc.h), else None
    if fast is not None:
        return fast
    a0, a1, a2 = scale.float()
    b = base.float()
    pre = torch.sigmoid(a0 * m[..., :n] + b[:n]) + hc_eps
    post = 2 * torch.sigmoid(a1 * m[..., n:2 * n] + b[n:2 * n])
    comb = (a2 * m[..., 2 * n:] + b[2 * n:]).unflatten(-1, (n, n)).softmax(-1) + hc_eps
    return pre, post, sinkhorn(comb, iters, hc_eps)


def first_pre(x: torch.Tensor) -> torch.Tensor:
    """The pre of the first sub-layer: select copy 0 (the copies are equal after the embedding)."""
    pre = torch.zeros(x.shape[:-1], dtype=torch.float32, device=x.device)
    pre[..., 0] = 1.0
    return pre


def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """[B,T,n,D], [B,T,n] -> [B,T,D]."""
    fast = kernels_mhc.collapse(x, pre)          # compiled (mhc.h), else None
    if fast is not None:
        return fast
    return torch.einsum("btnd,btn->btd", x.float(), pre).to(x.dtype)


def expand(x: torch.Tensor, f: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """x'_j = post_j f + sum_i comb[i, j] x_i.  x [B,T,n,D], f [B,T,D] -> [B,T,n,D]."""
    fast = kernels_mhc.expand(x, f, post, comb)  # compiled (mhc.h), else None
    if fast is not None:
        return fast
    mixed = torch.einsum("btij,btid->btjd", comb, x.float())
    return (mixed + post.unsqueeze(-1) * f.float().unsqueeze(-2)).to(x.dtype)
