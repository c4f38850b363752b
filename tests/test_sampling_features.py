"""vLLM / OpenAI sampling features, engine side: prompt logprobs, n / best_of, penalties, logit_bias, allowed_token_ids,
logits processors, LLM.chat, plain-Python outputs, `cedlm generate` errors, `cedlm bench` not
installing anything unasked."""
import math

import pytest
import torch

from cedlm import CEDModel, LLM, ModelConfig, SamplingParams
from cedlm.engine.request import TokenLogprob, select_samples
from cedlm.engine.sampler import Sampler, make_generator, process_logits


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return CEDModel(ModelConfig.preset("tiny").replace(initializer_range=0.08)).eval()


def prompt(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def forward_logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]))[0].float(), -1)


# ============================================================================ SamplingParams
@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-1, prompt_logprobs=1), "max_tokens"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(prompt_logprobs=1.5), "prompt_logprobs"),
    (dict(n=0), "n"),
    (dict(n=True), "n"),
    (dict(n=3, best_of=2), "best_of"),
    (dict(best_of=0), "best_of"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(frequency_penalty="1"), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(logit_bias={1: 100.5}), "logit_bias"),
    (dict(logit_bias={1: float("nan")}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"a": 1.0}), "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
    (dict(allowed_token_ids="12"), "allowed_token_ids"),
    (dict(logits_processors=[3]), "logits_processors"),
    (dict(logits_processors=5), "logits_processors"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert str(e.value).startswith(field + " ")


def test_params_normalisation_and_samples():
    sp = SamplingParams(max_tokens=0, prompt_logprobs=0)
    assert sp.max_tokens == 0
    assert SamplingParams(logit_bias={"7": 3, 5: -100}).logit_bias == {7: 3.0, 5: -100.0}
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert not SamplingParams().processes_logits
    assert SamplingParams(repetition_penalty=1.2).processes_logits
    sp = SamplingParams(n=2, best_of=3, seed=10)
    assert sp.num_samples == 3
    subs = [sp.for_sample(i) for i in range(3)]
    assert [s.seed for s in subs] == [10, 11, 12] and all(s.n == 1 and s.best_of is None for s in subs)
    assert SamplingParams(n=2).for_sample(1).seed is None
    plain = SamplingParams()
    assert plain.for_sample(0) is plain


# ============================================================================ sampler
def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5]])
    sp = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    got = process_logits(logits, [sp], [([0, 4], [2, 2, 3])])[0]
    # token 0 (prompt, > 0): 2 / 2; token 1 unseen; token 2 (output twice): 0.5 / 2 - 2 * 0.5 - 0.25;
    # token 3 (output once): 3 / 2 - 0.5 - 0.25; token 4 (prompt, < 0): -0.5 * 2
    want = torch.tensor([1.0, -1.0, -1.0, 0.75, -1.0])
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5]]))   # input untouched
    # frequency / presence count generated tokens only; repetition counts the prompt too
    only_prompt = process_logits(logits, [SamplingParams(frequency_penalty=1.0, presence_penalty=1.0)],
                                 [([0, 1, 3], [])])
    assert torch.equal(only_prompt, logits)


def test_penalised_sampling_distribution_matches_hand_softmax():
    V, N = 5, 20000
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5]]).expand(N, V).contiguous()
    sp = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, seed=1)
    hist = [([0, 4], [2, 2, 3])] * N
    out = Sampler().sample(logits, [sp] * N, None, hist)
    freq = torch.bincount(out.token_ids, minlength=V).double() / N
    want = torch.softmax(torch.tensor([1.0, -1.0, -1.0, 0.75, -1.0], dtype=torch.float64), -1)
    assert torch.allclose(freq, want, atol=0.015), (freq, want)
    # without the penalties the distribution is the raw softmax (token 3 dominates): they changed it
    assert want[3] < 0.4 < torch.softmax(logits[0].double(), -1)[3]
    # logprobs stay those of the raw distribution
    raw = torch.log_softmax(logits[0], -1)
    assert torch.allclose(out.logprobs, raw[out.token_ids], atol=1e-6)


