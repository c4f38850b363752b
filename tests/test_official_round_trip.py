"""The official layout round-trips the whole model: text, DSpark drafter (`mtp.*`) and vision
tower (`vision.*`, `aligner.*`, `image_*`). Export -> load gives the text and drafter logits up
to the weight quantisation and the vision embeddings exactly (the tower is stored in BF16, which
the model here already is); exporting the loaded model again and loading it gives every tensor,
logit and embedding bit for bit; `speculative="dspark"` and an image request run on the reloaded
model (one load path: `cedlm.checkpoint.load_model` and `cedlm.official.load_official_model`
build the same components and set the same Engram map)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from cedlm.checkpoint import load_model, set_token_map
from cedlm.config import ModelConfig
from cedlm.config.vision import VisionConfig, with_vision
from cedlm.engine.images import expand, span_embeds
from cedlm.engine.llm import LLM
from cedlm.engine.sampling_params import SamplingParams
from cedlm.model import CEDModel, dspark
from cedlm.official import export_official, load_official_model
from cedlm.text.tokenizer import load_tokenizer

ASSETS = Path(__file__).resolve().parents[1] / "cedlm" / "assets"
VC = VisionConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=48,
                  patch_size=14, max_image_tokens=64, min_pixels=0)
IMG = 15
IDS = torch.tensor([[0, 17, 42, 300, 5, 99, 511, 2, 8, 64, 128, 256, 3, 7, 400, 401, 402, 9, 10, 11]])
PICTURE = Image.new("RGB", (60, 30), (200, 40, 90))


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ASSETS / "tokenizer-512")


@pytest.fixture(scope="module")
def original(tok):
    # the official RoPE precision: an export an official engine reads the same (no override)
    cfg = with_vision(ModelConfig.preset("tiny").replace(rope_precision="float32"), VC, IMG)
    torch.manual_seed(0)
    m = CEDModel(cfg, dspark=True).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():                   # BF16-exact vision: stored losslessly
            if n.startswith(("vision.", "aligner.", "image_")):
                p.copy_(p.bfloat16().float())
    set_token_map(m, tok)
    return m


@pytest.fixture(scope="module")
def round_trips(original, tok, tmp_path_factory):
    d = tmp_path_factory.mktemp("rt")
    export_official(original, d / "once", tok, shard_bytes=200_000)
    once, _ = load_model(d / "once")
    export_official(once, d / "twice", tok)
    twice, _ = load_model(d / "twice")
    return d, once, twice


def _text(m):
    with torch.no_grad():
        return m(IDS)


def _draft(m):
    """Draft logits of one block at position 12 over the context rows of positions 0..11."""
    from cedlm.model.rollback import capture
    with torch.no_grad(), capture(m, taps=True) as cap:
        m(IDS[:, :12])
    st = dspark.DraftState(m.kv_layout, len(m.mtp))
    rows = dspark.context_rows(m.mtp, cap.taps, torch.arange(12)[None])
    st.write([r[0] for r in rows], torch.arange(12))
    h, base = dspark.draft_block(m, [st], IDS[:, 12], torch.tensor([12]))
    return torch.cat((h.flatten(), base.flatten()))


def _vision(m):
    full, ims = expand(m, [0, 5, IMG, 7], [PICTURE])
    with torch.no_grad():
        return span_embeds(m, ims)[0][1]


def test_export_writes_and_load_reads_drafter_and_vision(original, round_trips):
    d, once, twice = round_trips
    assert hasattr(once, "mtp") and hasattr(once, "vision")
    rep = once.official_load_report
    assert set(rep.components) == {"mtp (DSpark draft stages)", "vision tower", "vision aligner",
                                   "image delimiter rows"}
    assert rep.unused == {}                                  # bias_vl is used: there is a tower
    # up to the weight quantisation (FP8 / FP4 / BF16 as the official layout stores them)
    a, b = _text(original), _text(once)
    assert ((a - b).norm() / a.norm()) < 0.2
    a, b = _draft(original), _draft(once)
    assert ((a - b).norm() / a.norm()) < 0.2
    assert torch.equal(_vision(original), _vision(once))
    # the engram map is the tokenizer's, on both load paths
    assert torch.equal(once.engram_token_map, original.engram_token_map)
    direct, _ = load_official_model(d / "once")
    assert torch.equal(direct.engram_token_map, original.engram_token_map)
    assert not torch.equal(original.engram_token_map, torch.arange(original.cfg.vocab_size)
                           % original.cfg.engram_compressed_vocab_size)


def test_second_round_trip_is_lossless(round_trips):
    _, once, twice = round_trips
    sa, sb = once.state_dict(), twice.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert torch.equal(_text(once), _text(twice))
    assert torch.equal(_draft(once), _draft(twice))
    assert torch.equal(_vision(once), _vision(twice))


def test_speculative_and_image_requests_on_the_reloaded_model(round_trips):
    d, once, _ = round_trips
    sp = SamplingParams(max_tokens=12, temperature=0)
    req = {"prompt": [0, 5, 6, IMG, 7, 8, 9], "multi_modal_data": {"image": PICTURE}}
    plain = LLM(str(d / "twice"), num_threads=1, kv_budget_bytes=8 << 20)
    spec = LLM(str(d / "twice"), num_threads=1, kv_budget_bytes=8 << 20, speculative="dspark")
    for prompt in ([0, 17, 42, 300, 5, 99], req):
        want = plain.generate(prompt, sp)[0].token_ids
        assert spec.generate(prompt, sp)[0].token_ids == want
    assert spec.stats()["spec_steps"] > 0
    # the engine's image answer is the training forward's
    full, ims = expand(once, req["prompt"], [PICTURE])
    with torch.no_grad():
        lg = once(torch.tensor([full]), images=[span_embeds(once, ims)])
    assert plain.generate(req, SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0] == int(lg[0, -1].argmax())
