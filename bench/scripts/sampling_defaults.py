"""Sampling settings of a chat model on held-out conversations: the measurement behind the shipped
model's generation_config.json defaults (docs/serving.md, "Sampling defaults").

    .venv/bin/python bench/scripts/sampling_defaults.py                      # the shipped model, 96 conversations
    .venv/bin/python bench/scripts/sampling_defaults.py --model DIR --seeds 0,1,2,3 --only "T0.3 p0.9"

The conversations are built from the corpus's validation split as `cedlm train chat` builds its
held-out set (`heldout_examples`); each setting answers every one (its prompt is every message
before the last assistant turn) with `max_tokens` 64. Per setting, over the seeds (greedy runs
once): the fraction of replies that end their turn, the word F1 of the reply with the reference
reply, the fraction of `source` questions whose reply names the right source and no other, and
the fraction of replies that repeat a 3-word phrase. One JSON line per setting.
"""
from __future__ import annotations

import argparse
import json
import re
import time
from collections import Counter

import torch

from cedlm import LLM, SamplingParams
from cedlm.train.chat_data import corpus_documents, heldout_examples
from cedlm.train.chat_eval import named_sources

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "greedy rep1.1": dict(temperature=0.0, repetition_penalty=1.1),
    "T0.2 p0.9": dict(temperature=0.2, top_p=0.9),
    "T0.3 p0.9": dict(temperature=0.3, top_p=0.9),
    "T0.3 p0.9 rep1.1": dict(temperature=0.3, top_p=0.9, repetition_penalty=1.1),
    "T0.5 p0.9": dict(temperature=0.5, top_p=0.9),
    "T0.7 p0.9": dict(temperature=0.7, top_p=0.9),
    "T0.7 p0.8 rep1.1": dict(temperature=0.7, top_p=0.8, repetition_penalty=1.1),
    "T1.0": dict(temperature=1.0),
}


def words(s: str) -> list[str]:
    return re.findall(r"\w+", s.lower())


def f1(reply: str, reference: str) -> float:
    a, b = words(reply), words(reference)
    common = sum((Counter(a) & Counter(b)).values())
    if not common:
        return 0.0
    p, r = common / len(a), common / len(b)
    return 2 * p * r / (p + r)


def repeats(s: str) -> bool:
    w = words(s)
    return any(v >= 2 for v in Counter(tuple(w[i:i + 3]) for i in range(len(w) - 2)).values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    ap.add_argument("--data", default="data/corpus", help="corpus directory (its val split)")
    ap.add_argument("--n", type=int, default=96, help="held-out conversations")
    ap.add_argument("--seeds", default="0,1", help="seeds of the sampled settings")
    ap.add_argument("--only", default=None, help="comma-separated setting names (default: all)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    llm = LLM(a.model, max_num_seqs=a.n, enable_prefix_cache=False)
    ex = heldout_examples(corpus_documents(a.data, "val"), llm.tokenizer, n=a.n, seed=0)
    seeds = [int(s) for s in a.seeds.split(",")]
    for name, kw in SETTINGS.items():
        if a.only and name not in a.only.split(","):
            continue
        acc: Counter = Counter()
        t0 = time.time()
        for seed in [0] if kw["temperature"] == 0 else seeds:
            sp = SamplingParams(max_tokens=64, seed=seed, **kw)
            for mode in ("chat", "thinking"):
                idx = [i for i, e in enumerate(ex) if e.thinking_mode == mode]
                if not idx:
                    continue
                for i, o in zip(idx, llm.chat([ex[i].prompt_messages for i in idx], sp, thinking_mode=mode)):
                    e = ex[i]
                    acc["n"] += 1
                    acc["finished"] += o.finish_reason == "stop"
                    acc["f1"] += f1(o.text, e.messages[-1]["content"])
                    acc["repeat"] += repeats(o.text)
                    if e.source is not None:
                        acc["src_n"] += 1
                        acc["src_ok"] += named_sources(o.text) == {e.source}
        print(json.dumps({"setting": name, **kw, "finished": round(acc["finished"] / acc["n"], 3),
                          "f1_vs_reference": round(acc["f1"] / acc["n"], 3),
                          "source_accuracy": round(acc["src_ok"] / max(1, acc["src_n"]), 3),
                          "repeated_3gram": round(acc["repeat"] / acc["n"], 3),
                          "seconds": round(time.time() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
