"""The compiled training step (cedlm/train/compile.py): a few optimizer steps compiled and eager
give the same losses and weights within float rounding; `--compile` parses; an expert no token
chose keeps no gradient under compile, as in eager."""
from __future__ import annotations

import pytest
import torch

from cedlm.config import ModelConfig
from cedlm.model import CEDModel
from cedlm.train.compile import ENV_VAR, drop_unrouted, training_loss
from cedlm.train.optim import clip_and_step, param_groups, update_moe_bias
from cedlm.train.train import build_parser, resolve_args

STEPS = 3
LOSS_RTOL = 1e-4          # relative, per step (measured: about 1e-6 on this config)
WEIGHT_ATOL = 1e-4        # after STEPS AdamW steps at lr 1e-3 (an update is ~1e-3 per step)


def _train(compile: bool, tmp_path, monkeypatch, backend: str = "inductor"):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.manual_seed(0)
    model = CEDModel(ModelConfig.preset("tiny")).train()
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    loss_fn = training_loss(model, compile, backend)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x = torch.randint(0, model.cfg.vocab_size, (2, 33), generator=g)
        loss = loss_fn(x[:, :-1], x[:, 1:])
        loss.backward()
        drop_unrouted(model)
        clip_and_step(opt, model.parameters(), 1.0)
        update_moe_bias(model, 1e-3)
        losses.append(loss.item())
    return losses, model.state_dict()


def test_traced_training_matches_eager(tmp_path, monkeypatch):
    """The captured graphs (dynamo + AOTAutograd: graph breaks, the cache's side effects, the
    backward), run by eager kernels: the quick check of what the compiled step computes."""
    torch._dynamo.reset()
    eager, w_eager = _train(False, tmp_path, monkeypatch)
    traced, w_traced = _train(True, tmp_path, monkeypatch, backend="aot_eager")
    assert traced == pytest.approx(eager, rel=LOSS_RTOL)
    for name, w in w_eager.items():
        torch.testing.assert_close(w_traced[name], w, atol=WEIGHT_ATOL, rtol=0, msg=name)


@pytest.mark.slow       # inductor's C++ for every graph: 15 min on a loaded 2-core machine, cold cache
def test_compiled_training_matches_eager(tmp_path, monkeypatch):
    torch._dynamo.reset()
    eager, w_eager = _train(False, tmp_path, monkeypatch)
    compiled, w_compiled = _train(True, tmp_path, monkeypatch)
    assert compiled == pytest.approx(eager, rel=LOSS_RTOL)
    for name, w in w_eager.items():
        torch.testing.assert_close(w_compiled[name], w, atol=WEIGHT_ATOL, rtol=0, msg=name)


def test_compile_flag_parses(monkeypatch, capsys):
    p = build_parser()
    assert p.parse_args(["--compile", "off"]).compile is False
    assert p.parse_args(["--compile", "on"]).compile is True
    with pytest.raises(SystemExit):
        p.parse_args(["--compile", "maybe"])
    assert "argument --compile: expected on or off, got 'maybe'" in capsys.readouterr().err
    omitted = p.parse_args([])
    assert omitted.compile is None                     # the default: compile_default()
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_args(omitted, None).compile is False   # off unless asked (a cold compile: ~15 min)
    monkeypatch.setenv(ENV_VAR, "on")
    assert resolve_args(omitted, None).compile is True
    assert resolve_args(p.parse_args(["--compile", "off"]), None).compile is False
    monkeypatch.setenv(ENV_VAR, "off")
    assert resolve_args(omitted, None).compile is False
    monkeypatch.setenv(ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match=ENV_VAR):
        resolve_args(omitted, None)


def test_drop_unrouted_keeps_eager_gradients():
    torch.manual_seed(0)
    model = CEDModel(ModelConfig.preset("tiny")).train()
    for layer in model.layers:                          # a gradient on every expert, as compiled
        for p in layer.ffn.experts.parameters():
            p.grad = torch.zeros_like(p)
    moe = model.layers[0].ffn
    moe.load.zero_()
    moe.load[1] = 3.0
    drop_unrouted(model)
    assert moe.experts[1].w1.weight.grad is not None
    assert all(p.grad is None for e in (0, 2) for p in moe.experts[e].parameters())
