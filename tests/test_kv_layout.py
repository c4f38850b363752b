"""KV layout (cedlm/kv_layout.py): the byte counts every other component sizes itself from.

Model-free: configs only, plus a SequenceState of byte rows.
"""
import dataclasses
from fractions import Fraction

import pytest
import torch

from cedlm.config import ConfigError, ModelConfig
from cedlm.kv_layout import KVLayout
from cedlm.model.state import SequenceState


@pytest.fixture(scope="module")
def v41() -> ModelConfig:
    return ModelConfig.preset("deepseek-v4.1-flash")


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return ModelConfig.preset("tiny")


def with_ratios(cfg: ModelConfig, **layers) -> ModelConfig:
    """tiny with some compress ratios changed (layer ids as 'l2=4')."""
    r = list(cfg.compress_ratios)
    for name, v in layers.items():
        r[int(name[1:])] = v
    return dataclasses.replace(cfg, compress_ratios=r)


# ------------------------------------------------------------------------------------------------
# official V4.1 numbers


def test_v41_bytes_per_token_is_890(v41):
    lay = KVLayout.from_config(v41)
    assert lay.bytes_per_token == 890
    assert isinstance(lay.bytes_per_token, Fraction)


def test_v41_per_kind_split(v41):
    lay = KVLayout.from_config(v41)
    # entry widths: kv_fp4 of 512 values = 256 data + 32 e4m3 scales; index_fp4 of 128 = 64 + 4
    assert {s.width for s in lay.rows_of("kv")} == {288}
    assert {s.width for s in lay.rows_of("idx")} == {68}
    ratios = sorted(s.ratio for s in lay.rows_of("kv"))
    assert ratios == [1, 2, 2, 2]                         # three CSA2 encoder sources + the decoder
    assert sorted(s.ratio for s in lay.rows_of("idx")) == ratios
    assert lay.bytes_per_token_of("kv") == 3 * Fraction(288, 2) + 288 == 720
    assert lay.bytes_per_token_of("idx") == 3 * Fraction(68, 2) + 68 == 170
    assert lay.bytes_per_token_of("kv") + lay.bytes_per_token_of("idx") == lay.bytes_per_token


def test_v41_window_bytes_per_sequence(v41):
    lay = KVLayout.from_config(v41)
    assert v41.head_dim == 512 and lay.window_entry_bytes == 528      # 512 fp8 + 16 ue8m0 scales
    assert lay.window_bytes_per_sequence == v41.n_layers * v41.sliding_window * 528
    assert lay.dspark_window_bytes_per_sequence == v41.num_nextn_predict_layers * v41.sliding_window * 528


def test_v41_max_pending_bytes(v41):
    lay = KVLayout.from_config(v41)
    want = sum((v41.compress_ratios[s] - 1) * 2 * v41.head_dim * 4
               for s in v41.kv_source_layer_ids if v41.compress_ratios[s] > 1)
    assert lay.max_pending_bytes == want == 3 * 2 * 512 * 4


def test_v41_block_bytes_and_sequence_bytes(v41):
    lay = KVLayout.from_config(v41)
    assert lay.bytes_per_block(64) == 64 * 890
    assert lay.bytes_per_block_of("kv", 64) + lay.bytes_per_block_of("idx", 64) == 64 * 890
    fixed = lay.window_bytes_per_sequence + lay.max_pending_bytes
    assert lay.sequence_bytes(1000) == 1000 * 890 + fixed
    # whole blocks: 1000 tokens in 64-token blocks -> 16 blocks
    assert lay.sequence_bytes(1000, block_tokens=64) == 16 * 64 * 890 + fixed
    # exact entries round down per row kind: 3 tokens -> 1 entry of each ratio-2 kind
    assert lay.sequence_bytes(3) == 3 * (288 + 68) + 3 * (288 + 68) + fixed


# ------------------------------------------------------------------------------------------------
# other shapes of the same rules


def test_max_pending_sums_r_minus_1_rows_per_source(tiny):
    cfg = with_ratios(tiny, l2=4, l3=4)                   # sources 2 (r=4), 4 (r=2), 6 (r=1)
    lay = KVLayout.from_config(cfg)
    hd = cfg.head_dim
    assert lay.max_pending_bytes == (4 - 1) * 2 * hd * 4 + (2 - 1) * 2 * hd * 4
    assert KVLayout.pending_bytes(3, hd) == 3 * 2 * hd * 4
    assert KVLayout.from_config(tiny).max_pending_bytes == 2 * (1 * 2 * hd * 4)


def test_exact_fractional_bytes_per_token(tiny):
    lay = KVLayout.from_config(with_ratios(tiny, l2=3, l3=3))   # ratios 3, 2, 1
    kv, idx = 18, 17                                            # widths for head_dim 32
    want = Fraction(kv, 3) + Fraction(kv, 2) + kv + Fraction(idx, 3) + Fraction(idx, 2) + idx
    assert lay.bytes_per_token == want == Fraction(385, 6)
    assert lay.min_block_tokens == 6
    assert lay.bytes_per_block(6) == 385
    assert lay.bytes_per_block(12) == 770