def test_logit_bias_bans_and_forces_tokens():
    logits = torch.tensor([[1.0, 4.0, 3.5, 0.0]])
    s = Sampler()
    assert s.sample(logits, [SamplingParams(temperature=0)]).token_ids.item() == 1
    banned = SamplingParams(temperature=0, logit_bias={1: -100})
    assert s.sample(logits, [banned]).token_ids.item() == 2
    forced = SamplingParams(temperature=0, logit_bias={3: 100})
    assert s.sample(logits, [forced]).token_ids.item() == 3
    N = 4000
    sp = SamplingParams(temperature=1.0, logit_bias={1: -100, 2: -100}, seed=3)
    toks = s.sample(logits.expand(N, 4).contiguous(), [sp] * N).token_ids
    assert not ((toks == 1) | (toks == 2)).any()
    assert set(toks.tolist()) == {0, 3}


def test_allowed_token_ids_and_processors():
    logits = torch.tensor([[1.0, 4.0, 3.5, 0.0, 2.0]])
    s = Sampler()
    sp = SamplingParams(temperature=0, allowed_token_ids=[0, 3, 4])
    assert s.sample(logits, [sp]).token_ids.item() == 4
    N = 2000
    toks = s.sample(logits.expand(N, 5).contiguous(),
                    [SamplingParams(allowed_token_ids=[0, 3], seed=4)] * N).token_ids
    assert set(toks.tolist()) == {0, 3}
    seen = []

    def proc(output_ids, row):
        seen.append(list(output_ids))
        row[:] = float("-inf")
        row[len(output_ids)] = 0.0
        return row
    out = s.sample(logits.repeat(2, 1), [SamplingParams(logits_processors=[proc])] * 2, None,
                   [([9, 9], [1, 2]), ([9], [])])
    assert out.token_ids.tolist() == [2, 0] and seen == [[1, 2], []]
    # every token masked: that row raises (the engine fails only that request)
    with pytest.raises(ValueError, match="masked"):
        s.sample(logits, [SamplingParams(logits_processors=[lambda ids, r: torch.full_like(r, float("-inf"))])])
    with pytest.raises(ValueError, match="logits_processors"):
        s.sample(logits, [SamplingParams(logits_processors=[lambda ids, r: r[:2]])])


