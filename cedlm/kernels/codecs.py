"""The KV codecs the model and the cache call: ``encode``, ``decode``, ``quant_dequant``,
bit-identical to the readable reference codecs of ``cedlm.quant.formats`` (which stay the
documentation and the oracle; the tests compare the two bit for bit).

Which path runs is the gate's choice (``gate.py``):

* the reference (``formats.*_reference``) when ``CEDLM_REFERENCE_KERNELS=1`` or
  ``gate.set_reference_kernels(True)``;
* ``"ext"``: the compiled module (``csrc/codecs.cpp``: one pass per entry, torch's intra-op
  threads), for CPU tensors of the three V4.1 formats when it is built (``build.py``);
* ``"torch"``: the vectorised torch codecs below; every other case (not built: one log line;
  other devices; ``v4_fp8``; ``gate.set_fast_backend("torch")``).

Both fast paths use the same look-up tables (``tables.py``, computed from the reference), so
neither can drift; ``tables.py`` explains the constructions and what makes the torch path fast.
bf16 entries are a plain dtype cast on every path. While torch.compile traces, the codecs are
the custom ops of ``ops.py`` (opaque: their eager code runs, see ``_opaque``).

Bit identity on every device (the audit; tests/test_devices_codecs.py pins it). The torch path
is what runs on a GPU, and every operation in it is exact or one IEEE-754 correctly rounded
operation, so CPU and CUDA give the same bits for the same inputs:

* input -> float32: exact from bf16/fp16, round-to-nearest-even from float64 (IEEE).
* tile amax = ``abs().amax``: max is exact and order-free (there is no sum anywhere); a NaN
  makes it NaN on both (its payload is never read: only ``isnan`` and exponent bits).
* scale rules (``formats.scale_bytes_from_amax``): clamps (exact float32 bounds), ONE division
  amax / 6 (kv_fp4, index_fp4) or multiplication by fp32(1/448) (window_fp8), by a float32
  tensor on the device, never a Python scalar: ATen's CUDA kernel divides by a CPU scalar as
  a * (1 / b), which changed 30 of the 131k kv_fp4 scale bytes of the test sweep (amax
  0.11132812: 0x09 by the quotient, 0x0A by the reciprocal). UE8M0 ceil: integer arithmetic
  on the int32 view (no log2 / exp2 / pow / ceil). kv_fp4's E4M3 scale byte: as the elements.
* scale values: gathers from 256-entry tables made on the CPU by the reference decoders.
* t = x / s: one IEEE division of device tensors (ATen builds without fast math and keeps
  subnormals on CPU and CUDA); a power of two s (UE8M0) divides exactly unless t is subnormal.
* element codes: an integer round-to-odd class index (shift / and / or on the int32 view) and
  a gather from tables the reference encoder filled on the CPU (E2M1 always; E4M3 on the device
  path, ``numerics.device_path``; the CPU path uses torch's float8 cast, the reference rule).
  No float -> int conversion, no ``torch.round``: indices come from bit views.
* NaN-scale ("poisoned") tiles: the codes are stated (``_poison_e2m1_``,
  ``formats.e4m3_poisoned``) instead of following NaN propagation (x86 returns the NaN operand,
  CUDA a canonical NaN); decode's product q * s (exact unless subnormal, then round-to-nearest-
  even) has its NaN bits stated by ``numerics.scaled``.
* packing: integer shifts and ors (an int16 view: little-endian hosts and GPUs).
* no fused multiply-add can form: no product feeds an addition; torch.compile never fuses the
  codecs (inductor would, and on the GPU it turns a division by a constant into a reciprocal
  multiplication); the device path has no host sync, and its constants are fill kernels
  (``torch.full``), so a CUDA graph can capture it once the tables are on the device.

The readable reference (``formats``) follows the same rules (its E4M3 decode is bit arithmetic,
its float8 encode cast meets only finite values once the NaN rules are applied), so it too gives
the same bits on CUDA. Assumed of the process: subnormals kept (``torch.set_flush_denormal``
off, torch's default; cedlm never sets it). Not covered: bf16 entries (``bf16``, v4_fp8's RoPE;
outside the V4.1 formats) keep whatever bits each device's cast gives a NaN (0xFFFF from this
CPU's kernels; CUDA's conversion makes its own canonical NaN).
"""

