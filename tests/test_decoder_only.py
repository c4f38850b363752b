"""The decoder-only baseline: incremental decode equals its full forward; BF16 KV accounting."""
import torch

from cedlm import ModelConfig
from cedlm.model.decoder_only import DecoderOnlyModel


def test_decoder_only_incremental_equals_full():
    torch.manual_seed(0)
    m = DecoderOnlyModel(ModelConfig.preset("tiny").replace(initializer_range=0.08)).eval()
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1))
    full = m(ids[None])[0]
    st = m.new_state()
    out = [m.prefill(ids[:10], st)]
    for t in range(10, 40):
        out.append(m.decode(ids[t:t + 1], [st]))
    inc = torch.cat(out)
    # K and V are stored in BF16 in both paths; the rest is fp32
    # (fused and unfused SDPA kernels round differently: compare relative to the logit scale)
    assert (inc - full).abs().max().item() < 1e-4 * full.abs().max().item()
    assert st.nbytes() == 40 * m.kv_bytes_per_token == 40 * 2 * 10 * 32 * 2


def test_decoder_only_shares_width_depth_and_moe():
    cfg = ModelConfig.preset("small")
    m = DecoderOnlyModel(cfg)
    assert len(m.layers) == cfg.n_layers and m.embed.weight.shape[1] == cfg.hidden_size
    assert len(m.layers[0].ffn.experts) == cfg.n_routed_experts
    training = m.train()
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    loss = torch.nn.functional.cross_entropy(training(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    assert torch.isfinite(loss)