# ============================================================================ prompt logprobs
@pytest.mark.parametrize("kernels", ["reference", "fast"])
@pytest.mark.parametrize("mode", ["bounded", "exact"])
def test_prompt_logprobs_equal_full_forward(tiny, mode, kernels):
    """The engine's chunked prefill scores the prompt like one full forward. With the reference
    kernels on both sides to 1e-4; with the inference fast paths (compiled attention, indexer,
    mHC: float32 rounding of their own) to 1e-3: on this random model a rounding difference of
    1e-7 in one attention output already moves a later log-probability by up to 5e-5 (a near tie
    in a top-k selection or an expert choice), and the fast paths moved one by 2.2e-4."""
    from cedlm.kernels.gate import reference_kernels_forced
    tol = 1e-4 if kernels == "reference" else 1e-3
    ids = prompt(64)
    ref = forward_logprobs(tiny, ids)
    llm = LLM(tiny, prefill_mode=mode, block_tokens=8, prefill_chunk=16)
    # warm the prefix cache with the same prompt: a scored request must not start from it
    llm.generate(ids, SamplingParams(max_tokens=1, temperature=0))
    before = dict(llm.engine.counters)
    with reference_kernels_forced(kernels == "reference"):
        out = llm.generate(ids, SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    assert out.finish_reason == "length" and out.token_ids == [] and out.text == ""
    assert out.num_cached_tokens == 0
    assert llm.engine.counters["encoder_tokens"] - before["encoder_tokens"] == len(ids)
    assert llm.engine.counters["decoder_prefill_tokens"] - before["decoder_prefill_tokens"] == len(ids)
    pl = out.prompt_logprobs
    assert len(pl) == len(ids) and pl[0] is None
    for j in range(1, len(ids)):
        e = pl[j]
        assert isinstance(e, TokenLogprob) and e.token_id == ids[j]
        assert type(e.logprob) is float and all(type(v) is float for v in e.top_logprobs)
        assert all(type(t) is int for t in e.top_ids) and type(e.rank) is int
        row = ref[j - 1]
        assert e.logprob == pytest.approx(row[ids[j]].item(), abs=tol)
        a = row[ids[j]]                      # rank: 1 + tokens more likely (up to float noise)
        assert int((row > a + tol).sum()) + 1 <= e.rank <= int((row > a - tol).sum()) + 1
        tv, ti = row.topk(3)
        assert e.top_logprobs == pytest.approx(tv.tolist(), abs=tol)
        assert [row[t].item() for t in e.top_ids] == pytest.approx(tv.tolist(), abs=tol)
        assert e.as_dict()[ids[j]] == e.logprob
    assert llm.engine.pool.num_used == 0


def test_prompt_logprobs_with_generation_and_k0(tiny):
    ids = prompt(40, seed=1)
    ref = forward_logprobs(tiny, ids)
    llm = LLM(tiny, block_tokens=8, prefill_chunk=16)        # bounded default
    out = llm.generate(ids, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=0, logprobs=2))[0]
    assert [e.top_ids for e in out.prompt_logprobs[1:]] == [[]] * (len(ids) - 1)
    assert out.prompt_logprobs[5].logprob == pytest.approx(ref[4, ids[5]].item(), abs=1e-4)
    # the first token comes from the same (full) prefill: argmax of the forward's last row
    assert out.token_ids[0] == int(ref[-1].argmax())
    assert len(out.token_ids) == 3
    assert all(type(v) is float for v in out.logprobs)
    assert all(type(i) is int and type(v) is float for ids_, lps in out.top_logprobs for i, v in zip(ids_, lps))
    # one-token prompt: nothing to score
    one = llm.generate([5], SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    assert one.prompt_logprobs == [None]
    # without prompt_logprobs the output field is None
    assert llm.generate(ids, SamplingParams(max_tokens=1))[0].prompt_logprobs is None


# ============================================================================ n / best_of
def test_n_samples_are_seeded_distinct_and_prefilled_once(tiny):
    ids = prompt(37, seed=2)
    sp = SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=11, logprobs=0)
    kw = dict(block_tokens=8, prefill_chunk=16, prefill_mode="exact", replay_mode="exact")
    llm = LLM(tiny, enable_prefix_cache=False, **kw)
    out = llm.generate(ids, sp)[0]
    assert llm.engine.counters["encoder_tokens"] == len(ids)          # one prefill for 3 samples
    assert [c.index for c in out.outputs] == [0, 1, 2]
    toks = [c.token_ids for c in out.outputs]
    assert len({tuple(t) for t in toks}) == 3                          # distinct
    assert out.token_ids == toks[0] and out.request_id == "req-0"
    again = LLM(tiny, enable_prefix_cache=False, **kw).generate(ids, sp)[0]
    assert [c.token_ids for c in again.outputs] == toks                # reproducible
    # sample i is the single request with seed + i
    for i in range(3):
        single = llm.generate(ids, SamplingParams(max_tokens=6, temperature=1.0, seed=11 + i))[0]
        assert single.token_ids == toks[i]
    for c in out.outputs:
        assert c.cumulative_logprob == pytest.approx(sum(c.logprobs))
    assert llm.engine.pool.num_used == 0 and all(v == 0 for v in llm.engine.pool.ref)
    # with the prefix cache on, also prefilled once; samples that cannot start from the
    # prefill (one sequence slot) run on their own from the prefix cache, with the same result
    on = LLM(tiny, **kw)
    assert [c.token_ids for c in on.generate(ids, sp)[0].outputs] == toks
    assert on.engine.counters["encoder_tokens"] == len(ids)
    slot = LLM(tiny, max_num_seqs=1, **kw)
    assert [c.token_ids for c in slot.generate(ids, sp)[0].outputs] == toks
    assert slot.stats()["prefix_hits"] >= 2
    assert slot.engine.pool.num_used == 0


def test_greedy_n_and_best_of_selection(tiny):
    ids = prompt(30, seed=3)
    kw = dict(block_tokens=8, prefill_mode="exact", replay_mode="exact", enable_prefix_cache=False)
    llm = LLM(tiny, **kw)
    g = llm.generate(ids, SamplingParams(max_tokens=5, temperature=0, n=2))[0]
    assert g.outputs[0].token_ids == g.outputs[1].token_ids
    assert g.outputs[0].token_ids == llm.generate(ids, SamplingParams(max_tokens=5, temperature=0))[0].token_ids
    all4 = llm.generate(ids, SamplingParams(max_tokens=5, temperature=1.0, n=4, seed=5))[0].outputs
    best = llm.generate(ids, SamplingParams(max_tokens=5, temperature=1.0, n=2, best_of=4, seed=5))[0].outputs
    top2 = sorted(all4, key=lambda c: -c.cumulative_logprob)[:2]
    assert [(c.index, c.token_ids) for c in best] == [(c.index, c.token_ids) for c in top2]
    assert len({c.index for c in best}) == 2


