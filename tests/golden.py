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

Each case also records the model's discrete choices (the indexers' top-k entries and the MoE
routing, `cedlm.model.decisions`) into `tests/fixtures/golden_decisions.pt` (`--write-decisions`).
Another CPU rounds the same math differently in the last bits, and a choice taken on a near-tie
can then fall the other way; replaying the recorded choices (`cases(pins=...)`) keeps the
comparison of the continuous math independent of such ties, and `test_golden.py` checks the
choices themselves separately.
"""
from __future__ import annotations

import argparse
import hashlib
import lzma
import math
from contextlib import contextmanager
from pathlib import Path

import torch

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "golden.pt"
DECISIONS = Path(__file__).resolve().parent / "fixtures" / "golden_decisions.pt"
KEEP_ROWS = 4          # logits rows kept per case in the committed fixture (first, last, 2 inner)


def _tiny(device="cpu"):
    from cedlm import CEDModel, ModelConfig
    cfg = ModelConfig.preset("tiny").replace(initializer_range=0.08)
    torch.manual_seed(0)
    m = CEDModel(cfg).eval()
    # Round weights to bf16 so that a different SIMD path in the RNG cannot change them.
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return m.to(device)


def _small(device="cpu"):
    from cedlm import LLM
    return LLM(max_num_seqs=2, device=device).model


def _clone_without_windows(model, st):
    """What persistence keeps: global rows, compressor pending rows, token ids (no windows)."""
    from cedlm.model.replay import persisted_copy
    return persisted_copy(model, st)


@contextmanager
def _choices(model, key: str, pins: dict | None, logs: dict | None):
    """Run one case with the model's discrete choices recorded into logs[key] (pins None) or
    replayed from pins[key] (every recorded choice must be used)."""
    from cedlm.model.decisions import Decisions
    d = Decisions.record(model) if pins is None else Decisions.replay(model, pins[key])
    try:
        yield
    finally:
        d.detach()
    if pins is None:
        if logs is not None:
            logs[key] = dict(d.log)
    elif not d.all_replayed():
        raise RuntimeError(f"golden: case {key} took fewer choices than were recorded")


def _model_cases(name, model, out, pins=None, logs=None):
    cfg = model.cfg
    g = torch.Generator().manual_seed(11)
    S = 3 * cfg.exact_prefill_tokens // 2 + 3                 # > exact bound, odd (pending group)
    ids = torch.randint(0, cfg.vocab_size, (S + 6,), generator=g).to(next(model.parameters()).device)
    with torch.no_grad(), _choices(model, f"{name}/forward", pins, logs):
        out[f"{name}/forward"] = model(ids[None])[0].cpu()
    for mode in ("full", "exact", "bounded"):
        with _choices(model, f"{name}/prefill_{mode}", pins, logs):
            st = model.new_state()
            rows = [model.prefill(ids[:S], st, mode, chunk_size=cfg.sliding_window + 3)[-1:]]
            for t in range(S, S + 5):
                rows.append(model.decode(ids[t:t + 1], [st]))
        out[f"{name}/prefill_{mode}"] = torch.cat(rows).cpu()
    with _choices(model, f"{name}/replay_source", pins, logs):
        st = model.new_state()
        model.prefill(ids[:S], st, "full")
    for mode in ("exact", "bounded"):
        with _choices(model, f"{name}/replay_{mode}", pins, logs):
            r = _clone_without_windows(model, st)
            rows = [model.replay(r, mode)[None]]
            for t in range(S, S + 3):
                rows.append(model.decode(ids[t:t + 1], [r]))
        out[f"{name}/replay_{mode}"] = torch.cat(rows).cpu()


def _engine_cases(out, pins=None, logs=None, device="cpu"):
    from cedlm import LLM, SamplingParams
    llm = LLM(max_num_seqs=4, device=device)
    with _choices(llm.model, "small/engine_greedy_ids", pins, logs):
        res = llm.generate(["It is a truth universally acknowledged", "And God said"],
                           SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    out["small/engine_greedy_ids"] = torch.tensor([r.token_ids for r in res])


def cases(pins: dict | None = None, logs: dict | None = None, device="cpu") -> dict[str, torch.Tensor]:
    """Every case's output (on the CPU), computed on `device`. pins: the recorded choices to
    replay (a `golden_decisions.pt`); logs: a dict that receives each case's choices when they are
    not replayed."""
    out: dict[str, torch.Tensor] = {}
    _model_cases("tiny", _tiny(device), out, pins, logs)
    _model_cases("small", _small(device), out, pins, logs)
    _engine_cases(out, pins, logs, device)
    return out


def pack_decisions(logs: dict) -> dict:
    """Choices as committed: per case, per module, each call's tensor as int16 (shape kept), the
    case's bytes LZMA-compressed (about 0.8 MB for every case instead of 14 MB of int64)."""
    out = {}
    for case, log in logs.items():
        meta, raw = [], []
        for key, calls in log.items():
            for t in calls:
                if t.numel() and (int(t.max()) > 32767 or int(t.min()) < -32768):
                    raise ValueError(f"golden: a choice of {key} does not fit int16")
                meta.append((key, tuple(t.shape)))
                raw.append(t.to(torch.int16).numpy().tobytes())
        out[case] = {"calls": meta, "data": torch.frombuffer(bytearray(lzma.compress(b"".join(raw))),
                                                              dtype=torch.uint8)}
    return out


def unpack_decisions(packed: dict) -> dict:
    logs = {}
    for case, rec in packed.items():
        raw, at, log = lzma.decompress(rec["data"].numpy().tobytes()), 0, {}
        for key, shape in rec["calls"]:
            n = 2 * math.prod(shape)
            t = torch.frombuffer(bytearray(raw[at:at + n]), dtype=torch.int16).view(shape).long()
            log.setdefault(key, []).append(t)
            at += n
        logs[case] = log
    return logs


def load_decisions() -> dict:
    return unpack_decisions(torch.load(DECISIONS))


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
    ap.add_argument("--write-decisions", action="store_true",
                    help="record the discrete choices of every case into golden_decisions.pt")
    ap.add_argument("--pinned", action="store_true",
                    help="replay golden_decisions.pt's choices (what test_golden.py compares)")
    ap.add_argument("--full", default=None)
    ap.add_argument("--check-full", default=None)
    ap.add_argument("--from-full", default=None, help="write the fixture from a saved full dump")
    a = ap.parse_args()
    if a.from_full:
        torch.save(compact(torch.load(a.from_full)), FIXTURE)
        raise SystemExit(0)
    torch.set_num_threads(1)
    logs: dict = {}
    full = cases(pins=load_decisions() if a.pinned else None, logs=logs)
    if a.write:
        torch.save(compact(full), FIXTURE)
    if a.write_decisions:
        torch.save(pack_decisions(logs), DECISIONS)
    if a.full:
        torch.save(full, a.full)
    if a.check_full:
        ref = torch.load(a.check_full)
        bad = [k for k in ref if not torch.equal(ref[k], full[k])]
        print("bit-identical" if not bad else f"DIFFER: {bad}")
        for k in bad:
            print(k, (ref[k].float() - full[k].float()).abs().max().item())