from __future__ import annotations

import sys

import torch

from cedlm.quant import formats as F
from cedlm.quant import numerics as N
from cedlm.quant.bf16 import Bf16Format

from . import gate, tables

__all__ = ["encode", "decode", "quant_dequant", "fast_encode", "fast_decode",
           "fast_quant_dequant", "ext_format", "CHUNK_VALUES"]

CHUNK_VALUES = 1 << 18          # float32 values per row chunk (1 MiB; temporaries stay cached)
_LITTLE = sys.byteorder == "little"
_EXT_KIND = {("kv_fp4", "e2m1", "e4m3"): 0, ("index_fp4", "e2m1", "ue8m0"): 1,
             ("window_fp8", "e4m3", "ue8m0"): 2}


# ---------------------------------------------------------------------------------------------
# the public codecs: fast unless the reference is forced
# ---------------------------------------------------------------------------------------------

def _opaque(f) -> str | None:
    """The format's name while torch.compile traces (the call then goes through the custom op
    ``torch.ops.cedlm.*`` of ``ops.py``, which inductor keeps as one opaque call running these
    eager codecs: fused into generated code, the arithmetic would not be pinned, e.g. inductor
    turns a division by a constant into a multiplication by its reciprocal on the GPU); None
    otherwise, for bf16 (a plain cast) and for a format object the ops cannot name."""
    if not torch.compiler.is_compiling() or isinstance(f, Bf16Format):
        return None
    try:
        return f.name if F.get_format(f.name) == f else None
    except ValueError:
        return None


def _ops():
    from . import ops          # registers torch.ops.cedlm.* (ops imports this module)
    return torch.ops.cedlm


def encode(x: torch.Tensor, fmt: str | F.QuantFormat) -> torch.Tensor:
    """float [..., dim] -> uint8 [..., bytes_per_entry(fmt, dim)], layout [elements][scales];
    bit-identical to ``formats.encode_reference`` (which runs when the reference is forced)."""
    f = F.get_format(fmt)
    if isinstance(f, Bf16Format):
        return f.encode(x)
    if (name := _opaque(f)) is not None:
        return _ops().encode(x.detach(), name)
    if gate.reference_kernels():
        return F.encode_reference(x, f)
    return fast_encode(x, f)


def decode(b: torch.Tensor, fmt: str | F.QuantFormat, dim: int) -> torch.Tensor:
    """uint8 [..., bytes_per_entry(fmt, dim)] -> float32 [..., dim] (fast path, as ``encode``)."""
    f = F.get_format(fmt)
    F.check_bytes(b, f, dim)
    if isinstance(f, Bf16Format):
        return f.decode(b, dim)
    if (name := _opaque(f)) is not None:
        return _ops().decode(b, name, dim)
    if gate.reference_kernels():
        return F.decode_reference(b, f, dim)
    return fast_decode(b, f, dim)


def quant_dequant(x: torch.Tensor, fmt: str | F.QuantFormat | None) -> torch.Tensor:
    """Bitwise equal to ``decode(encode(x, fmt), fmt, dim)`` (float32), without packing bytes.

    ``fmt`` None or "none" is the identity (returns ``x`` unchanged, any dtype). Fast path as
    ``encode``.
    """
    if fmt is None or fmt == "none":
        return x
    f = F.get_format(fmt)
    if isinstance(f, Bf16Format):
        return f.quant_dequant(x)
    if (name := _opaque(f)) is not None:
        return _ops().quant_dequant(x.detach(), name)
    if gate.reference_kernels():
        return F.quant_dequant_reference(x, f)
    return fast_quant_dequant(x, f)


