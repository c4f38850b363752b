"""DSpark acceptance after a full prefill, after a prefix-cache hit and in forked samples (n > 1).

    .venv/bin/python bench/scripts/dspark_context.py [--model cedlm/assets/model] [--json]
    .venv/bin/python bench/scripts/dspark_context.py --cases full --policy always --prompts 24 --max-tokens 96

The same held-out prompts (openings of `data/corpus/val.txt` documents, as `cedlm bench --only
dspark` takes them), greedy, `ignore_eos`, one sequence at a time:
- full: a fresh prefill of each prompt (prefix cache off);
- prefix hit: each prompt run once to fill the prefix cache, then again: only the second run's
  speculative counters count (its prompt comes from the cache, the windows and the drafter's
  context are rebuilt by replay);
- fork: n = 2 greedy samples of each prompt: the first is prefilled, the second starts from a
  copy of its state; both samples' counters count.
With the drafter's context as a full prefill leaves it in all three, the acceptance by position
and the tokens per target forward agree.

`--policy always` speculates at every step (the default adaptive policy verifies only where it
measures a gain), so the figure is the drafter's acceptance on every token: the second command
compares drafters on 24 held-out prompts. `--cases` picks the cases. The engine decodes with its
default step; `CEDLM_DECODE_STEP=static` spares the compile (same tokens, same acceptance).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
CASES = ("full", "prefix_hit", "fork")


def _stats(e) -> dict:
    return dict(e.speculator.stats.as_dict())


def _delta(after: dict, before: dict) -> dict:
    out = {}
    for k in ("spec_steps", "spec_emitted_tokens"):
        out[k] = after[k] - before[k]
    out["verified"] = [a - b for a, b in zip(after["spec_verified_by_position"], before["spec_verified_by_position"])]
    out["accepted"] = [a - b for a, b in zip(after["spec_accepted_by_position"], before["spec_accepted_by_position"])]
    return out


def _summary(parts: list[dict]) -> dict:
    steps = sum(p["spec_steps"] for p in parts)
    emitted = sum(p["spec_emitted_tokens"] for p in parts)
    ver = [sum(x) for x in zip(*(p["verified"] for p in parts))]
    acc = [sum(x) for x in zip(*(p["accepted"] for p in parts))]
    return {"tokens_per_forward": round(emitted / steps, 3) if steps else 0.0,
            "acceptance_by_position": [round(a / v, 3) if v else 0.0 for a, v in zip(acc, ver)],
            "verify_forwards": steps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="cedlm/assets/model")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--policy", default="adaptive", help="speculative policy (\"always\": every step "
                    "speculates, the drafter's acceptance on every token)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"which of {', '.join(CASES)}")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    from cedlm.bench.dspark import _documents, _prompts
    from cedlm.checkpoint import load_model
    from cedlm.engine.engine import Engine, EngineConfig
    from cedlm.engine.sampling_params import SamplingParams
    from cedlm.engine.speculative import SpeculativeConfig
    model, tok = load_model(args.model)
    prompts = _prompts(tok, _documents(quick=False)[1], args.prompts, args.prompt_len)

    def engine(cache: bool):
        return Engine(model, tok, EngineConfig(kv_budget_bytes=64 << 20, max_num_seqs=4, block_tokens=16,
                                               enable_prefix_cache=cache),
                      speculative=SpeculativeConfig(policy=args.policy))

    def run(e, p, n=1):
        sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, n=n)
        reqs = e.add_samples(p, sp) if n > 1 else [e.add_request(p, sp)]
        while e.has_work:
            e.step()
        return reqs

    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = sorted(set(cases) - set(CASES))
    if bad:
        ap.error(f"--cases: unknown {', '.join(bad)} ({', '.join(CASES)})")
    res = {k: [] for k in cases}
    hits = []
    for p in prompts:
        if "full" in res:
            e = engine(False)
            s0 = _stats(e)
            run(e, p)
            res["full"].append(_delta(_stats(e), s0))
        if "prefix_hit" in res:
            e = engine(True)
            run(e, p)
            s0 = _stats(e)
            hits.append(run(e, p)[0].num_cached_tokens)
            res["prefix_hit"].append(_delta(_stats(e), s0))
        if "fork" in res:
            e = engine(False)
            s0 = _stats(e)
            run(e, p, n=2)
            res["fork"].append(_delta(_stats(e), s0))
    out = {k: _summary(v) for k, v in res.items()}
    if "prefix_hit" in out:
        out["prefix_hit"]["cached_prompt_tokens"] = hits
    out["config"] = {"model": args.model, "prompts": len(prompts), "prompt_len": args.prompt_len,
                     "max_tokens": args.max_tokens, "policy": args.policy}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k in cases:
            print(f"{k:11s} tokens/forward {out[k]['tokens_per_forward']:.2f}  acceptance by position "
                  f"{' / '.join(f'{x:.2f}' for x in out[k]['acceptance_by_position'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
