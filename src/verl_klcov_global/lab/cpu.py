"""Run verl's real FSDP engine on a CPU-only machine.

verl 0.9.1 has no CPU platform: without a GPU it falls back to "nvidia" and
calls ``torch.cuda``; verl 0.8.0 detects "cpu" but hands the engine ``torch.cpu``,
which lacks the memory and RNG calls verl makes. This module supplies the
missing pieces so that the unmodified ``FSDPEngineWithLMHead`` (FSDP1 and
FSDP2) trains on CPU with ``gloo``:

* :func:`install_cpu_platform` -- a ``PlatformBase`` subclass for CPU,
  installed with ``set_platform``, a "cpu" entry in ``EngineRegistry`` and the
  documented patches listed there (each one fails loudly when its target is
  missing, i.e. when verl or torch changed under it).
* :func:`init_process_group_cpu` -- plain ``gloo`` process group plus the env
  vars verl reads (verl's own init asks for ``"cpu:gloo,cpu:gloo"``, which
  torch rejects).
* :func:`build_fsdp_engine` -- an initialised engine with SGD, constant LR,
  sdpa attention and fp32 (or bf16-autocast) compute.
* :func:`engine_params_flat` -- the full parameter vector, same ordering for
  every strategy and world size.
* :func:`spawn` -- run a module-level function on ``world_size`` gloo ranks.

Targets: verl 0.9.1 and 0.8.0, torch 2.13 (CPU build), transformers 5.x.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import socket
import tempfile
from types import ModuleType
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

__all__ = [
    "CPUPlatform",
    "install_cpu_platform",
    "init_process_group_cpu",
    "find_free_port",
    "build_fsdp_engine",
    "engine_params_flat",
    "spawn",
]

_INSTALLED = False


# ---------------------------------------------------------------------------
# Platform
# ---------------------------------------------------------------------------


class _CPUDeviceModule:
    """Stand-in for ``torch.cuda`` as returned by ``get_torch_device()``.

    Memory queries report 0, cache/allocator calls are no-ops, RNG calls use
    torch's CPU generator; anything else (``synchronize``, ``current_stream``,
    ``Stream``, ``Event``, ``device_count``, ...) is looked up on ``torch.cpu``.
    """

    __name__ = "verl_klcov_global.lab.cpu.device_module"

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "CPU"

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def ipc_collect() -> None:
        return None

    @staticmethod
    def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
        return None

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    @staticmethod
    def memory_reserved(device: Any = None) -> int:
        return 0

    @staticmethod
    def max_memory_allocated(device: Any = None) -> int:
        return 0

    @staticmethod
    def max_memory_reserved(device: Any = None) -> int:
        return 0

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        """(free, total) bytes; 0/0 keeps verl's memory logging harmless."""
        return 0, 0

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)


def _platform_base() -> type:
    from verl.plugin.platform import PlatformBase

    return PlatformBase


def _make_platform_class() -> type:
    """Build the ``PlatformBase`` subclass lazily (verl imported on demand)."""
    base = _platform_base()

    class CPUPlatform(base):  # type: ignore[misc, valid-type]
        """verl platform for CPU-only hosts: device "cpu", backend "gloo"."""

        _device_module = _CPUDeviceModule()

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> ModuleType:
            return self._device_module  # type: ignore[return-value]

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return True

        def current_device(self) -> str:  # type: ignore[override]
            # A string: verl passes this to ``.to()``/FSDP ``device_id``; an int
            # would be read as ``cuda:N``.
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: Optional[int] = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            # "GPU" so a full Ray trainer can run with fake GPUs
            # (``ray_kwargs.ray_init.num_gpus=N``); unused by the engine.
            return "GPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> None:
            return None

    return CPUPlatform


CPUPlatform: Optional[type] = None  # set by install_cpu_platform()


# ---------------------------------------------------------------------------
# Patches (each named, version-tagged, loud on a missing target)
# ---------------------------------------------------------------------------


