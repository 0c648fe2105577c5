"""The only module that touches verl internals: the per-optimizer-step prepass hook.

Target: verl 0.9.1. Every patch is listed here, named, and checked by
``tests/test_hook_patches.py`` so that an upstream change fails loudly.

PATCH ``train_batch_prepass``: wraps ``verl.workers.engine.base.BaseEngine.train_batch``
(verl 0.9.1 ``workers/engine/base.py`` ~113; signature ``(self, data, loss_function)``;
one call per optimizer step, made by ``TrainingWorker.train_batch`` for every
minibatch and PPO epoch). Every engine inherits it. When the loss function's
actor config selects a global loss mode (``kl_cov_global`` or ``clip_cov_global``,
:mod:`verl_klcov_global.modes`) the wrapper, before verl's own step:

1. runs a no-grad forward of the whole minibatch that computes only log-probs
   (:func:`compute_prepass_log_probs`), RNG states restored afterwards -- one prepass
   for every mode;
2. selects tokens over the minibatch and the data-parallel group with that mode's
   selection (``GlobalLossMode.select``);
3. stores the mask as the per-token field ``kl_cov_global_mask`` of the
   minibatch, in the layout of ``response_mask`` (nested or padded), so verl's
   micro-batch splitting (static or dynamic, which reorders samples) carries
   each slice to its micro-batch;
4. calls verl's ``train_batch`` with the loss function wrapped so that each
   micro-batch's loss call runs inside ``provide_selection_mask(<its slice>)``.

Every other loss mode runs verl's ``train_batch`` untouched.

PATCH ``prepass_batched_logsumexp`` (prepass only, inside :func:`compute_prepass_log_probs`):
swaps ``verl.utils.torch_functional.logprobs_from_logits_v2`` (verl 0.9.1 ~173, the
path ``logprobs_from_logits`` takes without flash-attn / NPU kernels, e.g. on CPU) for
a version that calls ``torch.logsumexp`` once per chunk of rows instead of once per
row, while the no-grad prepass runs; restored afterwards. verl loops per row to bound
peak memory under autograd; without grad a chunk of ``_LOGSUMEXP_CHUNK_ELEMENTS``
logits bounds it the same way. CPU logits only, where the results are bit-identical to
verl's loop (tests/test_hook_patches.py); bf16/fp16 and accelerator logits keep verl's path.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.workers.engine.base import BaseEngine
from verl.workers.utils.padding import no_padding_2_padding

from .config import MASK_KEY
from .loss import provide_selection_mask
from .modes import KL_COV, GlobalLossMode, Selection, fit_width, global_mode_of, padded  # noqa: F401 (re-exported)

TARGET_VERL_VERSION = "0.9.1"
SUPPORTED_STRATEGIES = ("fsdp", "fsdp2")
_ORIGINAL_ATTR = "__verl_klcov_global_original__"
_SELECTION_OBSERVERS: list[Callable[[BaseEngine, "PrepassResult"], None]] = []
_LOGSUMEXP_CHUNK_ELEMENTS = 1 << 24  # logits per logsumexp call in the prepass (64 MiB in fp32)


class UnsupportedEngineError(RuntimeError):
    """A global loss mode was selected on an engine the prepass hook does not cover."""


@dataclass(frozen=True)
class PrepassResult:
    """Outcome of one optimizer step's prepass and selection.

    ``selection.mask`` is (batch, response_len) bool over this rank's minibatch,
    in its original sample order; ``mode`` is the loss mode that made it.
    """

    selection: Selection
    prepass_seconds: float
    selection_seconds: float
    mode: GlobalLossMode = KL_COV


# ---------------------------------------------------------------------------------------------
# Installation


def install_hook() -> None:
    """Install PATCH ``train_batch_prepass`` (idempotent). Raises if verl's target moved."""
    current = BaseEngine.train_batch
    if getattr(current, _ORIGINAL_ATTR, None) is not None:
        return
    params = list(inspect.signature(current).parameters)
    if params != ["self", "data", "loss_function"]:
        raise RuntimeError(
            f"verl_klcov_global targets verl {TARGET_VERL_VERSION}: BaseEngine.train_batch(self, data, "
            f"loss_function) was expected, found parameters {params}. Pin verl==0.9.1 or update the plugin."
        )

    @functools.wraps(current)
    def train_batch(self, data: TensorDict, loss_function: Callable) -> Any:
        return _train_batch_with_prepass(current, self, data, loss_function)

    setattr(train_batch, _ORIGINAL_ATTR, current)
    BaseEngine.train_batch = train_batch


