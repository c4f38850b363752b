"""Does the model answer? Eleven fixed questions about the texts it trained on (who wrote a novel,
which book a famous line is from, what a standard-library function does, which chapter, who a
passage names) and one general question, each asked greedily through the engine (`LLM.chat`, the
server's encoding); a reply counts as an answer when it names the expected keyword, and as ended
when it ends its turn within 64 tokens.

    .venv/bin/python experiments/joint_pretraining/chat_questions.py MODEL_DIR [OUT.json]

The wordings are not the training templates' (`cedlm.train.chat_data`), except the first, which
is one of them; the facts are the corpus's.
"""
from __future__ import annotations

import sys

import torch

from cedlm.checkpoint import load_model, resolve_checkpoint
from cedlm.engine.llm import LLM
from cedlm.engine.sampling_params import SamplingParams

from chat_eval import report          # this folder's script: the same JSON output

QUESTIONS = [
    ("Who wrote Pride and Prejudice?", ["Austen"]),
    ("Which author wrote the novel Emma?", ["Austen"]),
    ("Tell me who the author of Moby-Dick was.", ["Melville"]),
    ('Where is this line from? "Call me Ishmael."', ["Moby"]),
    ('"It is a truth universally acknowledged, that a single man in possession of a good fortune, '
     'must be in want of a wife." Which book opens with this sentence?', ["Pride", "Austen"]),
    ('Which book of the Bible begins "In the beginning God created the heaven and the earth"?', ["Genesis"]),
    ("What is the title of the first chapter of Moby-Dick?", ["Loomings"]),
    ("In Python, what does `os.path.join` do?", ["join", "path"]),
    ("What does Python's `len` function return?", ["length", "number"]),
    ("What is `json.dumps` used for in Python?", ["JSON", "serial", "string"]),
    ('Which people are mentioned here? "Mr. Knightley walked over to Hartfield to see Emma and her '
     'father."', ["Knightley"]),
    ("What is the capital of France?", ["Paris"]),
]


def main(argv: list[str]) -> int:
    if not argv or len(argv) > 2:
        print(__doc__.strip().splitlines()[6].strip(), file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    model, tok = load_model(resolve_checkpoint(argv[0]))
    llm = LLM(model, tok, max_num_seqs=len(QUESTIONS), enable_prefix_cache=False)
    outs = llm.chat([[{"role": "user", "content": q}] for q, _ in QUESTIONS],
                    SamplingParams(max_tokens=64, temperature=0.0))
    rows = []
    for (q, keys), o in zip(QUESTIONS, outs):
        c = o.outputs[0]
        text = c.text
        rows.append({"question": q, "reply": text, "ended": c.finish_reason == "stop",
                     "answered": any(k.lower() in text.lower() for k in keys), "keywords": keys})
    out = {"model": argv[0], "answered": sum(r["answered"] for r in rows), "ended": sum(r["ended"] for r in rows),
           "n": len(rows), "rows": rows}
    report(out, argv[1] if len(argv) == 2 else None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
