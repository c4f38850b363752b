"""The MoE's formulations: the static step's stacked-weight gather against the grouped routed loop
(same experts, same sums within float rounding), and training counting the load on the loop."""
import torch

from cedlm.config import ModelConfig
from cedlm.model.moe import MoE


def test_training_counts_load_on_the_loop():
    cfg = ModelConfig.preset("tiny")
    moe = MoE(cfg).train()
    moe(torch.randn(1, 1, cfg.hidden_size))
    assert moe.load.sum() == cfg.num_experts_per_tok


def test_stacked_step_matches_the_grouped_loop():
    for func in ("sqrtsoftplus", "softmax"):
        cfg = ModelConfig.preset("tiny").replace(scoring_func=func)
        torch.manual_seed(0)
        moe = MoE(cfg).eval()
        with torch.no_grad():
            moe.gate.bias.copy_(torch.randn_like(moe.gate.bias) * 0.1)
            x = torch.randn(3, 2, cfg.hidden_size)
            ref = moe(x)
            moe.stack()
            got, ids = moe.step(x)
            again = moe(x)                    # the experts' weights are views of the stacks now
        assert torch.equal(ref, again)
        assert ids.shape == (6, cfg.num_experts_per_tok)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
