"""Export a trained checkpoint as a lean model directory (BF16 weights, config, tokenizer).

    python -m cedlm.train.export runs/small-ced cedlm/assets/model

BF16 is the official checkpoint's dtype for these tensors; the loader upcasts to fp32. Training
state (optimizer, RNG) is left behind; `training_args.json` and a summary of the run are kept.
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from cedlm.checkpoint import load_model, resolve_checkpoint


def export_model(src: str | Path, dst: str | Path, dtype: torch.dtype = torch.bfloat16,
                 summary: dict | None = None) -> Path:
    ckpt = resolve_checkpoint(src)
    model, tok = load_model(ckpt)
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}.tmp-"))
    try:
        model.cfg.save_json(tmp / "config.json")
        state = {k: (v.to(dtype) if v.is_floating_point() and k.endswith("weight") else v).contiguous()
                 for k, v in model.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tok.save(tmp)
        if (ckpt / "training_args.json").exists():
            shutil.copy(ckpt / "training_args.json", tmp / "training_args.json")
        if summary:
            (tmp / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        tmp.chmod(0o755)
        if dst.exists():
            shutil.rmtree(dst)
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit("usage: python -m cedlm.train.export RUN_OR_CHECKPOINT OUT_DIR")
    print(export_model(argv[0], argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
