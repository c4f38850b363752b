"""The single-token MoE path (batch-1 decode) against the grouped routed loop it shortcuts:
bit-identical outputs for many tokens and both scoring functions; training keeps the loop."""
import torch

from cedlm.config import ModelConfig
from cedlm.model.moe import MoE
from cedlm.kernels import gate


def test_one_token_path_is_bit_identical():
    for func in ("sqrtsoftplus", "softmax"):
        cfg = ModelConfig.preset("tiny").replace(scoring_func=func)
        torch.manual_seed(0)
        moe = MoE(cfg).eval()
        with torch.no_grad():
            moe.gate.bias.copy_(torch.randn_like(moe.gate.bias) * 0.1)
        for i in range(20):
            x = torch.randn(1, 1, cfg.hidden_size) * (10.0 if i % 5 == 0 else 1.0)
            with torch.no_grad():
                a = moe(x)
                with gate.reference_kernels_forced():
                    b = moe(x)
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_training_counts_load_on_the_loop():
    cfg = ModelConfig.preset("tiny")
    moe = MoE(cfg).train()
    moe(torch.randn(1, 1, cfg.hidden_size))
    assert moe.load.sum() == cfg.num_experts_per_tok
