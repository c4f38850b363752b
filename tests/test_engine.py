"""The engine against the plain model: greedy equality, batching, prefix cache, memory hygiene."""
import pytest
import torch

from cedlm import CEDModel, LLM, ModelConfig, SamplingParams
from cedlm.plan import plan


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return CEDModel(ModelConfig.preset("tiny").replace(initializer_range=0.08)).eval()


def greedy_reference(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def prompts(k, lo=3, hi=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(k)]


@pytest.mark.parametrize("mode", ["full", "exact"])
def test_engine_greedy_equals_plain_model(tiny, mode, kernels):
    llm = LLM(tiny, prefill_mode=mode, block_tokens=8, prefill_chunk=16)
    ps = prompts(3)
    outs = llm.generate(ps, SamplingParams(max_tokens=12, temperature=0))
    for p, o in zip(ps, outs):
        assert o.token_ids == greedy_reference(tiny, p, 12)
        assert o.finish_reason == "length"


def test_concurrent_equals_one_at_a_time(tiny):
    ps = prompts(8, seed=1)
    sp = SamplingParams(max_tokens=10, temperature=0)
    together = LLM(tiny, prefill_mode="exact", max_num_seqs=8, block_tokens=8, prefill_chunk=7).generate(ps, sp)
    alone = [LLM(tiny, prefill_mode="exact", max_num_seqs=1, block_tokens=8).generate([p], sp)[0]
             for p in ps]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]


def test_preemption_keeps_outputs_and_frees_blocks(tiny):
    ps = prompts(4, lo=20, hi=30, seed=2)
    sp = SamplingParams(max_tokens=24, temperature=0)
    ref = LLM(tiny, prefill_mode="exact", block_tokens=8).generate(ps, sp)
    llm = LLM(tiny, prefill_mode="exact", block_tokens=8, max_num_seqs=4, enable_prefix_cache=False,
              kv_budget_bytes=4 * llm_window_bytes(tiny) + 14 * 8 * plan(tiny.cfg)["kv_bytes_per_token"])
    outs = llm.generate(ps, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert llm.engine.counters["preemptions"] > 0
    assert llm.engine.pool.num_used == 0


def llm_window_bytes(model):
    c = model.cfg
    return c.n_layers * c.sliding_window * (c.head_dim + c.head_dim // 32)


def test_prefix_hit_encodes_only_the_suffix(tiny):
    llm = LLM(tiny, prefill_mode="exact", block_tokens=8, replay_mode="exact")
    shared = prompts(1, lo=40, hi=41, seed=3)[0]
    a = shared + [7, 8, 9]
    b = shared + [10, 11, 12, 13, 14]
    sp = SamplingParams(max_tokens=6, temperature=0)
    llm.generate([a], sp)
    before = dict(llm.engine.counters)
    out = llm.generate([b], sp)[0]
    encoded = llm.engine.counters["encoder_tokens"] - before["encoder_tokens"]
    assert out.num_cached_tokens == 40                      # 5 full blocks of 8
    assert encoded == len(b) - 40                            # only the uncached suffix
    assert llm.stats()["prefix_hits"] >= 1
    assert out.token_ids == greedy_reference(tiny, b, 6)     # exact replay: output unchanged


def test_blocks_return_to_zero_after_finish_and_abort(tiny):
    llm = LLM(tiny, block_tokens=8, prefill_chunk=8)
    eng = llm.engine
    reqs = [eng.add_request(p, SamplingParams(max_tokens=30, temperature=0)) for p in prompts(5, seed=4)]
    for _ in range(6):
        eng.step()
    assert eng.pool.num_used > 0
    eng.abort(reqs[0].request_id)
    eng.abort(reqs[3].request_id)
    while eng.has_work:
        eng.step()
    assert all(r.finished for r in reqs) and reqs[0].finish_reason == "abort"
    cached_free = eng.pool.num_free
    assert eng.pool.num_used == 0 and cached_free == eng.pool.num_blocks
    assert all(v == 0 for v in eng.pool.ref)


def test_measured_bytes_per_token_equal_plan():
    torch.manual_seed(0)
    model = CEDModel(ModelConfig.preset("small")).eval()
    llm = LLM(model, block_tokens=64)
    eng = llm.engine
    req = eng.add_request(list(range(3, 131)), SamplingParams(max_tokens=2, temperature=0))
    eng.step()
    st = eng.runs[req.request_id].state
    rows = sum(r.nbytes for r in list(st.kv.values()) + list(st.index.values()))
    expected = plan(model.cfg)["kv_bytes_per_token"]
    assert rows == 128 * expected                            # bytes held by the rows
    assert eng.pool.bytes_per_block == 64 * expected          # bytes allocated per block
    assert llm.stats()["kv_bytes_per_token"] == expected


def test_sampling_seed_stop_and_logprobs(tiny):
    # exact replay: the second copy hits the first's prefix blocks and must see the same logits
    llm = LLM(tiny, block_tokens=8, replay_mode="exact", prefill_mode="exact")
    p = prompts(1, seed=5)[0]
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=123, logprobs=2)
    a, b = llm.generate([p, p], [sp, sp])
    assert a.token_ids == b.token_ids and len(a.logprobs) == 8 and len(a.top_logprobs) == 8
    # a's first logits are this very prefill (exact mode, one chunk: the same sums on any CPU); only
    # log_softmax vs logit - logsumexp rounding differs: < 2 * 512 * 2^-24 (sums of 512 exp terms)
    logits = tiny.prefill(p, tiny.new_state(), "exact", chunk_size=llm.engine.cfg.prefill_chunk)[-1]
    lp = torch.log_softmax(logits, -1)[a.token_ids[0]].item()
    assert a.logprobs[0] == pytest.approx(lp, abs=1e-4)
    first = greedy_reference(tiny, p, 3)
    out = llm.generate(p, SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[first[2]]))[0]
    assert out.finish_reason == "stop" and out.token_ids == first


