"""The one gate of the compiled kernels: whether a call runs compiled code, the vectorised torch
codecs or the readable reference.

* ``CEDLM_REFERENCE_KERNELS=1`` (read here, once, at import; ``0``, ``false``, ``no``, ``off`` or
  empty mean the fast paths), ``set_reference_kernels(True)`` or ``with
  reference_kernels_forced(): ...`` turn every fast path off: the codecs run
  ``cedlm.quant.formats.*_reference`` and the model runs its readable torch code.
* ``set_fast_backend("auto" | "ext" | "torch")`` picks the codecs' fast backend: the compiled
  module when built (``"auto"``, the default), the compiled module or an error (``"ext"``), the
  vectorised torch codecs (``"torch"``, which also turns the model's compiled kernels off).
* ``inference_op(name, *tensors)``: a compiled model kernel (attention, indexer, mHC, RoPE) for
  one inference call, or None (the caller runs its reference) when autograd needs the call, a
  tensor is not on the CPU, or (unless ``float32=False``) not float32.
* The C++ kernels are CPU-only: ``codec_module(*tensors)``, ``ext_op(name, *tensors)`` and
  ``inference_op`` all answer "torch path" for a tensor on any other device (CUDA runs the
  vectorised torch codecs, bit-identical, and the model's torch reference code).

The compiled module is loaded on first use (``build.load``: never compiles). When it is missing,
stale or fails to import, ONE warning line is logged (logger ``cedlm.quant``, as before the
kernels had their own package) and every caller runs its torch path, bit-identical for the
codecs. ``CEDLM_KERNEL_ISA`` (see ``build.py``) selects the instruction set of the loaded module.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

from . import tables

__all__ = ["ENV_VAR", "reference_kernels", "set_reference_kernels", "reference_kernels_forced",
           "set_fast_backend", "fast_backend", "active_backend", "compiled", "compiled_status",
           "ext_op", "inference_op", "on_compiled"]

log = logging.getLogger("cedlm.quant")

ENV_VAR = "CEDLM_REFERENCE_KERNELS"


def _env_flag(value: str | None) -> bool:
    return (value or "").strip().lower() not in ("", "0", "false", "no", "off")


_FORCE_REFERENCE = _env_flag(os.environ.get(ENV_VAR))


def reference_kernels() -> bool:
    """True when the reference kernels are forced (``CEDLM_REFERENCE_KERNELS=1`` at import, or
    ``set_reference_kernels(True)``)."""
    return _FORCE_REFERENCE


def set_reference_kernels(on: bool) -> bool:
    """Force (True) or release (False) the reference kernels; returns the previous setting."""
    global _FORCE_REFERENCE
    prev, _FORCE_REFERENCE = _FORCE_REFERENCE, bool(on)
    _sync_ops()
    return prev


@contextlib.contextmanager
def reference_kernels_forced(on: bool = True):
    """``with reference_kernels_forced(): ...`` runs the block on the reference (or, with
    ``on=False``, on the fast) kernels and restores the previous setting."""
    prev = set_reference_kernels(on)
    try:
        yield
    finally:
        set_reference_kernels(prev)


# ---------------------------------------------------------------------------------------------
# the compiled module: loaded once per process, tables set, or None with one log line
# ---------------------------------------------------------------------------------------------

_BACKENDS = ("auto", "ext", "torch")
_backend = "auto"
_ext_state: dict[str, object] = {}      # "module" (or None) and "why", once per process


def compiled():
    """The loaded compiled module (tables and ISA set) or None; tries once, logs once when it
    is unavailable."""
    if "module" not in _ext_state:
        from . import build          # not at import: `python -m cedlm.kernels.build` runs it as main
        mod, why = build.load()
        nan_rule = tables.nan_scale_wins() if mod is not None else None
        if mod is not None and nan_rule is None:
            # torch's kernels here give a third NaN for NaN * NaN (e.g. scalar kernels under
            # ATEN_CPU_CAPABILITY=default): the extension could not match them bit for bit
            mod, why = None, "NaN * NaN in the reference decode is neither operand on this CPU path"
        if mod is not None:
            t = tables.CPU
            mod.set_tables(t["e2m1_code"], t["e2m1_value"], t["e2m1_pair"], t["e4m3_code"],
                           t["e4m3"], t["ue8m0"], nan_rule)
            mod.set_avx2(build.isa() == "auto")
        else:
            log.warning("cedlm.quant: compiled KV codecs unavailable (%s); using the vectorised "
                        "torch fast path", why)
        _ext_state["module"], _ext_state["why"] = mod, why
        if mod is not None:
            for fn in _ON_LOAD:
                fn(mod)
            _sync_ops()
    return _ext_state["module"]


_ON_LOAD: list = []


def on_compiled(fn) -> None:
    """Run ``fn(module)`` once the compiled module is loaded and accepted (now, if it already
    is): ``ops.py`` registers the custom ops' CPU kernels with torch's dispatcher this way."""
    _ON_LOAD.append(fn)
    mod = _ext_state.get("module")
    if mod is not None:
        fn(mod)
        _sync_ops()


def _sync_ops() -> None:
    """Tell the module's dispatcher kernels (``csrc/dispatch.h``) whether they run the compiled
    code (the active backend is "ext") or call the ops' Python kernels."""
    mod = _ext_state.get("module")
    if mod is not None:
        mod.set_ops_enabled(not _FORCE_REFERENCE and _backend != "torch")