@contextlib.contextmanager
def observe_selections(callback: Callable[[BaseEngine, "PrepassResult"], None]) -> Iterator[None]:
    """Call ``callback(engine, result)`` after every prepass selection made inside this block.

    For diagnostics and tests: the mask is deleted from the minibatch after the step.
    """
    _SELECTION_OBSERVERS.append(callback)
    try:
        yield
    finally:
        _SELECTION_OBSERVERS.remove(callback)


def is_hook_installed() -> bool:
    """True when PATCH ``train_batch_prepass`` is active in this process."""
    return getattr(BaseEngine.train_batch, _ORIGINAL_ATTR, None) is not None


def uninstall_hook() -> None:
    """Restore verl's own ``BaseEngine.train_batch`` (for tests)."""
    original = getattr(BaseEngine.train_batch, _ORIGINAL_ATTR, None)
    if original is not None:
        BaseEngine.train_batch = original


# ---------------------------------------------------------------------------------------------
# The wrapped optimizer step


def actor_config_of(loss_function: Optional[Callable]) -> Any:
    """The actor config bound into verl's loss function (``partial(ppo_loss, config=...)``), or None."""
    keywords = getattr(loss_function, "keywords", None) or {}
    return keywords.get("config")


def _train_batch_with_prepass(original: Callable, engine: BaseEngine, data: TensorDict, loss_function: Callable):
    actor_config = actor_config_of(loss_function)
    mode = global_mode_of(actor_config)
    if mode is None:
        return original(engine, data, loss_function)
    settings = mode.read_settings(actor_config)
    require_supported_engine(engine, mode.name)

    prepass = run_prepass_and_select(engine, data, settings, mode)
    for observer in list(_SELECTION_OBSERVERS):
        observer(engine, prepass)
    data[MASK_KEY] = mask_in_layout_of(prepass.selection.mask, data["response_mask"])
    try:
        outputs = original(
            engine, data, functools.partial(_loss_with_mask_slice, loss_function, prepass.selection.figures())
        )
    finally:
        del data[MASK_KEY]
    if isinstance(outputs, dict) and isinstance(outputs.get("metrics"), dict):
        prefix = mode.metric_prefix
        outputs["metrics"][f"{prefix}prepass_seconds"] = Metric(AggregationType.MEAN, prepass.prepass_seconds)
        outputs["metrics"][f"{prefix}selection_seconds"] = Metric(AggregationType.MEAN, prepass.selection_seconds)
    return outputs


