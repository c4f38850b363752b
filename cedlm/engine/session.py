"""Sessions: what persistence keeps of a sequence, and how it comes back.

A session record holds the global KV rows (main KV and index keys of every source layer, in
their byte formats), the compressor's pending rows (an incomplete ratio-2 group: a few fp32
rows) and the token ids. Window rings are never stored: `restore` rebuilds them by replaying the
last n_win tokens (bounded, approximate) or the last L * (n_win - 1) + 1 tokens (exact).

The store is a cache: a save the store cannot take stores nothing (0 bytes), and a restore the
store cannot serve -- absent, corrupt, unusable, or the store failing -- is a miss (None). With a
`StoreGuard` (what the engine's store always is) failures are counted and logged there; with a
bare backend they are logged here.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from cedlm.cache.store import Record
from cedlm.model import CEDModel
from cedlm.model.state import SequenceState

SESSION_PREFIX = "session:"

log = logging.getLogger(__name__)


def session_record(state: SequenceState, fingerprint: bytes) -> Record:
    """The record of a state, its arrays on the host (the state may live on a GPU)."""
    arrays = {"token_ids": np.asarray(state.token_ids, dtype=np.int32)}
    for s, rows in state.kv.items():
        arrays[f"kv.{s}"] = rows.view().contiguous().cpu()
    for s, rows in state.index.items():
        arrays[f"idx.{s}"] = rows.view().contiguous().cpu()
    for s, (kv, gate) in state.pending.items():
        arrays[f"pending_kv.{s}"] = kv.float().contiguous().cpu()
        arrays[f"pending_gate.{s}"] = gate.float().contiguous().cpu()
    meta = {"fingerprint": fingerprint.hex(), "num_tokens": state.num_tokens, "kind": "session"}
    return Record(meta=meta, arrays=arrays)


def state_from_record(model: CEDModel, rec: Record, fingerprint: bytes) -> SequenceState | None:
    """A window-less state from a record (on the model's device); None when the record does not
    fit this model."""
    if rec.meta.get("fingerprint") != fingerprint.hex():
        return None
    st = model.new_state()
    try:
        t = rec.tensors()
        ids = t["token_ids"].tolist()
        if len(ids) != int(rec.meta["num_tokens"]):
            return None
        st.set_tokens(ids)
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
            st.pending[s] = (t[f"pending_kv.{s}"].to(st.device, copy=True),
                             t[f"pending_gate.{s}"].to(st.device, copy=True))
    except Exception:                                 # noqa: BLE001 - a record that does not fit: a miss
        return None
    return st


def save_session(model: CEDModel, store, key: str, state: SequenceState, fingerprint: bytes) -> int:
    """Write a session; returns the bytes of array data stored (0 when the store failed)."""
    rec = session_record(state, fingerprint)
    try:
        ok = store.put(SESSION_PREFIX + key, rec)    # a StoreGuard answers False on failure
    except Exception as e:                           # noqa: BLE001 - a bare backend failing
        log.warning("session %r not saved: the store failed: %s: %s", key, type(e).__name__, e)
        return 0
    return 0 if ok is False else rec.nbytes


@torch.no_grad()
def restore_session(model: CEDModel, store, key: str, fingerprint: bytes, mode: str = "exact"):
    """-> (state with rebuilt windows, next-token logits [vocab]) or None on a miss (absent,
    corrupted or truncated entries are misses: the caller recomputes)."""
    try:
        rec = store.get(SESSION_PREFIX + key)
    except Exception as e:                           # noqa: BLE001 - a bare backend failing: a miss
        log.warning("session %r not restored: the store failed: %s: %s", key, type(e).__name__, e)
        return None
    if rec is None:
        return None
    st = state_from_record(model, rec, fingerprint)
    if st is None:
        return None
    return st, model.replay(st, mode)