def _require(obj: Any, attr: str, what: str) -> Any:
    """Return ``getattr(obj, attr)`` or raise: the patch target is gone."""
    if not hasattr(obj, attr):
        raise RuntimeError(
            f"verl_klcov_global CPU support: cannot find {what} ({getattr(obj, '__name__', obj)}.{attr}); "
            "the installed verl/torch differs from the version this patch targets."
        )
    return getattr(obj, attr)


def _patch_fsdp1_sync_module_states_cpu() -> None:
    """PATCH fsdp1-sync-module-states-cpu (torch 2.13, used by verl 0.9.1 FSDP1).

    verl builds FSDP1 with ``sync_module_states=True`` (rank 0 holds the
    loaded weights, other ranks meta tensors materialised by ``init_fn``).
    torch's ``_check_module_states_for_sync_module_states`` refuses CPU
    parameters before the broadcast, although the broadcast itself works
    over gloo. The check is replaced by a no-op; the broadcast
    (``_sync_params_and_buffers``) is untouched. FSDP2 needs nothing.
    """
    from torch.distributed.fsdp import _init_utils

    name = "_check_module_states_for_sync_module_states"
    original = _require(_init_utils, name, "FSDP1 sync_module_states CPU check")
    if getattr(original, "_verl_klcov_cpu_patch", False):
        return
    caller = _require(_init_utils, "_sync_module_params_and_buffers", "FSDP1 module-state broadcast")
    if name not in inspect.getsource(caller):
        raise RuntimeError(
            f"verl_klcov_global CPU support: torch's _sync_module_params_and_buffers no longer calls {name}; "
            "re-check the FSDP1 CPU patch for this torch version."
        )

    def _allow_cpu_module_states(module_states: list[torch.Tensor]) -> None:
        return None

    _allow_cpu_module_states._verl_klcov_cpu_patch = True  # type: ignore[attr-defined]
    _allow_cpu_module_states._original = original  # type: ignore[attr-defined]
    setattr(_init_utils, name, _allow_cpu_module_states)


_IMPORT_TIME_DEVICE_NAME_MODULES = (
    "verl.workers.engine.torchtitan.transformer_impl",
    "verl.experimental.separation.engine_workers",
    "verl.utils.megatron.router_replay_utils",
)


def _patch_import_time_device_name() -> None:
    """PATCH import-time-device-name (verl 0.9.1).

    ``import verl`` already resolves the platform (auto-detection falls back
    to "nvidia" on a CPU host), and a few modules cache
    ``device_name = get_device_name()`` at import time -- among them
    ``verl/workers/engine/fsdp/transformer_impl.py`` (~89, used for the
    Ulysses device mesh). Reset that global to "cpu" in the FSDP engine module
    (required) and in the other known ones when they are already imported.
    """
    import sys

    from verl.workers.engine.fsdp import transformer_impl

    _require(transformer_impl, "device_name", "module-level device_name of the FSDP engine")
    transformer_impl.device_name = "cpu"
    for name in _IMPORT_TIME_DEVICE_NAME_MODULES:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "device_name"):
            module.device_name = "cpu"


def _register_cpu_engines() -> None:
    """PATCH engine-registry-cpu (verl 0.9.1): register ``FSDPEngineWithLMHead`` (actor) and
    ``FSDPEngineWithValueHead`` (critic) for device "cpu", backends fsdp/fsdp2 (verl registers only cuda/npu)."""
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl

    engines = _require(EngineRegistry, "_engines", "EngineRegistry table")
    for model_type, class_name in (("language_model", "FSDPEngineWithLMHead"),
                                   ("value_model", "FSDPEngineWithValueHead")):
        engine_cls = _require(transformer_impl, class_name, f"FSDP {model_type} engine class")
        backends = engines.get(model_type, {})
        missing = [b for b in ("fsdp", "fsdp2") if "cpu" not in backends.get(b, {})]
        if missing:
            EngineRegistry.register(model_type=model_type, backend=missing, device="cpu")(engine_cls)


@contextlib.contextmanager
def _quiet_logger(name: str):
    """Raise logger ``name`` to ERROR for the duration of the block."""
    import logging

    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def has_platform_plugin() -> bool:
    """True when verl selects devices through ``verl.plugin.platform`` (verl 0.9.x; 0.8.x has none)."""
    import importlib.util

    return importlib.util.find_spec("verl.plugin") is not None and \
        importlib.util.find_spec("verl.plugin.platform") is not None


