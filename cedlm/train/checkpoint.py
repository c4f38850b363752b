"""Training state of a checkpoint: RNG states and `training_state.pt` for exact resume.

The checkpoint directory itself (config, weights, tokenizer, atomic save, `load_model`) is
`cedlm.checkpoint`; `save_checkpoint` there writes `training_state.pt` and `training_args.json`
when given them, and `load_training_state` here reads the state back.
"""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from cedlm.checkpoint import TRAINING_STATE, resolve_checkpoint


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
            "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def load_training_state(path: str | Path) -> dict:
    ckpt = resolve_checkpoint(path)
    f = ckpt / TRAINING_STATE
    if not f.exists():
        raise FileNotFoundError(f"resume: {ckpt} has no {TRAINING_STATE} (a model-only checkpoint)")
    return torch.load(f, map_location="cpu", weights_only=False)
