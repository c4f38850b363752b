"""RoPE angle precision: fp32 as the published inference code computes it, fp64 for cedlm's models."""
import math

import torch

from cedlm.config import ModelConfig
from cedlm.model.rope import Rope


def test_official_configs_use_the_reference_fp32_angles_and_presets_fp64():
    assert ModelConfig.preset("deepseek-v4.1-flash").rope_precision == "float32"
    assert ModelConfig.preset("tiny").rope_precision == "float64"
    off = ModelConfig.preset("deepseek-v4.1-flash")
    assert "cedlm" not in off.to_dict()                     # the official file still round-trips
    small = ModelConfig.preset("small")
    assert ModelConfig.from_dict(small.to_dict()).rope_precision == "float64"


def test_fp32_angles_are_the_reference_computation_and_drift_at_long_context():
    cfg = ModelConfig.preset("deepseek-v4.1-flash")
    d, theta = cfg.qk_rope_head_dim, cfg.compress_rope_theta
    r32 = Rope(d, theta, cfg.rope_scaling, "float32")
    r64 = Rope(d, theta, cfg.rope_scaling, "float64")
    # the reference: fp32 inv_freq, fp32 t * inv_freq (YaRN blend as in rope_frequencies)
    t = torch.tensor([65536, 1048576])
    ref = t.float().unsqueeze(-1) * r32.freqs
    assert torch.equal(r32.cos_sin(t)[0], ref.cos())
    # measured gap of the two precisions (angles in radians, then on cos/sin)
    exact = t.double().unsqueeze(-1) * r64.freqs
    gap = (ref.double() - exact).abs().amax(-1)
    assert gap[0] < 3e-3 and 1e-2 < gap[1] < 5e-2, gap
    cs = (r32.cos_sin(t)[0] - r64.cos_sin(t)[0]).abs().amax(-1)
    assert cs[1] > 1e-3 and math.isfinite(float(cs.max()))
