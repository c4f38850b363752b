"""Per-token time of the compiled decode step of CED-small at one context, batch 1 (the peer
figure's CED side, without its peers), one JSON line per run: for comparing two commits' steps on
one machine, alternating processes.

    .venv/bin/python bench/scripts/decode_step_time.py [--context 512] [--rounds 40]

Two commits, A/B: check the other one out beside this one, build its kernels into a folder of
their own, and alternate (the interpreter and packages of this checkout; `code` in the output
says which tree ran):

    git worktree add /tmp/old COMMIT && ln -s $PWD/.venv /tmp/old/.venv
    (cd /tmp/old && CEDLM_KERNEL_DIR=/tmp/oldk PYTHONPATH=/tmp/old .venv/bin/python -m cedlm.kernels.build)
    for i in 1 2 3 4; do
      .venv/bin/python bench/scripts/decode_step_time.py
      (cd /tmp/old && CEDLM_KERNEL_DIR=/tmp/oldk PYTHONPATH=/tmp/old .venv/bin/python \\
          $OLDPWD/bench/scripts/decode_step_time.py)
    done

The model is drawn from a fixed seed and its cache filled with random values
(`cedlm.bench.common.synth_ced_batch`); the step is the engine's default (`ced_decode_fn`), its
graph compiled or loaded before the timing (`warm_s`). Each round decodes 16 greedy tokens;
`median_ms` and `min_ms` are per token over the rounds.
"""
from __future__ import annotations

import argparse
import json
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=40)
    a = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    import cedlm
    from cedlm.bench.common import _build_ced, ced_decode_fn, small_config, synth_ced_batch
    new = 16
    ced = _build_ced(small_config(), 0)
    states = synth_ced_batch(ced, a.context, 1, seed=0, new_tokens=new * (a.rounds + 4))
    step = ced_decode_fn(ced)
    g = torch.Generator().manual_seed(0)

    def decode(n: int) -> None:
        tok = torch.randint(1, ced.cfg.vocab_size, (1,), generator=g)
        for _ in range(n):
            tok = step(tok, states).argmax(-1)

    t0 = time.perf_counter()
    decode(new)
    warm = time.perf_counter() - t0
    decode(new)
    per_token = []
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        decode(new)
        per_token.append((time.perf_counter() - t0) / new)
    per_token.sort()
    print(json.dumps({"code": cedlm.__file__, "context": a.context, "warm_s": round(warm, 1),
                      "median_ms": round(per_token[len(per_token) // 2] * 1e3, 3),
                      "min_ms": round(per_token[0] * 1e3, 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
