"""Peak memory that prompt scoring adds, one measurement per process.

    .venv/bin/python bench/scripts/prompt_scoring_memory.py --tokens 16384 --path chunked
    .venv/bin/python bench/scripts/prompt_scoring_memory.py --tokens 16384 --path oneshot

`chunked`: the engine's path (`LLM.generate` with `prompt_logprobs`: the decoder runs chunk by
chunk and each chunk is scored as it goes). `oneshot`: the one-shot alternative (the
decoder over every prompt row at once, then every row's logits scored). `plain`: a normal
prefill of the same prompt (no scoring), for reference. Prints one JSON line: the peak RSS above
the RSS after loading and warming up (MiB), and the seconds taken. 1 torch thread.
"""
from __future__ import annotations

import argparse
import json
import resource
import time


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def reset_peak() -> None:
    """Start the peak (VmHWM) afresh at the current RSS (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--path", choices=("chunked", "oneshot", "plain"), default="chunked")
    ap.add_argument("--model", default="small")
    a = ap.parse_args()
    import torch

    from cedlm.engine.llm import LLM
    from cedlm.engine.prompt_scoring import prompt_logprobs
    from cedlm.engine.sampling_params import SamplingParams
    llm = LLM(a.model, num_threads=1, max_model_len=a.tokens + 8, kv_budget_bytes=(a.tokens + 1024) * 2048)
    vocab = llm.engine.model.cfg.vocab_size
    ids = torch.randint(5, vocab - 1, (a.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    llm.generate([ids[:64]], SamplingParams(max_tokens=1, prompt_logprobs=1))       # warm-up
    reset_peak()
    base, t0 = rss_mib(), time.perf_counter()
    if a.path == "chunked":
        out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
        n = len(out.prompt_logprobs)
    elif a.path == "oneshot":
        m = llm.engine.model
        logits = m.prefill(ids, m.new_state(), "full", chunk_size=llm.engine.cfg.prefill_chunk)
        n = len(prompt_logprobs(logits, ids, 1))
    else:
        out = llm.generate([ids], SamplingParams(max_tokens=1))[0]
        n = len(ids)
    print(json.dumps({"tokens": a.tokens, "path": a.path, "scored": n, "rss_base_mib": round(base),
                      "peak_added_mib": round(peak_mib() - base), "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
