"""The CPU harness's device patches (``lab/cpu.py``) on the installed verl, whichever route it takes.

verl 0.9.x: ``CPUPlatform`` through ``verl.plugin.platform`` + PATCH import-time-device-name.
verl 0.8.x (no ``verl.plugin.platform``): PATCH cpu-torch-device. Either way verl's own device
helpers, as the FSDP engine imported them, must say "cpu" and return the CPU device stand-in.
"""

from __future__ import annotations

import sys

import torch

from verl_klcov_global.lab import cpu as _cpu


def test_verls_device_helpers_say_cpu_after_install():
    _cpu.install_cpu_platform()
    import verl.utils.device as verl_device
    from verl.workers.engine.fsdp import transformer_impl

    assert verl_device.get_device_name() == "cpu"
    assert verl_device.get_device_id() == "cpu"  # a string: an int would be read as cuda:N
    assert transformer_impl.device_name == "cpu"
    torch_device = verl_device.get_torch_device()
    assert isinstance(torch_device, _cpu._CPUDeviceModule)
    assert (torch_device.max_memory_allocated(), torch_device.memory_reserved(), torch_device.mem_get_info()) == \
        (0, 0, (0, 0))
    # modules that bound the helper by name before the install see the same
    fsdp_utils = sys.modules["verl.utils.fsdp_utils"]
    assert isinstance(fsdp_utils.get_torch_device(), _cpu._CPUDeviceModule)
    if not _cpu.has_platform_plugin():  # verl 0.8: the helper itself was swapped, once
        assert getattr(verl_device.get_torch_device, _cpu._TORCH_DEVICE_PATCHED) is True
        original = verl_device.get_torch_device._original
        assert original() is torch.cpu  # what verl 0.8 would have handed the engine: no memory calls
        assert not hasattr(torch.cpu, "max_memory_allocated")
    from verl.workers.engine.base import EngineRegistry

    assert EngineRegistry.get_engine_cls("language_model", "fsdp") is transformer_impl.FSDPEngineWithLMHead