def _install_platform_plugin() -> None:
    """verl 0.9.x: register and select :class:`CPUPlatform` through ``verl.plugin.platform``."""
    global CPUPlatform
    from verl.plugin.platform import PlatformRegistry, platform_manager, set_platform

    if CPUPlatform is None:
        CPUPlatform = _make_platform_class()
    if PlatformRegistry.get("cpu") is None:
        PlatformRegistry.register(platform="cpu")(CPUPlatform)
    current = _require(platform_manager, "_current_platform", "verl platform singleton")
    if not isinstance(current, CPUPlatform):
        # ``import verl`` has already auto-detected (and cached) "nvidia";
        # replacing it is expected, so mute set_platform's warning about it.
        with _quiet_logger(platform_manager.__name__):
            set_platform(CPUPlatform())
    _patch_import_time_device_name()


_TORCH_DEVICE_PATCHED = "__verl_klcov_cpu_torch_device__"


def _patch_cpu_torch_device() -> None:
    """PATCH cpu-torch-device (verl 0.8.0 ``utils/device.py``; 0.8 has no ``verl.plugin.platform``).

    verl 0.8 picks the device from module-level flags computed at import
    (``is_cuda_available``, ``is_npu_available``): on a CPU host
    ``get_device_name()`` is already "cpu" and ``get_device_id()`` returns
    ``torch.cpu.current_device()`` == "cpu", a string, as the engine needs. Only
    ``get_torch_device()`` (``getattr(torch, "cpu")``) falls short: ``torch.cpu``
    has no ``empty_cache``, ``memory_allocated``, ``max_memory_*``,
    ``mem_get_info``, ``manual_seed``, RNG state calls, which verl's FSDP path
    and memory logging call. It is replaced, in ``verl.utils.device`` and in
    every verl module already imported that bound it by name (``from
    verl.utils.device import get_torch_device``), by one that returns the
    :class:`_CPUDeviceModule` stand-in; modules imported later bind the
    replacement. Refuses a host where verl 0.8 detected an accelerator.
    """
    import sys

    from verl.utils import device as verl_device

    original = _require(verl_device, "get_torch_device", "verl.utils.device.get_torch_device")
    if getattr(original, _TORCH_DEVICE_PATCHED, False):
        return
    device_name = _require(verl_device, "get_device_name", "verl.utils.device.get_device_name")()
    if device_name != "cpu":
        raise RuntimeError(
            f"verl_klcov_global CPU support: verl detected device {device_name!r}; the CPU harness on verl 0.8 "
            "runs only where verl's own detection says \"cpu\" (hide accelerators, e.g. CUDA_VISIBLE_DEVICES=)."
        )
    _require(verl_device, "get_device_id", "verl.utils.device.get_device_id")
    module = _CPUDeviceModule()

    def get_torch_device() -> Any:
        return module

    setattr(get_torch_device, _TORCH_DEVICE_PATCHED, True)
    get_torch_device._original = original  # type: ignore[attr-defined]
    for name, loaded in list(sys.modules.items()):
        if (name == "verl" or name.startswith("verl.")) and getattr(loaded, "get_torch_device", None) is original:
            loaded.get_torch_device = get_torch_device


_PADDING_PATCHED = "__verl_klcov_padding_fallback__"


def _torch_index_first_axis(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return tensor[indices]


def _torch_pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    output = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    output[indices] = hidden_states
    return output.view(batch, seqlen, *hidden_states.shape[1:])


def _torch_unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask=None):
    all_masks = (attention_mask + unused_mask) if unused_mask is not None else attention_mask
    seqlens = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, int(seqlens.max().item()), used_seqlens


def _einops_rearrange(*args: Any, **kwargs: Any) -> Any:
    from einops import rearrange  # only this one needs einops, as in verl 0.9.1's fallback

    return rearrange(*args, **kwargs)


