"""The CPU harness's device patches (``lab/cpu.py``) on the installed verl, whichever route it takes.

verl 0.9.x: ``CPUPlatform`` through ``verl.plugin.platform`` + PATCH import-time-device-name.
verl 0.8.x (no ``verl.plugin.platform``): PATCH cpu-torch-device. Either way verl's own device
helpers, as the FSDP engine imported them, must say "cpu" and return the CPU device stand-in.
"""

from __future__ import annotations

import sys

import torch

import pytest

from verl_klcov_global.lab import cpu as _cpu

pytestmark = pytest.mark.slow  # verl's real engine / workers / trainer on CPU: the slow tier


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


def test_legacy_minibatch_conversion_runs_without_flash_attn():
    """PATCH padding-utils-without-flash-attn: verl 0.8's ``left_right_2_no_padding`` imports flash-attn;
    with the patch (a no-op on 0.9.1, which has its own fallback) it runs on CPU and keeps every real token."""
    from verl import DataProto
    from verl.workers.utils.padding import left_right_2_no_padding

    _cpu.ensure_padding_utils_without_flash_attn()
    # prompt left-padded, response right-padded, as verl's trainer sends them
    prompts = torch.tensor([[0, 0, 5, 6], [0, 7, 8, 9]])
    responses = torch.tensor([[10, 11, 0], [12, 13, 14]])
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 1]])
    input_ids = torch.cat([prompts, responses], dim=1)
    proto = DataProto.from_dict(tensors={
        "input_ids": input_ids, "attention_mask": attention_mask, "prompts": prompts, "responses": responses,
        "response_mask": attention_mask[:, 4:], "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
    })
    data = left_right_2_no_padding(proto.to_tensordict())
    assert data["input_ids"].is_nested
    assert torch.equal(data["input_ids"].values(), input_ids[attention_mask.bool()])
    assert data["input_ids"].offsets().tolist() == [0, 4, 10]
