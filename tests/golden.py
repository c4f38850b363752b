"""Golden outputs: what the model and engine produce, recorded once and compared ever after.

`cases()` runs the public API only (CEDModel forward / prefill / decode / replay and the `LLM`
engine) on the `tiny` preset (seeded random weights) and on the shipped `small` model:
  - the full (training) forward,
  - chunked prefill then decode, in each prefill mode (full, exact, bounded),
  - restore by replay (exact and bounded) from what persistence keeps, then decode,
  - engine greedy generation (token ids; two prompts batched).
Run `python -m tests.golden --write` to record `tests/fixtures/golden.pt` (compact: a few rows of
logits per case, argmax of every row, a SHA-256 of the exact fp32 bytes) and, with `--full PATH`,
every logit for a bit-for-bit comparison on the recording machine.
"""
from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import torch

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "golden.pt"
KEEP_ROWS = 4          # logits rows kept per case in the committed fixture (first, last, 2 inner)


def _tiny():
    from cedlm import CEDModel, ModelConfig
    cfg = ModelConfig.preset("tiny").replace(initializer_range=0.08)
    torch.manual_seed(0)
    m = CEDModel(cfg).eval()
    # Round weights to bf16 so that a different SIMD path in the RNG cannot change them.
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return m


def _small():
    from cedlm import LLM
    return LLM(max_num_seqs=2).model


def _clone_without_windows(model, st):
    """What persistence keeps: global rows, compressor pending rows, token ids (no windows)."""
    from cedlm.model.replay import persisted_copy
    return persisted_copy(model, st)


def _model_cases(name, model, out):
    cfg = model.cfg
    g = torch.Generator().manual_seed(11)
    S = 3 * cfg.exact_prefill_tokens // 2 + 3                 # > exact bound, odd (pending group)
    ids = torch.randint(0, cfg.vocab_size, (S + 6,), generator=g)
    with torch.no_grad():
        out[f"{name}/forward"] = model(ids[None])[0]
    for mode in ("full", "exact", "bounded"):
        st = model.new_state()
        rows = [model.prefill(ids[:S], st, mode, chunk_size=cfg.sliding_window + 3)[-1:]]
        for t in range(S, S + 5):
            rows.append(model.decode(ids[t:t + 1], [st]))
        out[f"{name}/prefill_{mode}"] = torch.cat(rows)
    st = model.new_state()
    model.prefill(ids[:S], st, "full")
    for mode in ("exact", "bounded"):
        r = _clone_without_windows(model, st)
        rows = [model.replay(r, mode)[None]]
        for t in range(S, S + 3):
            rows.append(model.decode(ids[t:t + 1], [r]))
        out[f"{name}/replay_{mode}"] = torch.cat(rows)


def _engine_cases(out):
    from cedlm import LLM, SamplingParams
    llm = LLM(max_num_seqs=4)
    res = llm.generate(["It is a truth universally acknowledged", "And God said"],
                       SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    out["small/engine_greedy_ids"] = torch.tensor([r.token_ids for r in res])


def cases() -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    _model_cases("tiny", _tiny(), out)
    _model_cases("small", _small(), out)
    _engine_cases(out)
    return out


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def compact(full: dict[str, torch.Tensor]) -> dict:
    rec = {}
    for k, t in full.items():
        if t.is_floating_point():
            n = t.shape[0]
            rows = sorted({0, n // 3, 2 * n // 3, n - 1})[:KEEP_ROWS]
            top2 = t.topk(2, -1).values
            rec[k] = {"rows": torch.tensor(rows), "logits": t[rows].clone(), "argmax": t.argmax(-1),
                      "margin": top2[..., 0] - top2[..., 1], "sha256": digest(t)}
        else:
            rec[k] = {"ids": t.clone()}
    return rec


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--full", default=None)
    ap.add_argument("--check-full", default=None)
    ap.add_argument("--from-full", default=None, help="write the fixture from a saved full dump")
    a = ap.parse_args()
    if a.from_full:
        torch.save(compact(torch.load(a.from_full)), FIXTURE)
        raise SystemExit(0)
    torch.set_num_threads(1)
    full = cases()
    if a.write:
        torch.save(compact(full), FIXTURE)
    if a.full:
        torch.save(full, a.full)
    if a.check_full:
        ref = torch.load(a.check_full)
        bad = [k for k in ref if not torch.equal(ref[k], full[k])]
        print("bit-identical" if not bad else f"DIFFER: {bad}")
        for k in bad:
            print(k, (ref[k].float() - full[k].float()).abs().max().item())
