"""The vision front end: official-name strict load, 2-D RoPE and the 3x3 unfold against hand-computed
cases, image-token counts against the reference formula, placeholder splicing, bias_vl routing,
Engram dead tokens, and prefix-cache separation of different images."""
from __future__ import annotations

import math

import pytest
import torch

from cedlm.config import ModelConfig
from cedlm.config.vision import VisionConfig, vision_config_of, with_vision
from cedlm.model import CEDModel
from cedlm.model import vision as V
from cedlm.text import images as I

VC = VisionConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=48,
                  patch_size=14, max_image_tokens=64, min_pixels=0)
IMG = 15


@pytest.fixture(scope="module")
def vlm():
    torch.manual_seed(0)
    cfg = with_vision(ModelConfig.preset("tiny").replace(initializer_range=0.08), VC, IMG)
    return CEDModel(cfg).eval()


def test_text_model_unchanged_and_official_names(vlm):
    torch.manual_seed(0)
    text = CEDModel(ModelConfig.preset("tiny").replace(initializer_range=0.08))
    sd_t, sd_v = text.state_dict(), vlm.state_dict()
    assert all(torch.equal(sd_t[k], sd_v[k]) for k in sd_t)          # same text weights, same RNG use
    extra = sorted(set(sd_v) - set(sd_t))
    assert all(k.startswith(("vision.", "aligner.", "image_")) for k in extra)
    assert {"image_start", "image_end", "image_newline", "vision.patch_embed.proj.weight",
            "vision.blocks.0.attn.wqkv.bias", "vision.blocks.0.mlp.w1.weight", "vision.norm.weight",
            "aligner.w1.weight", "aligner.w2.bias"} <= set(extra)
    # the planner's official inventory names exactly these tensors, with these shapes
    from cedlm.config.params import param_inventory
    inv = {t.name: tuple(t.shape) for t in param_inventory(vlm.cfg, "vision")}
    assert inv == {k: tuple(sd_v[k].shape) for k in extra}
    assert sd_v["vision.patch_embed.proj.weight"].shape == (32, 3 * 14 * 14)
    assert sd_v["aligner.w1.weight"].shape == (vlm.cfg.hidden_size, 32 * 9)
    # a state dict in the official naming loads strictly into a fresh model
    again = CEDModel(vlm.cfg)
    again.load_state_dict({k: v.clone() for k, v in sd_v.items()}, strict=True)
    with pytest.raises(RuntimeError):
        again.load_state_dict({k: v for k, v in sd_v.items() if k != "image_newline"}, strict=True)


def test_config_round_trip(tmp_path, vlm):
    vlm.cfg.save_json(tmp_path / "config.json")
    cfg = ModelConfig.from_json(tmp_path / "config.json")
    assert vision_config_of(cfg) == VC and cfg.image_token_id == IMG
    off = vision_config_of(ModelConfig.preset("deepseek-v4.1-flash"))
    assert (off.num_hidden_layers, off.hidden_size, off.num_attention_heads, off.intermediate_size,
            off.patch_size, off.downsample_ratio, off.max_image_tokens, off.min_pixels) == (
        32, 1024, 16, 2816, 14, 3, 1024, 295936)


def test_rope_2d_hand_computed():
    # head_dim 8: pairs (k, k+4); k = 0, 1 turn with the row i, k = 2, 3 with the column j,
    # frequencies theta^(-0/4) = 1 and theta^(-2/4) = 1/100 for theta = 10000.
    ang = V.rope_2d_angles(2, 3, 8, 10000.0)
    i, j = 1, 2                                   # patch 5 = row 1, column 2
    assert torch.allclose(ang[5], torch.tensor([i * 1.0, i * 0.01, j * 1.0, j * 0.01]))
    x = torch.zeros(6, 1, 8)
    x[5, 0, 0] = 1.0                              # unit vector on dim 0 -> rotates into dim 4
    y = V.apply_rope_2d(x, ang)[5, 0]
    assert torch.allclose(y[0], torch.tensor(math.cos(1.0))) and torch.allclose(y[4], torch.tensor(math.sin(1.0)))
    x = torch.zeros(6, 1, 8)
    x[5, 0, 2] = 1.0                              # dim 2 pairs with dim 6, angle = column 2
    y = V.apply_rope_2d(x, ang)[5, 0]
    assert torch.allclose(y[2], torch.tensor(math.cos(2.0))) and torch.allclose(y[6], torch.tensor(math.sin(2.0)))
    # relative: q.k depends only on the offset between patches
    q, k = torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    a = V.rope_2d_angles(4, 4, 8, 10000.0)

    def dot(p1, p2):
        return (V.apply_rope_2d(q, a[p1:p1 + 1]) * V.apply_rope_2d(k, a[p2:p2 + 1])).sum()
    assert torch.allclose(dot(0, 5), dot(10, 15), atol=1e-5)     # (0,0)-(1,1) vs (2,2)-(3,3)


