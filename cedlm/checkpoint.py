"""HF-style checkpoint directories: saving and loading a model with its tokenizer.

    DIR/config.json              ModelConfig.save_json (the official nested deepseek_v41 schema)
    DIR/model.safetensors        model.state_dict() (official tensor names, MoE gate bias buffers)
    DIR/<part>.safetensors       optional component files added by later stages (mtp, vision);
                                 all weight files are merged and loaded strictly
    DIR/tokenizer.json           the tokenizer the model was trained with
    DIR/tokenizer_config.json
    DIR/training_state.pt        (training checkpoints) optimizer, step, RNG states, sampler state
    DIR/training_args.json       (training checkpoints) the training settings, readable without torch

A checkpoint is written into a temp directory beside DIR and renamed into place, so DIR is always
either the previous complete checkpoint or the new complete one. `load_model` accepts a checkpoint
directory or a run directory holding `checkpoint/`, and sets the Engram token map (compressed ids)
from the checkpoint's tokenizer (`set_token_map`: the map named by the config's `engram_token_map`,
"v41" unless the checkpoint says "legacy-v0"). Reading the training state back is `cedlm.train.checkpoint`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cedlm.config import ModelConfig
from cedlm.model import build_model
from cedlm.model.model import CEDModel
from cedlm.official import is_official_layout, load_official_model
from cedlm.official.load import model_config_for
from cedlm.text.engram_map import set_token_map  # noqa: F401  (re-exported: the loaders' map setter)
from cedlm.text.tokenizer import load_tokenizer
from cedlm.util import atomic_directory, resolve_device

CHECKPOINT_NAME = "checkpoint"
TRAINING_STATE = "training_state.pt"


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint dir itself, or a run dir containing `checkpoint/`."""
    p = Path(path)
    if (p / "config.json").exists():
        return p
    if (p / CHECKPOINT_NAME / "config.json").exists():
        return p / CHECKPOINT_NAME
    raise FileNotFoundError(f"model: no checkpoint (config.json) in {p} or {p / CHECKPOINT_NAME}")


def save_checkpoint(path: str | Path, model: CEDModel, tokenizer, training_state: dict | None = None,
                    training_args: dict | None = None) -> Path:
    """Write a complete checkpoint directory atomically (`cedlm.util.atomic_directory`)."""
    path = Path(path)
    with atomic_directory(path) as tmp:
        model.cfg.save_json(tmp / "config.json")
        # views are copied: the compiled decode step makes some parameters views of one stacked
        # or concatenated matrix (compiled_step.py), and safetensors refuses shared storage
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save(tmp)
        if training_state is not None:
            torch.save(training_state, tmp / TRAINING_STATE)
        if training_args is not None:
            (tmp / "training_args.json").write_text(json.dumps(training_args, indent=2) + "\n")
    return path


def weight_files(ckpt: Path) -> list[Path]:
    """`model.safetensors` first, then the component files beside it (`mtp.safetensors` for the
    DSpark drafter, `vision.safetensors` for the ViT ...), so a stage trained on top of a model
    adds its own file instead of rewriting the main one."""
    main = ckpt / "model.safetensors"
    if not main.exists():
        raise FileNotFoundError(f"model: no model.safetensors in {ckpt}")
    return [main] + sorted(f for f in ckpt.glob("*.safetensors") if f.name != main.name)


def read_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """The state dict of a checkpoint directory: every weight file merged; a tensor name in two
    files is an error naming both."""
    state: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for f in weight_files(ckpt):
        for k, v in load_file(str(f)).items():
            if k in state:
                raise ValueError(f"model: tensor {k!r} is in both {where[k]} and {f.name}")
            state[k], where[k] = v, f.name
    return state


def load_model(path: str | Path, device: str | torch.device = "cpu"):
    """-> (CEDModel in eval mode, Tokenizer) from a checkpoint (or run) directory, in either
    layout: the DSpark drafter and the vision tower are built when the directory has their
    tensors, and then loaded strictly (`cedlm.official.load.model_config_for`).

    A directory in the official DeepSeek-V4.1 layout (an index file, `quantization_config`, or
    `.scale` tensors) is read by `cedlm.official.load_official_model`: dequantised to float32,
    checked for size first, its report on `model.official_load_report`.

    device: where the weights go (`cedlm.util.resolve_device`: "auto", "cpu", "cuda", "cuda:N" or
    a torch.device; a ValueError naming `device` otherwise). The tensors are read and checked on
    the host, then moved; Engram tables memory-mapped by the official loader stay in host memory
    (the lookup gathers their rows there and moves only those, `cedlm.model.engram`)."""
    dev = resolve_device(device, "device")
    ckpt = resolve_checkpoint(path)
    if is_official_layout(ckpt):
        model, _ = load_official_model(ckpt, device=dev)   # size check first; sets the Engram map itself
        tokenizer = load_tokenizer(ckpt)
    else:
        tokenizer = load_tokenizer(ckpt)
        state = read_weights(ckpt)
        # The same components as the official layout: the DSpark drafter when the directory
        # ships mtp.* (mtp.safetensors), the vision tower when it ships its tensors.
        cfg, dspark = model_config_for(ModelConfig.from_json(ckpt / "config.json"), state, ckpt)
        model = build_model(cfg, dspark=dspark)
        model.load_state_dict(state, strict=True)
        set_token_map(model, tokenizer)
    return model.to(dev).eval(), tokenizer
