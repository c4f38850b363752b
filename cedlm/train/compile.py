"""The compiled training step: a model's training forward + loss captured by torch.compile
(inductor, CPU: gcc), its backward compiled with it (AOTAutograd).

    loss_fn = training_loss(model, compile=True)      # compiles in its first call
    loss = loss_fn(x, y); loss.backward()

What is compiled is the whole forward and the cross-entropy; the MoE's routed experts stay eager
(their shapes follow the routing: `MoE._routed`), so each layer's graph ends before them and a
new one starts after. Inductor's artefacts go to `inductor/` in cedlm's cache folder
(`$CEDLM_CACHE_DIR`, else `~/.cache/cedlm`; $TORCHINDUCTOR_CACHE_DIR when set): a second start
with the same model shapes reuses them and compiles in a fraction of the first start's time.

Eager and compiled agree within float rounding (tests/test_train_compile.py), not bit for bit:
inductor fuses and reorders float operations. One difference is kept away by `drop_unrouted`:
an expert that no token chose has no gradient in eager (AdamW then skips it, no weight decay);
compiled, it gets a zero gradient, which `drop_unrouted` turns back into None.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from cedlm.util import inductor_cache_dir

ENV_VAR = "CEDLM_TRAIN_COMPILE"         # --compile's default: off unless this says on
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def compile_flag(value: str) -> bool:
    """--compile's value: on/off (also true/false, yes/no, 1/0) -> bool; anything else is the
    parser's one-line error naming the flag."""
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}")


def compile_default() -> bool:
    """--compile's default: off, unless $CEDLM_TRAIN_COMPILE is on (and the reference kernels are
    not forced: `CEDLM_REFERENCE_KERNELS=1`, no fast path). Compiled training measured 1.3-1.4x
    the tokens/s of eager at the shipped size on an idle core (bench/scripts/train_throughput.py),
    but its first step compiles for about 15 minutes with an empty cache (2-4 with a warm one):
    it pays after roughly 350 steps cold, 55 warm, so a long run (the default model's
    pretraining) asks for it with --compile on; a short run or a first try does not wait."""
    from cedlm.kernels import reference_kernels
    value = os.environ.get(ENV_VAR, "off")
    try:
        on = compile_flag(value)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"{ENV_VAR}: {e}") from None
    return on and not reference_kernels()


def use_inductor_cache() -> Path:
    """Point inductor's on-disk cache at cedlm's (`cedlm.util.inductor_cache_dir`) unless the
    caller chose another directory in $TORCHINDUCTOR_CACHE_DIR; -> the directory. (Importing
    torch's compile stack sets that variable to inductor's default under /tmp, which a reboot
    empties: that value is taken as not chosen.)"""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    cur = os.environ.get(CACHE_ENV)
    if cur is None or os.path.abspath(cur) == os.path.abspath(default_cache_dir()):
        os.environ[CACHE_ENV] = str(inductor_cache_dir())
    d = Path(os.environ[CACHE_ENV])
    d.mkdir(parents=True, exist_ok=True)
    return d


def _cross_entropy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy of the model's logits on x against targets y [B, S]; with a
    bool mask [B, S], the mean over the targets where it is True (a float mask: the weighted mean)."""
    if mask is None:
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    ce = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none")
    m = mask.flatten().to(ce.dtype)
    return (ce * m).sum() / m.sum().clamp_min(1)


def training_loss(model: torch.nn.Module, compile: bool, backend: str = "inductor"
                  ) -> Callable[..., torch.Tensor]:
    """`loss_fn(x, y[, mask])`: the model's training forward and its mean cross-entropy (over the
    mask's targets when one is given), compiled or
    eager. Compiling happens in the first call of each input shape (the forward) and its first
    backward (AOTAutograd compiles the backward then): time the first step to see it. `backend`
    is torch.compile's ("aot_eager": the same traced graphs run by eager kernels, no code
    generated; what the quick test checks)."""
    if not compile:
        return lambda x, y, mask=None: _cross_entropy(model, x, y, mask)
    use_inductor_cache()
    # One graph per layer kind and pass; the default limit (8) is below a 12-layer model's.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    fn = torch.compile(_cross_entropy, dynamic=False, backend=backend)
    return lambda x, y, mask=None: fn(model, x, y, mask)


def drop_unrouted(model: torch.nn.Module) -> None:
    """After backward: experts that no token chose this step (their MoE `load` count is 0) get
    `grad = None`, as in eager, where they took no part in the graph. Call right after backward:
    before the gradients are averaged over ranks (this rank's load: `sync_gradients` then keeps
    None where no rank used an expert, as in eager) and before `optim.update_moe_bias` resets
    the load."""
    for layer in model.layers:
        moe = layer.ffn
        for e in torch.nonzero(moe.load == 0).flatten().tolist():
            for p in moe.experts[e].parameters():
                p.grad = None