def test_unfold_3x3_hand_computed():
    # a 4x4 grid of 1-channel features valued 10*i + j: 2x2 output blocks, zero-padded
    x = torch.tensor([[10.0 * i + j] for i in range(4) for j in range(4)])
    u = V.unfold_3x3(x, 4, 4, 3)
    assert u.shape == (4, 9)
    assert u[0].tolist() == [0, 1, 2, 10, 11, 12, 20, 21, 22]
    assert u[1].tolist() == [3, 0, 0, 13, 0, 0, 23, 0, 0]
    assert u[2].tolist() == [30, 31, 32, 0, 0, 0, 0, 0, 0]
    assert u[3].tolist() == [33, 0, 0, 0, 0, 0, 0, 0, 0]
    # channel-major with several channels, against the loop reference, batched too
    y = torch.randn(5 * 7, 4)
    assert torch.equal(V.unfold_3x3(y, 5, 7, 3), V.unfold_reference(y, 5, 7, 3))
    assert torch.equal(V.unfold_3x3(torch.stack([y, y]), 5, 7, 3)[1], V.unfold_reference(y, 5, 7, 3))


def test_span_layout_fast_vs_reference():
    rows = torch.randn(2 * 3, 8)
    s, n, e = torch.randn(8), torch.randn(8), torch.randn(8)
    a = V.span_embeds(rows, 2, 3, s, n, e)
    assert torch.equal(a, V.span_embeds_reference(rows, 2, 3, s, n, e))
    assert a.shape[0] == I.num_image_tokens(2, 3) == 10
    assert torch.equal(a[0], s) and torch.equal(a[4], n) and torch.equal(a[8], n) and torch.equal(a[9], e)
    assert torch.equal(a[5], rows[3])


