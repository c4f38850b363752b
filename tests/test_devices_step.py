"""The static decode step off the CPU, checked on the CPU (tests/devices.py), and the CUDA-graph
path's host logic (cedlm/model/step_graph.py: bucketing, padding, static buffers) pinned here.

- under `implicit_device_guard()` (a tensor made without a device lands on meta) the step and its
  host side (`CompiledDecode`: inputs, pools, write-back) give bit-identical results to the
  unguarded run: nothing is made on an implicit device;
- `decode_step` and `CompiledDecode`'s whole call run on a fake CUDA copy of the model (fake
  tensors: no data; a CPU tensor meeting a CUDA one raises);
- the graphs' buffers (batch padded to a power of two with dummy rows, the table widened, copied
  pools in buckets) give the same step as the unpadded call, across calls that shrink and grow
  the batch inside one bucket (no earlier row lingers), and past `max_graphs` the least
  recently used graph goes; the CUDA capture itself runs on a GPU (tests/test_compiled_step.py's
  device-parametrised tests).
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from cedlm.cache.block_pool import BlockPool, BlockTable
from cedlm.checkpoint import load_model
from cedlm.model.model import decode_step, prepare_static
from cedlm.model.static_kv import StepShapes
from cedlm.model.compiled_step import CompiledDecode, default_mode
from cedlm.model.step_graph import StepGraphs, bucket
from tests.devices import fake_cuda, implicit_device_guard

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              # the host side compares pools' addresses; fake tensors have none to give
              pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")]


@pytest.fixture(scope="module")
def shipped():
    return load_model("cedlm/assets/model")[0].eval()


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 4000, (L,), generator=g) for L in lengths]


def _states(model, lengths, paged: bool, seed=0):
    """Prefilled states (paged: in one block pool) and the next token of each."""
    pool = BlockPool(model.kv_layout, 64, 64) if paged else None
    states, toks = [], []
    for p in _prompts(lengths, seed):
        st = model.new_state(pool.rows(BlockTable(pool)) if paged else None)
        toks.append(int(model.prefill(p, st)[-1].argmax()))
        states.append(st)
    return states, toks


def test_bucket():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 63, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 64, 128]


def test_cudagraph_is_the_default_on_cuda(monkeypatch):
    from cedlm.kernels.gate import reference_kernels_forced
    monkeypatch.delenv("CEDLM_DECODE_STEP", raising=False)
    with reference_kernels_forced(False):
        assert default_mode("cuda") == "cudagraph" and default_mode("cpu") == "compiled"
        monkeypatch.setenv("CEDLM_DECODE_STEP", "static")
        assert default_mode("cuda") == "static"


# ---------------------------------------------------------------- implicit devices
@torch.no_grad()
@pytest.mark.parametrize("mode", ["static", "cudagraph"])
@pytest.mark.parametrize("paged", [False, True])
def test_step_under_implicit_device_guard_is_bit_identical(shipped, mode, paged):
    """Batch 1 and batch 3, contiguous and paged rows: steps under the guard equal unguarded
    steps bit for bit (logits and every byte written back)."""
    step = CompiledDecode(shipped, mode)
    for lengths in ([61], [5, 40, 130]):
        ref, toks = _states(shipped, lengths, paged)
        got = copy.deepcopy(ref)
        for _ in range(4):
            a = step(toks, ref)
            with implicit_device_guard():
                b = step(toks, got)
            assert torch.equal(a, b)
            toks = a.argmax(-1).tolist()
        for x, y in zip(ref, got):
            assert torch.equal(x.window_all, y.window_all) and x.token_ids == y.token_ids
            for s in x.kv:
                assert torch.equal(x.kv[s].view(), y.kv[s].view())
            for s in x.pending:
                assert torch.equal(x.pending[s][0], y.pending[s][0])


# ---------------------------------------------------------------- fake CUDA
@contextlib.contextmanager
def _fake_model():
    """A fresh shipped model (not yet fused: the fused and stacked weights are made from the fake
    parameters) on the fake CUDA device (`FAKE_DEVICE`: meta on the CPU wheel, where views of
    fake cuda tensors fail), inside its mode; yields (model, its device)."""
    fake, mode = fake_cuda(load_model("cedlm/assets/model")[0].eval())
    with mode:
        dev = next(fake.parameters()).device
        assert dev.type != "cpu"
        yield fake, dev


@torch.no_grad()
def test_decode_step_on_fake_cuda(shipped):
    """`decode_step` on a fake CUDA model with fake CUDA inputs of a real batch's shapes (paged
    rows of a block pool, batch 3): every tensor it makes is on CUDA, so are its outputs."""
    states, toks = _states(shipped, [5, 40, 130], paged=True, seed=1)
    host = CompiledDecode(shipped, "static")
    args = host.inputs(torch.tensor(toks), states)
    with _fake_model() as (fake, dev):
        prepare_static(fake)
        shapes = StepShapes(fake)
        fargs = torch.utils._pytree.tree_map(
            lambda x: torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=dev)
            if isinstance(x, torch.Tensor) else x, args)
        logits, out = decode_step(shapes, *fargs)
        leaves = [t for t in torch.utils._pytree.tree_leaves((logits, out)) if isinstance(t, torch.Tensor)]
    assert logits.shape == (3, shipped.cfg.vocab_size)
    assert leaves and all(t.device == dev for t in leaves)


@torch.no_grad()
@pytest.mark.parametrize("graphs", [False, True])
def test_compiled_decode_call_on_fake_cuda(graphs):
    """`CompiledDecode`'s whole call (inputs, pools, the step, the write-back) on a fake CUDA
    model and fake CUDA states, batch 1 (contiguous rows) and batch 2 (paged rows of a block pool
    on CUDA); graphs: through the CUDA-graph path's buffers (the capture itself needs a GPU)."""
    with _fake_model() as (fake, dev):
        step = CompiledDecode(fake, "static")
        assert step.device == dev
        if graphs:
            step.graphs = StepGraphs(decode_step, capture=False)
        pool = BlockPool(fake.kv_layout, 8, 64, device=step.device)
        for states in ([fake.new_state()], [fake.new_state(pool.rows(BlockTable(pool))) for _ in range(2)]):
            logits = step(list(range(3, 3 + len(states))), states)
            logits = step(list(range(3, 3 + len(states))), states)
            assert logits.device == dev and logits.shape[0] == len(states)
            assert all(st.num_tokens == 2 and st.window_all.device == dev for st in states)