def require_supported_engine(engine: BaseEngine, loss_mode: str = KL_COV.name) -> None:
    """Raise :class:`UnsupportedEngineError` unless ``engine`` is verl's FSDP engine (fsdp or fsdp2)."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    strategy = getattr(getattr(engine, "engine_config", None), "strategy", None)
    if not isinstance(engine, FSDPEngineWithLMHead) or strategy not in SUPPORTED_STRATEGIES:
        raise UnsupportedEngineError(
            f"loss_mode={loss_mode} supports verl's FSDP engine only (actor strategy {SUPPORTED_STRATEGIES}); "
            f"this actor runs {type(engine).__name__} with strategy {strategy!r}. Set "
            f"actor_rollout_ref.actor.strategy=fsdp2 (or fsdp), or use loss_mode={loss_mode.removesuffix('_global')} "
            "(per-micro-batch selection)."
        )


def _loss_with_mask_slice(loss_function: Callable, figures: dict, *args, **kwargs):
    """verl's loss function, called inside ``provide_selection_mask`` with this micro-batch's mask slice.

    verl also passes the same function as a logits processor for top-k distillation
    (``logits_processor_func(student_logits=..., data=...)``, verl 0.9.1
    transformer_impl.py ~1413): such calls compute no policy loss and go through untouched.
    """
    if "student_logits" in kwargs:
        return loss_function(*args, **kwargs)
    return _policy_loss_with_mask_slice(loss_function, figures, *args, **kwargs)


def _policy_loss_with_mask_slice(loss_function: Callable, figures: dict, model_output, data: TensorDict,
                                 dp_group=None):
    if MASK_KEY not in data.keys():
        raise RuntimeError(
            f"micro-batch lost the per-token field {MASK_KEY!r} on its way from the minibatch: verl's micro-batch "
            f"splitting changed (plugin targets verl {TARGET_VERL_VERSION})"
        )
    # Same conversion verl's ppo_loss applies to response_mask, so the shapes match.
    mask = data.select("response_mask", MASK_KEY).to_padded_tensor()[MASK_KEY].bool()
    with provide_selection_mask(mask, figures):
        return loss_function(model_output=model_output, data=data, dp_group=dp_group)


# ---------------------------------------------------------------------------------------------
# Prepass and selection


def run_prepass_and_select(engine: BaseEngine, data: TensorDict, settings: Any,
                           mode: GlobalLossMode = KL_COV) -> PrepassResult:
    """No-grad log-probs of the whole minibatch, then ``mode``'s one selection over it and the DP group."""
    started = time.perf_counter()
    log_probs = compute_prepass_log_probs(engine, data, settings.prepass_layout)
    selected_at = time.perf_counter()
    group = engine.get_data_parallel_group() if dist.is_available() and dist.is_initialized() else None
    selection = mode.select(log_probs, data, settings, group)
    finished = time.perf_counter()
    return PrepassResult(
        selection=selection, prepass_seconds=selected_at - started, selection_seconds=finished - selected_at,
        mode=mode,
    )


def prepass_micro_batching(engine: BaseEngine, data: TensorDict, layout: str) -> dict[str, Any]:
    """Non-tensor micro-batch keys of the prepass for ``layout`` ("infer" or "train")."""
    use_dynamic_bsz = tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True)
    if layout == "train":
        return {}
    engine_config = engine.engine_config
    if use_dynamic_bsz:
        if engine_config.infer_max_token_len_per_gpu is None:
            raise ValueError(
                "kl_cov_global's prepass uses the log-prob inference layout, but infer_max_token_len_per_gpu is not "
                "set: set actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu, or "
                "actor_rollout_ref.actor.policy_loss.prepass_layout=train"
            )
        return {"max_token_len_per_gpu": engine_config.infer_max_token_len_per_gpu}
    if engine_config.infer_micro_batch_size_per_gpu is None:
        raise ValueError(
            "kl_cov_global's prepass uses the log-prob inference layout, but infer_micro_batch_size_per_gpu is not "
            "set: set actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu, or "
            "actor_rollout_ref.actor.policy_loss.prepass_layout=train"
        )
    return {"micro_batch_size_per_gpu": largest_divisor_at_most(len(data), engine_config.infer_micro_batch_size_per_gpu)}


def largest_divisor_at_most(rows: int, limit: int) -> int:
    """The largest micro-batch size <= ``limit`` that divides ``rows``.

    verl's static micro-batching asserts that the size divides the batch; verl only applies
    the inference size to a whole compute_log_prob batch, but the prepass applies it to one
    optimizer minibatch, which can be smaller than or not a multiple of it.
    """
    return max(size for size in range(1, max(1, min(rows, limit)) + 1) if rows % size == 0)


