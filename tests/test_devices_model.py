"""The model and its KV storage are device-agnostic: checked on the CPU (tests/devices.py).

1. Under ``implicit_device_guard()`` (a tensor created without ``device=`` lands on ``meta`` and
   fails the first op that meets a real one) every inference path of the ``tiny`` preset runs for
   real on the CPU and gives results IDENTICAL (``torch.equal``) to the unguarded run: the full
   forward (and with an indexer probe), chunked prefill then decode in each prefill mode, batched
   decode over paged rows (the block pool), prompt scoring, restore by replay (exact, bounded)
   from a persisted copy, speculative verify + rollback, DSpark drafting at model level, the
   vision tower and a model with an image span, a model whose Engram tables are offloaded to host
   memory (also equal to the same model with its tables in place), and the decoder-only baseline.
   Each runs on two kernel backends: ``torch`` (no compiled kernel: the path a CUDA device takes)
   and ``auto`` (the compiled CPU kernels where built).

2. Under ``fake_cuda(model)`` (fake tensors on another device than the CPU: shapes, dtypes and
   devices, no data) the shape-static parts run: the full forward and batch decode from an empty
   state whose storage (window rings, byte rows, pending rows) is created on the fake device, and
   a batched decode over a block pool on it. What cannot run there, because it reads data on the
   host (a fake tensor has none):
   * the MoE's routed loop (``MoE._routed``: ``torch.nonzero(counts).tolist()``, the experts a
     call's tokens chose): the fake runs replace the MoE
     by its dense reference (``MoE.forward_reference``: every expert on every token, the same
     parameters), which exercises everything around it;
   * a prefill chunk or replay of more than one token: ``ByteKVCache._window_batched`` sizes the
     window it gathers by the most ring entries any row keeps (``int(keep.sum(1).max())``), and
     ``ByteKVCache.push_stash`` reads the chunk's first positions (``pos[:, 0].tolist()``);
   * an offloaded Engram table (numpy gathers the rows on the host: it needs the row indices'
     values), and ``DraftState.write`` (``int(pos[-1])``).
"""
from __future__ import annotations

import pytest
import torch

from tests.devices import FAKE_DEVICE, fake_cuda, implicit_device_guard
from cedlm.config import ModelConfig
from cedlm.kernels.gate import set_fast_backend

CPU = "cpu"
# torch: no compiled kernel (the path a CUDA device takes); auto: the compiled CPU kernels where
# built (needs cedlm/kernels/attention.py's store_args index made on the keys' device)
BACKENDS = ["torch", "auto"]


# ------------------------------------------------------------------------------------ helpers
def _tiny(**over):
    from cedlm.model import CEDModel
    cfg = ModelConfig.preset("tiny").replace(initializer_range=0.08, **over)
    torch.manual_seed(0)
    return CEDModel(cfg).eval()


