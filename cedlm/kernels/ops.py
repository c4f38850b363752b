"""The compiled kernels as torch custom ops (``torch.ops.cedlm.*``), for code that torch.compile
traces: the compiled decode step (``cedlm/model/model.py``'s ``decode_step``) calls these, and inductor keeps each as
one opaque call instead of breaking its graph at a pybind function.

Each op runs the compiled kernel when the gate allows it (``gate.ext_op``: built, not forced to
the reference, every tensor on the CPU) and otherwise the same torch code as the eager path, so a
graph traced with the kernels missing still runs and agrees. The ops are defined with
``torch.library.Library`` with one Python kernel each, registered under
``CompositeExplicitAutograd`` (every device; on CUDA the gate always answers "torch path": the C++
kernels are CPU-only), and a fake (meta) implementation that gives torch.compile and
``FakeTensorMode`` the output shapes, dtypes and device (a few microseconds of dispatch, measured
against about 45 for ``torch.library.custom_op``, whose autograd wrapper these inference-only ops
do not need); they call the extension's functions directly. Once the compiled module is loaded,
it registers a CPU kernel of each op with the dispatcher (``csrc/dispatch.h``, through
``gate.on_compiled``), which the dispatcher prefers for CPU tensors: the steps' generated C++
then calls the kernels without entering the interpreter. Those CPU kernels do what the Python
kernels below do and call them (under the GIL) in every case the gate does not answer "ext". The codec ops are bit-identical to
``cedlm.kernels.encode`` / ``decode`` / ``quant_dequant`` (they call them); the others agree with
their readable references as the eager fast paths do, and run those very functions, the ones the
eager model runs, where the kernel does not (``index.py``: ``score_reference``,
``topk_reference``; ``attention.py``: ``attend_reference``).

    cedlm::encode(x, fmt)                    float [..., dim] -> uint8 [..., bytes]
    cedlm::decode(b, fmt, dim)               uint8 [..., bytes] -> float32 [..., dim]
    cedlm::quant_dequant(x, fmt)             float -> float32, the stored value
    cedlm::index_score(q, w, raw, visible, fmt)   indexer scores straight from packed keys
    cedlm::stable_topk(score, k)             top-k, ties toward the newest index
    cedlm::attend(q, win_k, win_valid, comp_k, comp_valid, sink, scale)   sparse attention
    cedlm::attend_packed(q, win_rows, win_idx, win_valid, win_fmt, comp_rows, comp_idx,
                         comp_valid, comp_fmt, sink, scale)   the same over packed row stores
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import codecs, gate
from .attention import attend_reference
from .codecs import ext_format
from .index import score_reference, topk_reference

_LIB = torch.library.Library("cedlm", "DEF")
_SCHEMAS = {
    "encode": "encode(Tensor x, str fmt) -> Tensor",
    "decode": "decode(Tensor b, str fmt, int dim) -> Tensor",
    "quant_dequant": "quant_dequant(Tensor x, str fmt) -> Tensor",
    "index_score": "index_score(Tensor q, Tensor w, Tensor raw, Tensor visible, str fmt) -> Tensor",
    "stable_topk": "stable_topk(Tensor score, int k) -> (Tensor, Tensor)",
    "attend": "attend(Tensor q, Tensor win_k, Tensor win_valid, Tensor comp_k, Tensor comp_valid, "
              "Tensor sink, float scale) -> Tensor",
}
for _schema in _SCHEMAS.values():
    _LIB.define(_schema)


_DEVICES = ("CompositeExplicitAutograd",)   # the Python kernels serve every device


def _impl(name):
    def register(fn):
        for key in _DEVICES:
            _LIB.impl(name, fn, key)
        return fn
    return register


def _fake(name):
    def register(fn):
        torch.library.register_fake(f"cedlm::{name}", fn, lib=_LIB)
        return fn
    return register


def _codec(fmt: str, t: Tensor):
    """(the extension module, kind, block) for a V4.1 format the extension codes and a tensor on
    the CPU, else None (the torch codecs)."""
    kind = ext_format(fmt)
    if kind is None or gate.reference_kernels():
        return None
    mod = gate.codec_module(t)
    return None if mod is None else (mod, *kind)


# ---------------------------------------------------------------- codecs
@_impl("encode")
def encode(x: Tensor, fmt: str) -> Tensor:
    ext = _codec(fmt, x)
    if ext is None:
        return codecs.encode(x, fmt)
    mod, kind, block = ext
    dim = x.shape[-1]
    if not x.numel():                         # zero rows (an entry-less chunk): nothing to code
        return torch.empty(*x.shape[:-1], _width(fmt, dim), dtype=torch.uint8, device=x.device)
    return mod.encode(x.reshape(-1, dim).float().contiguous(), kind, block).view(*x.shape[:-1],
                                                                                 _width(fmt, dim))


def _width(fmt: str, dim: int) -> int:
    """Bytes of one encoded row (stated, so that zero rows keep their shape)."""
    from cedlm.quant import formats as F
    return F.bytes_per_entry(F.get_format(fmt), dim)


@_fake("encode")
def _(x, fmt):
    return x.new_empty(*x.shape[:-1], _width(fmt, x.shape[-1]), dtype=torch.uint8)


@_impl("decode")
def decode(b: Tensor, fmt: str, dim: int) -> Tensor:
    ext = _codec(fmt, b)
    if ext is None:
        return codecs.decode(b, fmt, dim)
    mod, kind, block = ext
    if not b.numel():
        return torch.empty(*b.shape[:-1], dim, dtype=torch.float32, device=b.device)
    return mod.decode(b.reshape(-1, b.shape[-1]).contiguous(), kind, dim, block).view(*b.shape[:-1], dim)


@_fake("decode")
def _(b, fmt, dim):
    return b.new_empty(*b.shape[:-1], dim, dtype=torch.float32)


@_impl("quant_dequant")
def quant_dequant(x: Tensor, fmt: str) -> Tensor:
    ext = _codec(fmt, x)
    if ext is None:
        return codecs.quant_dequant(x, fmt).float().clone()
    mod, kind, block = ext
    if not x.numel():
        return x.float().clone()
    return mod.quant_dequant(x.reshape(-1, x.shape[-1]).float().contiguous(), kind, block).view(x.shape)


@_fake("quant_dequant")
def _(x, fmt):
    return x.new_empty(x.shape, dtype=torch.float32)


# ---------------------------------------------------------------- indexer
@_impl("index_score")
def index_score(q: Tensor, w: Tensor, raw: Tensor, visible: Tensor, fmt: str) -> Tensor:
    """q [B,T,h,d], w [B,T,h], raw uint8 [B,N,bytes] packed keys, visible [B,T,N] -> [B,T,N]."""
    op, kind = gate.ext_op("index_score", q, w, raw, visible), ext_format(fmt)
    if op is not None and kind is not None and raw.shape[-2] > 0:
        return op(q.float().contiguous(), w.float().contiguous(), raw.contiguous(),
                  visible.contiguous(), *kind)
    keys = codecs.decode(raw, fmt, q.shape[-1])
    return score_reference(q, w, keys, visible)


@_fake("index_score")
def _(q, w, raw, visible, fmt):
    return q.new_empty(*visible.shape, dtype=torch.float32)


@_impl("stable_topk")
def stable_topk(score: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(indices int64, values) of the k best along the last dim, ties toward the newest."""
    op = gate.ext_op("stable_topk", score)
    if op is not None and score.dtype == torch.float32:
        return op(score.contiguous(), k)
    ids, vals = topk_reference(score, k)
    return ids.contiguous(), vals.contiguous()


