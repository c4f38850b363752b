"""Training state of a checkpoint: RNG states and `training_state.pt` for exact resume.

The checkpoint directory itself (config, weights, tokenizer, atomic save, `load_model`) is
`cedlm.checkpoint`; `save_checkpoint` there writes `training_state.pt` and `training_args.json`
when given them, and `load_training_state` here reads the state back.

`training_state.pt` is read with `torch.load(weights_only=True)`: only tensors and plain Python
containers and numbers unpickle, so a crafted checkpoint cannot run code on `--resume`. Everything
the trainer saves is of that kind: the step, the optimizer's state_dict, the sampler's state
(numpy `Generator.bit_generator.state`, plain ints), the metrics, the saved arguments, and the RNG
states, where numpy's legacy RNG state (an ndarray) is stored as a tensor (`rng_state`). Older
checkpoints hold that ndarray itself; the handful of numpy globals needed to rebuild a plain
numeric array are allowed for them (`LEGACY_NUMPY_GLOBALS`), nothing else.
"""
from __future__ import annotations

import pickle
import random
from pathlib import Path

import numpy as np
import torch

from cedlm.checkpoint import TRAINING_STATE, resolve_checkpoint


def rng_state() -> dict:
    """Every RNG the trainer draws from, as tensors and plain Python values only."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    npst = state["numpy"]
    if isinstance(npst, dict):
        keys = np.asarray(npst["keys"].numpy(), dtype=np.uint32)
        npst = (npst["kind"], keys, npst["pos"], npst["has_gauss"], npst["cached_gaussian"])
    np.random.set_state(npst)                     # a legacy checkpoint: numpy's own tuple
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))  # (tuples may come back as lists)


def _legacy_numpy_globals() -> list:
    """What a pickled plain numeric ndarray needs (numpy 2 names): the array rebuild, the array
    and dtype classes, and the dtype class of the legacy RNG's uint32 keys."""
    from numpy._core.multiarray import _reconstruct
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32)), type(np.dtype(np.int64)),
            type(np.dtype(np.float64))]


LEGACY_NUMPY_GLOBALS = _legacy_numpy_globals()


class UnsafeCheckpointError(ValueError):
    """A training state that holds something other than tensors and plain values."""


def load_training_state(path: str | Path) -> dict:
    ckpt = resolve_checkpoint(path)
    f = ckpt / TRAINING_STATE
    if not f.exists():
        raise FileNotFoundError(f"resume: {ckpt} has no {TRAINING_STATE} (a model-only checkpoint)")
    try:
        with torch.serialization.safe_globals(LEGACY_NUMPY_GLOBALS):
            state = torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message suggests weights_only=False; keep only the line naming what was refused
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln), type(e).__name__)
        raise UnsafeCheckpointError(
            f"resume: {f} holds objects other than tensors and plain values; refusing to unpickle "
            f"it (only checkpoints written by `cedlm train` load): {why}") from None
    if not isinstance(state, dict):
        raise UnsafeCheckpointError(f"resume: {f} is not a training state (a {type(state).__name__}, "
                                    f"not a dict)")
    return state
