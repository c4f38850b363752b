"""The device harness itself (tests/devices.py): the guard catches a factory call without a device,
and leaves nothing behind (a later torch.compile in the same process still traces)."""
import pytest
import torch
from torch.overrides import _get_current_function_mode_stack

from tests.devices import DEVICES, FAKE_DEVICE, fake_cuda, implicit_device_guard


def test_guard_catches_a_tensor_made_without_a_device():
    x = torch.ones(3)
    with implicit_device_guard():
        assert torch.arange(3).device.type == "meta"
        assert torch.zeros(2, device=x.device).device.type == "cpu"     # explicit: unchanged
        with pytest.raises(RuntimeError, match="meta"):
            torch.cat([x, torch.zeros(2)])
    assert torch.arange(3).device.type == "cpu"


def test_guard_leaves_no_device_mode_behind():
    before = len(_get_current_function_mode_stack())
    with implicit_device_guard():
        pass
    assert len(_get_current_function_mode_stack()) == before
    f = torch.compile(lambda t: t * 2 + 1, backend="eager", fullgraph=True)
    assert torch.equal(f(torch.ones(2)), torch.full((2,), 3.0))


def test_fake_device_mixing_with_the_cpu_fails():
    fake, mode = fake_cuda(torch.nn.Linear(4, 2))
    with mode:
        out = fake(torch.empty(3, 4, device=FAKE_DEVICE))
        assert out.device.type == torch.device(FAKE_DEVICE).type and out.shape == (3, 2)
        with pytest.raises(Exception, match="device"):
            fake(torch.empty(3, 4))


def test_devices_list_has_the_cpu_and_a_cuda_entry():
    assert DEVICES[0] == "cpu" and DEVICES[1].values == ("cuda",)