@_fake("stable_topk")
def _(score, k):
    shape = (*score.shape[:-1], k)
    return score.new_empty(shape, dtype=torch.int64), score.new_empty(shape)


# ---------------------------------------------------------------- attention
@_impl("attend")
def attend(q: Tensor, win_k: Tensor, win_valid: Tensor, comp_k: Tensor, comp_valid: Tensor,
           sink: Tensor, scale: float) -> Tensor:
    """q [B,T,H,hd]; win_k [B,W,hd], win_valid [B,T,W]; comp_k [B,T,k,hd], comp_valid [B,T,k]
    (k may be 0); sink [H] -> [B,T,H,hd] float32."""
    op = gate.ext_op("attend_sparse", q, win_k, win_valid, comp_k, comp_valid, sink)
    if op is not None:
        return op(q.float().contiguous(), win_k.float().contiguous(), win_valid.contiguous(),
                  comp_k.float().contiguous(), comp_valid.contiguous(), sink.float().contiguous(),
                  float(scale))
    return attend_reference(q, win_k, win_valid, comp_k, comp_valid, sink, scale)


@_fake("attend")
def _(q, win_k, win_valid, comp_k, comp_valid, sink, scale):
    return q.new_empty(q.shape, dtype=torch.float32)


# ---------------------------------------------------------------- attention over packed keys
_LIB.define("attend_packed(Tensor q, Tensor win_rows, Tensor win_idx, Tensor win_valid, str win_fmt, "
            "Tensor comp_rows, Tensor comp_idx, Tensor comp_valid, str comp_fmt, Tensor sink, "
            "float scale) -> Tensor")


