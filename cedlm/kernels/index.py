"""The compiled indexer kernels (``csrc/index.h``): the lightning indexer's scores read straight
from the packed FP4/FP8 index keys, and its top-k with the newest-first tie rule. The readable
references are ``Indexer.score`` over decoded keys and ``stable_topk`` in
``cedlm/model/indexer.py``, which call these first.

The scores agree with the reference to float32 rounding (another summation order; the AVX2 + FMA
scorer where the CPU has it unless ``CEDLM_KERNEL_ISA=sse2``); the top-k is bit-identical. Each
returns None for the reference path: training (autograd), other devices or dtypes, the kernels
not built, the reference switch (``CEDLM_REFERENCE_KERNELS=1``).
"""

from __future__ import annotations

import torch

from .codecs import ext_format
from .gate import inference_op

__all__ = ["stable_topk", "score_packed"]


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
