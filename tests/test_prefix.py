"""Prefix-cache block hashes and model fingerprints: reproducible, chained, salted."""

import hashlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from cedlm.cache.prefix import HASH_SIZE, block_hashes, model_fingerprint

TOKENS = [(i * 7919 + 13) % 50000 for i in range(103)]  # 6 full blocks of 16 + 7 trailing
SALT = b"model-fp"


def _reference(tokens, bt, salt):
    """The documented construction, written independently with struct-free byte packing."""
    prev, out = bytes(16), []
    for b in range(len(tokens) // bt):
        data = b"".join(t.to_bytes(4, "little", signed=True) for t in tokens[b * bt:(b + 1) * bt])
        prev = hashlib.blake2b(prev + salt + data, digest_size=16).digest()
        out.append(prev)
    return out


def test_matches_documented_construction():
    hs = block_hashes(TOKENS, 16, SALT)
    assert hs == _reference(TOKENS, 16, SALT)
    assert all(isinstance(h, bytes) and len(h) == HASH_SIZE for h in hs)
    assert block_hashes([-5, 2**31 - 1], 2) == _reference([-5, 2**31 - 1], 2, b"")


def test_same_hashes_in_a_separate_process():
    code = ("from cedlm.cache.prefix import block_hashes, model_fingerprint;"
            f"print(b''.join(block_hashes({TOKENS!r}, 16, {SALT!r})).hex());"
            "print(model_fingerprint({'b': [1, 2], 'a': 1.5}).hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"}).stdout.split()
    assert out[0] == b"".join(block_hashes(TOKENS, 16, SALT)).hex()
    assert out[1] == model_fingerprint({"a": 1.5, "b": [1, 2]}).hex()


def test_changing_a_token_changes_its_block_and_all_later():
    base = block_hashes(TOKENS, 16, SALT)
    assert len(base) == 6
    for blk in range(6):
        t = list(TOKENS)
        t[blk * 16 + 5] += 1
        hs = block_hashes(t, 16, SALT)
        assert hs[:blk] == base[:blk]
        assert all(a != b for a, b in zip(hs[blk:], base[blk:]))


def test_partial_trailing_block_not_hashed():
    base = block_hashes(TOKENS, 16, SALT)
    assert block_hashes(TOKENS[:96], 16, SALT) == base
    assert block_hashes(TOKENS[:95], 16, SALT) == base[:5]
    t = list(TOKENS)
    t[100] = 0  # inside the partial block: no effect
    assert block_hashes(t, 16, SALT) == base
    assert block_hashes(TOKENS[:15], 16, SALT) == []
    assert block_hashes([], 16) == []


def test_salt_changes_every_hash():
    a, b = block_hashes(TOKENS, 16, b"model-A"), block_hashes(TOKENS, 16, b"model-B")
    assert all(x != y for x, y in zip(a, b))
    assert all(x != y for x, y in zip(a, block_hashes(TOKENS, 16)))


def test_prefix_property_and_input_types():
    hs = block_hashes(TOKENS, 8, SALT)
    assert block_hashes(TOKENS + [1, 2, 3, 4, 5, 6, 7, 8, 9], 8, SALT)[:len(hs)] == hs
    assert block_hashes(np.array(TOKENS, dtype=np.int64), 8, SALT) == hs
    assert block_hashes(torch.tensor(TOKENS), 8, SALT) == hs
    assert block_hashes(tuple(TOKENS), 8, SALT) == hs
    assert block_hashes(TOKENS, 4, SALT) != hs[:1]  # block size matters


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_block_tokens(bad):
    with pytest.raises(ValueError, match="block_tokens"):
        block_hashes(TOKENS, bad)


def test_bad_tokens():
    with pytest.raises(ValueError, match="int32"):
        block_hashes([2**31], 1)
    with pytest.raises(TypeError):
        block_hashes([1.0], 1)
    with pytest.raises(TypeError):
        block_hashes([1], 1, salt="str")


def test_model_fingerprint_config():
    a = model_fingerprint({"dim": 64, "layers": 4, "nested": {"x": 1, "y": [1, 2]}})
    assert len(a) == HASH_SIZE
    assert a == model_fingerprint({"nested": {"y": [1, 2], "x": 1}, "layers": 4, "dim": 64})  # key order
    assert a != model_fingerprint({"dim": 64, "layers": 5, "nested": {"x": 1, "y": [1, 2]}})
    assert a != model_fingerprint({"dim": 64, "layers": 4, "nested": {"x": 1, "y": [1, 2]}}, {})


def test_model_fingerprint_weights():
    torch.manual_seed(0)
    cfg = {"dim": 8}
    sd = {"w1": torch.randn(4, 8), "b": torch.zeros(3, dtype=torch.bfloat16), "e": torch.arange(6).reshape(2, 3)}
    fp = model_fingerprint(cfg, sd)
    assert fp == model_fingerprint(cfg, dict(reversed(list(sd.items()))))  # name order, not dict order
    assert fp == model_fingerprint(cfg, {k: v.clone() for k, v in sd.items()})
    assert fp == model_fingerprint(cfg, {"w1": sd["w1"].numpy(), "b": sd["b"], "e": sd["e"].numpy()})
    assert fp != model_fingerprint(cfg)
    changed = {k: v.clone() for k, v in sd.items()}
    changed["w1"][3, 7] = torch.nextafter(changed["w1"][3, 7], torch.tensor(10.0))  # one ulp
    assert fp != model_fingerprint(cfg, changed)
    assert fp != model_fingerprint(cfg, {**sd, "b": sd["b"].float()})  # dtype
    assert fp != model_fingerprint(cfg, {**sd, "e": sd["e"].reshape(3, 2)})  # shape
    assert fp != model_fingerprint(cfg, {**sd, "w2": torch.zeros(1)})  # extra tensor
    renamed = dict(sd)
    renamed["w0"] = renamed.pop("w1")
    assert fp != model_fingerprint(cfg, renamed)
    # usable as a salt
    assert block_hashes(TOKENS, 16, fp) != block_hashes(TOKENS, 16, model_fingerprint(cfg))