# ---------------------------------------------------------------- the graphs' host logic
@torch.no_grad()
@pytest.mark.parametrize("paged", [False, True])
def test_graph_buffers_match_the_unpadded_step(shipped, paged):
    """The CUDA-graph path's buffers on the CPU (no capture): batch sizes 3, 4, 1, 2, 3 (3 -> a
    bucket of 4 with a dummy row; 4 fills it; 3 again must not see the 4th row), the table
    widened to a power of two, contiguous rows copied into bucketed pools (paged: the pool read
    in place). Same decisions and logits as the unpadded step within float rounding (a dummy row
    and wider masks change the matrix products' blocking, not the math), and every state byte
    written back equal."""
    states, toks = _states(shipped, [5, 40, 520, 70], paged, seed=3)
    step = CompiledDecode(shipped, "static")
    graphs = StepGraphs(decode_step, capture=False)
    widened = False
    for B in (3, 4, 1, 2, 3):
        sts = states[:B]
        ids = torch.tensor(toks[:B])
        shapes = step.shape_for(sts, paged=True)
        args, copied = step._inputs(ids, sts)
        assert copied == (not paged and B > 1)
        ref_logits, ref_out = step.fn(shapes, *args)
        ref_states = copy.deepcopy(sts)
        step.write_back(ids, ref_states, ref_out)
        logits, out = graphs(shapes, args, copied)
        g = graphs.graphs[graphs.key(shapes, args, copied)]
        assert g.ids.shape[0] == bucket(B) and g.table.shape[1] == bucket(args[6].shape[1])
        widened |= g.table.shape[1] > args[6].shape[1]
        if copied:
            assert all(buf.shape[:2] == (bucket(B), bucket(p.shape[1]))
                       for buf, p in zip(g.pools.values(), args[5].values()))
        assert logits.shape == ref_logits.shape
        for l, (idx, ok) in ref_out["topk"].items():
            gidx, gok = out["topk"][l]
            for b in range(B):
                assert set(idx[b, 0][ok[b, 0]].tolist()) == set(gidx[b, 0][gok[b, 0]].tolist())
        for l, e in ref_out["experts"].items():
            assert torch.equal(e.sort(-1).values, out["experts"][l].sort(-1).values)
        assert (logits - ref_logits).abs().max().item() < 1e-3
        step.write_back(ids, sts, out)
        for a, b in zip(sts, ref_states):
            assert torch.equal(a.window_pos_all, b.window_pos_all) and a.token_ids == b.token_ids
            assert (a.window_all != b.window_all).float().mean().item() <= 0.005
            for s in a.kv:
                assert a.kv[s].n == b.kv[s].n
        toks[:B] = ref_logits.argmax(-1).tolist()
    assert len(graphs.graphs) >= 3                      # buckets 4, 1, 2 (and table widths)
    assert widened == paged                             # 520 tokens: 9 blocks + spare -> 16 columns


