"""Sessions: what persistence keeps of a sequence, and how it comes back.

A session record holds the global KV rows (main KV and index keys of every source layer, in
their byte formats), the compressor's pending rows (an incomplete ratio-2 group: a few fp32
rows) and the token ids. Window rings are never stored: `restore` rebuilds them by replaying the
last n_win tokens (bounded, approximate) or the last L * (n_win - 1) + 1 tokens (exact).
"""
from __future__ import annotations

import numpy as np
import torch

from cedlm.cache.store import Record
from cedlm.model import CEDModel
from cedlm.model.state import SequenceState

SESSION_PREFIX = "session:"


def session_record(state: SequenceState, fingerprint: bytes) -> Record:
    arrays = {"token_ids": np.asarray(state.token_ids, dtype=np.int32)}
    for s, rows in state.kv.items():
        arrays[f"kv.{s}"] = rows.view().contiguous()
    for s, rows in state.index.items():
        arrays[f"idx.{s}"] = rows.view().contiguous()
    for s, (kv, gate) in state.pending.items():
        arrays[f"pending_kv.{s}"] = kv.float().contiguous()
        arrays[f"pending_gate.{s}"] = gate.float().contiguous()
    meta = {"fingerprint": fingerprint.hex(), "num_tokens": state.num_tokens, "kind": "session"}
    return Record(meta=meta, arrays=arrays)


def state_from_record(model: CEDModel, rec: Record, fingerprint: bytes) -> SequenceState | None:
    """A window-less state from a record; None when the record does not fit this model."""
    if rec.meta.get("fingerprint") != fingerprint.hex():
        return None
    t = rec.tensors()
    st = model.new_state()
    try:
        ids = t["token_ids"].tolist()
        st.num_tokens, st.token_ids = int(rec.meta["num_tokens"]), ids
        if len(ids) != st.num_tokens:
            return None
        cfg = model.cfg
        for s, rows in st.kv.items():
            arr = t[f"kv.{s}"]
            if arr.shape != (st.num_tokens // cfg.compress_ratios[s], rows.width):
                return None
            rows.append(arr.clone())
        for s, rows in st.index.items():
            arr = t[f"idx.{s}"]
            if arr.shape != (st.num_tokens // cfg.compress_ratios[s], rows.width):
                return None
            rows.append(arr.clone())
        for s in st.pending:
            st.pending[s] = (t[f"pending_kv.{s}"].clone(), t[f"pending_gate.{s}"].clone())
    except KeyError:
        return None
    return st


def save_session(model: CEDModel, store, key: str, state: SequenceState, fingerprint: bytes) -> int:
    """Write a session; returns the bytes of array data stored."""
    rec = session_record(state, fingerprint)
    store.put(SESSION_PREFIX + key, rec)
    return rec.nbytes


@torch.no_grad()
def restore_session(model: CEDModel, store, key: str, fingerprint: bytes, mode: str = "exact"):
    """-> (state with rebuilt windows, next-token logits [vocab]) or None on a miss (absent,
    corrupted or truncated entries are misses: the caller recomputes)."""
    rec = store.get(SESSION_PREFIX + key)
    if rec is None:
        return None
    st = state_from_record(model, rec, fingerprint)
    if st is None:
        return None
    return st, model.replay(st, mode)
