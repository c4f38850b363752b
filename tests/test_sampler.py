"""SamplingParams (cedlm.engine.sampling_params) and Sampler (cedlm.engine.sampler)."""

import pytest
import torch

from cedlm.engine.sampler import Sampler, apply_top_k_top_p, make_generator
from cedlm.engine.sampling_params import TOP_K_MAX, SamplingParams

V = 50


def _logits(B=6, V=V, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, V, generator=g) * 3


def _sample(logits, params, seeds=None):
    gens = [make_generator(s) for s in (seeds or [None] * len(params))]
    return Sampler().sample(logits, params, gens)


# --------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": "1"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["a", 3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"logprobs": -1}, "logprobs"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ],
)
def test_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p) == (16, 1.0, 0, 1.0)
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None and not p.greedy
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=-1).top_k == -1 and SamplingParams(top_k=1).top_k == 1



@pytest.mark.parametrize("top_k", [9223372036854775808, TOP_K_MAX + 1, -2, 2.0, True, "5", None])
def test_top_k_out_of_range_rejected(top_k):
    with pytest.raises(ValueError, match=r"^top_k:"):
        SamplingParams(top_k=top_k)


def test_top_k_accepted_range():
    for k in (-1, 0, 1, V, V + 1, TOP_K_MAX):
        assert SamplingParams(top_k=k).top_k == k

def test_make_generator():
    assert make_generator(None) is None
    a, b = make_generator(7), make_generator(7)
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))
    make_generator(-3)  # negative seeds accepted


# --------------------------------------------------------------------------- greedy equivalences


def test_greedy_is_argmax_with_lowest_id_on_ties():
    x = _logits()
    x[0, 7] = x[0, 3] = x[0].max() + 1.0   # tie: 3 < 7 must win
    out = _sample(x, [SamplingParams(temperature=0)] * x.shape[0])
    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (x.shape[0],)
    assert torch.equal(out.token_ids, x.argmax(-1))
    assert out.token_ids[0] == 3


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1e-7),           # below GREEDY_EPS
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=5.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=2.0, top_p=1e-6, top_k=10),
    ],
    ids=["t0", "t-tiny", "topk1", "topk1-hot", "topp-tiny", "topp-tiny-topk"],
)
def test_degenerate_settings_equal_greedy(params):
    x = _logits(B=8)
    x[1, 10] = x[1, 20] = x[1].max() + 1.0     # a tie in row 1
    want = x.argmax(-1)
    for seeds in ([None] * 8, list(range(8))):
        for _ in range(5):
            assert torch.equal(_sample(x, [params] * 8, seeds).token_ids, want)


# --------------------------------------------------------------------------- seeds & batching


def test_seeded_runs_repeat():
    x = _logits()
    params = [SamplingParams(temperature=1.3, top_k=20, top_p=0.9)] * x.shape[0]
    seeds = [11, 12, 13, 14, 15, 16]
    a = [_sample(x, params, seeds).token_ids for _ in range(2)]
    assert torch.equal(a[0], a[1])
    # generators keep their state across steps: a multi-step run repeats as a whole
    def run():
        gens = [make_generator(s) for s in seeds]
        return torch.stack([Sampler().sample(x, params, gens).token_ids for _ in range(20)])
    r1, r2 = run(), run()
    assert torch.equal(r1, r2)
    assert len(set(r1[:, 0].tolist())) > 1     # the steps really do sample


def test_seeded_rows_independent_of_batch_composition():
    x = _logits(B=6)
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.5, top_p=0.8),
        SamplingParams(temperature=1.0, seed=None),
        SamplingParams(temperature=2.0, top_k=30, top_p=0.95),
    ]
    seeds = [1, 2, 3, 4, None, 6]
    seeded = [b for b in range(6) if seeds[b] is not None]
    steps = 10

    def run(order):
        gens = [make_generator(seeds[b]) for b in order]
        out = []
        for _ in range(steps):
            out.append(Sampler().sample(x[order], [params[b] for b in order], gens).token_ids)
        toks = torch.stack(out, 1)            # [len(order), steps]
        return {b: toks[i].tolist() for i, b in enumerate(order)}

    full = run(list(range(6)))
    rev = run(list(reversed(range(6))))
    alone = {b: run([b])[b] for b in seeded}
    subset = run([5, 0, 3])
    for b in seeded:
        assert full[b] == rev[b] == alone[b]
    for b in (5, 0, 3):
        assert subset[b] == full[b]


# --------------------------------------------------------------------------- distribution


def test_empirical_distribution_matches_softmax():
    torch.manual_seed(0)
    x = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5]])
    n = 20000
    params = [SamplingParams(temperature=1.0)]
    # batch the 20k draws as rows (unseeded rows share the global generator, drawn at once) ...
    toks = Sampler().sample(x.expand(n, -1), params * n, None).token_ids
    counts = torch.bincount(toks, minlength=x.shape[1]).double()
    expected = torch.softmax(x[0].double(), -1) * n
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    # df = 7: P(chi2 > 24.32) = 0.001
    assert chi2 < 24.32, (chi2, counts, expected)
    # ... and via one seeded generator stepped n times (checks the per-row generator path)
    g = [make_generator(123)]
    toks2 = torch.stack([Sampler().sample(x, params, g).token_ids for _ in range(4000)]).flatten()
    counts2 = torch.bincount(toks2, minlength=x.shape[1]).double()
    expected2 = torch.softmax(x[0].double(), -1) * 4000
    assert (((counts2 - expected2) ** 2) / expected2).sum().item() < 24.32