@torch.no_grad()
def test_graphs_are_bounded_least_recently_used_out(shipped):
    """Past `max_graphs` the least recently used bucket goes; a bucket used again is recaptured
    (here: rebuilt) and gives the same step."""
    states, toks = _states(shipped, [5, 40, 70], paged=True, seed=4)
    step = CompiledDecode(shipped, "static")
    graphs = StepGraphs(decode_step, capture=False, max_graphs=2)
    keys, first = [], {}
    for B in (1, 2, 3, 1):
        sts, ids = states[:B], torch.tensor(toks[:B])
        shapes = step.shape_for(sts, paged=True)
        args, copied = step._inputs(ids, sts)
        logits, _ = graphs(shapes, args, copied)
        keys.append(graphs.key(shapes, args, copied))
        assert torch.equal(logits, first.setdefault(B, logits))
        assert list(graphs.graphs) == keys[-2:]


@torch.no_grad()
@pytest.mark.parametrize("mode", ["static", "cudagraph"])
def test_offloaded_engram_table_runs_the_step(shipped, tmp_path, mode):
    """An Engram table offloaded to host memory (the seeds' design beside a model on the GPU)
    no longer sends decoding to the reference: its rows are looked up on the host before the step
    (an input of the step and of the graphs' buffers), and the step gives bit for bit the logits
    of the same step with the table in the model."""
    off = load_model("cedlm/assets/model")[0].eval()
    off.offload_engram(tmp_path)
    step, ref_step = CompiledDecode(off, mode), CompiledDecode(shipped, mode)
    assert step.why_not() is None
    for lengths in ([61], [5, 40]):
        ref, toks = _states(shipped, lengths, paged=False, seed=5)
        got = copy.deepcopy(ref)
        for _ in range(3):
            a, b = ref_step(toks, ref), step(toks, got)
            assert torch.equal(a, b)
            toks = a.argmax(-1).tolist()
    assert step.fallbacks == 0 and step.calls == 6


HOST_READS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero"}   # .item(), bool(t)


@torch.no_grad()
@pytest.mark.parametrize("paged", [False, True])
def test_step_is_capturable(shipped, paged, monkeypatch):
    """What a CUDA graph capture refuses, looked for on the CPU, inside the step and its kernels'
    torch code (the path a GPU runs: the vectorised torch codecs, backend "torch", and their
    sync-free NaN rules, `numerics.DEVICE_PATH_ON_CPU`): no read of a tensor value on the host
    (the profiler sees every aten op, also inside the custom ops) and no tensor made from host
    data (`torch.tensor` / `torch.as_tensor`: a host-to-device copy on CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    from cedlm.kernels.gate import set_fast_backend
    from cedlm.quant import numerics
    states, toks = _states(shipped, [5, 40, 130], paged, seed=6)
    step = CompiledDecode(shipped, "static")
    shapes = step.shape_for(states, paged=paged)
    args = step.inputs(torch.tensor(toks), states)
    made = []

    def from_host(real):
        def f(data, *a, **k):
            if not isinstance(data, torch.Tensor):
                made.append(repr(data)[:60])
            return real(data, *a, **k)
        return f
    monkeypatch.setattr(numerics, "DEVICE_PATH_ON_CPU", True)
    prev = set_fast_backend("torch")
    try:
        with monkeypatch.context() as m, profile(activities=[ProfilerActivity.CPU]) as prof:
            m.setattr(torch, "tensor", from_host(torch.tensor))
            m.setattr(torch, "as_tensor", from_host(torch.as_tensor))
            decode_step(shapes, *args)
    finally:
        set_fast_backend(prev)
    names = {e.name for e in prof.events()}
    assert "cedlm::attend_packed" in names and "aten::index" in names     # the profile sees inside
    assert not names & HOST_READS, names & HOST_READS
    assert not made, made