def _flat(out):
    """Every tensor of a nested result (lists, tuples, dicts), in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for k in sorted(out) for t in _flat(out[k])]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flat(o)]
    return []


def _guarded_equals_plain(run):
    """run() twice: as is, then with the implicit-device guard; every tensor identical."""
    with torch.no_grad():
        plain = _flat(run())
        with implicit_device_guard():
            guarded = _flat(run())
    assert len(plain) == len(guarded) and plain
    for i, (a, b) in enumerate(zip(plain, guarded)):
        assert b.device.type == CPU, f"result {i} on {b.device}"
        assert a.dtype == b.dtype and torch.equal(a, b), f"result {i} differs under the guard"


def _state_tensors(st):
    """The bytes a SequenceState holds (rings, rows of every kind, pending rows)."""
    return ([st.window_all, st.window_pos_all] + [st.kv[s].view() for s in sorted(st.kv)]
            + [st.index[s].view() for s in sorted(st.index)]
            + [t for s in sorted(st.pending) for t in st.pending[s]])


@pytest.fixture(scope="module")
def tiny():
    m = _tiny()
    with torch.no_grad():                       # golden's bf16-rounded weights
        for p in m.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return m


@pytest.fixture(scope="module")
def ids(tiny):
    cfg = tiny.cfg
    S = 3 * cfg.exact_prefill_tokens // 2 + 3
    return torch.randint(0, cfg.vocab_size, (S + 6,), generator=torch.Generator().manual_seed(11)), S


@pytest.fixture(params=BACKENDS)
def backend(request, tiny):
    with torch.no_grad():
        tiny(torch.zeros(1, 4, dtype=torch.int64))     # the kernels load on first use, unguarded
    prev = set_fast_backend(request.param)
    yield request.param
    set_fast_backend(prev)


# ------------------------------------------------------------------------------------ guard
def test_forward(tiny, ids, backend):
    from cedlm.model.probe import IndexerProbe
    x, S = ids
    _guarded_equals_plain(lambda: [tiny(x[None]), tiny(x[None, :S], probe=IndexerProbe(dense=False))])


@pytest.mark.parametrize("mode", ["full", "exact", "bounded"])
def test_prefill_then_decode(tiny, ids, backend, mode):
    x, S = ids

    def run():
        st = tiny.new_state()
        rows = [tiny.prefill(x[:S], st, mode, chunk_size=tiny.cfg.sliding_window + 3)[-1:]]
        for t in range(S, S + 4):
            rows.append(tiny.decode(x[t:t + 1], [st]))
        return rows, _state_tensors(st)
    _guarded_equals_plain(run)


def test_batched_paged_decode_and_prompt_scoring(tiny, ids, backend):
    from cedlm.cache.block_pool import BlockPool, BlockTable
    x, S = ids

    def run():
        pool = BlockPool(tiny.kv_layout, 16, 8, device=CPU)
        a, b = (tiny.new_state(pool.rows(BlockTable(pool))) for _ in range(2))
        scored = []
        tiny.start_prefill(x[:S], a, "full", chunk_size=7, on_rows=lambda l, c: scored.append(l)).run()
        tiny.prefill(x[:S - 5], b, "exact", chunk_size=9)
        out = [tiny.decode(x[S + i: S + i + 2], [a, b]) for i in range(3)]
        return scored, out, list(pool.data.values())
    _guarded_equals_plain(run)


@pytest.mark.parametrize("mode", ["exact", "bounded"])
def test_replay_from_persisted_copy(tiny, ids, backend, mode):
    from cedlm.model.replay import persisted_copy
    x, S = ids

    def run():
        st = tiny.new_state()
        tiny.prefill(x[:S], st, "full")
        r = persisted_copy(tiny, st)
        rows = [tiny.replay(r, mode)]
        for t in range(S, S + 3):
            rows.append(tiny.decode(x[t:t + 1], [r]))
        return rows, _state_tensors(r)
    _guarded_equals_plain(run)


def test_verify_and_rollback(tiny, ids, backend):
    from cedlm.model.rollback import mark, rollback, verify
    x, S = ids

    def run():
        st = tiny.new_state()
        tiny.prefill(x[:S], st, "full", chunk_size=10)
        m = mark(st, 4)
        logits, cap = verify(tiny, x[S:S + 4][None], [st], taps=True)
        rollback(tiny, st, m, 2, cap, 0)
        return logits, tiny.decode(x[S + 2:S + 3], [st]), _state_tensors(st)
    _guarded_equals_plain(run)


def test_dspark_drafting(backend):
    from cedlm.model import dspark
    from cedlm.model.rollback import capture
    from cedlm.model.model import CEDModel
    cfg = ModelConfig.preset("tiny").replace(initializer_range=0.08)
    torch.manual_seed(1)
    m = CEDModel(cfg, dspark=True).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(2))

    def run():
        with capture(m, taps=True) as cap:
            m(ids)
        taps = cap.taps
        st = dspark.DraftState(m.kv_layout, len(m.mtp), device=m.device)
        done = 0
        for n in (5, 1, 7):                                      # context in uneven chunks
            pos = torch.arange(done, done + n, device=CPU)
            rows = dspark.context_rows(m.mtp, taps[:, done:done + n], pos[None])
            st.write([r[0] for r in rows], pos)
            done += n
        h, base = dspark.draft_block(m, [st, st.clone()], ids[0, done:done + 2],
                                     torch.tensor([done, done], device=CPU))
        toks, logits, conf = dspark.markov_decode(m, h, base, ids[0, done:done + 2], lambda l, i: l.argmax(-1))
        full = dspark.full_forward(m, ids, taps, torch.tensor([[3, 9, 13]], device=CPU))
        return h, toks, logits, conf, full, st.window
    _guarded_equals_plain(run)


def test_vision_tower_and_image_prompt(backend):
    from cedlm.config.vision import VisionConfig, with_vision
    from cedlm.model import vision as V
    from cedlm.model.model import CEDModel
    vc = VisionConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=48,
                      patch_size=14, max_image_tokens=64, min_pixels=0)
    torch.manual_seed(0)
    m = CEDModel(with_vision(ModelConfig.preset("tiny").replace(initializer_range=0.08), vc, 15)).eval()
    g = torch.Generator().manual_seed(3)
    patches = torch.randn(16, 3, 14, 14, generator=g)
    ids = torch.randint(16, m.cfg.vocab_size, (31,), generator=g)

    def run():
        emb = V.encode_image(m, patches, (4, 4), (2, 2))
        x = ids.clone()
        x[5:5 + emb.shape[0]] = 15
        st = m.new_state()
        st.images = [(5, emb)]
        pre = m.prefill(x[:30], st, "full", chunk_size=7)
        return emb, m(x[None, :30], images=[[(5, emb)]]), pre, m.decode(x[30:31], [st])
    _guarded_equals_plain(run)


def test_engram_offloaded(tiny, ids, backend, tmp_path):
    """Tables in host memory (memory-mapped .npy): the same results as the tables in place."""
    x, S = ids
    off = _tiny()
    off.load_state_dict(tiny.state_dict())
    off.offload_engram(tmp_path)
    assert not any(".engram.embed." in n for n, _ in off.named_parameters())

    def run(m):
        st = m.new_state()
        pre = m.prefill(x[:S], st, "exact", chunk_size=9)
        return m(x[None, :S]), pre, m.decode(x[S:S + 1], [st]), _state_tensors(st)
    _guarded_equals_plain(lambda: run(off))
    with torch.no_grad():
        for a, b in zip(_flat(run(tiny)), _flat(run(off))):
            assert torch.equal(a, b)


def test_decoder_only_baseline(backend):
    from cedlm.model import build_model
    cfg = ModelConfig.preset("tiny").replace(arch="decoder_only")
    torch.manual_seed(0)
    m = build_model(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(4))

    def run():
        st = m.new_state()
        return m(ids[None]), m.prefill(ids[:10], st), m.decode(ids[10:12], [st, st])
    _guarded_equals_plain(run)


# ------------------------------------------------------------------------------------ fake device
@pytest.fixture
def dense_moe(monkeypatch):
    """The MoE's dense reference instead of its routed loop (which reads the routing on the host)."""
    from cedlm.model.moe import MoE
    monkeypatch.setattr(MoE, "forward", lambda self, x, image_mask=None: MoE.forward_reference(self, x))