def test_samples_api_and_abort_of_first_sample(tiny):
    llm = LLM(tiny, block_tokens=8, prefill_chunk=8)
    eng = llm.engine
    with pytest.raises(ValueError, match="^n: .*add_samples"):
        eng.add_request(prompt(20), SamplingParams(n=2))
    reqs = eng.add_samples(prompt(20), SamplingParams(n=3, max_tokens=4, seed=1), request_id="grp")
    assert [r.request_id for r in reqs] == ["grp-0", "grp-1", "grp-2"]
    assert {r.group_id for r in reqs} == {"grp"} and [r.sample_index for r in reqs] == [0, 1, 2]
    eng.step()
    eng.abort("grp-0")                    # mid-prefill: the other samples still run on their own
    while eng.has_work:
        eng.step()
    assert reqs[0].finish_reason == "abort"
    assert [r.finish_reason for r in reqs[1:]] == ["length", "length"]
    assert all(len(r.output_ids) == 4 for r in reqs[1:])
    assert eng.pool.num_used == 0
    assert select_samples(reqs[1:], 1) == [max(reqs[1:], key=lambda r: r.cumulative_logprob)]


# ============================================================================ through the engine
def greedy_penalised_reference(model, ids, n, rp, fp, pp, bias=None):
    out = []
    for _ in range(n):
        with torch.no_grad():
            row = model(torch.tensor([ids + out]))[0, -1].float()
        seen = set(ids + out)
        row = torch.tensor([(v / rp if v > 0 else v * rp) if t in seen else v for t, v in enumerate(row.tolist())])
        for t in set(out):
            row[t] -= fp * out.count(t) + pp
        for t, b in (bias or {}).items():
            row[t] += b
        out.append(int(row.argmax()))
    return out


def test_engine_applies_penalties_and_bias_over_the_history(tiny):
    ids = prompt(24, seed=4)
    llm = LLM(tiny, block_tokens=8, prefill_mode="exact")
    sp = SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.3, frequency_penalty=0.4,
                        presence_penalty=0.2)
    got = llm.generate(ids, sp)[0].token_ids
    assert got == greedy_penalised_reference(tiny, ids, 8, 1.3, 0.4, 0.2)
    # the penalties matter here: plain greedy repeats itself differently
    assert got != llm.generate(ids, SamplingParams(max_tokens=8, temperature=0))[0].token_ids
    plain = llm.generate(ids, SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]
    banned = llm.generate(ids, SamplingParams(max_tokens=1, temperature=0, logit_bias={plain: -100}))[0]
    ref = forward_logprobs(tiny, ids)[-1]
    assert banned.token_ids[0] == int(ref.topk(2).indices[1])
    with pytest.raises(ValueError, match="^logit_bias: token id 600"):
        llm.generate(ids, SamplingParams(logit_bias={600: 1.0}))
    with pytest.raises(ValueError, match="^allowed_token_ids: token id 512"):
        llm.generate(ids, SamplingParams(allowed_token_ids=[1, 512]))
    assert llm.engine.pool.num_used == 0 and not llm.engine.has_work


def test_logits_processor_hook_and_failure_containment(tiny):
    llm = LLM(tiny, block_tokens=8)
    eng = llm.engine
    calls = []

    def count_up(output_ids, logits):       # forces 100, 101, 102, ...
        calls.append(list(output_ids))
        forced = torch.full_like(logits, float("-inf"))
        forced[100 + len(output_ids)] = 0.0
        return forced

    def broken(output_ids, logits):
        raise RuntimeError("grammar exploded")

    good = eng.add_request(prompt(12, seed=5), SamplingParams(max_tokens=4, logits_processors=[count_up]))
    bad = eng.add_request(prompt(12, seed=6), SamplingParams(max_tokens=4, logits_processors=[broken]))
    other = eng.add_request(prompt(12, seed=7), SamplingParams(max_tokens=4, allowed_token_ids=[7, 8]))
    while eng.has_work:
        eng.step()
    assert good.output_ids == [100, 101, 102, 103] and calls == [[], [100], [100, 101], [100, 101, 102]]
    assert bad.finish_reason == "error" and "grammar exploded" in bad.error
    assert other.finish_reason == "length" and set(other.output_ids) <= {7, 8}
    assert eng.pool.num_used == 0


