"""DSpark drafter (cedlm/model/dspark.py): official names and strict loading, config checks,
incremental drafting = the training (full) forward."""
import pytest
import torch
from safetensors.torch import save_file

from cedlm.config import ConfigError, ModelConfig
from cedlm.config.params import param_inventory
from cedlm.model import CEDModel, build_model
from cedlm.model import dspark


def _tiny(**kw):
    return ModelConfig.preset("tiny").replace(initializer_range=0.08, **kw)


@pytest.mark.parametrize("layers,taps", [(1, [9]), (3, [7, 8, 9]), (1, [7, 8, 9]), (2, [3, 9])])
def test_official_names_and_strict_load(layers, taps):
    """Any number of draft layers and taps (V4.1: 3 and 3; V4-Flash-0731: 1 draft layer, 3 taps):
    the built `mtp.*` are exactly the official inventory, and such a state dict loads strictly."""
    cfg = _tiny(num_nextn_predict_layers=layers, dspark_target_layer_ids=taps)
    torch.manual_seed(0)
    m = CEDModel(cfg, dspark=True)
    built = {n: tuple(p.shape) for n, p in m.named_parameters() if n.startswith("mtp.")}
    official = {t.name: t.shape for t in param_inventory(cfg, "dspark")}
    assert built == official
    sd = m.state_dict()
    assert {k for k in sd if k.startswith("mtp.")} >= set(official)
    fresh = CEDModel(cfg, dspark=True)
    fresh.load_state_dict(sd, strict=True)
    with pytest.raises(RuntimeError, match="mtp"):
        CEDModel(cfg).load_state_dict(sd, strict=True)             # no drafter built: mtp.* unexpected


def test_drafter_leaves_the_target_unchanged():
    cfg = _tiny()
    torch.manual_seed(0)
    a = CEDModel(cfg).state_dict()
    torch.manual_seed(0)
    b = CEDModel(cfg, dspark=True).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)                 # same params, same RNG use
    assert set(b) - set(a) == {k for k in b if k.startswith("mtp.")}


def test_official_v41_fields_load():
    for name in ("deepseek-v4.1-flash", "deepseek-v4-flash"):
        cfg = ModelConfig.preset(name)
        assert cfg.num_nextn_predict_layers >= 1
    cfg = ModelConfig.preset("deepseek-v4.1-flash")
    assert (cfg.num_nextn_predict_layers, len(cfg.dspark_target_layer_ids)) == (3, 3)
    # V4-Flash-0731: one draft layer, three taps (the counts are independent)
    cfg.replace(num_nextn_predict_layers=1)


def test_model_dir_with_and_without_mtp(tmp_path):
    from cedlm.checkpoint import load_model, save_checkpoint
    from cedlm.text.tokenizer import load_tokenizer
    cfg = _tiny()
    torch.manual_seed(0)
    m = CEDModel(cfg, dspark=True)
    tok = load_tokenizer("cedlm/assets/model")
    target = CEDModel(cfg)
    target.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("mtp.")})
    save_checkpoint(tmp_path / "m", target, tok)
    plain, _ = load_model(tmp_path / "m")
    assert not hasattr(plain, "mtp")
    save_file({k: v.contiguous() for k, v in m.state_dict().items() if k.startswith("mtp.")},
              str(tmp_path / "m" / "mtp.safetensors"))
    withd, _ = load_model(tmp_path / "m")
    assert hasattr(withd, "mtp")
    for k, v in m.state_dict().items():
        assert torch.equal(withd.state_dict()[k], v)


@pytest.mark.parametrize("field,value,msg", [
    ("num_nextn_predict_layers", 0, "num_nextn_predict_layers"),
    ("dspark_block_size", 1, "dspark_block_size"),
    ("dspark_noise_token_id", 512, "dspark_noise_token_id"),
    ("dspark_target_layer_ids", [], "dspark_target_layer_ids"),
    ("dspark_num_experts_per_tok", 5, "dspark_num_experts_per_tok"),
])
def test_bad_dspark_config_names_the_field(field, value, msg):
    cfg = _tiny(**{field: value})
    with pytest.raises(ConfigError, match=msg):
        build_model(cfg, dspark=True)


def test_taps_are_independent_of_draft_layers():
    _tiny(num_nextn_predict_layers=1, dspark_target_layer_ids=[7, 8, 9])      # no error
    with pytest.raises(ConfigError, match="dspark_target_layer_ids"):
        _tiny(dspark_target_layer_ids=[10])


def _context_taps(model, ids):
    from cedlm.model.rollback import capture
    with torch.no_grad(), capture(model, taps=True) as cap:
        model(ids)
    return cap.taps


