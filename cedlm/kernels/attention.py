"""Sparse attention: one softmax over [window keys || selected compressed keys || a per-head sink
logit], K = V. ``attend_reference`` is its readable torch form (the einsums), which
``attend`` in ``cedlm/model/attention.py`` and the custom op ``cedlm::attend`` (``ops.py``) run
when no compiled kernel does; the compiled kernels compute the same, float32 rounding apart.

* ``attend_sparse`` (``csrc/attend.h``): keys already decoded to float32 (tests/test_attend_fast.py).
* ``attend_packed`` (``csrc/attend_packed.h``): keys still in the KV cache's storage bytes
  (``PackedKeys``: a row store and the row of each key), decoded tile by tile inside the attention
  loop with the codec's own tables, so no decoded float32 copy of the selected entries or of the
  window is written (tests/test_attend_packed.py).

Each compiled kernel returns None for the reference path: training (autograd), other devices or
dtypes, the kernels not built, the reference switch (``CEDLM_REFERENCE_KERNELS=1``), a format the
compiled decode does not read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .codecs import decode, ext_format
from .gate import inference_op

__all__ = ["PackedKeys", "attend_reference", "attend_sparse", "attend_packed", "available",
           "unpacked"]

NEG = float("-inf")


@dataclass(frozen=True)
class PackedKeys:
    """Keys still in their storage: ``rows`` uint8 [R, width] (entries of KV format ``fmt``,
    ``dim`` values each, e.g. a paged pool's rows) and ``index`` int64 [...] in [0, R): the row
    each key slot reads. ``decoded()`` is the float32 [..., dim] the codec gives them."""
    rows: torch.Tensor
    index: torch.Tensor
    fmt: object
    dim: int

    def decoded(self) -> torch.Tensor:
        rows = torch.index_select(self.rows, 0, self.index.reshape(-1))
        return decode(rows.view(*self.index.shape, self.rows.shape[-1]), self.fmt, self.dim)


def unpacked(keys):
    """float32 keys for the readable reference: ``keys`` decoded if packed, else unchanged."""
    return keys.decoded() if isinstance(keys, PackedKeys) else keys


def attend_reference(q, win_k, win_valid, comp_k, comp_valid, sink, scale, dense: bool = False,
                     return_probs: bool = False):
    """The readable attention (float32 keys): scores of the window keys and of the compressed
    keys, -inf where not valid, one softmax with the sink logit appended (it takes mass, adds no
    value), then the probability-weighted sum of the same keys (K = V).

    q [B,T,H,hd]; win_k [B,W,hd], win_valid [B,T,W]; sink [H]; comp_k None (window only), or
    dense=False: comp_k [B,T,k,hd] gathered per query, comp_valid [B,T,k];
    dense=True: comp_k [B,N,hd] all entries, comp_valid [B,T,N] top-k mask.
    Returns [B,T,H,hd] float32; with return_probs, also the probabilities of the compressed
    entries [B,H,T,N or k]."""
    qf = q.float()
    sw = torch.einsum("bthd,bwd->bhtw", qf, win_k.float()) * scale
    sw = sw.masked_fill(~win_valid.unsqueeze(1), NEG)
    parts = [sw]
    if comp_k is not None:
        eq = "bthd,bnd->bhtn" if dense else "bthd,btnd->bhtn"
        sc = torch.einsum(eq, qf, comp_k.float()) * scale
        parts.append(sc.masked_fill(~comp_valid.unsqueeze(1), NEG))
    B, H, T = sw.shape[:3]
    parts.append(sink.float().view(1, H, 1, 1).expand(B, H, T, 1))
    p = torch.cat(parts, -1).softmax(-1)
    W = sw.shape[-1]
    out = torch.einsum("bhtw,bwd->bthd", p[..., :W], win_k.float())
    if comp_k is not None:
        eq = "bhtn,bnd->bthd" if dense else "bhtn,btnd->bthd"
        out = out + torch.einsum(eq, p[..., W:-1], comp_k.float())
    return (out, p[..., W:-1]) if return_probs else out


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


def store_args(keys, lead: int) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
    """(rows, index, kind, block) of the compiled kernel for ``keys``: PackedKeys (kind and block
    of its format; None for a format the kernel does not decode) or float32 keys [*lead dims*,
    n, hd] (read in place: kind -1, index = each key's own row); ``lead`` is how many leading
    dims the index has before the key dim."""
    if isinstance(keys, PackedKeys):
        kind = ext_format(keys.fmt)
        if kind is None:
            return None
        return keys.rows, keys.index.contiguous(), *kind
    rows = keys.reshape(-1, keys.shape[-1])
    return rows, torch.arange(rows.shape[0], device=rows.device).view(keys.shape[:lead + 1]), -1, 0


def _readable(keys) -> bool:
    """Whether the compiled kernel may read these keys (CPU; float32 unless packed)."""
    if isinstance(keys, PackedKeys):
        return inference_op("attend_packed", keys.rows, keys.index, float32=False) is not None
    return inference_op("attend_packed", keys) is not None


def attend_packed(q, win_k, win_valid, comp_k, comp_valid, sink, scale: float
                  ) -> torch.Tensor | None:
    """``attend_sparse`` with either kind of keys packed: win_k PackedKeys with index [B,W] (or
    float32 [B,W,hd]); comp_k PackedKeys with index [B,T,k] (or float32 [B,T,k,hd], or None),
    comp_valid [B,T,k]; sink [H] -> [B,T,H,hd] float32; or None."""
    op = inference_op("attend_packed", q, sink)
    if op is None or not all(_readable(k) for k in (win_k, comp_k) if k is not None):
        return None
    win = store_args(win_k, 1)
    if comp_k is None:
        B, T = q.shape[:2]
        comp_k, comp_valid = q.new_empty(B, T, 0, q.shape[-1]), win_valid.new_empty(B, T, 0)
    comp = store_args(comp_k, 2)
    if win is None or comp is None:
        return None
    return op(q.contiguous(), *win[:2], win_valid.contiguous(), *win[2:], *comp[:2],
              comp_valid.contiguous(), *comp[2:], sink.detach().contiguous(), float(scale))
