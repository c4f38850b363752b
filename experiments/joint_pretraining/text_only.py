"""A text-only copy of a model directory, the start of a stage that continues a shipped model
(`cedlm train pretrain --init-from`): its text weights, tokenizer and configs, without the DSpark
drafter (`mtp.safetensors`) and the vision tower (`vision.safetensors`, `vision_config`), which
the training model does not build.

    .venv/bin/python experiments/joint_pretraining/text_only.py MODEL_DIR OUT_DIR
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

DROPPED = ("mtp.safetensors", "vision.safetensors", "config.json", "README.md")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: text_only.py MODEL_DIR OUT_DIR", file=sys.stderr)
        return 2
    src, out = map(Path, argv)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in DROPPED:
            shutil.copy(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text("utf-8"))
    cfg.pop("vision_config", None)
    cfg["image_token_id"] = None
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
