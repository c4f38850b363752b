"""`cedlm train vision` pieces on the tiny preset: data, the three phases' losses, the export split
(text weights unchanged in model.safetensors, the tower in vision.safetensors) and a strict
reload through `load_model`."""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("sklearn")

from cedlm.config import ModelConfig  # noqa: E402
from cedlm.data import vision_tasks as T  # noqa: E402
from cedlm.model import CEDModel  # noqa: E402


@pytest.fixture(scope="module")
def setup():
    from cedlm.config.vision import VisionConfig
    from cedlm.engine.loader import tokenizer_for_vocab
    from cedlm.train.vision import Examples, extend_with_vision, freeze_text
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny")
    tok = tokenizer_for_vocab(cfg.vocab_size)
    text = CEDModel(cfg).eval()
    vc = VisionConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=48,
                      max_image_tokens=64, min_pixels=42 * 42)
    vlm = extend_with_vision(text, tok, vc).eval()
    freeze_text(vlm)
    tr, te = T.digits_split(0)
    ex = Examples(vlm, tok, tr[:40], T.DIGIT_QUESTION)
    return text, vlm, tok, ex


def test_data():
    tr, te = T.digits_split(0)
    assert len(tr) + len(te) == 1797 and len(te) == 359
    assert tr[0][0].size == (8, 8) and 0 <= tr[0][1] <= 9
    ims = T.word_examples(3, 5)
    assert ims[0][0].size == T.WORD_CANVAS and ims[0][1] in T.WORDS
    assert not set(T.UNSEEN_WORDS) & set(T.WORDS)


def test_examples_and_text_weights(setup):
    text, vlm, tok, ex = setup
    sd = vlm.state_dict()
    assert all(torch.equal(v, sd[k]) for k, v in text.state_dict().items())
    ids, mask, rows = ex.batch([0, 1])
    r = rows[0]
    assert ids[0, r[1]: r[1] + r[3].num_tokens].eq(vlm.image_token_id).all()
    assert tok.decode(ids[0, r[2]: mask[0].nonzero().max() + 1].tolist()).startswith(r[4])


def test_phases_reduce_their_losses(setup):
    from cedlm.train.vision import accuracy, loss_of
    from cedlm.train.vision_anchors import Anchors, train_anchors, train_regression
    _, vlm, tok, ex = setup
    rng = random.Random(0)
    anchors = {"digits": Anchors(vlm, ex)}
    a = anchors["digits"]
    before = a.loss(vlm, list(range(len(a.classes))))[0].item()
    log: list = []
    train_anchors(vlm, anchors, 8.0, 10, 3e-2, log.append, rng)
    vlm.train()
    after = a.loss(vlm, list(range(len(a.classes))))[0].item()
    vlm.eval()
    assert after < before
    log.clear()
    train_regression(vlm, anchors, 4.0, 16, 3e-3, log.append, rng)
    reg = [m["loss"] for m in log]
    assert reg and reg[-1] < reg[0]
    vlm.train()
    loss = loss_of(vlm, ex, [0, 1, 2])
    vlm.eval()
    loss.backward()
    assert vlm.aligner.w1.weight.grad is not None and vlm.embed.weight.grad is None
    acc = accuracy(vlm, tok, ex, limit=4, max_new=2)
    assert 0.0 <= acc <= 1.0


def test_export_split_and_strict_reload(setup, tmp_path):
    from safetensors import safe_open

    from cedlm.checkpoint import load_model, save_checkpoint
    from cedlm.train.export import export_model
    text, vlm, tok, _ = setup
    save_checkpoint(tmp_path / "ck", vlm, tok)
    out = export_model(tmp_path / "ck", tmp_path / "export")
    with safe_open(str(out / "vision.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert keys and all(k.startswith(("vision.", "aligner.", "image_")) for k in keys)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert not any(k.startswith(("vision.", "aligner.", "image_")) for k in f.keys())
    back, _ = load_model(out)
    assert back.image_token_id == vlm.image_token_id
    assert torch.equal(back.vision.blocks[0].attn.wqkv.weight, vlm.vision.blocks[0].attn.wqkv.weight.bfloat16().float())


def test_cli_help(capsys):
    from cedlm.cli import main
    with pytest.raises(SystemExit) as e:
        main(["train", "vision", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--init" in out and "--minutes" in out


def test_extend_keeps_an_existing_tower(setup):
    """A run can continue a trained tower: a model that already has one of the same config is
    returned as it is (weights untouched); another config builds a fresh tower."""
    import dataclasses

    from cedlm.config.vision import vision_config_of
    from cedlm.train.vision import extend_with_vision
    _, vlm, tok, _ = setup
    vc = vision_config_of(vlm.cfg)
    before = vlm.aligner.w2.weight.detach().clone()
    assert extend_with_vision(vlm, tok, vc) is vlm
    assert torch.equal(vlm.aligner.w2.weight, before)
    other = extend_with_vision(vlm, tok, dataclasses.replace(vc, hidden_size=48))
    assert other is not vlm and vision_config_of(other.cfg).hidden_size == 48
