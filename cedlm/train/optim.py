"""What one optimizer step of every training stage is made of: the learning-rate schedule (one
cosine with linear warm-up), AdamW parameter groups, gradient averaging over ranks, clip + step,
and the MoE gates' aux-loss-free balancing update."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from cedlm.model.moe import MoE


def cosine_lr(step: int, *, peak: float, min_lr: float, warmup: int, total: int | None = None,
              time_frac: float | None = None) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warm-up to `peak` over `warmup`
    steps, then cosine decay to `min_lr`.

    The decay's progress is the larger of the step fraction `(step - warmup) / (total - warmup)`
    (when `total` is given) and `time_frac`, the share of a wall-time budget used (when given), so
    a time-limited run also ends its schedule at its limit; it is clamped to [0, 1]."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = 0.0
    if total is not None:
        t = (step - warmup) / max(1, total - warmup)
    if time_frac is not None:
        t = max(t, time_frac)
    t = min(max(t, 0.0), 1.0)
    return min_lr + 0.5 * (1 + math.cos(math.pi * t)) * (peak - min_lr)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """The same learning rate for every parameter group of `opt`."""
    for g in opt.param_groups:
        g["lr"] = lr


def param_groups(model: torch.nn.Module, weight_decay: float):
    """AdamW groups: weight decay on matrices (dim >= 2), none on vectors and scalars."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]


def clip_and_step(opt: torch.optim.Optimizer, params, grad_clip: float | None) -> float | None:
    """Clip the global gradient norm of `params` to `grad_clip` (not when 0 / None), step, clear the
    gradients; -> the norm before clipping, or None when not clipped."""
    norm = None
    if grad_clip and grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(list(params), grad_clip).item()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return norm


def sync_gradients(params: list[torch.Tensor], world: int) -> None:
    """Average gradients over ranks in one all-reduce; a parameter that no rank used keeps None."""
    used = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=params[0].device)
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params]
                     + [used])
    dist.all_reduce(flat)
    flat /= world
    used_anywhere = (flat[-len(params):] > 0).tolist()
    n = 0
    for p, u in zip(params, used_anywhere):
        k = p.numel()
        p.grad = flat[n: n + k].view_as(p).clone() if u else None
        n += k


def moe_layers(model: torch.nn.Module) -> list[MoE]:
    """The MoE feed-forward of every layer (CEDModel and DecoderOnlyModel alike)."""
    return [layer.ffn for layer in model.layers]


@torch.no_grad()
def update_moe_bias(model: torch.nn.Module, rate: float, world: int = 1) -> None:
    """Aux-loss-free balancing from this step's load (tokens per expert, summed over ranks); the
    load counters are reset (rate 0: only the reset, for a stage whose gates are frozen)."""
    ffns = moe_layers(model)
    load = torch.stack([f.load for f in ffns])
    if world > 1:
        dist.all_reduce(load)
    for f, l in zip(ffns, load):
        if rate:
            f.gate.update_bias(l, rate)
        f.load.zero_()