def test_fake_device_forward(tiny, dense_moe):
    fm, mode = fake_cuda(tiny)
    with torch.no_grad(), mode:
        ids = torch.zeros(2, 11, dtype=torch.int64, device=FAKE_DEVICE)
        out = fm(ids)
    assert out.device.type == FAKE_DEVICE and out.shape == (2, 11, tiny.cfg.vocab_size)


def test_fake_device_storage(tiny):
    """The byte caches created on the fake device (contiguous rows, a block pool, a DSpark draft
    ring) and the shape-static reads and writes a decode step makes through `ByteKVCache`: the
    window ring write and its packed keys (one new position), compressed entries appended
    (encoded), their ends, index keys decoded, the selected entries packed."""
    from cedlm.cache.block_pool import BlockPool, BlockTable
    from cedlm.model import dspark
    from cedlm.model.kv_cache import ByteKVCache
    from cedlm.kernels.attention import PackedKeys
    cfg, lay = tiny.cfg, tiny.kv_layout
    fm, mode = fake_cuda(tiny)
    src = cfg.decoder_start                                     # the global KV source (ratio 1)
    isrc = next(s.layer for s in lay.rows_of("idx"))
    with torch.no_grad(), mode:
        dev = fm.device
        assert dev.type == FAKE_DEVICE
        pool = BlockPool(lay, 8, 8, device=dev)
        states = [fm.new_state(), fm.new_state(pool.rows(BlockTable(pool)))]
        draft = dspark.DraftState(lay, 1, device=dev)
        assert all(t.device.type == FAKE_DEVICE for st in states for t in _state_tensors(st))
        assert all(t.device.type == FAKE_DEVICE for t in [*pool.data.values(), draft.window, draft.window_pos])
        cache = ByteKVCache(lay, states)
        B, hd = len(states), cfg.head_dim
        pos = torch.zeros(B, 1, dtype=torch.int64, device=dev)
        keys, kpos = cache.window_keys(0, torch.zeros(B, 1, hd, device=dev), pos)
        for b in range(B):
            cache.add_entries(src, b, torch.zeros(5, hd, device=dev), None)
            cache.add_entries(isrc, b, torch.zeros(3, hd, device=dev),
                              torch.zeros(3, lay.row("idx", isrc).dim, device=dev))
        ends = cache.entry_ends(src)
        idx_keys, _ = cache.index_keys(isrc)
        sel = cache.selected_kv(src, torch.zeros(B, 1, 4, dtype=torch.int64, device=dev))
        gathered = cache.gather_kv(src, torch.zeros(B, 1, 4, dtype=torch.int64, device=dev))
    assert isinstance(keys, PackedKeys) and keys.rows.device.type == FAKE_DEVICE
    assert kpos.device.type == ends.device.type == idx_keys.device.type == FAKE_DEVICE
    assert sel.rows.device.type == sel.index.device.type == gathered.device.type == FAKE_DEVICE
    assert ends.shape == (B, 5) and gathered.shape == (B, 1, 4, hd)


