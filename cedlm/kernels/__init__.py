"""Compiled kernels of cedlm and the one gate that chooses them (CPU inference).

    codecs.py     the KV codecs the model and cache call: encode / decode / quant_dequant
                  (compiled, else vectorised torch; bit-identical to ``cedlm.quant``'s references)
    qat.py        fake_quant / store_round: the codec's values with a straight-through gradient
    mhc.py        mHC mixes, collapse, expand            (csrc/mhc.h)
    rope.py       the RoPE rotation                      (csrc/rope.h)
    index.py      indexer scores from packed keys, stable top-k   (csrc/index.h), and their
                  torch references (score_reference, topk_reference)
    attention.py  sparse attention over [window || selected || sink]   (csrc/attend.h), and its
                  torch reference (attend_reference)
    gate.py       the one gate: reference switch (CEDLM_REFERENCE_KERNELS), backend, inference_op
    build.py      build into the per-user cache, lazy load, ISA setting (CEDLM_KERNEL_ISA)
    tables.py     the codecs' look-up tables, computed from the reference

Each model-facing function returns its result, or None when the gate says no (not built,
reference forced, autograd, another device or dtype): the caller then runs its readable torch
reference (the model's own, or the one beside the kernel, which the custom ops of ops.py share).
The compiled sources are ``csrc/``: ``python -m cedlm.kernels.build`` builds them.
"""

from .codecs import decode, encode, quant_dequant
from .gate import reference_kernels, reference_kernels_forced, set_reference_kernels
from .qat import FakeQuant, fake_quant, store_round

__all__ = ["encode", "decode", "quant_dequant", "fake_quant", "FakeQuant", "store_round",
           "reference_kernels", "set_reference_kernels", "reference_kernels_forced"]