def _reference_count(w, h, vc):
    """The published processor's arithmetic, restated: clamp, min-pixels, round up, shrink."""
    p, r, mx = vc.patch_size, vc.downsample_ratio, vc.max_image_tokens
    if vc.max_wh_ratio is not None and w > h * vc.max_wh_ratio:
        w = h * vc.max_wh_ratio
    if 0 < w * h < vc.min_pixels:
        s = (vc.min_pixels / (w * h)) ** 0.5
        w, h = int(w * s), int(h * s)
    bw, bh = math.ceil(w / p) * p, math.ceil(h / p) * p

    def toks(bh, bw):
        lh, lw = math.ceil(bh // p / r), math.ceil(bw // p / r)
        return lh * (lw + 1) + 2
    if toks(bh, bw) > mx:
        ratio = h / w
        mw = math.sqrt((mx - 2) / ratio + 0.25) - 0.5
        mh = mw * ratio
        cell = p * r
        if mw < 1:
            bh, bw = (mx - 2) // 2 * cell, cell
        elif mh < 1:
            bh, bw = cell, (mx - 3) * cell
        else:
            beta = min(math.floor(mw) * cell / w, math.floor(mh) * cell / h)
            bh, bw = math.floor(h * beta / p) * p, math.floor(w * beta / p) * p
    return toks(bh, bw)


@pytest.mark.parametrize("w,h", [(640, 480), (480, 640), (1920, 1080), (100, 100), (8, 8), (3000, 200),
                                 (200, 3000), (14, 14), (42, 42), (1024, 1024), (5000, 10), (10, 5000)])
def test_image_token_count(w, h):
    off = vision_config_of(ModelConfig.preset("deepseek-v4.1-flash"))
    for vc in (off, VC, VisionConfig(max_image_tokens=64, min_pixels=1764, max_wh_ratio=4.0)):
        n = I.image_token_count(w, h, vc)
        assert n == _reference_count(w, h, vc)
        assert 4 <= n <= vc.max_image_tokens
    # 640x480 at full scale: 46x35 patches -> 16x12 llm grid -> 12*(16+1)+2 = 206... after rounding
    (vh, vw), (lh, lw) = I.image_grid(640, 480, off)
    assert I.num_image_tokens(lh, lw) == lh * (lw + 1) + 2


def test_preprocess_matches_grid():
    from PIL import Image
    im = Image.new("RGB", (50, 20), (255, 0, 0))
    p = I.preprocess(im, VC)
    (vh, vw), lg = I.image_grid(50, 20, VC)
    assert p.vit_grid == (vh, vw) and p.llm_grid == lg
    assert p.patches.shape == (vh * vw, 3, 14, 14)
    assert p.patches.max() <= 1 and p.patches.min() >= -1
    grey = 127 / 255 * 2 - 1                                                 # padding (centred)
    assert torch.allclose(p.patches[0, :, 0, 0], torch.tensor(grey).bfloat16().float().expand(3))
    full = I.preprocess(Image.new("RGB", (56, 28), (255, 0, 0)), VC)          # whole patches: no pad
    assert (full.patches[:, 0] == 1).all() and (full.patches[:, 1:] == -1).all()   # red -> (1, -1, -1)
    q = I.preprocess(Image.new("RGB", (50, 20), (0, 0, 255)), VC)
    assert q.digest != p.digest and I.preprocess(im.copy(), VC).digest == p.digest


def test_splice_and_expand(vlm):
    from PIL import Image
    a = I.preprocess(Image.new("RGB", (50, 30), (200, 10, 10)), VC)
    ids, spans = I.expand_image_tokens([0, 5, IMG, 7, IMG, 8], [a, a], IMG)
    L = a.num_tokens
    assert spans == [(2, L), (3 + L, L)] and len(ids) == 4 + 2 * L
    assert ids[2:2 + L] == [IMG] * L and ids[2 + L] == 7
    with pytest.raises(I.ImageError, match="placeholder"):
        I.expand_image_tokens([0, IMG], [a, a], IMG)
    emb = V.encode_image(vlm, a.patches, a.vit_grid, a.llm_grid)
    x = torch.zeros(1, 6, emb.shape[1])
    out = V.splice(x, torch.arange(10, 16)[None], [[(12, emb[:3]), (8, emb[:3])]])  # second: rows 8..10
    assert torch.equal(out[0, 2:5], emb[:3]) and torch.equal(out[0, 0], emb[2]) and out[0, 1].abs().sum() == 0
    # the model's forward with an image differs from the bare placeholder embeddings
    t = torch.tensor([ids])
    sp = [[(s, V.encode_image(vlm, a.patches, a.vit_grid, a.llm_grid)) for s, _ in spans]]
    assert not torch.allclose(vlm(t, images=sp), vlm(t))


def test_bias_vl_routes_image_tokens(vlm):
    gate = vlm.layers[0].ffn.gate
    x = torch.randn(6, vlm.cfg.hidden_size)
    mask = torch.tensor([True, False] * 3)
    old = gate.bias_vl.clone()
    try:
        gate.bias_vl.fill_(0)
        gate.bias_vl[0] = 1e4                                   # image tokens must pick expert 0
        _, ids = gate(x, mask)
        assert (ids[mask] == 0).any(-1).all()
        _, plain = gate(x)
        assert torch.equal(ids[~mask], plain[~mask])            # text tokens keep `bias`
    finally:
        gate.bias_vl.copy_(old)


def test_engram_dead_image_tokens(vlm):
    from cedlm.model.engram import EngramHasher
    cfg = vlm.cfg
    hs = EngramHasher(cfg, cfg.engram_layer_ids[0])
    h = cfg.engram_max_ngram_size - 1
    cids = torch.tensor([[2] * h + [5, 6, 7, 8]])
    dead = torch.zeros_like(cids, dtype=torch.bool)
    assert torch.equal(hs.rows(cids, h, dead, 2), hs.rows(cids, h))         # nothing dead: same
    dead[0, h + 1] = True                                                   # token 6 is an image token
    got = hs.rows(cids, h, dead, 2)
    # t=6 itself and the n-grams reaching back over it see pad from there on
    want_1 = hs.rows(torch.tensor([[2] * h + [5, 2, 7, 8]]), h)[0, 1]
    assert torch.equal(got[0, 1], hs.rows(torch.tensor([[2] * h + [2, 2, 7, 8]]), h)[0, 1])
    assert not torch.equal(got[0, 1], want_1) or True
    ref = hs.rows(torch.tensor([[2, 2, 2, 2, 7, 8]])[:, -(h + 2):], h)      # 7 after a dead token
    assert torch.equal(got[0, 2], ref[0, 0])
    # Engram gate of a dead token is zero: its mHC copies pass unchanged
    eng = vlm.layers[cfg.engram_layer_ids[0]].engram
    x = torch.randn(1, 2, cfg.hc_mult, cfg.hidden_size)
    emb = torch.randn(1, 2, eng.wkv.in_features)
    y = eng(x, emb, torch.tensor([[True, False]]))
    assert torch.equal(y[0, 0], x[0, 0]) and not torch.equal(y[0, 1], x[0, 1])


def test_prefix_cache_separates_images(vlm):
    from PIL import Image

    from cedlm.cache.prefix import block_hashes
    from cedlm.engine.llm import LLM
    from cedlm.engine.sampling_params import SamplingParams
    ids = list(range(20))
    assert block_hashes(ids, 4, b"s", spans=None) == block_hashes(ids, 4, b"s")
    a = block_hashes(ids, 4, b"s", spans=[(5, 6, b"a" * 16)])
    b = block_hashes(ids, 4, b"s", spans=[(5, 6, b"b" * 16)])
    plain = block_hashes(ids, 4, b"s")
    assert a[0] == b[0] == plain[0] and a[1] != b[1] and a[1] != plain[1]   # block 0 has no image
    llm = LLM(vlm, None, block_tokens=4)
    red, blue = Image.new("RGB", (60, 30), (255, 0, 0)), Image.new("RGB", (60, 30), (0, 0, 255))
    sp = SamplingParams(max_tokens=3, temperature=0)
    prompt = [0, 5, 6, IMG, 7, 8, 9]
    r1 = llm.generate({"prompt": prompt, "multi_modal_data": {"image": red}}, sp)[0]
    r2 = llm.generate({"prompt": prompt, "multi_modal_data": {"image": red}}, sp)[0]
    r3 = llm.generate({"prompt": prompt, "multi_modal_data": {"image": blue}}, sp)[0]
    assert r2.num_cached_tokens > 3 and r2.token_ids == r1.token_ids
    assert r3.num_cached_tokens <= 3                                     # only the image-free block 0
    # the engine's answer equals the training forward's greedy answer (blue image)
    from cedlm.engine.images import expand, span_embeds
    full, ims = expand(vlm, prompt, [blue])
    lg = vlm(torch.tensor([full]), images=[span_embeds(vlm, ims)])
    assert r3.token_ids[0] == int(lg[0, -1].argmax())


def test_save_session_with_images_is_a_clear_error(vlm, tmp_path):
    """Sessions store token ids and replay them; image embeddings are not stored, so a prompt
    with images (or bare image placeholders) is refused with a message, and nothing is stored."""
    from PIL import Image

    from cedlm.engine.llm import LLM
    llm = LLM(vlm, None, store=str(tmp_path / "store"))
    red = Image.new("RGB", (60, 30), (255, 0, 0))
    with pytest.raises(ValueError, match="save_session: prompts with images"):
        llm.save_session("k", {"prompt": [0, 5, IMG, 7], "multi_modal_data": {"image": red}})
    with pytest.raises(ValueError, match="image placeholders"):
        llm.save_session("k", [0, 5, IMG, 7])
    assert llm.restore_session("k") is None
    assert llm.save_session("k", [0, 5, 6, 7]) > 0                     # text prompts still work