def ext_format(fmt) -> tuple[int, int] | None:
    """(the extension's kind code, block) of a V4.1 KV format name or object, for the compiled
    kernels that read packed entries themselves (e.g. the indexer's ``index_score``); None for a
    format the extension does not decode (bf16, V4-Flash's fp8)."""
    f = F.get_format(fmt)
    if not isinstance(f, F.QuantFormat):
        return None
    kind = _EXT_KIND.get((f.name, f.element, f.scale), -1)
    return None if kind < 0 else (kind, f.block)


def _ext_for(f: F.QuantFormat, t: torch.Tensor):
    """(the compiled module, its kind code) for a codec call on ``t``, or (None, -1): the torch
    path (also for any tensor not on the CPU: the C++ kernels are CPU-only)."""
    if t.device.type != "cpu":
        return None, -1
    kind = _EXT_KIND.get((f.name, f.element, f.scale), -1)
    if kind < 0:
        return None, -1
    return gate.codec_module(t), kind


def _gather(table: torch.Tensor, idx: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """table[idx] for an int32 index of any shape (flattened), into ``out`` when given."""
    flat = idx.reshape(-1)
    if out is None:
        return torch.index_select(table, 0, flat).view(idx.shape)
    torch.index_select(table, 0, flat, out=out.view(-1))
    return out


def _span(t: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """Rows r0:r1 of ``t`` (``narrow``, not Python indexing: the same view, and it also runs
    on the tests' fake CUDA tensors, which a CPU torch build cannot index)."""
    return t.narrow(0, r0, r1 - r0)


def _cols(t: torch.Tensor, c0: int, c1: int) -> torch.Tensor:
    """Columns c0:c1 (the last dim) of ``t``, as ``_span``."""
    return t.narrow(-1, c0, c1 - c0)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous()`` (a contiguous copy, or ``t`` itself when it is one), without the
    binding that a CPU build of torch cannot run on the tests' fake CUDA tensors (``_put``)."""
    return t if t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)


def _put(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` through the aten op itself (``Tensor.copy_``'s Python binding takes a
    device guard, which a CPU build of torch cannot make for the tests' fake CUDA tensors)."""
    torch.ops.aten.copy_.default(dst, src)


def _rows_per_chunk(x: torch.Tensor, dim: int) -> int:
    if x.device.type != "cpu":
        return max(1, x.shape[0])          # one chunk: the device has the memory bandwidth
    return max(1, CHUNK_VALUES // dim)


def _tile_amax(xt: torch.Tensor) -> torch.Tensor:
    """max |x| over the last dim (NaN if the tile has one), as the reference computes it."""
    return xt.abs().amax(dim=-1)


def _scale_values(sb: torch.Tensor, scale: str, tab: dict[str, torch.Tensor]) -> torch.Tensor:
    return _gather(tab["e4m3" if scale == "e4m3" else "ue8m0"], sb.to(torch.int32))


def _class_index(t: torch.Tensor, idx: torch.Tensor, shift: int) -> torch.Tensor:
    """int32 round-to-odd class index of contiguous float32 ``t`` at ``shift`` (see
    ``tables.py``: the bits above ``shift``, a sticky bit for any bit below OR-ed into bit 0),
    written into the flat ``idx`` (``t.numel()`` elements)."""
    tb = t.view(-1).view(torch.int32)
    torch.bitwise_right_shift(tb, shift, out=idx)
    idx.bitwise_and_((1 << (32 - shift)) - 1)
    idx.bitwise_or_(tb.bitwise_and((1 << shift) - 1).ne_(0))
    return idx


def _e2m1_index(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The E2M1 class index (3 mantissa bits kept) of ``t``, into ``idx``."""
    return _class_index(t, idx, 20)


def _e4m3_codes(t: torch.Tensor, tab: dict[str, torch.Tensor]) -> torch.Tensor:
    """uint8 E4M3 bytes of float32 ``t`` (any shape; a scratch tensor, may be clamped in place):
    clamp to +-448 and round to nearest even, ``numerics.e4m3_encode``. On the device path by
    the class table (5 mantissa bits kept) built from it on the CPU; on the CPU by that very
    function (torch's float8 cast, the reference rule, two passes instead of six)."""
    if not N.device_path(t):
        return N.e4m3_encode(t, inplace=True)
    t = _dense(t)
    idx = torch.empty(t.numel(), dtype=torch.int32, device=t.device)
    return _gather(tab["e4m3_code"], _class_index(t, idx, 18)).view(t.shape)


def _poison_e2m1_(c: torch.Tensor, x: torch.Tensor, s: torch.Tensor) -> None:
    """In a NaN-scale tile (t = x/NaN) every E2M1 code becomes 0 with the sign of x, as the
    reference states it; c [r, tiles, block] uint8, x the unscaled input of that shape."""
    if not N.device_path(c) and not N.any_nan(s):
        return
    torch.where(torch.isnan(s), torch.signbit(x).to(torch.uint8) << 3, c, out=c)


# ---------------------------------------------------------------------------------------------
# the V4.1 formats
# ---------------------------------------------------------------------------------------------

def _flat_input(x: torch.Tensor, dim: int) -> torch.Tensor:
    x = x.detach()
    return x.reshape(-1, dim)


def _chunk_f32(x2: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    return _dense(_span(x2, r0, r1).to(torch.float32))


def fast_encode(x: torch.Tensor, f: F.QuantFormat | F.V4Fp8Format) -> torch.Tensor:
    """The fast ``encode`` (the reference switch not consulted): bit-identical to ``formats.encode_reference``."""
    if isinstance(f, F.V4Fp8Format):
        return _v4_encode(x, f)
    dim = f.check_dim(x.shape[-1]) if x.dim() > 0 else f.check_dim(0)
    x2 = _flat_input(x, dim)
    rows, tiles, nd = x2.shape[0], dim // f.block, f.data_bytes(dim)
    mod, kind = _ext_for(f, x)
    if mod is not None:
        xc = x2.to(torch.float32).contiguous()
        return mod.encode(xc, kind, f.block).view(*x.shape[:-1], nd + tiles)
    out = torch.empty(rows, nd + tiles, dtype=torch.uint8, device=x.device)
    tab = tables.for_device(x.device)
    step = _rows_per_chunk(x2, dim)
    fp4 = f.element == "e2m1"
    idx = torch.empty(min(step, rows) * dim, dtype=torch.int32, device=x.device) if fp4 else None
    code = torch.empty(min(step, rows) * dim, dtype=torch.uint8, device=x.device) if fp4 else None
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        r = r1 - r0
        xt = _chunk_f32(x2, r0, r1).view(r, tiles, f.block)
        xs = _span(x2, r0, r1).reshape(r, tiles, f.block)   # own dtype: the sign of a NaN
        sb = F.scale_bytes_from_amax(_tile_amax(xt), f, lambda y: _e4m3_codes(y, tab))
        s = _scale_values(sb, f.scale, tab).unsqueeze(-1)
        t = xt / s
        if fp4:
            c = _gather(tab["e2m1_code"], _e2m1_index(t, _span(idx, 0, r * dim)),
                        _span(code, 0, r * dim))
            _poison_e2m1_(c.view(r, tiles, f.block), xs, s)
            _put(_cols(_span(out, r0, r1), 0, nd), _pack(c, r, dim))
        else:
            c = F.e4m3_poisoned(_e4m3_codes(t, tab), xs, s)
            _put(_cols(_span(out, r0, r1), 0, nd), c.view(r, dim))
        _put(_cols(_span(out, r0, r1), nd, nd + tiles), sb)
    return out.view(*x.shape[:-1], nd + tiles)


def _pack(code: torch.Tensor, r: int, dim: int) -> torch.Tensor:
    """uint8 codes [r*dim] -> packed [r, dim/2], even element in the low nibble."""
    if _LITTLE:
        c16 = code.view(torch.int16)                 # even | odd << 8
        return (c16 | (c16 >> 4)).to(torch.uint8).view(r, dim // 2)   # low byte: even | odd << 4
    return N.pack_nibbles(code.view(r, dim))


def fast_decode(b: torch.Tensor, f: F.QuantFormat | F.V4Fp8Format, dim: int) -> torch.Tensor:
    """The fast ``decode`` (the caller validated ``b``): bit-identical to the reference."""
    if isinstance(f, F.V4Fp8Format):
        return _v4_decode(b, f, dim)
    nd, tiles, nbytes = f.data_bytes(dim), dim // f.block, f.bytes_per_entry(dim)
    b2 = b.reshape(-1, nbytes)
    mod, kind = _ext_for(f, b)
    if mod is not None:
        if b2.stride(-1) != 1:
            b2 = b2.contiguous()
        return mod.decode(b2, kind, dim, f.block).view(*b.shape[:-1], dim)
    rows = b2.shape[0]
    out = torch.empty(rows, dim, dtype=torch.float32, device=b.device)
    tab = tables.for_device(b.device)
    step = _rows_per_chunk(b2, dim)
    fp4 = f.element == "e2m1"
    idx = torch.empty(min(step, rows), nd, dtype=torch.int32, device=b.device)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        r = r1 - r0
        i = _span(idx, 0, r)
        _put(i, _cols(_span(b2, r0, r1), 0, nd))
        oc = _span(out, r0, r1)
        if fp4:
            _gather(tab["e2m1_pair"], i, oc.view(torch.int64))
        else:
            _gather(tab["e4m3"], i, oc)
        s = _scale_values(_cols(_span(b2, r0, r1), nd, nbytes), f.scale, tab).unsqueeze(-1)
        q = oc.view(r, tiles, f.block)
        N.scaled(q, s, q_nan=not fp4, out=q)
    return out.view(*b.shape[:-1], dim)


def fast_quant_dequant(x: torch.Tensor, f: F.QuantFormat | F.V4Fp8Format) -> torch.Tensor:
    """The fast ``quant_dequant``: bit-identical to ``formats.quant_dequant_reference``."""
    if isinstance(f, F.V4Fp8Format):
        return _v4_quant_dequant(x, f)
    dim = f.check_dim(x.shape[-1]) if x.dim() > 0 else f.check_dim(0)
    x2 = _flat_input(x, dim)
    rows, tiles = x2.shape[0], dim // f.block
    mod, kind = _ext_for(f, x)
    if mod is not None:
        xc = x2.to(torch.float32).contiguous()
        return mod.quant_dequant(xc, kind, f.block).view(x.shape)
    out = torch.empty(rows, dim, dtype=torch.float32, device=x.device)
    tab = tables.for_device(x.device)
    step = _rows_per_chunk(x2, dim)
    fp4 = f.element == "e2m1"
    idx = torch.empty(min(step, rows) * dim, dtype=torch.int32, device=x.device) if fp4 else None
    e4 = lambda y: _e4m3_codes(y, tab)      # noqa: E731
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        r = r1 - r0
        xt = _chunk_f32(x2, r0, r1).view(r, tiles, f.block)
        sb = F.scale_bytes_from_amax(_tile_amax(xt), f, e4)
        s = _scale_values(sb, f.scale, tab).unsqueeze(-1)
        oc = _span(out, r0, r1).view(r, tiles, f.block)
        if fp4:
            # A poisoned tile (s = NaN) needs no fix of q: q * NaN is s's NaN (``scaled``).
            torch.div(xt, s, out=oc)
            _gather(tab["e2m1_value"], _e2m1_index(oc, _span(idx, 0, r * dim)), oc)
        else:
            xs = _span(x2, r0, r1).reshape(r, tiles, f.block)
            c = F.e4m3_poisoned(_e4m3_codes(xt / s, tab), xs, s)
            _gather(tab["e4m3"], c.to(torch.int32), oc)
        N.scaled(oc, s, q_nan=not fp4, out=oc)
    return out.view(x.shape)


# ---------------------------------------------------------------------------------------------
# v4_fp8 (DeepSeek V4's entry; outside the V4.1 target, same tools)
# ---------------------------------------------------------------------------------------------

def _v4_encode(x: torch.Tensor, f: F.V4Fp8Format) -> torch.Tensor:
    dim = f.check_dim(x.shape[-1]) if x.dim() > 0 else f.check_dim(0)
    nope, rope = dim - f.rope, f.rope
    tiles = nope // f.block
    x2 = _flat_input(x, dim)
    rows = x2.shape[0]
    out = torch.empty(rows, f.bytes_per_entry(dim), dtype=torch.uint8, device=x.device)
    tab = tables.for_device(x.device)
    step = _rows_per_chunk(x2, dim)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        r = r1 - r0
        xc = _chunk_f32(x2, r0, r1)
        xt = _cols(xc, 0, nope).reshape(r, tiles, f.block)
        sb = F.v4_scale_bytes_from_amax(_tile_amax(xt))
        sv = _gather(tab["ue8m0"], sb.to(torch.int32)).unsqueeze(-1)
        xs = _cols(_span(x2, r0, r1), 0, nope).reshape(r, tiles, f.block)
        c = F.e4m3_poisoned(_e4m3_codes(xt / sv, tab), xs, sv)
        o = _span(out, r0, r1)
        _put(_cols(o, 0, nope), c.view(r, nope))
        rb = _cols(xc, nope, dim).to(torch.bfloat16).view(torch.uint8)
        _put(_cols(o, nope, nope + 2 * rope), rb)
        _put(_cols(o, nope + 2 * rope, nope + 2 * rope + tiles), sb)
        _cols(o, nope + 2 * rope + tiles, nope + 2 * rope + tiles + 1).zero_()
    return out.view(*x.shape[:-1], out.shape[-1])


def _v4_decode(b: torch.Tensor, f: F.V4Fp8Format, dim: int) -> torch.Tensor:
    nope, rope = f.nope(dim), f.rope
    tiles, nbytes = nope // f.block, f.bytes_per_entry(dim)
    b2 = b.reshape(-1, nbytes)
    rows = b2.shape[0]
    out = torch.empty(rows, dim, dtype=torch.float32, device=b.device)
    tab = tables.for_device(b.device)
    step = _rows_per_chunk(b2, dim)
    idx = torch.empty(min(step, rows), nope, dtype=torch.int32, device=b.device)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        r = r1 - r0
        i = _span(idx, 0, r)
        _put(i, _cols(_span(b2, r0, r1), 0, nope))
        q = _gather(tab["e4m3"], i).view(r, tiles, f.block)
        br = _span(b2, r0, r1)
        sb = _cols(br, nope + 2 * rope, nope + 2 * rope + tiles)
        s = _gather(tab["ue8m0"], sb.to(torch.int32))
        oc = _span(out, r0, r1)
        _put(_cols(oc, 0, nope).view(r, tiles, f.block), N.scaled(q, s.unsqueeze(-1)))
        _put(_cols(oc, nope, dim), _dense(_cols(br, nope, nope + 2 * rope)).view(torch.bfloat16))
    return out.view(*b.shape[:-1], dim)


def _v4_quant_dequant(x: torch.Tensor, f: F.V4Fp8Format) -> torch.Tensor:
    # Only the twin's training/reference forward uses it, at activation sizes: the reference.
    return F.v4_quant_dequant(x, f)
