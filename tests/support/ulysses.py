"""Run verl's Ulysses sequence parallelism on CPU (gloo), for tests only.

verl 0.9.1 wires Ulysses into flash-attention only: with ``use_remove_padding=True`` (or an SP size
> 1), ``verl.models.transformers.monkey_patch.apply_monkey_patch`` replaces transformers'
``integrations.flash_attention._flash_attention_forward`` by ``_ulysses_flash_attention_forward``,
which all-to-alls (sequence shards -> head shards), all-gathers ``position_ids``, calls the varlen
kernel it imported as ``monkey_patch._flash_attention_forward`` and all-to-alls back. flash-attn
does not exist on CPU, so this module supplies the two missing ends and leaves verl's middle alone:

* the attention implementation :data:`ATTN_IMPLEMENTATION`, registered in transformers'
  ``AttentionInterface`` as transformers' own ``flash_attention_forward`` -- the entry that calls
  the function verl patched;
* TEST PATCH ``cpu-varlen-kernel`` (verl 0.9.1, transformers 5.x): ``monkey_patch._flash_attention_forward``
  (the flash-attn varlen call at the bottom of verl's Ulysses forward) is replaced, inside
  :func:`cpu_varlen_attention`, by :func:`varlen_attention_cpu` -- causal attention per packed
  sequence, sequences found from ``position_ids``, with torch's sdpa.

:func:`cpu_varlen_attention` also counts what ran: kernel calls with their head counts, and verl's
``all_to_all_tensor`` calls (the Ulysses all-to-all, forward and backward), so a test can show that
SP really went through verl's Ulysses path and not around it.

:class:`UlyssesEngineSpec` builds the FSDP engine of ``experiment.EngineSpec`` with that attention,
``use_remove_padding=True`` (Ulysses needs it) and ``ulysses_sequence_parallel_size``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from verl_klcov_global.lab import cpu as _cpu
from verl_klcov_global.lab.experiment import EngineSpec

ATTN_IMPLEMENTATION = "verl_klcov_test_cpu_varlen"


@dataclass
class UlyssesCounts:
    """What went through verl's Ulysses attention path in this process.

    ``kernel_heads``, ``kernel_kv_heads``: query and key/value heads per kernel call (the model's
    heads / SP size after the all-to-all; key/value heads repeated first when fewer than SP size).
    ``kernel_tokens``: packed tokens per kernel call (the whole micro-batch after the all-to-all).
    ``all_to_all``: calls of verl's ``verl.utils.ulysses.all_to_all_tensor`` (4 per attention
    forward, 4 more per backward).
    """

    kernel_heads: list[int] = field(default_factory=list)
    kernel_kv_heads: list[int] = field(default_factory=list)
    kernel_tokens: list[int] = field(default_factory=list)
    all_to_all: int = 0

    @property
    def kernel_calls(self) -> int:
        return len(self.kernel_heads)


_UNSUPPORTED = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "cu_seqlens")


def varlen_attention_cpu(
    query_states: torch.Tensor,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    query_length: int,
    *args: Any,
    position_ids: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    dropout: float = 0.0,
    softmax_scale: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    s_aux: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> torch.Tensor:
    """flash-attn's varlen forward for one packed row, on CPU (the signature verl calls).

    Args:
        query_states: (1, L, H, D); key_states, value_states: (1, L, H_kv, D), H a multiple of H_kv.
        attention_mask: must be None (packed input: sequences come from ``position_ids``).
        position_ids: (1, L); a sequence starts wherever the position does not continue the
            previous one by +1 (as transformers' ``find_packed_sequence_indices``), which also
            separates verl's Ulysses padding (positions ``0..pad-1``).

    Returns (1, L, H, D): causal attention within each sequence, ``softmax_scale`` or 1/sqrt(D).
    Raises on anything it does not implement (dropout, sliding window, softcap, sinks, a mask,
    explicit cu_seqlens) instead of ignoring it.
    """
    bad = [k for k in _UNSUPPORTED if kwargs.get(k) is not None]
    if args or attention_mask is not None or position_ids is None or dropout or sliding_window or softcap or bad \
            or s_aux is not None or query_states.shape[0] != 1:
        raise NotImplementedError(
            "test varlen attention: packed (1, L) input with position_ids only; got "
            f"args={len(args)} mask={attention_mask is not None} position_ids={position_ids is not None} "
            f"dropout={dropout} sliding_window={sliding_window} softcap={softcap} s_aux={s_aux is not None} "
            f"kwargs={bad} batch={query_states.shape[0]}"
        )
    positions = position_ids.reshape(-1)
    if positions.numel() != query_states.shape[1]:
        raise ValueError(f"position_ids hold {positions.numel()} tokens, query {query_states.shape[1]}")
    starts = (torch.nonzero(torch.diff(positions) != 1).flatten() + 1).tolist()
    bounds = [0] + starts + [positions.numel()]
    q, k, v = (t[0].transpose(0, 1) for t in (query_states, key_states, value_states))  # (H, L, D)
    pieces = [
        F.scaled_dot_product_attention(
            q[:, s:e], k[:, s:e], v[:, s:e], is_causal=is_causal, scale=softmax_scale, enable_gqa=True
        )
        for s, e in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(pieces, dim=1).transpose(0, 1).unsqueeze(0)


def _register_attention() -> None:
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, flash_attention_forward)


@contextlib.contextmanager
def cpu_varlen_attention() -> Iterator[UlyssesCounts]:
    """Register :data:`ATTN_IMPLEMENTATION` (it stays registered) and apply TEST PATCH ``cpu-varlen-kernel``
    for the block.

    Yields the :class:`UlyssesCounts` of this process, filled while the block runs. Restores verl's
    kernel and ``all_to_all_tensor`` on exit. Raises when the verl/transformers seams moved.
    """
    from transformers.integrations import flash_attention
    from verl.models.transformers import monkey_patch
    from verl.utils import ulysses

    for module, name in ((monkey_patch, "_flash_attention_forward"), (monkey_patch, "_ulysses_flash_attention_forward"),
                         (ulysses, "all_to_all_tensor"), (flash_attention, "_flash_attention_forward")):
        if not hasattr(module, name):
            raise RuntimeError(f"{module.__name__}.{name} is gone: re-check the test Ulysses CPU patch for this verl")
    _register_attention()
    counts = UlyssesCounts()
    kernel, all_to_all = monkey_patch._flash_attention_forward, ulysses.all_to_all_tensor

    def counted_kernel(query_states, key_states, *args, **kwargs):
        counts.kernel_heads.append(query_states.shape[2])
        counts.kernel_kv_heads.append(key_states.shape[2])
        counts.kernel_tokens.append(query_states.shape[1])
        return varlen_attention_cpu(query_states, key_states, *args, **kwargs)

    def counted_all_to_all(*args, **kwargs):
        counts.all_to_all += 1
        return all_to_all(*args, **kwargs)

    monkey_patch._flash_attention_forward = counted_kernel
    ulysses.all_to_all_tensor = counted_all_to_all
    try:
        yield counts
    finally:
        monkey_patch._flash_attention_forward = kernel
        ulysses.all_to_all_tensor = all_to_all


@dataclass(frozen=True)
class UlyssesEngineSpec(EngineSpec):
    """``EngineSpec`` with the test varlen attention, packed input and Ulysses SP of ``sp_size``.

    Build it inside :func:`cpu_varlen_attention` (the model needs the registered attention).
    """

    use_remove_padding: bool = True
    sp_size: int = 1

    def build(self):
        if not self.use_remove_padding:
            raise ValueError("verl's Ulysses SP needs use_remove_padding=True")
        if self.device != "cpu":
            raise ValueError(f"UlyssesEngineSpec runs on CPU (gloo) only, got device={self.device!r}")
        _cpu.install_cpu_platform()
        if not dist.is_initialized():
            _cpu.init_process_group_cpu()
        from verl.workers.engine.base import EngineRegistry

        seed = 0  # as _cpu.build_fsdp_engine
        torch.manual_seed(seed)
        configs = _cpu.fsdp_engine_configs(
            self.model_path, strategy=self.strategy, dtype=self.dtype, lr=self.lr, clip_grad=self.clip_grad,
            use_remove_padding=True, infer_micro_batch_size_per_gpu=self.infer_micro_batch_size_per_gpu,
            infer_max_token_len_per_gpu=self.infer_max_token_len_per_gpu, seed=seed,
        )
        model_config = configs["model_config"]
        configs["model_config"] = dataclasses.replace(
            model_config, override_config={**model_config.override_config, "attn_implementation": ATTN_IMPLEMENTATION}
        )
        configs["engine_config"] = dataclasses.replace(
            configs["engine_config"], ulysses_sequence_parallel_size=self.sp_size
        )
        engine = EngineRegistry.new(model_type="language_model", backend=self.strategy, **configs)
        engine.initialize()
        return engine
