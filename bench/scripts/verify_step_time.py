"""Per-call time of the compiled verify step (the anchor and the drafts of one block, T rows)
beside the compiled plain decode step and the compiled draft step, for the shipped model with its
drafter at one context, batch 1, one JSON line per run: where a speculative step's time goes on
this machine, and what a change to the verify or draft step buys.

    .venv/bin/python bench/scripts/verify_step_time.py [--context 512] [--rounds 40] [--T 6]

Where each step's time goes: `--only verify` (or `plain`) runs that step alone for the rounds,
to be sampled by a profiler once the warm-up is over (about 5 s with the graphs stored), e.g.

    perf record -F 4000 -D 8000 -o verify.data -- .venv/bin/python \
        bench/scripts/verify_step_time.py --only verify --rounds 3000
    perf report -i verify.data --sort dso      # the graph's .so, cedlm_kernels.so, the host

The cache is filled with random values (`cedlm.bench.common.synth_ced_state`); each step's graphs
are compiled or loaded before the timing (`warm_s`). The verify step writes nothing back, so every
round verifies against the same cache; the plain step decodes on. `verify_over_plain` and
`draft_over_plain` are the ratios of the medians: the costs `cedlm bench --only dspark` reports
per speculative step (its verification time also holds the host's input preparation, as here).
"""
from __future__ import annotations

import argparse
import json
import time


def _median(ts: list[float]) -> float:
    ts = sorted(ts)
    return ts[len(ts) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="cedlm/assets/model")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--T", type=int, default=6, help="rows verified per call: the anchor + drafts")
    ap.add_argument("--only", choices=("verify", "plain"),
                    help="time only this step (a loop for a profiler to sample)")
    a = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    import cedlm
    from cedlm.bench.common import synth_ced_state
    from cedlm.checkpoint import load_model
    from cedlm.model import dspark
    from cedlm.model.compiled_step import CompiledDecode
    from cedlm.model.dspark_steps import DraftStep, VerifyStep
    model = load_model(a.model)[0]                    # in eval mode
    plain_rounds = 0 if a.only == "verify" else a.rounds       # each plain step adds a token
    state = synth_ced_state(model, a.context, seed=0, margin=plain_rounds + 16)
    dec = CompiledDecode.of(model, "compiled")
    vs = VerifyStep.of(dec, a.T)
    ds = DraftStep.of(dec) if hasattr(model, "mtp") else None
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, model.cfg.vocab_size, (1, a.T), generator=g)
    warm = {}
    t0 = time.perf_counter()
    vs(ids, [state])
    warm["verify"] = time.perf_counter() - t0
    if ds is not None:
        dst = dspark.DraftState(model.kv_layout, len(model.mtp), device=model.device)
        P = torch.tensor([state.num_tokens])
        t0 = time.perf_counter()
        ds([dst], ids[0, :1], P)
        warm["draft"] = time.perf_counter() - t0
    tok = ids[0, :1]
    t0 = time.perf_counter()
    tok = dec(tok, [state]).argmax(-1)
    warm["plain"] = time.perf_counter() - t0
    plain, verify, draft = [], [], []
    for _ in range(a.rounds):
        if a.only != "verify":
            t0 = time.perf_counter()
            tok = dec(tok, [state]).argmax(-1)
            plain.append(time.perf_counter() - t0)
        if a.only != "plain":
            t0 = time.perf_counter()
            vs(ids, [state])
            verify.append(time.perf_counter() - t0)
        if ds is not None and a.only is None:
            t0 = time.perf_counter()
            ds([dst], ids[0, :1], torch.tensor([state.num_tokens]))
            draft.append(time.perf_counter() - t0)
    out = {"code": cedlm.__file__, "context": a.context, "T": a.T, "rounds": a.rounds,
           "warm_s": {k: round(x, 1) for k, x in warm.items()}}
    p = _median(plain) if plain else None
    v = _median(verify) if verify else None
    if p:
        out["plain_ms"] = round(p * 1e3, 3)
    if v:
        out["verify_ms"] = round(v * 1e3, 3)
    if p and v:
        out["verify_over_plain"] = round(v / p, 3)
    if draft:
        d = _median(draft)
        out.update(draft_ms=round(d * 1e3, 3), draft_over_plain=round(d / p, 3))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