def test_temperature_changes_distribution():
    torch.manual_seed(1)
    x = torch.tensor([[1.0, 0.0, -1.0]])
    n = 20000
    t = 2.0
    toks = Sampler().sample(x.expand(n, -1), [SamplingParams(temperature=t)] * n).token_ids
    freq = torch.bincount(toks, minlength=3).double() / n
    assert torch.allclose(freq, torch.softmax(x[0].double() / t, -1), atol=0.015)


def test_sampled_tokens_stay_inside_top_k_and_top_p():
    torch.manual_seed(2)
    x = _logits(B=1, V=40, seed=3)
    n = 5000
    toks = Sampler().sample(x.expand(n, -1), [SamplingParams(top_k=4)] * n).token_ids
    assert set(toks.tolist()) == set(x[0].topk(4).indices.tolist())
    probs = torch.softmax(x[0], -1)
    srt, idx = probs.sort(descending=True)
    m = int((srt.cumsum(0) < 0.7).sum()) + 1          # smallest prefix reaching 0.7
    toks = Sampler().sample(x.expand(n, -1), [SamplingParams(top_p=0.7)] * n).token_ids
    assert set(toks.tolist()) == set(idx[:m].tolist())




@pytest.mark.parametrize("top_k", [V + 1, 10 * V, TOP_K_MAX])
def test_top_k_above_vocab_samples_like_disabled(top_k):
    x = _logits(B=4)
    seeds = [1, 2, 3, 4]
    for kw in ({"temperature": 1.3}, {"temperature": 0.8, "top_p": 0.9}):
        off = [SamplingParams(top_k=0, logprobs=2, **kw)] * 4
        big = [SamplingParams(top_k=top_k, logprobs=2, **kw)] * 4
        a, b = _sample(x, off, seeds), _sample(x, big, seeds)
        assert torch.equal(a.token_ids, b.token_ids)
        assert torch.equal(a.logprobs, b.logprobs)
        # mixed batch: an above-vocab row next to a real top-k row keeps its own (disabled) behaviour
        mixed = _sample(x, [big[0], SamplingParams(top_k=3, **kw), big[2], off[3]], seeds)
        assert mixed.token_ids[[0, 2, 3]].tolist() == a.token_ids[[0, 2, 3]].tolist()
# --------------------------------------------------------------------------- masks


def test_top_k_mask_keeps_exactly_k_best():
    x = _logits(B=4, V=30)
    x[2, 5] = x[2, 9] = x[2, 11] = 100.0     # three-way tie at the top; k=2 keeps ids 5 and 9
    k = torch.tensor([1, 3, 2, 30])
    out = apply_top_k_top_p(x, k, None)
    for b in range(4):
        kept = torch.isfinite(out[b]).nonzero().flatten().tolist()
        assert len(kept) == k[b]
        if b == 2:
            assert kept == [5, 9]
        else:
            assert set(kept) == set(x[b].topk(int(k[b])).indices.tolist())
        assert torch.equal(out[b, kept], x[b, kept])   # kept logits are untouched


def test_top_p_mask_hand_example():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])   # sorted: id1 .5, id3 .3, id2 .15, id0 .05
    x = probs.log()[None].expand(5, -1)
    p = torch.tensor([0.4, 0.75, 0.81, 0.96, 2.0])  # 2.0 = off
    out = apply_top_k_top_p(x, None, p)
    kept = [set(torch.isfinite(out[b]).nonzero().flatten().tolist()) for b in range(5)]
    assert kept == [{1}, {1, 3}, {1, 3, 2}, {0, 1, 2, 3}, {0, 1, 2, 3}]


def test_top_p_after_top_k():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    x = probs.log()[None]
    # top-k=2 renormalises to (4/7, 3/7); top-p 0.6 then needs both
    out = apply_top_k_top_p(x, torch.tensor([2]), torch.tensor([0.6]))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 1]


# --------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_at_sampled_token():
    x = _logits(B=6)
    params = [
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=0.5, top_k=3, logprobs=2),
        SamplingParams(temperature=2.0, top_p=0.5, logprobs=5),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, logprobs=0),
        SamplingParams(temperature=1.2, top_k=1, logprobs=1),
    ]
    out = _sample(x, params, [1, 2, 3, 4, 5, 6])
    ref = torch.log_softmax(x, -1)
    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == (6,)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    assert [t is None for t in out.top_logprobs] == [True, False, False, True, True, False]
    for b in (1, 2, 5):
        ids, lps = out.top_logprobs[b]
        k = params[b].logprobs
        assert ids.shape == (k,) and lps.shape == (k,) and ids.dtype == torch.int64
        torch.testing.assert_close(lps, ref[b].topk(k).values)
        torch.testing.assert_close(lps, ref[b, ids])


def test_sampler_input_checks():
    x = _logits(B=2)
    with pytest.raises(ValueError, match="SamplingParams"):
        Sampler().sample(x, [SamplingParams()], None)
    with pytest.raises(ValueError, match="generators"):
        Sampler().sample(x, [SamplingParams()] * 2, [None])
    with pytest.raises(ValueError, match="shape"):
        Sampler().sample(x[0], [SamplingParams()], None)


def test_sampler_half_precision_input_and_masked_vocab():
    x = _logits(B=3).to(torch.bfloat16)
    x[:, 40:] = float("-inf")                       # e.g. padded vocabulary
    out = _sample(x, [SamplingParams(temperature=1.0)] * 3, [1, 2, 3])
    assert (out.token_ids < 40).all() and torch.isfinite(out.logprobs).all()
    assert out.logprobs.dtype == torch.float32