# ============================================================================ LLM.chat
def test_llm_chat_uses_the_v41_encoder(tiny):
    from cedlm.text.chat import encode_chat, encode_chat_ids
    llm = LLM(tiny, block_tokens=8, enable_prefix_cache=False)   # bounded replay would differ
    assert llm.tokenizer is not None
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    sp = SamplingParams(max_tokens=4, temperature=0, logprobs=1)
    out = llm.chat(msgs, sp)
    assert len(out) == 1
    o = out[0]
    assert o.prompt == encode_chat(msgs)
    assert o.prompt_token_ids == encode_chat_ids(msgs, llm.tokenizer)
    assert o.token_ids == llm.generate(o.prompt_token_ids, sp)[0].token_ids
    assert all(type(v) is float for v in o.logprobs)
    assert all(type(ids[0]) is int and type(lps[0]) is float for ids, lps in o.top_logprobs)
    two = llm.chat([msgs, [{"role": "user", "content": "Yo"}]], sp, thinking_mode="thinking")
    assert len(two) == 2 and two[1].prompt == encode_chat([{"role": "user", "content": "Yo"}], "thinking")
    with pytest.raises(ValueError, match="^messages"):
        llm.chat("hello")


# ============================================================================ CLI
def _cli(argv, capsys):
    from cedlm.cli import main
    try:
        rc = main(argv)
    except SystemExit as e:          # argparse's own errors
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.mark.parametrize("flags, words", [
    (["--max-tokens", "0"], "max_tokens"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "1.5"], "top_p"),
    (["--model", "no-such-model"], "model"),
    (["--threads", "0"], "--threads"),
    (["--max-tokens", "many"], "--max-tokens"),
])
def test_generate_bad_flags_one_error_line(flags, words, capsys):
    rc, out, err = _cli(["generate", "--prompt", "hi", *flags], capsys)
    assert rc == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("cedlm generate: error: ") and words in last
    assert "Traceback" not in err


def test_generate_random_weights_warning_and_scoring(capsys):
    import json
    rc, out, err = _cli(["generate", "--model", "tiny", "--prompt", "hello world", "--max-tokens", "0",
                         "--prompt-logprobs", "1", "--json"], capsys)
    assert rc == 0
    warn = [l for l in err.splitlines() if "RANDOM weights" in l]
    assert len(warn) == 1 and "--random-weights" in warn[0]
    obj = json.loads(out)
    assert obj["token_ids"] == [] and obj["stats"]["finish_reason"] == "length"
    assert obj["prompt_logprobs"][0] is None and len(obj["prompt_logprobs"]) == obj["stats"]["prompt_tokens"]
    assert math.isfinite(obj["stats"]["prompt_logprob"])
    rc, out, err = _cli(["generate", "--model", "tiny", "--random-weights", "--prompt", "hi",
                         "--max-tokens", "2"], capsys)
    assert rc == 0 and "RANDOM" not in err


# ============================================================================ bench
def test_bench_installs_nothing_unless_asked(monkeypatch):
    import importlib.util
    import subprocess

    from cedlm.bench import cli, peer
    from cedlm.bench.common import Ctx
    assert Ctx().install is False
    p = __import__("argparse").ArgumentParser()
    cli._add_arguments(p)
    assert p.parse_args([]).install_peer is False and p.parse_args(["--install-peer"]).install_peer
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))

    def no_pip(*a, **k):
        raise AssertionError(f"pip was run: {a}")
    monkeypatch.setattr(subprocess, "run", no_pip)
    tf, how = peer.ensure_transformers(False, log=lambda s: None)
    assert tf is None and "--install-peer" in how
    # the llama.cpp peer: absent -> one line that says what is missing and how to opt in
    from cedlm.bench import peer_llamacpp
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("transformers", "llama_cpp") else real(name, *a))
    lc, how, script = peer_llamacpp.ensure_llama_cpp(False, log=lambda s: None)
    assert lc is None and script is None and "\n" not in how
    assert how.startswith("llama.cpp peer skipped") and peer_llamacpp.LLAMA_CPP_PIN in how
    assert "--install-peer" in how
