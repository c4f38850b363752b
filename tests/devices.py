"""Devices for the tests, and two CPU-only checks that code is device-agnostic.

``DEVICES``: the devices an exactness test is parametrised over (``@pytest.mark.parametrize(
"device", DEVICES)``): the CPU always, CUDA when this torch build sees a GPU, skipped with the
reason otherwise.

On a machine without a GPU nothing runs on CUDA, yet code that would break there can be found:

* ``implicit_device_guard()``: tensors created without a ``device=`` land on the ``meta`` device
  for the block, so a factory call (``torch.arange(n)``, ``torch.tensor(ids)``) that would put a
  tensor on the CPU beside a model on the GPU fails at once ("Tensor on device meta is not on the
  expected device cpu"). The model itself runs on the CPU, with real values.
* ``fake_cuda(module)``: a copy of the module whose parameters and buffers are fake tensors on
  ``cuda`` (``torch._subclasses.FakeTensorMode``: shapes, dtypes and devices, no data), and the
  mode to run it in; an op that mixes it with a tensor on the CPU raises
  ``FakeTensorDeviceMismatchError``. Only shape-static code runs there (no ``.item()``, no
  ``.tolist()``). On a torch build without CUDA (the CPU wheel) a view of a fake ``cuda`` tensor
  (``t[0]``, ``t[1:]``) fails inside torch ("PyTorch is not linked with support for cuda
  devices"), so there the fake device is ``meta`` (``FAKE_DEVICE``): another device than the CPU,
  which the model treats as CUDA (every compiled-kernel gate takes the torch path), and mixing it
  with a CPU tensor fails the same way. (There the mode accepts real inputs: ``torch.tensor(data,
  device="meta")`` gives a real meta tensor inside the mode; a real CPU tensor is made a fake
  CPU tensor, and mixing it with the fake device still fails.)
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch

CUDA = torch.cuda.is_available()
NO_CUDA = ("no CUDA device: torch.cuda.is_available() is False (the CPU torch wheel, or no GPU); "
           "the CUDA half of this test runs on a machine with one (bench/scripts/gpu_check.sh)")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason=NO_CUDA))]
FAKE_DEVICE = "cuda" if torch.backends.cuda.is_built() else "meta"   # see the module docstring


@contextlib.contextmanager
def implicit_device_guard():
    """Within the block, a tensor created without an explicit device is put on ``meta``.

    ``with torch.device("meta")`` pushes torch's device mode for the block and pops it after.
    (``torch.set_default_device(prev)`` would not restore the state before: setting the CPU back
    leaves a device mode installed for good, and torch.compile cannot trace under one: a later
    compile in the same process then fails with "Attempted to call a super() attribute".)"""
    with torch.device("meta"):
        yield


def fake_cuda(module: torch.nn.Module):
    """(copy of ``module`` on a fake ``cuda`` device (``FAKE_DEVICE``), the FakeTensorMode to run
    it in). Inputs are made inside the mode on ``FAKE_DEVICE``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    mode = FakeTensorMode(allow_non_fake_inputs=FAKE_DEVICE == "meta",
                          shape_env=ShapeEnv(allow_dynamic_output_shape_ops=True))
    fake = copy.deepcopy(module)
    with mode:
        for mod in fake.modules():
            for k, p in list(mod._parameters.items()):
                if p is not None:
                    mod._parameters[k] = torch.nn.Parameter(
                        torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=FAKE_DEVICE),
                        requires_grad=p.requires_grad)
            for k, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[k] = torch.empty_strided(b.shape, b.stride(), dtype=b.dtype, device=FAKE_DEVICE)
    return fake, mode
