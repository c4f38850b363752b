"""Persistence: sessions and prefix blocks keep only global KV + token ids; windows are replayed."""
import json
from pathlib import Path

import pytest
import torch

from cedlm import CEDModel, LLM, ModelConfig, SamplingParams
from cedlm.cache.store import DirStore, RedisStore



@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return CEDModel(ModelConfig.preset("tiny").replace(initializer_range=0.08)).eval()


def _prompt(n, seed):
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_session_restore_exact_and_bounded(tiny, tmp_path):
    llm = LLM(tiny, store=str(tmp_path / "store"), prefill_mode="full")
    n = 2 * tiny.replay_tokens("exact") + 5                  # long enough that bounded != exact
    prompt = _prompt(n, 1)
    stored = llm.save_session("s1", prompt)
    with torch.no_grad():
        ref = tiny(torch.tensor([prompt]))[0, -1]               # the uninterrupted run
    st, exact = llm.restore_session("s1", "exact")
    assert (exact - ref).abs().max().item() < 1e-4
    _, bounded = llm.restore_session("s1", "bounded")
    dev = (bounded - ref).abs().max().item()
    c = tiny.cfg
    window = c.n_layers * c.sliding_window * (c.head_dim + c.head_dim // 32)
    (tmp_path / "restore_deviation.json").write_text(json.dumps({
        "preset": "tiny", "tokens": n, "bounded_max_abs_logit_dev": dev,
        "bounded_argmax_equal": bool(bounded.argmax() == ref.argmax()),
        "exact_max_abs_logit_dev": (exact - ref).abs().max().item(),
        "stored_bytes": stored, "window_bytes_not_stored": window}, indent=2))
    assert 1e-5 < dev < 5.0
    # decoding continues from the restored state exactly as from the original
    orig = tiny.new_state()
    tiny.prefill(prompt, orig, "full")
    for t in (5, 6, 7):
        assert torch.allclose(tiny.decode([t], [st]), tiny.decode([t], [orig]), atol=1e-4)
    # what is stored: token ids (4 B) + global rows (+ a pending group); no window bytes
    kv = sum(r.nbytes for r in list(orig.kv.values()) + list(orig.index.values()))
    assert stored <= kv + 4 * n + 2 * 4 * c.head_dim * 2


def test_corrupted_or_truncated_session_is_a_miss(tiny, tmp_path):
    store = DirStore(tmp_path / "s")
    llm = LLM(tiny, store=store)
    llm.save_session("a", _prompt(30, 2))
    llm.save_session("b", _prompt(30, 3))
    files = sorted((tmp_path / "s").glob("*.kv"))
    assert len(files) == 2
    raw = bytearray(files[0].read_bytes())
    raw[len(raw) // 2] ^= 0x40
    files[0].write_bytes(bytes(raw))
    files[1].write_bytes(files[1].read_bytes()[:-100])
    assert llm.restore_session("a") is None and llm.restore_session("b") is None
    assert store.stats()["corrupt"] == 2
    llm.save_session("a", _prompt(30, 2))                       # recomputed and stored again
    assert llm.restore_session("a") is not None


def _prefix_across_engines(tiny, store_a, store_b):
    shared = _prompt(48, 4)
    sp = SamplingParams(max_tokens=5, temperature=0)
    a = LLM(tiny, store=store_a, block_tokens=8, prefill_mode="exact", replay_mode="exact")
    out_a = a.generate([shared + [5, 6, 7]], sp)[0]
    b = LLM(tiny, store=store_b, block_tokens=8, prefill_mode="exact", replay_mode="exact")
    out_b = b.generate([shared + [5, 6, 7]], sp)[0]
    assert b.engine.kv.stats["store_block_hits"] == 6             # 48 tokens / 8 from the store
    assert b.engine.counters["encoder_tokens"] == 3               # only the suffix was encoded
    assert out_b.token_ids == out_a.token_ids
    return b


def test_prefix_blocks_persist_across_engines_dir(tiny, tmp_path):
    _prefix_across_engines(tiny, str(tmp_path / "p"), str(tmp_path / "p"))


def test_prefix_blocks_persist_across_engines_redis(tiny, redis_url):
    sa = RedisStore(redis_url, prefix="cedlm-test-prefix:")
    for k in sa.keys():
        sa.delete(k)
    _prefix_across_engines(tiny, sa, RedisStore(redis_url, prefix="cedlm-test-prefix:"))


def test_other_model_never_uses_the_blocks(tiny, tmp_path):
    store = str(tmp_path / "q")
    sp = SamplingParams(max_tokens=2, temperature=0)
    LLM(tiny, store=store, block_tokens=8).generate([_prompt(40, 5)], sp)
    torch.manual_seed(1)
    other = CEDModel(tiny.cfg).eval()
    b = LLM(other, store=store, block_tokens=8)
    b.generate([_prompt(40, 5)], sp)
    assert b.engine.kv.stats["store_block_hits"] == 0
