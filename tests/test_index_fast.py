"""The indexer's compiled kernels (cedlm/kernels/csrc/index.h) against their readable references in
cedlm/model/indexer.py:
- `stable_topk`: the same indices and values, bit for bit, under the tie rule (equal scores:
  newest first; NaN first), including rows full of ties, -inf and NaN;
- `index_score` read straight from packed keys: the reference decodes every key with the codec and
  runs `Indexer.score`; same math in another summation order, so the scores agree to float32
  rounding (stated below) and the -inf pattern (visibility) is identical;
- the indexer inside the model: prefill + decode with the fast paths give the reference path's
  logits to 1e-4 and the same argmax."""
import pytest
import torch

from cedlm.config import presets
from cedlm.kernels import decode, encode, gate
from cedlm.kernels import index as kernels_index
from cedlm.kernels.codecs import ext_format
from cedlm.model.indexer import Indexer, stable_topk

pytestmark = [
    pytest.mark.skipif(gate.reference_kernels(), reason="CEDLM_REFERENCE_KERNELS=1 turns the compiled "
                       "kernels off: no fast path to compare with its reference"),
    pytest.mark.skipif(gate.ext_op("index_score") is None and not gate.reference_kernels(),
                       reason="compiled extension not built"),
]

RTOL, ATOL = 1e-5, 1e-5        # relative to the score's scale: sum_h |w| * |q| * |k|


def _ref_topk(score, k):
    with gate.reference_kernels_forced():
        return stable_topk(score, k)


@pytest.mark.parametrize("shape,k", [((1, 1, 37), 5), ((2, 3, 300), 64), ((4, 1, 16), 16),
                                     ((2, 5, 9), 0), ((1, 2, 1000), 1000)])
def test_topk_is_bit_identical(shape, k):
    g = torch.Generator().manual_seed(k)
    s = torch.randn(*shape, generator=g).relu()                  # many ties at 0
    s[..., ::7] = float("-inf")                                  # invisible entries
    s.view(-1)[::11] = 0.5                                       # ties away from 0
    if s.numel() > 20:
        s.view(-1)[13] = float("nan")
        s.view(-1)[3] = -0.0
    assert gate.inference_op("stable_topk", s) is not None
    ids, vals = stable_topk(s, k)
    rids, rvals = _ref_topk(s, k)
    assert ids.dtype == rids.dtype == torch.int64 and ids.shape == rids.shape
    assert torch.equal(ids, rids)
    assert torch.equal(vals.view(torch.int32), rvals.view(torch.int32))


def test_topk_orders_signed_zeros_and_nans_as_the_reference():
    """NaNs of either sign and payload first (newest first among them), -0.0 tied with +0.0, -inf
    last; values returned with their own bits."""
    g = torch.Generator().manual_seed(3)
    s = torch.randn(2, 3, 5000, generator=g).round()           # many ties, zeros among them
    flat = s.view(-1)
    flat[::5] = -0.0
    flat[1::97] = float("nan")
    flat.view(torch.int32)[2::89] = -4194304                   # 0xFFC00000: a negative NaN
    flat[3::13] = float("-inf")
    for k in (1, 64, 5000):
        ids, vals = stable_topk(s, k)
        rids, rvals = _ref_topk(s, k)
        assert torch.equal(ids, rids)
        assert torch.equal(vals.view(torch.int32), rvals.view(torch.int32))


def test_topk_of_a_row_of_equal_scores_is_the_newest():
    s = torch.zeros(1, 1, 10)
    ids, _ = stable_topk(s, 3)
    assert ids.tolist() == [[[9, 8, 7]]]


def _case(fmt, B, T, N, H=4, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g)
    w = torch.randn(B, T, H, generator=g)
    keys = torch.randn(B, N, D, generator=g) * 3
    raw = encode(keys.reshape(-1, D), fmt).view(B, N, -1)
    counts = torch.randint(1, N + 1, (B,), generator=g)
    ends = torch.arange(N) * 4 + 3
    pos = torch.randint(0, 4 * N + 4, (B, T), generator=g)
    visible = (ends.view(1, 1, N) <= pos.unsqueeze(-1)) & (torch.arange(N) < counts.view(B, 1, 1))
    for b in range(B):
        raw[b, counts[b]:] = 0                                   # the cache's zero padding
    return q, w, raw, visible


@pytest.mark.parametrize("fmt", ["index_fp4", "window_fp8", "kv_fp4"])
@pytest.mark.parametrize("B,T,N", [(1, 1, 1), (1, 1, 700), (3, 1, 129), (2, 40, 90)])
def test_index_score_from_packed_keys_matches_decode_then_score(fmt, B, T, N):
    q, w, raw, visible = _case(fmt, B, T, N, seed=N + T)
    kind = ext_format(fmt)
    got = gate.ext_op("index_score")(q, w, raw, visible, *kind)
    keys = decode(raw.reshape(B * N, -1), fmt, q.shape[-1]).view(B, N, -1)
    ref = Indexer.score(q, w, keys, visible)
    assert torch.equal(torch.isinf(got), torch.isinf(ref)) and torch.equal(got.isinf(), ~visible)
    scale = torch.einsum("bthd,bnd->bthn", q.abs(), keys.abs())
    scale = torch.einsum("bthn,bth->btn", scale, w.abs())
    fin = visible
    assert ((got[fin] - ref[fin]).abs() <= ATOL * scale[fin] + RTOL * ref[fin].abs()).all()


def test_formats_without_a_kernel_and_autograd_take_the_reference_path():
    assert ext_format("bf16") is None and ext_format("v4_fp8") is None
    assert ext_format("index_fp4") is not None
    q = torch.randn(1, 1, 2, 32, requires_grad=True)
    assert gate.inference_op("index_score", q, torch.randn(1, 1, 2)) is None
    assert kernels_index.stable_topk(torch.randn(3, 4).bfloat16(), 2) is None


def test_decode_with_the_fast_indexer_matches_the_reference():
    """A prompt longer than the window, then decode steps: with the fused scoring and top-k the
    logits agree with the reference path's to 1e-4 and every argmax is the same."""
    from cedlm.model.model import CEDModel
    torch.manual_seed(0)
    cfg = presets.tiny()
    model = CEDModel(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (150,), generator=torch.Generator().manual_seed(1))

    def run():
        st = model.new_state()
        out = [model.prefill(ids[:120], st, "full")[-1]]
        for t in ids[120:]:
            out.append(model.decode([int(t)], [st])[0])
        return torch.stack(out)

    with torch.no_grad():
        got = run()
        with gate.reference_kernels_forced():
            ref = run()
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4), (got - ref).abs().max()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