def ensure_padding_utils_without_flash_attn() -> None:
    """PATCH padding-utils-without-flash-attn (verl 0.8.0 ``utils/attention_utils.py``).

    verl's ``unpad_input`` / ``pad_input`` / ``index_first_axis`` (used by
    ``workers/utils/padding.left_right_2_no_padding``, i.e. the legacy trainer's minibatch) import
    ``flash_attn.bert_padding`` on every non-NPU host. verl 0.9.1 falls back to pure-torch
    equivalents when flash-attn is absent (CPU hosts); 0.8.0 raises ``ModuleNotFoundError``. When
    ``_get_attention_functions`` raises ``ImportError`` (0.8 on a host without flash-attn), it is
    replaced by one returning the same pure-torch functions 0.9.1 uses; otherwise nothing changes.
    """
    from verl.utils import attention_utils

    original = _require(attention_utils, "_get_attention_functions", "verl's attention-utils dispatcher")
    if getattr(original, _PADDING_PATCHED, False):
        return
    try:
        original()
        return  # flash-attn, NPU kernels or verl's own fallback: nothing to do
    except ImportError:
        pass
    functions = (_torch_index_first_axis, _torch_pad_input, _einops_rearrange, _torch_unpad_input)

    def _get_attention_functions() -> tuple[Callable, Callable, Callable, Callable]:
        return functions

    setattr(_get_attention_functions, _PADDING_PATCHED, True)
    _get_attention_functions._original = original  # type: ignore[attr-defined]
    attention_utils._get_attention_functions = _get_attention_functions


def install_cpu_platform() -> None:
    """Install the CPU platform, CPU engine registration and patches (idempotent).

    verl 0.9.x: :class:`CPUPlatform` through ``verl.plugin.platform`` plus PATCH
    import-time-device-name. verl 0.8.x (no platform plugin; device detection
    already says "cpu" on a CPU host): PATCH cpu-torch-device. Both: PATCH
    engine-registry-cpu, fsdp1-sync-module-states-cpu, padding-utils-without-flash-attn
    (a no-op where verl has its own fallback) and value-head-model-sdpa.

    Call before building any engine. Safe to call many times and in every
    spawned process.
    """
    global _INSTALLED
    if _INSTALLED:
        return
    if has_platform_plugin():
        _install_platform_plugin()
    else:
        _patch_cpu_torch_device()
    _register_cpu_engines()
    _patch_fsdp1_sync_module_states_cpu()
    ensure_padding_utils_without_flash_attn()
    _patch_value_head_model_sdpa()
    _INSTALLED = True


def _patch_value_head_model_sdpa() -> None:
    """PATCH value-head-model-sdpa (verl 0.8-0.9.1 ``utils/model.py`` ``load_valuehead_model``, which the critic's
    FSDP engine imports when it builds): verl loads the critic's token-classification model with
    ``attn_implementation="flash_attention_2"`` whatever the model config says; a CPU has no flash-attention, so
    load it with sdpa (the attention the lab's actors use). Models without a token-classification head still go to
    verl's own loader (its trl route)."""
    from verl.utils import model as verl_model

    original = _require(verl_model, "load_valuehead_model", "critic model loader")
    if getattr(original, "_cpu_sdpa", False):
        return

    @functools.wraps(original)
    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        from transformers import AutoModelForTokenClassification

        try:
            return AutoModelForTokenClassification.from_pretrained(
                pretrained_model_name_or_path=local_path, torch_dtype=torch_dtype, config=model_config,
                attn_implementation="sdpa", trust_remote_code=trust_remote_code)
        except ValueError:  # no token-classification head for this architecture
            return original(local_path, torch_dtype, model_config, trust_remote_code)

    load_valuehead_model._cpu_sdpa = True
    verl_model.load_valuehead_model = load_valuehead_model


# ---------------------------------------------------------------------------
# Process group
# ---------------------------------------------------------------------------