@pytest.mark.parametrize("layers", [1, 2])
def test_incremental_draft_equals_full_forward(layers):
    """draft_block over rings filled chunk by chunk (what the engine does) = full_forward over
    the whole sequence (training), for anchors before, at and past the window."""
    cfg = _tiny(num_nextn_predict_layers=layers)
    torch.manual_seed(1)
    m = CEDModel(cfg, dspark=True).eval()
    S, N = 30, cfg.dspark_block_size
    ids = torch.randint(0, cfg.vocab_size, (1, S), generator=torch.Generator().manual_seed(2))
    taps = _context_taps(m, ids)
    anchors = torch.tensor([[0, 3, 8, 9, 17, 25]])
    with torch.no_grad():
        full = dspark.full_forward(m, ids, taps, anchors)[0]
    st = dspark.DraftState(m.kv_layout, layers)
    done = 0
    for k, a in enumerate(anchors[0].tolist()):
        while done < a:                                        # context in uneven chunks
            n = min(a - done, 1 + done % 4)
            pos = torch.arange(done, done + n)
            rows = dspark.context_rows(m.mtp, taps[:, done:done + n], pos[None])
            st.write([r[0] for r in rows], pos)
            done += n
        h, base = dspark.draft_block(m, [st], ids[:, a], torch.tensor([a]))
        assert torch.allclose(h[0], full[k], atol=1e-4, rtol=1e-4), f"anchor {a}"
        assert torch.equal(base.argmax(-1), dspark.base_logits(m, full[k:k + 1]).argmax(-1))


def test_markov_decode_is_left_to_right():
    cfg = _tiny()
    torch.manual_seed(3)
    m = CEDModel(cfg, dspark=True).eval()
    torch.nn.init.normal_(m.mtp[0].markov_head.head.weight, std=1.0)
    h = torch.randn(2, cfg.dspark_block_size, cfg.hidden_size)
    base = dspark.base_logits(m, h)
    toks, logits, conf = dspark.markov_decode(m, h, base, torch.tensor([5, 6]), lambda l, i: l.argmax(-1))
    assert toks.shape == (2, cfg.dspark_block_size) and ((conf > 0) & (conf < 1)).all()
    prev = torch.cat((torch.tensor([[5], [6]]), toks[:, :-1]), 1)
    bias, _ = dspark.markov_terms(m, h, prev)
    assert torch.allclose(logits, base + bias, atol=1e-5)
    assert torch.equal(toks, logits.argmax(-1))


def test_draft_window_is_block_anchored():
    """The reference's DSpark window (vLLM sparse_swa.py, the DSpark index kernel): every row of
    a block at P sees the same context positions max(P - W, 0) .. P - 1 plus the whole block.
    Re-derived here position by position on a tiny config (3 draft layers, window 8, block 5) and
    compared with the engine's ring form (draft_block) and the training form (full_forward)."""
    cfg = _tiny(num_nextn_predict_layers=3, dspark_block_size=5)
    W, N, S = cfg.sliding_window, 5, 30
    assert W == 8
    torch.manual_seed(4)
    m = CEDModel(cfg, dspark=True).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, S), generator=torch.Generator().manual_seed(5))
    taps = _context_taps(m, ids)
    rows = dspark.context_rows(m.mtp, taps, torch.arange(S)[None])          # per layer [1, S, hd]
    anchors = [2, 8, 13, 20, 25]
    with torch.no_grad():
        full = dspark.full_forward(m, ids, taps, torch.tensor([anchors]))[0]
    mask = dspark.context_mask(torch.tensor([anchors]).repeat_interleave(N, 1), S, W)[0]
    for k, P in enumerate(anchors):
        # the mask, one (row, position) pair at a time, from the reference's start/end
        start, end = max(P - W, 0), P
        want = torch.tensor([[start <= j < end for j in range(S)] for _ in range(N)])
        assert torch.equal(mask[k * N:(k + 1) * N], want), f"anchor {P}"
        valid = torch.cat((want[:, :P], torch.ones(N, N, dtype=torch.bool)), -1)[None]
        with torch.no_grad():
            ref = dspark.blocks_forward(m, dspark.block_ids(cfg, ids[:, P]), P + torch.arange(N)[None],
                                        [r[:, :P] for r in rows], valid)[0]
        st = dspark.DraftState(m.kv_layout, 3)
        st.write([r[0, :P] for r in rows], torch.arange(P))
        h, _ = dspark.draft_block(m, [st], ids[:, P], torch.tensor([P]))
        # the ring stores rows in the window format (rounding), the re-derivation uses them raw
        assert torch.allclose(h[0], ref, atol=2e-3, rtol=1e-3), f"anchor {P}: ring"
        assert torch.allclose(full[k], h[0], atol=1e-4, rtol=1e-4), f"anchor {P}: training form"