def compiled_status() -> str:
    """Why the compiled module is (or is not) in use, after trying to load it."""
    compiled()
    return str(_ext_state["why"])


def set_fast_backend(name: str) -> str:
    """"auto" (the extension when built, else torch), "ext" (raises if not built) or "torch";
    returns the previous choice. The reference switch (``set_reference_kernels``) overrides it."""
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"fast backend {name!r}: one of {_BACKENDS}")
    if name == "ext" and compiled() is None:
        raise RuntimeError(f"cedlm.kernels: compiled kernels unavailable: {_ext_state['why']}")
    prev, _backend = _backend, name
    _sync_ops()
    return prev


def fast_backend() -> str:
    return _backend


def active_backend() -> str:
    """What a codec call on a CPU V4.1-format tensor runs now: "reference", "ext" or "torch"."""
    if reference_kernels():
        return "reference"
    return "torch" if _backend == "torch" or compiled() is None else "ext"


def _on_cpu(tensors) -> bool:
    return all(t.device.type == "cpu" for t in tensors)


def codec_module(*tensors: torch.Tensor):
    """The compiled module for a codec call on ``tensors`` (the reference switch already checked
    by the caller), or None for the vectorised torch codecs: a tensor not on the CPU (the C++
    kernels are CPU-only), the torch backend chosen, or torch.compile tracing (the codecs then
    reach the custom ops of ``ops.py``, opaque to inductor)."""
    if torch.compiler.is_compiling() or not _on_cpu(tensors):
        return None
    return None if _backend == "torch" else compiled()


def ext_op(name: str, *tensors: torch.Tensor):
    """A compiled kernel of the module (e.g. ``"mhc_mixes"``) when the compiled module is the
    active backend and every one of ``tensors`` is on the CPU, else None: the caller then runs
    its reference (torch) path. The reference switch and ``set_fast_backend("torch")`` turn
    these off too."""
    if not _on_cpu(tensors) or active_backend() != "ext":
        return None
    return getattr(compiled(), name, None)


def inference_op(name: str, *tensors: torch.Tensor, float32: bool = True):
    """``ext_op(name)`` for an inference call on ``tensors``, else None, and the caller runs its
    readable reference: when autograd needs the call (grad enabled and a tensor requires grad),
    a tensor is not on the CPU or (``float32``) not float32, or torch.compile is tracing (the
    compiled decode step reaches the kernels it keeps through the custom ops of ``ops.py``)."""
    if torch.compiler.is_compiling():
        return None        # traced by torch.compile: the torch reference is what inductor fuses
    if any(t.device.type != "cpu" or (float32 and t.dtype != torch.float32) for t in tensors):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    return ext_op(name)