def test_min_block_tokens_is_lcm_of_ratios(tiny, v41):
    assert KVLayout.from_config(tiny).min_block_tokens == 2
    assert KVLayout.from_config(v41).min_block_tokens == 2
    assert KVLayout.from_config(with_ratios(tiny, l2=4, l3=4)).min_block_tokens == 4
    assert KVLayout.from_config(with_ratios(tiny, l2=3, l3=3)).min_block_tokens == 6
    # a layout without global rows accepts any positive block size
    empty = dataclasses.replace(KVLayout.from_config(tiny), rows=())
    assert empty.min_block_tokens == 1


def test_round_block_tokens(tiny):
    lay = KVLayout.from_config(with_ratios(tiny, l2=3, l3=3))   # min 6
    assert [lay.round_block_tokens(n) for n in (1, 5, 6, 7, 12, 13)] == [6, 6, 6, 12, 12, 18]
    for n in range(1, 40):
        r = lay.round_block_tokens(n)
        lay.check_block_tokens(r)                                # always valid
        assert n <= r < n + 6


def test_check_block_tokens(tiny):
    lay = KVLayout.from_config(with_ratios(tiny, l2=4, l3=4))   # min 4
    for ok in (4, 8, 64):
        lay.check_block_tokens(ok)
    for bad in (0, -4, 2, 6, 65):
        with pytest.raises(ValueError, match="block_tokens"):
            lay.check_block_tokens(bad)
        with pytest.raises(ValueError, match="block_tokens"):
            lay.bytes_per_block(bad)


def test_non_ced_family_is_rejected():
    with pytest.raises(ConfigError, match="family"):
        KVLayout.from_config(ModelConfig.preset("deepseek-v3"))


def test_row_lookup(tiny):
    lay = KVLayout.from_config(tiny)
    assert lay.row("kv", 2).ratio == 2 and lay.row("idx", 6).ratio == 1
    with pytest.raises(KeyError):
        lay.row("kv", 0)


# ------------------------------------------------------------------------------------------------
# SequenceState sizes itself from the layout


def _feed(st: SequenceState, lay: KVLayout, n_tokens: int) -> None:
    """Append the global rows n_tokens positions produce, and the pending rows of the
    incomplete groups, as the model would."""
    for spec in lay.rows:
        store = (st.kv if spec.kind == "kv" else st.index)[spec.layer]
        new = n_tokens // spec.ratio - store.n
        store.append(torch.randint(0, 256, (new, spec.width), dtype=torch.uint8))
    for s, r, d in lay.pending:
        st.pending[s] = (torch.zeros(n_tokens % r, d), torch.zeros(n_tokens % r, d))


@pytest.mark.parametrize("ratios", [{}, {"l2": 4, "l3": 4}, {"l2": 3, "l3": 3}])
def test_sequence_state_nbytes_matches_layout(tiny, ratios):
    cfg = with_ratios(tiny, **ratios)
    lay = KVLayout.from_config(cfg)
    st = SequenceState(lay)
    nb = st.nbytes()
    assert nb["main_kv"] == nb["index_keys"] == nb["compressor_state"] == 0
    assert nb["window"] == lay.window_bytes_per_sequence                 # rings allocated whole
    full = 0
    for n in (1, 5, 12, 13, 31):
        _feed(st, lay, n)
        nb = st.nbytes()
        assert nb["main_kv"] == sum((n // s.ratio) * s.width for s in lay.rows_of("kv"))
        assert nb["index_keys"] == sum((n // s.ratio) * s.width for s in lay.rows_of("idx"))
        assert nb["window"] == lay.window_bytes_per_sequence
        assert nb["compressor_state"] == sum(KVLayout.pending_bytes(n % r, d) for _, r, d in lay.pending)
        assert nb["compressor_state"] <= lay.max_pending_bytes
        assert sum(nb.values()) <= lay.sequence_bytes(n)
        m = lay.min_block_tokens
        if n % m == m - 1:       # every pending group one short of complete (m = lcm of ratios)
            assert sum(nb.values()) == lay.sequence_bytes(n)
            full += 1
    assert full >= 1


def test_sequence_state_exact_bound_at_full_pending(tiny):
    lay = KVLayout.from_config(tiny)
    st = SequenceState(lay)
    _feed(st, lay, 9)                                    # odd: every ratio-2 source holds 1 row
    assert sum(st.nbytes().values()) == lay.sequence_bytes(9)
    _feed(st, lay, 10)                                   # even: no pending rows
    assert st.nbytes()["compressor_state"] == 0
    assert sum(st.nbytes().values()) == lay.sequence_bytes(10) - lay.max_pending_bytes