def test_fake_device_dspark_draft(dense_moe):
    """A draft block over draft rings on the fake device (draft_block + markov_decode)."""
    from cedlm.model import dspark
    from cedlm.model.model import CEDModel
    cfg = ModelConfig.preset("tiny").replace(initializer_range=0.08)
    torch.manual_seed(1)
    fm, mode = fake_cuda(CEDModel(cfg, dspark=True).eval())
    with torch.no_grad(), mode:
        states = [dspark.DraftState(fm.kv_layout, len(fm.mtp), device=fm.device) for _ in range(2)]
        anchors = torch.zeros(2, dtype=torch.int64, device=FAKE_DEVICE)
        h, base = dspark.draft_block(fm, states, anchors, torch.full((2,), 9, device=FAKE_DEVICE))
        toks, logits, conf = dspark.markov_decode(fm, h, base, anchors, lambda l, i: l.argmax(-1))
    assert toks.device.type == FAKE_DEVICE and toks.shape == (2, cfg.dspark_block_size)


def test_fake_device_vision(dense_moe):
    """The vision tower on the fake device (host patches moved in by the ViT) and a forward with
    the image span spliced in."""
    from cedlm.config.vision import VisionConfig, with_vision
    from cedlm.model import vision as V
    from cedlm.model.model import CEDModel
    vc = VisionConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=48,
                      patch_size=14, max_image_tokens=64, min_pixels=0)
    torch.manual_seed(0)
    fm, mode = fake_cuda(CEDModel(with_vision(ModelConfig.preset("tiny"), vc, 15)).eval())
    patches = torch.randn(16, 3, 14, 14)
    with torch.no_grad(), mode:
        emb = V.encode_image(fm, patches, (4, 4), (2, 2))
        out = fm(torch.full((1, 20), 15, dtype=torch.int64, device=FAKE_DEVICE), images=[[(5, emb)]])
    assert emb.device.type == out.device.type == FAKE_DEVICE and emb.shape == (8, fm.cfg.hidden_size)


