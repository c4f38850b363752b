"""A model directory: one model's text weights with another model's vision tower, as the start of a
`cedlm train vision` run that re-fits the tower to a new text model.

    .venv/bin/python experiments/joint_pretraining/with_tower.py TEXT_DIR TOWER_DIR OUT_DIR

OUT_DIR gets TEXT_DIR's files, TOWER_DIR's `vision.safetensors` (ViT, aligner and image rows) and a
config.json that is TEXT_DIR's with TOWER_DIR's `vision_config` and `image_token_id`. The two must
share the tokenizer (the image placeholder is a token id). The default model's tower was trained
this way: its ViT already reads digits; phases A-C of `cedlm train vision` fit the aligner and the
image rows to the new text model.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from cedlm.config import ModelConfig
from cedlm.config.vision import vision_config_of, with_vision
from cedlm.util import atomic_directory


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: with_tower.py TEXT_DIR TOWER_DIR OUT_DIR", file=sys.stderr)
        return 2
    text, tower, out = map(Path, argv)
    if (text / "tokenizer.json").read_bytes() != (tower / "tokenizer.json").read_bytes():
        print(f"error: {text} and {tower} have different tokenizers", file=sys.stderr)
        return 2
    cfg, tcfg = ModelConfig.from_json(text / "config.json"), ModelConfig.from_json(tower / "config.json")
    vc = vision_config_of(tcfg)
    if vc is None or not (tower / "vision.safetensors").exists():
        print(f"error: {tower} has no vision tower", file=sys.stderr)
        return 2
    with atomic_directory(out) as tmp:
        for f in text.iterdir():
            if f.is_file() and f.name not in ("config.json", "README.md"):
                shutil.copy(f, tmp / f.name)
        shutil.copy(tower / "vision.safetensors", tmp / "vision.safetensors")
        with_vision(cfg, vc, tcfg.image_token_id).save_json(tmp / "config.json")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