def _keys(rows: Tensor, idx: Tensor, fmt: str, hd: int) -> Tensor:
    """The keys a row store gives: rows[idx] decoded by the codec (float32 rows when fmt is "")."""
    return rows[idx].float() if fmt == "" else codecs.decode(rows[idx], fmt, hd)


@_impl("attend_packed")
def attend_packed(q: Tensor, win_rows: Tensor, win_idx: Tensor, win_valid: Tensor, win_fmt: str,
                  comp_rows: Tensor, comp_idx: Tensor, comp_valid: Tensor, comp_fmt: str,
                  sink: Tensor, scale: float) -> Tensor:
    """``attend`` with the keys read from row stores (``attention.PackedKeys``): rows uint8
    [R, bytes] of KV format ``*_fmt`` (or float32 [R, hd] with fmt ""), win_idx [B,W], comp_idx
    [B,T,k] (k may be 0); the kernel decodes the rows inside its loop (csrc/attend_packed.h)."""
    op = gate.ext_op("attend_packed", q, win_rows, win_idx, win_valid, comp_rows, comp_idx,
                     comp_valid, sink)
    kinds = [(-1, 0) if f == "" else ext_format(f) for f in (win_fmt, comp_fmt)]
    if op is not None and None not in kinds:
        return op(q.float().contiguous(), win_rows, win_idx.contiguous(), win_valid.contiguous(),
                  *kinds[0], comp_rows, comp_idx.contiguous(), comp_valid.contiguous(), *kinds[1],
                  sink.float().contiguous(), float(scale))
    hd = q.shape[-1]
    return attend_reference(q, _keys(win_rows, win_idx, win_fmt, hd), win_valid,
                            _keys(comp_rows, comp_idx, comp_fmt, hd), comp_valid, sink, scale)


@_fake("attend_packed")
def _(q, win_rows, win_idx, win_valid, win_fmt, comp_rows, comp_idx, comp_valid, comp_fmt, sink,
      scale):
    return q.new_empty(q.shape, dtype=torch.float32)


# ---------------------------------------------------------------- the CPU kernels in C++
def _register_cpu_kernels(mod) -> None:
    """Register the compiled module's CPU kernels of these ops (``csrc/dispatch.h``), given every
    format name the extension codes and the Python kernels above to fall back to."""
    from cedlm.quant import formats as F
    names = {n: ext_format(n) for n in (*F.FORMATS, *F.EXTRA_FORMATS)}
    fallbacks = {"encode": encode, "decode": decode, "quant_dequant": quant_dequant,
                 "index_score": index_score, "stable_topk": stable_topk, "attend": attend,
                 "attend_packed": attend_packed}
    mod.register_ops({n: kb for n, kb in names.items() if kb is not None}, fallbacks)


gate.on_compiled(_register_cpu_kernels)
