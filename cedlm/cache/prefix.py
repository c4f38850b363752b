"""Prefix-cache keys: chained block hashes over token ids, and a model fingerprint to salt them.

Both are pure functions of their inputs (blake2b over explicitly encoded bytes), so they agree across
processes, machines and Python versions; Python's salted ``hash`` is never used.

Block hash chain (``digest_size=16``)::

    h_{-1} = 16 zero bytes
    h_i    = blake2b(h_{i-1} || salt || int32_le(token ids of block i))

With images (``spans``: (start, length, 16-byte content digest) per image span), every span
that overlaps block i adds ``b"img" || int64_le(start, length) || digest`` after the token ids,
so equal token ids with different images never share a block (blocks without images, and calls
without spans, hash exactly as before).

Only FULL blocks are hashed; a trailing partial block has no hash (it cannot be shared yet).
Because every h_i covers all tokens before it, equal h_i means an equal whole prefix (up to
collisions of a 128-bit hash), so a cache lookup can walk the list and stop at the first miss.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable, Mapping

import numpy as np

HASH_SIZE = 16  # bytes per block hash
_ROOT = bytes(HASH_SIZE)  # h_{-1}
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1
_FINGERPRINT_TAG = b"cedlm.model_fingerprint.v1\x00"


def _token_bytes(block: Iterable[int]) -> bytes:
    ids = list(block)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise TypeError(f"token ids must be ints, got {type(t).__name__}: {t!r}")
        if not _INT32_MIN <= int(t) <= _INT32_MAX:
            raise ValueError(f"token id {int(t)} does not fit in int32")
    return np.asarray(ids, dtype="<i4").tobytes()


def block_hashes(token_ids: Iterable[int], block_tokens: int, salt: bytes = b"",
                 spans: list[tuple[int, int, bytes]] | None = None) -> list[bytes]:
    """Chained 16-byte hashes of the full ``block_tokens``-sized blocks of ``token_ids``.

    ``len(result) == len(token_ids) // block_tokens``. ``salt`` (e.g. ``model_fingerprint(...)``)
    is mixed into every block so two models never share cache entries.
    """
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0:
        raise ValueError(f"block_tokens must be a positive int, got {block_tokens!r}")
    if not isinstance(salt, (bytes, bytearray, memoryview)):
        raise TypeError(f"salt must be bytes, got {type(salt).__name__}")
    salt = bytes(salt)
    if hasattr(token_ids, "tolist"):  # numpy array / torch tensor
        token_ids = token_ids.tolist()
    ids = list(token_ids)
    out: list[bytes] = []
    prev = _ROOT
    for start in range(0, len(ids) - block_tokens + 1, block_tokens):
        h = hashlib.blake2b(digest_size=HASH_SIZE)
        h.update(prev)
        h.update(salt)
        h.update(_token_bytes(ids[start:start + block_tokens]))
        for s0, n, digest in spans or ():
            if s0 < start + block_tokens and s0 + n > start:
                h.update(b"img" + np.asarray([s0, n], dtype="<i8").tobytes() + bytes(digest))
        prev = h.digest()
        out.append(prev)
    return out


def _tensor_bytes(value: Any) -> tuple[str, tuple[int, ...], memoryview]:
    """(dtype name, shape, raw bytes) of a torch tensor or numpy array, without value conversion."""
    if type(value).__module__.split(".")[0] == "torch":
        import torch

        t = value.detach().to("cpu").contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        shape = tuple(t.shape)
        raw = t.reshape(-1).view(torch.uint8).numpy()  # works for bf16/fp8 too
        return dtype, shape, memoryview(raw).cast("B")
    a = np.ascontiguousarray(value)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return a.dtype.name, tuple(a.shape), memoryview(a.reshape(-1).view(np.uint8))


def model_fingerprint(config_dict: Mapping[str, Any], state_dict_tensors: Mapping[str, Any] | None = None) -> bytes:
    """16-byte digest of a model's config and (optionally) weights, for salting ``block_hashes``.

    The config is hashed as canonical JSON (sorted keys, no whitespace); weights, when given, are
    hashed in sorted-name order as (name, dtype, shape, raw bytes), so dict order never matters and
    any changed byte, dtype or shape changes the fingerprint. Hashing weights reads every byte once.
    """
    h = hashlib.blake2b(digest_size=HASH_SIZE)
    h.update(_FINGERPRINT_TAG)
    cfg = json.dumps(dict(config_dict), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    cfg_b = cfg.encode()
    h.update(len(cfg_b).to_bytes(8, "little"))
    h.update(cfg_b)
    if state_dict_tensors is None:
        h.update(b"\x00")
        return h.digest()
    h.update(b"\x01")
    h.update(len(state_dict_tensors).to_bytes(8, "little"))
    for name in sorted(state_dict_tensors):
        dtype, shape, raw = _tensor_bytes(state_dict_tensors[name])
        desc = json.dumps([name, dtype, list(shape), raw.nbytes], separators=(",", ":")).encode()
        h.update(len(desc).to_bytes(8, "little"))
        h.update(desc)
        h.update(raw)
    return h.digest()


__all__ = ["HASH_SIZE", "block_hashes", "model_fingerprint"]