def compute_prepass_log_probs(engine: BaseEngine, data: TensorDict, layout: str) -> torch.Tensor:
    """Current-policy log-probs of every response token of ``data``: (batch, max_response_len), padded.

    A no-grad forward in eval mode (no dropout) that computes only log-probs: no
    entropy, no distillation; the module's mode and the CPU/device RNG states are
    restored afterwards, so the training step that follows is unchanged. (verl's kl_cov
    scores tokens with the training forward's train-mode log-probs; the two differ only
    for models with active dropout or router noise.)
    """
    prepass_data = data.copy()  # shallow: new keys here do not reach the training step
    tu.assign_non_tensor(
        prepass_data,
        calculate_entropy=False,
        calculate_sum_pi_squared=False,
        distillation_use_topk=False,
        distillation_only=False,
        **prepass_micro_batching(engine, data, layout),
    )
    module = engine.module
    was_training = module.training
    with preserved_rng_states(), batched_logsumexp():
        module.eval()
        try:
            output = engine.infer_batch(prepass_data, loss_function=None)
        finally:
            module.train(was_training)
    return no_padding_2_padding(output["model_output"]["log_probs"], prepass_data)


@contextlib.contextmanager
def batched_logsumexp() -> Iterator[None]:
    """PATCH ``prepass_batched_logsumexp``: no-grad float32/64 log-probs with one logsumexp per chunk of rows."""
    import verl.utils.torch_functional as verl_F

    original = verl_F.logprobs_from_logits_v2
    if list(inspect.signature(original).parameters) != ["logits", "labels"]:
        raise RuntimeError(
            f"verl_klcov_global targets verl {TARGET_VERL_VERSION}: logprobs_from_logits_v2(logits, labels) "
            "was expected. Pin verl==0.9.1 or update the plugin."
        )

    def logprobs_from_logits_chunked(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        exact_dtype = logits.dtype in (torch.float32, torch.float64)  # verl's bf16/fp16 path stays untouched
        # CPU only: there one batched reduction is bit-identical to verl's per-row loop (tested);
        # an accelerator's reduction order may differ in the last bit.
        on_cpu = logits.device.type == "cpu"
        if torch.is_grad_enabled() or not exact_dtype or not on_cpu or logits.dim() < 2 or not logits.shape[0]:
            return original(logits, labels)
        logits_labels = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
        rows = max(1, _LOGSUMEXP_CHUNK_ELEMENTS // max(1, logits[0].numel()))
        logsumexp_values = torch.cat([torch.logsumexp(chunk, dim=-1) for chunk in logits.split(rows)])
        return logits_labels - logsumexp_values

    verl_F.logprobs_from_logits_v2 = logprobs_from_logits_chunked
    try:
        yield
    finally:
        verl_F.logprobs_from_logits_v2 = original


@contextlib.contextmanager
def preserved_rng_states() -> Iterator[None]:
    """Restore the CPU RNG and, on an accelerator, the current device's RNG on exit."""
    cpu_state = torch.random.get_rng_state()
    device_module = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device_module = torch.cuda
    elif hasattr(torch, "npu") and torch.npu.is_available():  # pragma: no cover - Ascend only
        device_module = torch.npu
    device_state = device_module.get_rng_state() if device_module is not None else None
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu_state)
        if device_module is not None:
            device_module.set_rng_state(device_state)


# ---------------------------------------------------------------------------------------------
# Layout helpers


# ``padded`` and ``fit_width`` (reading the minibatch) live in modes.py, imported above.


def mask_in_layout_of(mask: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``mask`` (batch, width) bool, laid out like ``response_mask`` (nested or padded), in its dtype and on its device.

    The prepass's mask lives where the log-probs were computed (the accelerator); the minibatch
    TensorDict usually lives on the host until verl moves each micro-batch.
    """
    mask = mask.to(response_mask.device)
    if not response_mask.is_nested:
        return mask[:, : response_mask.shape[1]].to(response_mask.dtype)
    offsets = response_mask.offsets()
    lengths = offsets.diff()
    positions = torch.arange(mask.shape[1], device=mask.device)
    inside = positions.unsqueeze(0) < lengths.to(mask.device).unsqueeze(1)
    values = mask[inside].to(response_mask.dtype)
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets.to(values.device))
