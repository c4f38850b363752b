"""The lightning indexer's scores and its top-k with the newest-first tie rule: the readable torch
references (``score_reference`` over decoded keys, ``topk_reference``), which ``Indexer.score``
and ``stable_topk`` in ``cedlm/model/indexer.py`` and the custom ops of ``ops.py`` run when no
compiled kernel does, and the compiled kernels (``csrc/index.h``): the scores read straight from
the packed FP4/FP8 index keys, and the top-k.

The compiled scores agree with the reference to float32 rounding (another summation order; the
AVX2 + FMA scorer where the CPU has it unless ``CEDLM_KERNEL_ISA=sse2``); the top-k is
bit-identical. Each compiled kernel returns None for the reference path: training (autograd),
other devices or dtypes, the kernels not built, the reference switch
(``CEDLM_REFERENCE_KERNELS=1``).
"""

from __future__ import annotations

import torch

from .codecs import ext_format
from .gate import inference_op

__all__ = ["score_reference", "topk_reference", "stable_topk", "score_packed"]

NEG = float("-inf")


def score_reference(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor
                    ) -> torch.Tensor:
    """I(t, n) = sum_h w(t, h) * ReLU(q(t, h) . k(n)): q [B,T,h,d], w [B,T,h], keys [B,N,d]
    (decoded), visible [B,T,N] -> [B,T,N] float32, -inf where not visible."""
    s = torch.einsum("bthd,bnd->bthn", q.float(), keys.float()).relu()
    s = torch.einsum("bthn,bth->btn", s, w.float())
    return s.masked_fill(~visible, NEG)


def topk_reference(score: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, values) of the k best along the last dim, ties toward the newest (highest)
    index: a stable descending sort of the reversed scores."""
    N = score.shape[-1]
    vals, order = torch.sort(score.flip(-1), dim=-1, descending=True, stable=True)
    return (N - 1 - order[..., :k]), vals[..., :k]


def stable_topk(score: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(indices, values) of the k best along the last dim, ties toward the newest index; or
    None."""
    op = inference_op("stable_topk", score)
    return None if op is None else op(score, k)


def score_packed(q: torch.Tensor, w: torch.Tensor, raw: torch.Tensor, visible: torch.Tensor,
                 fmt) -> torch.Tensor | None:
    """I(t, n) = sum_h w(t, h) * ReLU(q(t, h) . k(n)) over the keys packed in ``raw`` (entries of
    KV format ``fmt``), -inf where ``visible`` is False; or None (also for a format the kernel
    does not decode, or no cached keys)."""
    kind = ext_format(fmt)
    op = inference_op("index_score", q, w)
    if op is None or kind is None or raw.shape[-2] == 0:
        return None
    return op(q.contiguous(), w.contiguous(), raw, visible.contiguous(), *kind)
