"""Which ids are image tokens: `image_token_id` only (V4.1's `image_sentinel_mask`, vLLM
deepseek_v41/common/mm_preprocess.py:54-56), not the five-id range V4's sentinel block had and
vLLM's shared MoE router keeps (deepseek_v4/nvidia/model.py:121-122). The next four ids are text:
they route without `bias_vl` and are live Engram tokens."""
import torch

from cedlm.config import ModelConfig
from cedlm.config.vision import VisionConfig, with_vision
from cedlm.model import CEDModel

VC = VisionConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=48,
                  patch_size=14, max_image_tokens=64, min_pixels=0)
IMG = 15


def _model():
    torch.manual_seed(0)
    return CEDModel(with_vision(ModelConfig.preset("tiny").replace(initializer_range=0.08), VC, IMG)).eval()


def test_only_image_token_id_is_an_image_token():
    m = _model()
    ids = torch.tensor([[IMG - 1, IMG, IMG + 1, IMG + 2, IMG + 3, IMG + 4]])
    assert m.image_mask(ids).tolist() == [[False, True, False, False, False, False]]


def test_the_next_four_ids_route_and_hash_as_text():
    m = _model()
    text = torch.tensor([[3, IMG + 1, IMG + 2, 40, IMG + 3, IMG + 4, 7]])
    with_img = torch.tensor([[3, IMG, IMG + 2, 40, IMG + 3, IMG + 4, 7]])
    with torch.no_grad():
        a_text, a_img = m(text), m(with_img)
        for name, buf in m.named_buffers():                 # another image-token routing bias
            if name.endswith(".ffn.gate.bias_vl"):
                buf.add_(torch.randn_like(buf) * 5)
        b_text, b_img = m(text), m(with_img)
    assert torch.equal(a_text, b_text)                      # no image token: bias_vl unused
    assert not torch.allclose(a_img, b_img)                 # the image token routes with it
