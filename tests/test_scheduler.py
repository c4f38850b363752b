"""The scheduler over integers, with a fake KV cache manager: no model involved."""
import pytest

from cedlm.engine.request import Request, Status
from cedlm.engine.sampling_params import SamplingParams
from cedlm.engine.scheduler import RequestRejected, Scheduler, StepResult


class FakeAlloc:
    def __init__(self, blocks, bt, hits=None):
        self.nfree, self.bt, self.held, self.hits = blocks, bt, {}, hits or {}

    def get_computed_blocks(self, req, use_prefix_cache=True):
        h = self.hits.get(req.request_id, 0)
        self.held[req.request_id] = h // self.bt
        self.nfree -= h // self.bt
        return h

    def allocate_slots(self, req, tokens):
        need = -(-tokens // self.bt) - self.held.get(req.request_id, 0)
        if need > self.nfree:
            return False
        self.nfree -= max(need, 0)
        self.held[req.request_id] = self.held.get(req.request_id, 0) + max(need, 0)
        return True

    def trim(self, req, tokens):
        keep = -(-tokens // self.bt)
        extra = self.held.get(req.request_id, 0) - keep
        if extra > 0:
            self.held[req.request_id] = keep
            self.nfree += extra

    def cache_full_blocks(self, req):
        pass

    def free(self, req):
        self.nfree += self.held.pop(req.request_id, 0)


def mk(rid, n, max_tokens=4):
    return Request(rid, list(range(n)), SamplingParams(max_tokens=max_tokens))


def run_step(s, out):
    """What the engine does with a plan: run it, then report what ran in one `StepResult`
    (the scheduler moves the counts)."""
    res = StepResult()
    for r in out.decode:
        res.computed.append((r, 1))
        r.output_ids.append(0)
    for r, n in out.prefills:
        res.computed.append((r, n))
        if r.num_computed_tokens + n == r.num_tokens:
            res.prefilled.append(r)
            r.output_ids.append(0)
    for r in list(s.active):
        if ((r.status is Status.RUNNING or any(r is p for p in res.prefilled))
                and len(r.output_ids) >= r.params.max_tokens):
            res.finish(r)
    s.update_from_output(out, res)


def test_update_from_output_moves_the_counts_of_what_ran():
    """The step's one report: positions computed (lookahead slots past the next position
    released), completed prefills decode next, finished requests freed, samples queued first."""
    kv = FakeAlloc(blocks=20, bt=4)
    s = Scheduler(kv, num_blocks=20, block_tokens=4, max_num_seqs=4, prefill_chunk=8, max_model_len=64)
    a, b, c = mk("a", 6), mk("b", 3), mk("c", 2)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.prefills] == [("b", 3), ("a", 6)]
    res = StepResult(computed=[(b, 3), (a, 6)], prefilled=[b, a])
    b.output_ids.append(0)
    s.update_from_output(out, res)
    assert (a.num_computed_tokens, b.num_computed_tokens) == (6, 3)
    assert a.status is b.status is Status.RUNNING and s.waiting == type(s.waiting)()
    a.output_ids.append(0)
    out = s.schedule()
    assert s.reserve_lookahead(out.decode, 8)                   # drafts of 8 for both
    held = kv.held["a"]
    res = StepResult(computed=[(a, 3), (b, 1)], requeue=[c])
    res.finish(b)
    res.finish(b)                                               # recorded once
    b.finish_reason = "stop"
    s.update_from_output(out, res)
    assert a.num_computed_tokens == 9 and kv.held["a"] == 3 < held    # 10 positions: 3 blocks
    assert b.finished and "b" not in kv.held and b not in s.active
    assert list(s.waiting) == [c] and c.status is Status.WAITING


def test_update_from_output_refuses_a_request_preempted_in_that_step():
    s = Scheduler(FakeAlloc(blocks=2, bt=4), num_blocks=2, block_tokens=4, max_num_seqs=2,
                  prefill_chunk=8, max_model_len=64)
    a, b = mk("a", 4), mk("b", 3)
    for r in (a, b):
        s.add(r)
    run_step(s, s.schedule())
    out = s.schedule()                                          # a needs a block: b preempted
    assert out.preempted == [b]
    with pytest.raises(ValueError, match="b was preempted"):
        s.update_from_output(out, StepResult(computed=[(b, 1)]))


def drain(s, limit=1000):
    steps = 0
    while s.has_work and steps < limit:
        run_step(s, s.schedule())
        steps += 1
    return steps


def test_chunked_prefill_then_decode():
    a = FakeAlloc(100, 4)
    s = Scheduler(a, num_blocks=100, block_tokens=4, max_num_seqs=4, prefill_chunk=5, max_model_len=100)
    r = mk("a", 12)
    s.add(r)
    sizes = []
    for _ in range(3):
        out = s.schedule()
        sizes.append(out.prefill_tokens)
        run_step(s, out)
    assert sizes == [5, 5, 2] and r.status is Status.RUNNING
    drain(s)
    assert r.finished and a.nfree == 100 and not a.held


def test_continuous_batching_admits_while_decoding():
    a = FakeAlloc(100, 4)
    s = Scheduler(a, num_blocks=100, block_tokens=4, max_num_seqs=3, prefill_chunk=8, max_model_len=100,
                  max_batched_tokens=8)
    reqs = [mk(str(i), 6, max_tokens=5) for i in range(5)]
    for r in reqs:
        s.add(r)
    out = s.schedule()                        # three admitted (max_num_seqs); one chunk fits the budget
    assert [r.request_id for r, _ in out.prefills] == ["0"] and len(s.active) == 3
    run_step(s, out)
    out = s.schedule()
    assert [r.request_id for r in out.decode] == ["0"] and [r.request_id for r, _ in out.prefills] == ["1"]
    run_step(s, out)
    assert len(s.active) <= 3
    drain(s)
    assert all(r.finished for r in reqs) and a.nfree == 100


def test_max_num_seqs_limits_admission():
    a = FakeAlloc(100, 4)
    s = Scheduler(a, num_blocks=100, block_tokens=4, max_num_seqs=2, prefill_chunk=64, max_model_len=100)
    for i in range(4):
        s.add(mk(str(i), 3, max_tokens=20))
    for _ in range(6):
        run_step(s, s.schedule())
        assert len(s.active) <= 2


def test_waits_when_memory_is_short_then_runs():
    a = FakeAlloc(4, 4)                                  # 16 tokens of KV in all
    s = Scheduler(a, num_blocks=4, block_tokens=4, max_num_seqs=4, prefill_chunk=64, max_model_len=100)
    r1, r2 = mk("1", 8, max_tokens=4), mk("2", 8, max_tokens=4)
    s.add(r1); s.add(r2)
    drain(s)
    assert r1.finished and r2.finished and a.nfree == 4


def test_preemption_frees_newest_and_resumes():
    a = FakeAlloc(5, 4)
    s = Scheduler(a, num_blocks=5, block_tokens=4, max_num_seqs=4, prefill_chunk=64, max_model_len=100)
    old, new = mk("old", 7, max_tokens=10), mk("new", 7, max_tokens=10)
    s.add(old); s.add(new)
    preempted = []
    steps = 0
    while s.has_work and steps < 200:
        out = s.schedule()
        preempted += [r.request_id for r in out.preempted]
        run_step(s, out)
        steps += 1
    assert "new" in preempted and "old" not in preempted
    assert old.finished and new.finished and new.num_preemptions >= 1 and a.nfree == 5


def test_requests_that_can_never_fit_are_rejected():
    a = FakeAlloc(4, 4)
    s = Scheduler(a, num_blocks=4, block_tokens=4, max_num_seqs=4, prefill_chunk=64, max_model_len=40)
    with pytest.raises(RequestRejected, match="kv_budget"):
        s.add(mk("x", 10, max_tokens=10))                # 20 tokens > 16
    with pytest.raises(RequestRejected, match="max_model_len"):
        s.add(mk("y", 41))
    with pytest.raises(RequestRejected, match="max_tokens"):
        s.add(mk("z", 30, max_tokens=20))
    with pytest.raises(RequestRejected, match="empty"):
        s.add(mk("e", 0))
    assert not s.has_work


def test_abort_releases_blocks():
    a = FakeAlloc(10, 4)
    s = Scheduler(a, num_blocks=10, block_tokens=4, max_num_seqs=4, prefill_chunk=3, max_model_len=100)
    r = mk("a", 10)
    s.add(r)
    run_step(s, s.schedule())
    assert a.nfree < 10
    s.abort(r)
    assert a.nfree == 10 and r.finished and not s.has_work


def test_prefix_hit_skips_cached_tokens():
    a = FakeAlloc(20, 4, hits={"h": 8})
    s = Scheduler(a, num_blocks=20, block_tokens=4, max_num_seqs=4, prefill_chunk=64, max_model_len=100)
    r = mk("h", 11)
    s.add(r)
    out = s.schedule()
    assert out.prefills == [(r, 3)] and r.num_cached_tokens == 8


# ------------------------------------------------------------------ fair scheduling
def check_plan(s, a, out):
    """Every planned position has its block, and the pool is never over-committed."""
    assert a.nfree >= 0
    assert a.nfree + sum(a.held.values()) == s.num_blocks
    for r in out.decode:
        assert a.held[r.request_id] * a.bt >= r.num_computed_tokens + 1
    for r, n in out.prefills:
        assert 0 < n <= s.prefill_chunk and r.status is Status.PREFILLING
        assert a.held[r.request_id] * a.bt >= r.num_computed_tokens + n
    ids = [r.request_id for r, _ in out.prefills] + [r.request_id for r in out.decode]
    assert len(ids) == len(set(ids))                      # nothing planned twice
    if len(out.prefills) > 1:                             # beyond the one guaranteed chunk: in budget
        assert out.num_batched_tokens <= s.max_batched_tokens


def test_short_request_behind_a_long_prefill_is_admitted_and_prefilled_at_once():
    a = FakeAlloc(2000, 16)
    s = Scheduler(a, num_blocks=2000, block_tokens=16, max_num_seqs=8, prefill_chunk=512,
                  max_model_len=20000)
    long = mk("long", 16384, max_tokens=4)                # the finding: a 16k-token prompt
    s.add(long)
    for _ in range(3):                                    # its prefill is under way
        out = s.schedule(); check_plan(s, a, out); run_step(s, out)
    assert long.status is Status.PREFILLING and 0 < long.num_computed_tokens < 16384
    short = mk("short", 20, max_tokens=4)
    s.add(short)
    out = s.schedule()
    check_plan(s, a, out)
    assert short.status is Status.PREFILLING              # admitted while the long prefill runs
    assert (short, 20) in out.prefills                    # and prefilled in the same step
    run_step(s, out)
    assert short.status is Status.RUNNING
    steps = 1
    while not short.finished:
        out = s.schedule(); check_plan(s, a, out); run_step(s, out)
        steps += 1
    assert steps <= short.params.max_tokens               # one decode per step, never held up
    assert not long.finished and long.num_computed_tokens > 3 * 512   # the long one kept going meanwhile
    drain(s)
    assert long.finished and a.nfree == 2000 and not a.held


def test_long_prefill_progresses_under_a_stream_of_short_prompts():
    """Shortest-remaining-first, bounded: a request passed over max_prefill_wait steps in a row goes
    first, so the long prompt gets a chunk at least every max_prefill_wait + 1 steps, and every
    short one is prefilled within a bounded number of steps of its arrival (the token budget
    alone: no bound on the chunks beside decoding, which a new prompt every step would outrun)."""
    a = FakeAlloc(10_000, 16)
    W = 2
    s = Scheduler(a, num_blocks=10_000, block_tokens=16, max_num_seqs=64, prefill_chunk=256,
                  max_model_len=10_000, max_batched_tokens=256, max_prefill_wait=W,
                  max_prefills_while_decoding=None)
    long = mk("long", 4096, max_tokens=2)
    s.add(long)
    shorts, arrived, prefilled = [], {}, {}
    last_long, gaps = 0, []
    step = 0
    while s.has_work and step < 500:
        step += 1
        if step <= 100:                                   # a new short prompt every step
            r = mk(f"s{step}", 40, max_tokens=3)
            s.add(r); shorts.append(r); arrived[r.request_id] = step
        out = s.schedule()
        check_plan(s, a, out)
        for r, _ in out.prefills:
            if r is long:
                gaps.append(step - last_long); last_long = step
        run_step(s, out)
        for r in shorts:
            if r.request_id not in prefilled and r.status is not Status.WAITING and r.output_ids:
                prefilled[r.request_id] = step
    assert long.finished and all(r.finished for r in shorts)
    assert max(gaps) <= W + 1                             # the long one never starves
    waits = [prefilled[rid] - arrived[rid] for rid in arrived]
    assert max(waits) <= W + 1                            # nor does any short one
    assert a.nfree == 10_000 and not a.held


def test_several_long_prefills_under_tight_memory_never_deadlock():
    """Prefills in flight at once: the whole sequence is reserved at admission, so no prefill can
    hold half its blocks while waiting on another's; decodes still preempt the newest."""
    import random
    rng = random.Random(0)
    for trial in range(30):
        nb = rng.randint(12, 40)
        a = FakeAlloc(nb, 4)
        s = Scheduler(a, num_blocks=nb, block_tokens=4, max_num_seqs=rng.randint(1, 6),
                      prefill_chunk=rng.randint(1, 16), max_model_len=nb * 4,
                      max_batched_tokens=rng.choice([None, 1, 8, 40]), max_prefill_wait=rng.randint(0, 3),
                      max_prefills_while_decoding=rng.choice([None, 1, 2]))
        reqs = []
        for i in range(rng.randint(2, 12)):
            r = mk(f"{trial}-{i}", rng.randint(1, nb * 2), max_tokens=rng.randint(1, nb))
            try:
                s.add(r)
                reqs.append(r)
            except RequestRejected:
                pass
        steps = 0
        while s.has_work:
            out = s.schedule()
            check_plan(s, a, out)
            assert not out.empty or not s.active, "no progress with requests admitted"
            run_step(s, out)
            steps += 1
            assert steps < 5000, "livelock"
        assert all(r.finished for r in reqs)
        assert a.nfree == nb and not a.held


def test_decodes_come_first_and_the_budget_is_shared():
    a = FakeAlloc(1000, 4)
    s = Scheduler(a, num_blocks=1000, block_tokens=4, max_num_seqs=16, prefill_chunk=8,
                  max_model_len=1000, max_batched_tokens=12)
    running = [mk(f"r{i}", 4, max_tokens=50) for i in range(6)]
    for r in running:
        s.add(r)
    out = s.schedule(); run_step(s, out)                  # 6 x 4 tokens, 3 chunks a step (budget 12)
    while any(r.status is Status.PREFILLING for r in running):
        out = s.schedule(); check_plan(s, a, out); run_step(s, out)
    big, small = mk("big", 64, max_tokens=2), mk("small", 3, max_tokens=2)
    s.add(big); s.add(small)
    out = s.schedule()
    check_plan(s, a, out)
    assert len(out.decode) == 6                           # every running sequence decodes
    # 12 - 6 = 6 tokens left: the 3-token chunk fits, the 8-token one waits for its turn
    assert out.prefills == [(small, 3)]
    run_step(s, out)
    out = s.schedule()
    check_plan(s, a, out)
    assert [r for r, _ in out.prefills] == [big]          # the one guaranteed chunk
    drain(s)
    assert a.nfree == 1000


def _decoding_bystander(s, max_tokens=400):
    """A sequence that decodes for the whole test (the stream a burst of prefills would hold up)."""
    by = mk("bystander", 4, max_tokens=max_tokens)
    s.add(by)
    while by.status is not Status.RUNNING:
        run_step(s, s.schedule())
    return by


@pytest.mark.parametrize("bound", [1, 2])
def test_prefills_beside_decoding_are_bounded_and_an_idle_engine_prefills_a_burst_at_once(bound):
    """Six prompts arriving at once beside a decoding stream: at most `max_prefills_while_decoding`
    chunks a step (each a prefill call of its own that the stream waits for), in arrival order;
    the same burst on an idle engine is prefilled in one step."""
    a = FakeAlloc(1000, 4)
    s = Scheduler(a, num_blocks=1000, block_tokens=4, max_num_seqs=16, prefill_chunk=64,
                  max_model_len=1000, max_prefills_while_decoding=bound)
    by = _decoding_bystander(s)
    burst = [mk(f"b{i}", 5, max_tokens=40) for i in range(6)]
    for r in burst:
        s.add(r)
    order, steps = [], 0
    while any(r.status is not Status.RUNNING for r in burst):
        out = s.schedule()
        check_plan(s, a, out)
        assert by in out.decode and 1 <= len(out.prefills) <= bound
        order += [r.request_id for r, _ in out.prefills]
        run_step(s, out)
        steps += 1
    assert order == [f"b{i}" for i in range(6)] and steps == -(-6 // bound)

    idle = Scheduler(FakeAlloc(1000, 4), num_blocks=1000, block_tokens=4, max_num_seqs=16,
                     prefill_chunk=64, max_model_len=1000, max_prefills_while_decoding=bound)
    burst = [mk(f"i{i}", 5, max_tokens=4) for i in range(6)]
    for r in burst:
        idle.add(r)
    out = idle.schedule()
    assert not out.decode and [r for r, _ in out.prefills] == burst     # nothing decodes: all at once
    run_step(idle, out)
    out = idle.schedule()                          # ... and from then on they decode together
    assert out.decode == burst and not out.prefills
    with pytest.raises(ValueError, match="max_prefills_while_decoding"):
        Scheduler(a, num_blocks=1, block_tokens=4, max_num_seqs=2, prefill_chunk=4, max_model_len=8,
                  max_prefills_while_decoding=0)


def _turns_under_the_bound(W: int, every: int, until: int = 90):
    """One chunk a step beside a decoding stream: a 4,096-token prompt (16 chunks) and a 40-token
    prompt every `every` steps up to step `until`; (the long prompt's longest run of steps passed
    over, the longest run of any, whether every run stayed within W + k - 1 (k: the most
    sequences prefilling during that run), steps until all finished)."""
    a = FakeAlloc(10_000, 16)
    s = Scheduler(a, num_blocks=10_000, block_tokens=16, max_num_seqs=256, prefill_chunk=256,
                  max_model_len=10_000, max_prefill_wait=W, max_prefills_while_decoding=1)
    by = _decoding_bystander(s, max_tokens=5000)
    long = mk("long", 4096, max_tokens=2)
    s.add(long)
    streak: dict[str, int] = {}
    worst: dict[str, int] = {}
    most: dict[str, int] = {}                     # the most sequences prefilling during its run
    within, shorts, step = True, [], 0
    while not long.finished or any(not r.finished for r in shorts) or step < until:
        step += 1
        if step <= until and step % every == 0:
            r = mk(f"s{step}", 40, max_tokens=3)
            s.add(r); shorts.append(r)
        out = s.schedule()
        check_plan(s, a, out)
        pre = [r for r in s.active if r.status is Status.PREFILLING]
        assert by in out.decode and len(out.prefills) == min(1, len(pre))
        served = out.prefills[0][0] if out.prefills else None
        for r in pre:
            rid = r.request_id
            streak[rid] = 0 if r is served else streak.get(rid, 0) + 1
            most[rid] = len(pre) if r is served else max(most.get(rid, 0), len(pre))
            worst[rid] = max(worst.get(rid, 0), streak[rid])
            within &= streak[rid] <= W + most[rid] - 1
        run_step(s, out)
        assert step < 5000, "no progress"
    assert long.finished and all(r.finished for r in shorts) and a.nfree + a.held["bystander"] == 10_000
    return worst["long"], max(worst.values()), within, step


def test_under_the_bound_prefills_take_turns_and_none_starves():
    """Under `max_prefills_while_decoding` = 1 the sequences prefilling take turns: shortest
    first, and one passed over `max_prefill_wait` steps goes first (the longest-waiting first),
    so none is passed over more than max_prefill_wait + k - 1 steps in a row (k: the sequences
    prefilling) and all finish. With a short prompt every third step the long prompt is never
    passed over more than max_prefill_wait steps; with one every step (more than one chunk a
    step can serve) it still gets its turns, where shortest-first alone would leave it waiting
    until the short prompts stop."""
    long_worst, any_worst, within, _ = _turns_under_the_bound(W=2, every=3)
    assert within and long_worst <= 2 and any_worst <= 2
    long_worst, any_worst, within, _ = _turns_under_the_bound(W=2, every=1)   # 90 short prompts
    assert within and long_worst <= 15 and any_worst <= 15
    starved, _, _, _ = _turns_under_the_bound(W=10_000, every=1)     # no anti-starvation rule
    assert starved >= 90                                  # the long one waits for all 90


def test_preempted_prefill_is_readmitted_and_finishes():
    a = FakeAlloc(6, 4)
    s = Scheduler(a, num_blocks=6, block_tokens=4, max_num_seqs=4, prefill_chunk=2, max_model_len=100)
    old, new = mk("old", 4, max_tokens=12), mk("new", 13, max_tokens=2)
    s.add(old)
    while old.status is not Status.RUNNING:
        run_step(s, s.schedule())
    s.add(new)                                            # 4 blocks reserved at admission
    pre = []
    for _ in range(200):
        if not s.has_work:
            break
        out = s.schedule(); check_plan(s, a, out)
        pre += out.preempted
        run_step(s, out)
    assert old.finished and new.finished and new in pre and a.nfree == 6


def test_lookahead_is_reserved_through_the_scheduler_and_released():
    """Speculative drafts: slots for the lookahead are taken for all sequences or none,
    `advance` gives back the ones not kept, preemption gives back everything."""
    a = FakeAlloc(12, 4)
    s = Scheduler(a, num_blocks=12, block_tokens=4, max_num_seqs=4, prefill_chunk=64, max_model_len=100)
    x, y = mk("x", 6, max_tokens=40), mk("y", 6, max_tokens=40)
    s.add(x), s.add(y)
    run_step(s, s.schedule())                       # both prefilled: 7 tokens each, 2 blocks each
    out = s.schedule()
    assert out.decode == [x, y] and a.held == {"x": 2, "y": 2}
    assert s.reserve_lookahead([x, y], 6)           # positions 0..12: 4 blocks each
    assert a.held == {"x": 4, "y": 4} and a.nfree == 4
    assert not s.reserve_lookahead([x, y], 20)      # 7 blocks each do not fit: none kept
    assert a.held == {"x": 2, "y": 2} and a.nfree == 8
    assert s.reserve_lookahead([x, y], 6)
    s.advance(x, 3)                                  # 2 drafts accepted + the target's token
    s.advance(y, 1)                                  # none accepted
    assert (x.num_computed_tokens, y.num_computed_tokens) == (9, 7)
    assert a.held == {"x": 3, "y": 2} and a.nfree == 7    # slots past the next position released
    assert s.reserve_lookahead([x, y], 6) and a.held["y"] == 4
    s._preempt(y, out)                                # noqa: SLF001 - preemption, as schedule() does it
    assert "y" not in a.held and y.num_computed_tokens == 0 and y.status is Status.WAITING


def test_one_owner_runs_at_most_its_share_and_a_bystander_is_admitted_at_once():
    """Fair share: the 16 prompts of one request (one owner) run at most
    `max_seqs_per_owner` (half of 8 slots) at a time; a small request arriving behind all of
    them is admitted at the next step, and the big request's prompts still all finish."""
    a = FakeAlloc(1000, 4)
    s = Scheduler(a, num_blocks=1000, block_tokens=4, max_num_seqs=8, prefill_chunk=64, max_model_len=100)
    assert s.max_seqs_per_owner == 4
    big = [mk(f"big-p{i}", 6, max_tokens=30) for i in range(16)]
    for r in big:
        r.owner = "big"
        s.add(r)
    run_step(s, s.schedule())
    assert [r.request_id for r in s.active] == [f"big-p{i}" for i in range(4)]
    by = mk("bystander", 4, max_tokens=4)
    s.add(by)
    out = s.schedule()
    assert by in out.admitted and by.first_scheduled_time is not None
    run_step(s, out)
    most = 0
    while s.has_work:
        run_step(s, s.schedule())
        most = max(most, sum(r.owner == "big" for r in s.active))
    assert most == 4 and by.finished and all(r.finished for r in big) and a.nfree == 1000


def test_forks_respect_the_owner_share():
    """A sample forked from its prompt's prefill counts against its owner's share: no fork while
    the owner holds it; without an owner nothing is capped."""
    a = FakeAlloc(100, 4)
    a.fork = lambda src, dst, n: True
    s = Scheduler(a, num_blocks=100, block_tokens=4, max_num_seqs=4, prefill_chunk=64, max_model_len=100,
                  max_seqs_per_owner=1)
    src, dst = mk("g-0", 4), mk("g-1", 4)
    src.owner = dst.owner = "g"
    s.add(src)
    run_step(s, s.schedule())
    assert not s.fork(src, dst, 4) and len(s.active) == 1
    dst.owner = None
    assert s.fork(src, dst, 4) and len(s.active) == 2
    with pytest.raises(ValueError, match="max_seqs_per_owner"):
        Scheduler(a, num_blocks=1, block_tokens=4, max_num_seqs=2, prefill_chunk=4, max_model_len=8,
                  max_seqs_per_owner=0)