def find_free_port() -> int:
    """Return a TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_process_group_cpu(
    rank: int = 0, world_size: int = 1, port: Optional[int] = None, backend: str = "gloo"
) -> None:
    """Initialise torch.distributed with ``backend`` ("gloo"; "cpu:gloo,cuda:nccl" on a GPU) on 127.0.0.1.

    Sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT. No-op when already initialised with the same world size;
    raises when initialised with another one.
    """
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError(
                f"torch.distributed already initialised with world_size={dist.get_world_size()}, "
                f"asked for {world_size}"
            )
        return
    if port is None:
        port = find_free_port()
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, init_method="env://")


# ---------------------------------------------------------------------------
# Engine
# ---------------------------------------------------------------------------

_DTYPES = {
    "fp32": {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
    "bf16": {"param_dtype": "bf16", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
}


def fsdp_engine_configs(
    model_path: str,
    *,
    strategy: str = "fsdp",
    dtype: str = "fp32",
    lr: float = 0.02,
    clip_grad: float = 0.05,
    weight_decay: float = 0.0,
    use_remove_padding: bool = False,
    use_dynamic_bsz: bool = False,
    micro_batch_size_per_gpu: Optional[int] = 8,
    max_token_len_per_gpu: Optional[int] = 2048,
    infer_micro_batch_size_per_gpu: Optional[int] = 16,
    infer_max_token_len_per_gpu: Optional[int] = 4096,
    gradient_checkpointing: bool = False,
    optimizer: str = "SGD",
    lora_rank: int = 0,
    lora_alpha: int = 16,
    param_offload: bool = False,
    optimizer_offload: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """verl's model/engine/optimizer/checkpoint configs of :func:`build_fsdp_engine`.

    Keys ``model_config``, ``engine_config``, ``optimizer_config``, ``checkpoint_config``:
    what ``EngineRegistry.new`` and verl's ``TrainingWorkerConfig`` take. sdpa attention.

    Args:
        strategy: "fsdp" (FSDP1) or "fsdp2".
        dtype: "fp32" (no autocast) or "bf16" (FSDP param_dtype bf16,
            reduce/buffer fp32; verl sets ``_autocast_dtype=bf16`` and runs the
            forward under ``torch.autocast``). Master weights fp32.
        lr, clip_grad, weight_decay: constant LR, no warmup; weight decay 0 so
            parameters move only by gradients.
        optimizer: a ``torch.optim`` class name: "SGD" (default: no optimizer
            state, so parameter differences are gradient differences) or
            "AdamW" (verl's default; the GPU kit's realistic step).
        use_remove_padding: engine-level flag (verl's monkey patch); the
            per-batch ``use_remove_padding`` key should agree with it.
        use_dynamic_bsz, micro_batch_size_per_gpu, max_token_len_per_gpu,
        infer_*: stored in the engine config (what ``TrainingWorker`` would
            inject); the batch's own non-tensor keys take precedence.
        lora_rank, lora_alpha: verl's LoRA (peft, ``target_modules="all-linear"``); rank 0 trains every weight.
        param_offload, optimizer_offload: verl's FSDP offload flags (on a CPU the moves stay on the host, but
            verl's offload and load calls all run).
        seed: ``FSDPEngineConfig.seed``.
    """
    if strategy not in ("fsdp", "fsdp2"):
        raise ValueError(f"strategy must be 'fsdp' or 'fsdp2', got {strategy!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

    model_config = HFModelConfig(
        path=model_path,
        override_config={"attn_implementation": "sdpa"},
        use_remove_padding=use_remove_padding,
        enable_gradient_checkpointing=gradient_checkpointing,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        target_modules="all-linear",
    )
    model_config.model_type = "language_model"
    engine_config = FSDPEngineConfig(
        strategy=strategy,
        model_dtype="fp32",
        mixed_precision=dict(_DTYPES[dtype]),
        use_dynamic_bsz=use_dynamic_bsz,
        micro_batch_size_per_gpu=micro_batch_size_per_gpu,
        max_token_len_per_gpu=max_token_len_per_gpu,
        infer_micro_batch_size_per_gpu=infer_micro_batch_size_per_gpu,
        infer_max_token_len_per_gpu=infer_max_token_len_per_gpu,
        use_remove_padding=use_remove_padding,
        use_torch_compile=False,
        param_offload=param_offload,
        optimizer_offload=optimizer_offload,
        seed=seed,
    )
    optimizer_config = FSDPOptimizerConfig(
        optimizer=optimizer,
        optimizer_impl="torch.optim",
        lr=lr,
        clip_grad=clip_grad,
        weight_decay=weight_decay,
        lr_scheduler_type="constant",
        lr_warmup_steps=0,
        lr_warmup_steps_ratio=0.0,
    )
    return dict(model_config=model_config, engine_config=engine_config, optimizer_config=optimizer_config,
                checkpoint_config=CheckpointConfig())


def build_fsdp_engine(model_path: str, *, device: str = "cpu", seed: int = 0, **options: Any):
    """Build and ``initialize()`` verl's ``FSDPEngineWithLMHead`` (on CPU by default).

    Args:
        model_path: local HF model dir (e.g. from ``_tiny.build_tiny_model``);
            weights are loaded from it, so they are identical on every call.
        device: "cpu" (installs the CPU platform, gloo) or "cuda" (verl's own
            platform, one NCCL rank).
        seed: ``FSDPEngineConfig.seed``; also seeds torch's CPU RNG.
        options: the engine's settings, see :func:`fsdp_engine_configs`.

    Initialises a world-size-1 group when none exists (for more ranks call
    :func:`init_process_group_cpu` first). Collective over the group.
    """
    if device == "cpu":
        install_cpu_platform()
        if not dist.is_initialized():
            init_process_group_cpu()
    elif not dist.is_initialized():  # an accelerator: verl's own platform, one NCCL rank
        # verl's workers init "cpu:gloo,cuda:nccl" (utils/distributed.py), so CPU-tensor collectives work too
        init_process_group_cpu(backend=f"cpu:gloo,{device}:nccl")
        getattr(torch, device).set_device(int(os.environ["LOCAL_RANK"]))  # as verl's init does

    from verl.workers.engine.base import EngineRegistry

    torch.manual_seed(seed)
    configs = fsdp_engine_configs(model_path, seed=seed, **options)
    engine = EngineRegistry.new(model_type="language_model", backend=configs["engine_config"].strategy, **configs)
    engine.initialize()
    return engine


def engine_params_flat(engine, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Full (unsharded) model state as a 1-D tensor of length P, in ``dtype`` (float64 by default; float32 holds
    an fp32 model's values exactly in half the memory).

    Gathers the full state dict on every rank (a collective: call it on all
    ranks) with ``torch.distributed.checkpoint.state_dict.get_model_state_dict``,
    which handles FSDP1 and FSDP2 and returns plain HF key names; the values
    are concatenated in sorted-key order, so the layout is identical for every
    strategy and world size. For Qwen2 the state dict holds parameters only
    (``rotary_emb.inv_freq`` is a non-persistent buffer). Tied input and output embeddings (SmolLM2) appear
    under both their keys, as in the HF model's own ``state_dict()``: the layout
    :meth:`experiments.policy_rollout.PolicySampler.load_flat` reads.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(engine.module, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return torch.cat([_full(state[k]).detach().reshape(-1).to(dtype) for k in sorted(state)])


def _full(t: torch.Tensor) -> torch.Tensor:
    """Materialise a DTensor (FSDP2) or return a plain tensor."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


# ---------------------------------------------------------------------------
# Multi-process helper
# ---------------------------------------------------------------------------


def _spawn_entry(rank: int, fn: Callable, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    """Child-process body of :func:`spawn`: one CPU thread share, run, save."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    result = fn(rank, world_size, port, *args)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, world_size, port, *args)`` in ``world_size`` processes.

    ``fn`` must be importable (module level) and should call
    ``init_process_group_cpu(rank, world_size, port)``. A fresh free port is
    picked per call. An exception in any rank is raised here
    (``torch.multiprocessing.ProcessRaisedException``). Returns the list of
    per-rank return values (passed back with ``torch.save``/``torch.load``).
    """
    import torch.multiprocessing as mp

    port = find_free_port()
    with tempfile.TemporaryDirectory(prefix="verl_klcov_spawn_") as out_dir:
        mp.spawn(_spawn_entry, args=(fn, world_size, port, out_dir, args), nprocs=world_size, join=True)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
