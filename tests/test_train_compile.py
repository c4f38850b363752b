"""The compiled training step (cedlm/train/compile.py): a few optimizer steps compiled and eager
give the same losses and weights within float rounding, and so does the masked loss of the chat
and joint stages; `--compile` parses; an expert no token chose keeps no gradient under compile, as
in eager."""
from __future__ import annotations

import pytest
import torch

from cedlm.config import ModelConfig
from cedlm.model import CEDModel
from cedlm.train.compile import ENV_VAR, drop_unrouted, training_loss
from cedlm.train.optim import clip_and_step, param_groups, update_moe_bias
from cedlm.train.train import build_parser, resolve_args
from tests.test_compiled_step import every_kind_config

STEPS = 3
LR = 1e-3
# From the same weights, the first step's loss and gradients are what the graphs compute: compared
# tightly (measured on an AMD EPYC: loss equal, gradients within 1.1e-5 of each tensor's largest).
GRAD_ATOL = 1e-4          # relative to the largest |gradient| of the tensor
# Later steps start from AdamW-updated weights, and AdamW normalises each gradient by its own
# running size: an element whose gradient is rounding noise around 0 moves by about +-lr either
# way. So after STEPS steps some elements differ by up to ~lr (measured on that CPU: at most
# 1.2e-3, 683 of 601,316 elements beyond 1e-4; the Xeon the test was written on had none beyond)
# and the losses by more than rounding (7.4e-5 relative at step 3). What is bounded then: every
# element within the steps' largest possible movement, and nearly all within WEIGHT_ATOL.
LOSS_RTOL = 1e-3
WEIGHT_ATOL = 1e-4
WEIGHT_FAR_FRACTION = 1e-2   # of all elements, at most this many beyond WEIGHT_ATOL (measured 1.1e-3)


def _train(compile: bool, tmp_path, monkeypatch, backend: str = "inductor", cfg=None):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.manual_seed(0)
    model = CEDModel(cfg or ModelConfig.preset("tiny")).train()
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=LR, betas=(0.9, 0.95), eps=1e-8)
    loss_fn = training_loss(model, compile, backend)
    g = torch.Generator().manual_seed(1)
    losses, first_grads = [], None
    for _ in range(STEPS):
        x = torch.randint(0, model.cfg.vocab_size, (2, 33), generator=g)
        loss = loss_fn(x[:, :-1], x[:, 1:])
        loss.backward()
        drop_unrouted(model)
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        clip_and_step(opt, model.parameters(), 1.0)
        update_moe_bias(model, 1e-3)
        losses.append(loss.item())
    return losses, model.state_dict(), first_grads, (model, loss_fn)


def _check_same_training(eager, other) -> None:
    (l_e, w_e, g_e, _), (l_o, w_o, g_o, _) = eager, other
    assert l_o[0] == pytest.approx(l_e[0], rel=1e-6)
    for name in set(g_e) | set(g_o):
        if name not in g_e or name not in g_o:          # a gradient of zeros where the other has None
            assert not (g_o.get(name, g_e.get(name))).any(), name
            continue
        scale = float(g_e[name].abs().max())
        torch.testing.assert_close(g_o[name], g_e[name], atol=GRAD_ATOL * scale + 1e-12, rtol=0, msg=name)
    assert l_o == pytest.approx(l_e, rel=LOSS_RTOL)
    far = total = 0
    for name, w in w_e.items():
        d = (w_o[name].double() - w.double()).abs()
        assert float(d.max()) <= 1.5 * STEPS * LR, name      # AdamW moves an element ~lr per step at most
        far += int((d > WEIGHT_ATOL).sum())
        total += d.numel()
    assert far <= WEIGHT_FAR_FRACTION * total, (far, total)


def test_traced_training_matches_eager(tmp_path, monkeypatch):
    """The captured graphs (dynamo + AOTAutograd: graph breaks, the cache's side effects, the
    backward), run by eager kernels: the quick check of what the compiled step computes. Then the
    masked loss (`loss_fn(x, y, mask)`: the chat and joint stages' mean over the mask's targets)
    through the same traced function, whose layers' graphs it reuses: equal to the eager one
    (tests/test_train_joint.py checks the eager one against the chat stage's `masked_loss`).
    On the tiny preset's widths in 6 layers, one of each kind (`every_kind_config`: the traces
    grow with the layers; 10 layers took 62 s here, 6 take 39 s)."""
    torch._dynamo.reset()
    cfg = every_kind_config("tiny")
    eager = _train(False, tmp_path, monkeypatch, cfg=cfg)
    traced = _train(True, tmp_path, monkeypatch, backend="aot_eager", cfg=cfg)
    _check_same_training(eager, traced)
    model, loss_fn = traced[3]
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 33), generator=g)
    mask = torch.rand(2, 32, generator=g) < 0.6
    mask[:, 0] = False
    x, y = ids[:, :-1], ids[:, 1:]
    want = training_loss(model, False)(x, y, mask)
    assert torch.allclose(loss_fn(x, y, mask), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(loss_fn(x, y, torch.ones_like(mask)), want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow       # inductor's C++ for every graph: 15 min on a loaded 2-core machine, cold cache
def test_compiled_training_matches_eager(tmp_path, monkeypatch):
    torch._dynamo.reset()
    eager = _train(False, tmp_path, monkeypatch)
    _check_same_training(eager, _train(True, tmp_path, monkeypatch))


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
