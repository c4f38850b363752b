"""`--resume` reads training_state.pt with torch.load(weights_only=True).

A crafted checkpoint must be refused before any of its code runs; what `cedlm train` writes
(tensors, plain values, numpy RNG state stored as a tensor) must still load and restore the RNGs
exactly; a checkpoint written before the change (numpy's RNG state as an ndarray) still loads.
"""
from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from cedlm.checkpoint import TRAINING_STATE
from cedlm.train import checkpoint as ts
from cedlm.train.train import build_parser, train


def _ckpt(tmp_path, state) -> os.PathLike:
    d = tmp_path / "checkpoint"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text("{}")
    torch.save(state, d / TRAINING_STATE)
    return tmp_path


class _RunsCode:
    """Unpickling this calls a function of the pickler's choosing (here: touch a file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Callback:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _state(rng=None) -> dict:
    m = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"step": 3, "optimizer": opt.state_dict(),
            "sampler": {"rng": np.random.default_rng(7).bit_generator.state, "batches": 5},
            "rng": [rng or ts.rng_state()], "metrics": [{"step": 1, "loss": 2.5, "val_loss": None}],
            "elapsed": 1.25, "args": {"lr": 3e-3, "data": "data/x", "eps": None, "flag": True},
            "world_size": 1}


@pytest.mark.parametrize("payload", [_RunsCode, _Callback], ids=["os.system", "builtins.open"])
def test_a_malicious_pickle_is_refused_and_never_runs(tmp_path, payload):
    marker = tmp_path / "pwned"
    run = _ckpt(tmp_path, {**_state(), "metrics": [payload(marker)]})
    with pytest.raises(ts.UnsafeCheckpointError, match="refusing to unpickle") as e:
        ts.load_training_state(run)
    assert "weights_only" not in str(e.value)          # no advice to turn the protection off
    assert not marker.exists()


def test_resume_refuses_a_malicious_checkpoint_before_anything_else(tmp_path):
    marker = tmp_path / "pwned"
    run = _ckpt(tmp_path, {"step": 1, "x": _RunsCode(marker)})
    with pytest.raises(ts.UnsafeCheckpointError):
        train(build_parser().parse_args(["--resume", str(run), "--threads", "1", "--no-progress"]))
    assert not marker.exists()


def test_numpy_object_arrays_are_refused(tmp_path):
    marker = tmp_path / "pwned"
    run = _ckpt(tmp_path, {"step": 1, "x": np.array([_RunsCode(marker)], dtype=object)})
    with pytest.raises(ts.UnsafeCheckpointError):
        ts.load_training_state(run)
    assert not marker.exists()


def test_not_a_dict_is_refused(tmp_path):
    with pytest.raises(ts.UnsafeCheckpointError, match="not a training state"):
        ts.load_training_state(_ckpt(tmp_path, [1, 2, 3]))


def test_what_training_saves_loads_and_restores_every_rng(tmp_path):
    state = _state()
    got = ts.load_training_state(_ckpt(tmp_path, state))
    assert got["step"] == 3 and got["sampler"] == state["sampler"] and got["args"] == state["args"]
    assert torch.equal(got["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    assert isinstance(got["rng"][0]["numpy"]["keys"], torch.Tensor)   # no ndarray in the file
    ts.set_rng_state(got["rng"][0])
    a = (torch.rand(3), np.random.rand(3), random.random(), np.random.randn())
    ts.set_rng_state(got["rng"][0])
    b = (torch.rand(3), np.random.rand(3), random.random(), np.random.randn())
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2] and a[3] == b[3]


def test_a_gaussian_cached_in_numpys_legacy_rng_survives(tmp_path):
    np.random.seed(1)
    np.random.randn()                                   # leaves a cached gaussian (has_gauss = 1)
    st = ts.rng_state()
    assert st["numpy"]["has_gauss"] == 1
    expect = np.random.randn()
    got = ts.load_training_state(_ckpt(tmp_path, _state(st)))
    ts.set_rng_state(got["rng"][0])
    assert np.random.randn() == expect


def test_a_checkpoint_from_before_still_loads(tmp_path):
    """The older format: numpy's legacy RNG state as its own tuple with an ndarray."""
    legacy = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    got = ts.load_training_state(_ckpt(tmp_path, _state(legacy)))
    assert isinstance(got["rng"][0]["numpy"][1], np.ndarray)
    ts.set_rng_state(got["rng"][0])
    x = np.random.rand()
    ts.set_rng_state(got["rng"][0])
    assert np.random.rand() == x
