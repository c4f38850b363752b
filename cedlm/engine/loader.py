"""Resolve `model=` to (CEDModel, tokenizer): a checkpoint directory, a preset name (random
weights, seeded), a CEDModel instance, or None for the shipped default model; and put it on its
device (`device=`), the Engram tables memory-mapped in host RAM first when asked (`engram_mmap`).

A checkpoint or preset is built on the CPU (a preset's random weights are then the same on every
device), its Engram tables moved to their memory-mapped host files when `engram_mmap` is given
(they are then no parameters: `model.to` leaves them in host RAM, the seeds' design), and only
then moved to the device."""
from __future__ import annotations

from pathlib import Path

import torch

from cedlm.config import ConfigError, ModelConfig
from cedlm.config.presets import PRESETS
from cedlm.model import CEDModel

ASSETS = Path(__file__).resolve().parents[1] / "assets"
DEFAULT_MODEL = ASSETS / "model"
# Presets above this many parameters are for accounting (cedlm plan), not for building here.
MAX_BUILD_PARAMS = 2_000_000_000


def tokenizer_for_vocab(vocab_size: int):
    """The shipped tokenizer whose vocabulary matches a preset (None: token ids only)."""
    from cedlm.text.tokenizer import load_tokenizer
    for d in (ASSETS / "tokenizer", ASSETS / f"tokenizer-{vocab_size}"):
        if (d / "tokenizer.json").exists():
            tok = load_tokenizer(d)
            if tok.vocab_size == vocab_size:
                return tok
    return None


def load(model=None, tokenizer=None, seed: int = 0, device=None, engram_mmap=None):
    """(CEDModel in eval mode on `device`, tokenizer). `device`: a `torch.device` (resolved by the
    caller, `cedlm.util.resolve_device`); None leaves a CEDModel instance where it is and puts a
    loaded one on the CPU. `engram_mmap`: directory to memory-map the Engram tables from."""
    # with engram_mmap: loaded on the CPU, the tables offloaded, then the rest moved; else a
    # checkpoint is read straight onto the device (the official loader moves tensor by tensor)
    m, tok = load_any(model, tokenizer, seed, device=None if engram_mmap is not None else device)
    if not isinstance(m, CEDModel):
        raise ConfigError("model: the decoder-only baseline (arch 'decoder_only') is a benchmark baseline; "
                          "the engine serves CED models (arch 'ced')")
    if engram_mmap is not None:
        m.offload_engram(engram_mmap)            # on the CPU, before the move: tables stay on the host
    if device is not None:
        m.to(device)
    return m, tok


def model_device(model) -> torch.device:
    """The device a model's weights live on: its own `device` (a CEDModel's token embedding), else
    its first parameter's (the CPU for a model without parameters)."""
    dev = getattr(model, "device", None)
    if isinstance(dev, torch.device):
        return dev
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def load_any(model=None, tokenizer=None, seed: int = 0, device=None):
    """As `load` (without the Engram offload), but any architecture: the decoder-only baseline
    loads too (for comparisons). A preset is built on the CPU and then moved (the same random
    weights on every device); a checkpoint is read onto `device` (None: the CPU)."""
    if isinstance(model, CEDModel):
        return model.eval(), tokenizer if tokenizer is not None else tokenizer_for_vocab(model.cfg.vocab_size)
    if model is None:
        if not (DEFAULT_MODEL / "config.json").exists():
            raise FileNotFoundError(f"model: no default model shipped at {DEFAULT_MODEL}; "
                                    f"pass a checkpoint directory or a preset ({sorted(PRESETS)})")
        model = DEFAULT_MODEL
    if isinstance(model, str) and model in PRESETS:
        cfg = ModelConfig.preset(model)
        from cedlm.config.params import param_counts
        n = param_counts(cfg)["total"]
        if n > MAX_BUILD_PARAMS:
            raise ConfigError(f"model: preset {model!r} has {n:,} parameters; it is for accounting "
                              f"(cedlm plan), not for building on this machine")
        torch.manual_seed(seed)
        with torch.device("cpu"):                # the seeded draw on the host, whatever the default
            m = CEDModel(cfg).eval()
        tok = tokenizer if tokenizer is not None else tokenizer_for_vocab(cfg.vocab_size)
        if tok is not None:
            from cedlm.checkpoint import set_token_map
            set_token_map(m, tok)
        return (m if device is None else m.to(device)), tok
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(f"model: {model!r} is neither a checkpoint directory nor a preset "
                                f"({sorted(PRESETS)})")
    from cedlm.checkpoint import load_model
    m, tok = load_model(path, device="cpu" if device is None else device)
    return m, tokenizer if tokenizer is not None else tok
