"""The constraint compile queue (cedlm/server/compile_queue.py): cache, bounds, fairness,
cancellation, on a fake compiler (no processes)."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from cedlm.server.compile_queue import ClientGone, CompileBusy, CompileQueue
from cedlm.server.grammar_compile import GrammarError

pytestmark = pytest.mark.foreground    # times wall-clock latencies: see tests/ahead.py


class FakeCompiler:
    """Compiles `value` to "g:<value>" after the gate opens; "bad" is rejected, "slow" times out."""

    def __init__(self):
        self.calls: list[str] = []
        self.gate = threading.Event()

    def __call__(self, param, kind, value):
        self.calls.append(value)
        self.gate.wait(10)
        if value == "bad":
            raise GrammarError(param, "invalid regex: nope")
        if value == "slow":
            e = GrammarError(param, "compiling the constraint took longer than the limit of 10 s")
            e.transient = True
            raise e
        return f"g:{value}"


def run(coro):
    return asyncio.run(coro)


def test_a_repeated_constraint_is_compiled_once_and_rejections_are_cached_too():
    fake = FakeCompiler()
    fake.gate.set()
    q = CompileQueue(fake, workers=2)

    async def go():
        a = await q.compile("guided_regex", "regex", "ab", "c1")
        b = await q.compile("response_format", "regex", "ab", "c2")
        with pytest.raises(GrammarError, match="^guided_regex: invalid regex"):
            await q.compile("guided_regex", "regex", "bad", "c1")
        with pytest.raises(GrammarError, match="^structured_outputs: invalid regex"):
            await q.compile("structured_outputs", "regex", "bad", "c1")
        for _ in range(2):                         # a time-out is not a verdict: compiled again
            with pytest.raises(GrammarError, match="took longer"):
                await q.compile("guided_regex", "regex", "slow", "c1")
        return a, b
    assert run(go()) == ("g:ab", "g:ab")
    assert fake.calls == ["ab", "bad", "slow", "slow"]
    assert q.counters["cache_hits"] == 2 and q.pending == 0 and not q.per_client


def test_identical_constraints_in_flight_compile_once():
    fake = FakeCompiler()
    q = CompileQueue(fake, workers=2)

    async def go():
        tasks = [asyncio.ensure_future(q.compile("guided_regex", "regex", "x+", f"c{i}")) for i in range(5)]
        await asyncio.sleep(0.1)
        fake.gate.set()
        return await asyncio.gather(*tasks)
    assert run(go()) == ["g:x+"] * 5 and fake.calls == ["x+"] and q.counters["shared"] == 4


def test_bounds_per_client_and_in_all_answer_busy_with_retry_after():
    fake = FakeCompiler()
    q = CompileQueue(fake, workers=1, max_pending=5, max_per_client=2)

    async def go():
        mine = [asyncio.ensure_future(q.compile("p", "regex", f"a{i}", "greedy")) for i in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(CompileBusy, match="2 constraints of this client") as e:
            await q.compile("p", "regex", "a9", "greedy")
        assert e.value.retry_after >= 1
        others = [asyncio.ensure_future(q.compile("p", "regex", f"b{i}", f"o{i}")) for i in range(3)]
        await asyncio.sleep(0.05)
        with pytest.raises(CompileBusy, match="compiling 5 constraints"):
            await q.compile("p", "regex", "c", "another")
        fake.gate.set()
        return await asyncio.gather(*mine, *others)
    assert len(run(go())) == 5 and q.counters["busy"] == 2 and q.pending == 0


def test_clients_take_turns():
    """One client queues 4 compilations, then two others one each: a compiler frees up and takes
    the next client's job, not the greedy client's next one."""
    fake = FakeCompiler()
    q = CompileQueue(fake, workers=1)

    async def go():
        greedy = [asyncio.ensure_future(q.compile("p", "regex", f"g{i}", "greedy")) for i in range(4)]
        await asyncio.sleep(0.05)
        other = [asyncio.ensure_future(q.compile("p", "regex", f"o{i}", f"other{i}")) for i in range(2)]
        await asyncio.sleep(0.05)
        fake.gate.set()
        await asyncio.gather(*greedy, *other)
    run(go())
    assert fake.calls[:4] == ["g0", "g1", "o0", "o1"], fake.calls


async def _occupy(q):
    """The one compiler busy with client a's constraint "first" (held until the fake's gate
    opens): later requests wait in the queue. -> its future."""
    busy = asyncio.ensure_future(q.compile("p", "regex", "first", "a"))
    await asyncio.sleep(0.05)
    return busy


def test_a_request_that_goes_away_leaves_the_queue():
    fake = FakeCompiler()
    q = CompileQueue(fake, workers=1)

    async def go():
        busy = await _occupy(q)
        gone = asyncio.Event()
        waiting = asyncio.ensure_future(q.compile("p", "regex", "abandoned", "b", gone.wait))
        await asyncio.sleep(0.05)
        assert q.pending == 2
        gone.set()
        with pytest.raises(ClientGone):
            await waiting
        assert q.pending == 1 and q.counters["cancelled"] == 1
        cancelled = asyncio.ensure_future(q.compile("p", "regex", "cancelled", "c"))
        await asyncio.sleep(0.05)
        cancelled.cancel()                           # the handler's task is cancelled
        await asyncio.sleep(0.05)
        fake.gate.set()
        assert await busy == "g:first"
    run(go())
    time.sleep(0.1)
    assert fake.calls == ["first"] and q.pending == 0 and q.counters["cancelled"] == 2


def test_one_client_leaves_a_compiler_to_the_others():
    """With 2 compilers a client runs one compilation at a time: another client's constraint
    compiles at once, while the first client's slow ones still wait."""
    started = {}
    release = threading.Event()

    def compile_fn(param, kind, value):
        started[value] = time.monotonic()
        if value.startswith("slow"):
            release.wait(10)
        return value
    q = CompileQueue(compile_fn, workers=2)

    async def go():
        greedy = [asyncio.ensure_future(q.compile("p", "regex", f"slow{i}", "greedy")) for i in range(3)]
        await asyncio.sleep(0.1)
        assert sorted(started) == ["slow0"]               # one at a time for that client
        t0 = time.monotonic()
        assert await q.compile("p", "regex", "quick", "other") == "quick"
        waited = time.monotonic() - t0
        release.set()
        await asyncio.gather(*greedy)
        return waited
    assert run(go()) < 0.5 and q.pending == 0 and not q.running


def test_one_of_two_identical_requests_going_away_leaves_the_other_its_compilation():
    fake = FakeCompiler()
    q = CompileQueue(fake, workers=1)

    async def go():
        busy = await _occupy(q)
        gone = asyncio.Event()
        leaving = asyncio.ensure_future(q.compile("p", "regex", "same", "b", gone.wait))
        staying = asyncio.ensure_future(q.compile("p", "regex", "same", "c"))
        await asyncio.sleep(0.05)
        gone.set()
        with pytest.raises(ClientGone):
            await leaving
        fake.gate.set()
        return await busy, await staying
    assert run(go()) == ("g:first", "g:same")
    assert fake.calls == ["first", "same"] and q.counters["cancelled"] == 0 and q.pending == 0