def test_fake_device_decoder_only(dense_moe):
    from cedlm.model import build_model
    torch.manual_seed(0)
    fm, mode = fake_cuda(build_model(ModelConfig.preset("tiny").replace(arch="decoder_only")).eval())
    with torch.no_grad(), mode:
        st = fm.new_state()
        assert st.kv.device.type == FAKE_DEVICE
        fm.prefill(torch.zeros(6, dtype=torch.int64, device=FAKE_DEVICE), st)
        out = fm.decode([3], [st])
    assert out.device.type == FAKE_DEVICE and st.n == 7


# ------------------------------------------------------------------------------------ loading
def test_load_model_places_weights_on_the_device(tmp_path, tok):
    """`load_model(path, device)`: every weight and buffer on the resolved device ("auto": CUDA
    when present, else the CPU); a device this build cannot use is refused naming the field."""
    from cedlm import checkpoint as ck
    from cedlm.model import CEDModel
    from cedlm.util import resolve_device
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny").replace(vocab_size=tok.vocab_size,
                                             engram_compressed_vocab_size=tok.vocab_size)
    model = CEDModel(cfg).eval()
    ck.set_token_map(model, tok)
    path = ck.save_checkpoint(tmp_path / "ckpt", model, tok)
    for name in ("cpu", "auto"):
        loaded, _ = ck.load_model(path, device=name)
        want = resolve_device(name)
        assert all(t.device == want for t in list(loaded.parameters()) + list(loaded.buffers()))
    ids = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    loaded, _ = ck.load_model(path, device="cpu")
    _guarded_equals_plain(lambda: [loaded(ids), model(ids)])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device"):
            ck.load_model(path, device="cuda")


def test_state_refuses_rows_on_another_device(tiny):
    """A block pool on another device than the state's is refused when the state is made."""
    from cedlm.cache.block_pool import BlockPool, BlockTable
    from cedlm.model.state import SequenceState
    pool = BlockPool(tiny.kv_layout, 4, 8, device="meta")
    with pytest.raises(ValueError, match="rows: .*model's device"):
        SequenceState(tiny.kv_layout, pool.rows(BlockTable(pool)), device="cpu")


def test_offloaded_engram_rows_move_to_the_model_device(tiny, tmp_path):
    """An offloaded Engram table stays in host memory when the model moves; a lookup gathers its
    rows there and hands them over on the layer's device (here meta, standing in for CUDA)."""
    import copy
    eng = copy.deepcopy(tiny.layers[tiny.cfg.engram_layer_ids[0]].engram)
    rows = torch.tensor([[[0, 5, 9, 2]]])[..., : eng.hasher.primes.numel()]
    want = eng.embed(rows).flatten(-2)
    eng.offload(tmp_path / "t.npy")
    assert torch.equal(eng.lookup(rows), want)
    eng.to("meta")
    got = eng.lookup(rows)
    assert got.device.type == "meta" and got.shape == want.shape
    assert eng(torch.zeros(1, 1, tiny.cfg.hc_mult, tiny.cfg.hidden_size, device="meta"), got).device.type == "meta"
