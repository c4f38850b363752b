"""The compiled sparse attention (``csrc/attend.h``): one softmax over [window keys || selected
compressed keys || a per-head sink logit], the same computation as the einsums of ``attend`` in
``cedlm/model/attention.py`` (which calls ``attend_sparse`` first), float32 rounding apart
(tests/test_attend_fast.py states the tolerance).

``attend_sparse`` returns None for the reference path: training (autograd), other devices or
dtypes, the kernels not built, the reference switch (``CEDLM_REFERENCE_KERNELS=1``).
"""

from __future__ import annotations

import torch

from .gate import inference_op

__all__ = ["attend_sparse", "available"]


def available(q, win_k, comp_k, sink) -> bool:
    """Whether ``attend_sparse`` would run compiled on these tensors (``comp_k`` may be None)."""
    return inference_op("attend_sparse", q, win_k, sink,
                        *([] if comp_k is None else [comp_k])) is not None


def attend_sparse(q, win_k, win_valid, comp_k, comp_valid, sink, scale: float
                  ) -> torch.Tensor | None:
    """q [B,T,H,hd]; win_k [B,W,hd], win_valid [B,T,W]; comp_k [B,T,k,hd] gathered per query (or
    None), comp_valid [B,T,k]; sink [H] -> [B,T,H,hd] float32; or None."""
    op = inference_op("attend_sparse", q, win_k, sink, *([] if comp_k is None else [comp_k]))
    if op is None:
        return None
    if comp_k is None:
        B, T = q.shape[:2]
        comp_k, comp_valid = q.new_empty(B, T, 0, q.shape[-1]), win_valid.new_empty(B, T, 0)
    return op(q.contiguous(), win_k.contiguous(), win_valid.contiguous(), comp_k.contiguous(),
              comp_valid.contiguous(), sink.detach().contiguous(), float(scale))
