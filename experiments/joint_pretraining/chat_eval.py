"""Held-out chat metrics of any checkpoint, as `cedlm train chat` measures them before and after
its stage: 48 conversations built from the validation split (seed 1, at most 128 tokens), replies
of at most 64 tokens through the engine, greedy and sampled (`cedlm.train.chat_eval`).

    .venv/bin/python experiments/joint_pretraining/chat_eval.py RUN_OR_MODEL_DIR [OUT.json]

The joint run trains chat from step 0, so it has no chat stage to measure it; this script gives
its checkpoints the same numbers as the shipped model's card (`finished_greedy`,
`source_accuracy_greedy`, ...).
"""
from __future__ import annotations

import json
import sys
import time

import torch

from cedlm.checkpoint import load_model, resolve_checkpoint
from cedlm.train.chat_data import corpus_documents, heldout_examples
from cedlm.train.chat_eval import chat_metrics


def main(argv: list[str]) -> int:
    if not argv or len(argv) > 2:
        print(__doc__.strip().splitlines()[4].strip(), file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    src = resolve_checkpoint(argv[0])
    model, tok = load_model(src)
    t0 = time.time()
    heldout = heldout_examples(corpus_documents("data/corpus", "val"), tok)    # `cedlm train chat`'s defaults
    out = {"model": str(src), **chat_metrics(model, tok, heldout, 64, seed=0),
           "eval_s": round(time.time() - t0, 1)}
    report(out, argv[1] if len(argv) == 2 else None)
    return 0


def report(out: dict, path: str | None) -> None:
    """Print the result as JSON, and write it to `path` when one is given."""
    text = json.dumps(out, indent=2, ensure_ascii=False)
    print(text)
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
