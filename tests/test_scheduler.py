"""The scheduler over integers, with a fake KV cache manager: no model involved."""
import pytest

from cedlm.engine.request import Request, Status
from cedlm.engine.sampling_params import SamplingParams
from cedlm.engine.scheduler import RequestRejected, Scheduler


class FakeAlloc:
    def __init__(self, blocks, bt, hits=None):
        self.nfree, self.bt, self.held, self.hits = blocks, bt, {}, hits or {}

    def get_computed_blocks(self, req, use_prefix_cache=True):
        h = self.hits.get(req.request_id, 0)
        self.held[req.request_id] = h // self.bt
        self.nfree -= h // self.bt
        req.num_cached = req.num_prefix_hit = h

    def allocate_slots(self, req, tokens):
        need = -(-tokens // self.bt) - self.held.get(req.request_id, 0)
        if need > self.nfree:
            return False
        self.nfree -= max(need, 0)
        self.held[req.request_id] = self.held.get(req.request_id, 0) + max(need, 0)
        return True

    def free(self, req):
        self.nfree += self.held.pop(req.request_id, 0)


def mk(rid, n, max_tokens=4):
    return Request(rid, list(range(n)), SamplingParams(max_tokens=max_tokens))


def run_step(s, out):
    """What the engine does with a plan: advance counters."""
    for r in out.decode:
        r.num_cached += 1
        r.output_ids.append(0)
    if out.prefill:
        r = out.prefill
        r.num_cached += out.prefill_tokens
        if r.num_cached == r.num_tokens:
            r.status = Status.RUNNING
            r.output_ids.append(0)
    for r in list(s.active):
        if r.status is Status.RUNNING and len(r.output_ids) >= r.params.max_tokens:
            s.finish(r)


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
    s = Scheduler(a, num_blocks=100, block_tokens=4, max_num_seqs=3, prefill_chunk=64, max_model_len=100)
    reqs = [mk(str(i), 6, max_tokens=5) for i in range(5)]
    for r in reqs:
        s.add(r)
    out = s.schedule(); run_step(s, out)
    out = s.schedule()
    assert [r.request_id for r in out.decode] == ["0"] and out.prefill.request_id == "1"
    run_step(s, out)
    assert max(len(s.active) for _ in [0]) <= 3
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
    assert out.prefill is r and out.prefill_tokens == 3 and r.num_prefix_hit == 8