def test_bad_requests_are_rejected_cleanly(tiny):
    llm = LLM(tiny, block_tokens=8, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([1] * 70, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([1, 2, 99999], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert llm.engine.pool.num_used == 0 and not llm.engine.has_work


def test_failure_mid_prefill_frees_blocks_and_publishes_nothing(tiny, monkeypatch):
    llm = LLM(tiny, block_tokens=8, prefill_chunk=16, prefill_mode="exact", replay_mode="exact")
    calls = {"n": 0}
    real = tiny.encoder_pass

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real(*a, **k)

    monkeypatch.setattr(tiny, "encoder_pass", flaky)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate([list(range(3, 50))], SamplingParams(max_tokens=2))
    pool = llm.engine.pool
    assert pool.num_used == 0 and all(r == 0 for r in pool.ref)
    assert len(pool.cached) == 2                 # only the first chunk's 2 complete blocks
    monkeypatch.setattr(tiny, "encoder_pass", real)
    ok = llm.generate([list(range(3, 50))], SamplingParams(max_tokens=3, temperature=0))[0]
    assert ok.num_cached_tokens == 16            # the published blocks are reused, and correct
    assert ok.token_ids == greedy_reference(tiny, list(range(3, 50)), 3)


def test_one_failing_request_does_not_fail_its_batch(tiny, monkeypatch):
    """A sampling failure that belongs to one request ends that request alone ("error", its KV
    freed); a bystander decoded in the same batch finishes normally with the greedy tokens."""
    from cedlm.engine.sampler import Sampler
    llm = LLM(tiny, block_tokens=8)
    real = Sampler.sample

    def picky(self, logits, params, gens):
        if any(p.seed == 666 for p in params):
            raise OverflowError("bad row")
        return real(self, logits, params, gens)

    monkeypatch.setattr(Sampler, "sample", picky)
    eng = llm.engine
    good = eng.add_request(list(range(3, 20)), SamplingParams(max_tokens=4, temperature=0))
    bad = eng.add_request(list(range(5, 22)), SamplingParams(max_tokens=4, seed=666))
    while eng.has_work:
        eng.step()
    assert bad.finish_reason == "error" and "bad row" in bad.error and not bad.output_ids
    assert good.finish_reason == "length" and good.output_ids == greedy_reference(tiny, list(range(3, 20)), 4)
    assert eng.pool.num_used == 0 and eng.counters["requests_failed"] == 1


def test_prefix_hit_with_exact_replay_reproduces_the_cold_run(tiny):
    """Prompt B shares a prefix with an earlier prompt A: the hit (global rows from the cache,
    windows replayed exactly, the rest prefilled) gives B's cold-run tokens."""
    sp = SamplingParams(max_tokens=4, temperature=0)

    def mk():
        return LLM(tiny, block_tokens=8, max_num_seqs=4, prefill_mode="exact", replay_mode="exact")
    for shared, own in ((32, 17), (48, 9), (16, 9)):
        base = [3 + (i * 37) % 500 for i in range(shared)]
        a = base + [5 + (k * 13) % 500 for k in range(own)]
        b = base + [7 + (k * 29) % 500 for k in range(own)]
        cold = mk().generate([b], sp)[0].token_ids
        llm = mk()
        llm.generate([a], sp)
        hit = llm.generate([b], sp)[0]
        assert hit.num_cached_tokens == shared and hit.token_ids == cold


# ============================================================================ StepOutput
def test_step_outputs_say_what_each_step_did(tiny):
    """Engine.step() returns one StepOutput per request it touched: plain Python values, the
    scored prompt once, the finish on the last one, timings in order; nothing is left behind."""
    eng = LLM(tiny, block_tokens=8, prefill_chunk=8).engine
    p = prompts(1, lo=20, hi=21, seed=3)[0]
    req = eng.add_request(p, SamplingParams(max_tokens=5, temperature=0, logprobs=2, prompt_logprobs=1))
    outs = []
    while eng.has_work:
        outs += [o for o in eng.step() if o.request_id == req.request_id]
    assert [len(o.new_token_ids) for o in outs] == [0, 0, 1, 1, 1, 1, 1]   # 3 chunks of <= 8, then 5 tokens
    ids = [t for o in outs for t in o.new_token_ids]
    assert ids == req.output_ids == greedy_reference(tiny, p, 5)
    assert all(type(t) is int for t in ids) and all(type(x) is float for o in outs for x in o.new_logprobs)
    assert sum(x for o in outs for x in o.new_logprobs) == pytest.approx(req.cumulative_logprob)
    tops = [tp for o in outs for tp in o.new_top_logprobs]
    assert len(tops) == 5 and all(len(i) == len(v) == 2 and type(i[0]) is int and type(v[0]) is float
                                  for i, v in tops)
    scored = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(scored) == 1 and len(scored[0]) == len(p) and scored[0][0] is None
    assert [o.finished for o in outs] == [False] * 6 + [True] and outs[-1].finish_reason == "length"
    last = outs[-1]
    assert (last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens) == (len(p), 5, 0)
    t = last.times
    assert t.arrival <= t.first_scheduled <= t.first_token <= t.finished
    assert t.queue_s >= 0 and t.ttft_s >= t.prefill_s >= 0 and t.e2e_s >= t.decode_s >= 0
    assert t.time_per_output_token(5) == pytest.approx(t.decode_s / 4)
    assert not eng.requests and not eng.runs and not eng.kv.tables and eng.pool.num_used == 0


def test_step_outputs_of_samples_and_failures(tiny, monkeypatch):
    """n samples: the forked ones get their own outputs from the step the prompt is done; a
    request failed by its batch gets finish_reason "error" with the error in its last output."""
    from cedlm.engine.sampler import Sampler
    eng = LLM(tiny, block_tokens=8).engine
    reqs = eng.add_samples(prompts(1, seed=5)[0], SamplingParams(n=3, max_tokens=3, seed=1), "g")
    got: dict[str, list] = {}
    while eng.has_work:
        for o in eng.step():
            got.setdefault(o.request_id, []).append(o)
    for r in reqs:
        assert [t for o in got[r.request_id] for t in o.new_token_ids] == r.output_ids
        assert got[r.request_id][-1].group_id == "g" and got[r.request_id][-1].finished
    real = Sampler.sample

    def broken(self, logits, params, gens, **kw):
        raise OverflowError("bad row")
    monkeypatch.setattr(Sampler, "sample", broken)
    bad = eng.add_request(prompts(1, seed=6)[0], SamplingParams(max_tokens=3))
    last = None
    while eng.has_work:
        last = next((o for o in eng.step() if o.request_id == bad.request_id), last)
    monkeypatch.setattr(Sampler, "sample", real)
    assert last.failed and "bad row" in last.error and last.new_token_ids == ()
    assert eng.pool.num_used == 0 and not eng.runs


class _WaitProbe:
    """A logits processor whose work is always there: records the wait the engine allows it."""

    def __init__(self):
        self.waits = []

    def prepare(self, output_ids):
        pass

    def wait(self, output_ids, timeout):
        self.waits.append(timeout)
        return True

    def __call__(self, output_ids, logits):
        return logits


@pytest.mark.parametrize("others", [0, 1])
def test_a_prefill_s_first_constrained_token_waits_only_when_nothing_else_decodes(tiny, others):
    """The first token's processor work was started long before: beside one other decoding
    sequence it is not waited for (a late one is held back), alone the engine waits up to
    MASK_WAIT_S (nothing else would run meanwhile)."""
    from cedlm.engine.engine import MASK_WAIT_S
    eng = LLM(tiny, block_tokens=8, enable_prefix_cache=False).engine
    for _ in range(others):
        eng.add_request(list(range(5, 12)), SamplingParams(max_tokens=30, temperature=0))
    while others and eng.scheduler.num_running < others:
        eng.step()
    probe = _WaitProbe()
    req = eng.add_request(list(range(7, 20)), SamplingParams(max_tokens=2, temperature=0,
                                                             logits_processors=[probe]))
    while not req.output_ids:
        eng.step()
    assert probe.waits[0] == 0.0 if others else 0.0 < probe.waits[0] <= MASK_WAIT_S
