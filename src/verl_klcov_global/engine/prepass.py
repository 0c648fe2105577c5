"""The only module that touches verl internals: the per-optimizer-step prepass hook.

Targets: verl 0.9.1 and 0.8.0 (the line references below are 0.9.1's). Every patch is listed
here, named, and checked by ``tests/test_hook_patches.py``; the verl seams they rest on are
checked at import by :mod:`verl_klcov_global.seams`, so that an upstream change fails loudly.

PATCH ``train_batch_prepass``: wraps ``verl.workers.engine.base.BaseEngine.train_batch``
(verl 0.9.1 ``workers/engine/base.py`` ~113; signature ``(self, data, loss_function)``;
one call per optimizer step, made by ``TrainingWorker.train_batch`` for every
minibatch and PPO epoch). Every engine inherits it. When the loss function's
actor config selects a global loss mode (``kl_cov_global`` or ``clip_cov_global``,
:mod:`verl_klcov_global.modes`) the wrapper, before verl's own step:

0. frees the previous step's gradients (``engine.optimizer_zero_grad()``, set to None):
   verl's ``train_batch`` does exactly that as its first call, so doing it before the
   prepass changes nothing but the prepass's memory;
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

Micro-batching of the prepass (``prepass_layout``):

* ``infer`` (default): the log-prob inference budget verl's ``compute_log_prob`` uses.
  Dynamic batching: ``infer_max_token_len_per_gpu``, split by verl exactly as
  ``compute_log_prob`` would split this minibatch. Static: ``ceil(rows / size)`` forwards
  for ``size = infer_micro_batch_size_per_gpu``, row counts differing by at most one (so
  each <= size); the count is agreed over the DP group (max), because every forward
  all-gathers FSDP parameters on every rank; a rank that would need an empty forward
  makes every rank raise instead of hanging.
* ``train``: the training micro-batch keys of the minibatch, verl's own split.

Peak memory (the prepass must not exceed max(verl's compute_log_prob on the same
minibatch, the training step)). The prepass runs inside verl's train-mode context, where an
offloaded optimizer's states are already on the device; ``compute_log_prob`` runs without
them. So:

* ``optimizer_offload=False``: the states are on the device during ``compute_log_prob`` too;
  the prepass holds the same parameters and states, no gradients (step 0), and the same
  micro-batches (``infer``) or the training step's micro-batches without autograd (``train``).
* ``optimizer_offload=True`` with ``infer``: :func:`optimizer_states_off_device` moves the
  states to the host (verl's ``engine.to(..., optimizer=True)``) for the prepass and back
  before verl's step: two host<->device copies of this rank's optimizer-state shard per
  optimizer step. Then the prepass holds what ``compute_log_prob`` holds.
* ``optimizer_offload=True`` with ``train``: no copies; each prepass forward is a training
  micro-batch's forward without autograd and gradients, so it stays below the training step.

PATCH ``validate_config_driver_checks`` (driver only, :func:`install_driver_checks`): wraps
``verl.utils.config.validate_config`` (verl 0.8.0 / 0.9.1 ``utils/config.py``; signature
``(config, use_reference_policy, use_critic)``), which ``main_ppo`` calls before ``ray.init``, so
that :mod:`verl_klcov_global.driver` checks the plugin's knobs on the raw config and adds the
worker loader to the Ray runtime environment before any Ray process starts.

PATCH ``prepass_batched_logsumexp`` (prepass only, inside :func:`compute_prepass_log_probs`):
swaps ``verl.utils.torch_functional.logprobs_from_logits_v2`` (verl 0.9.1 ~173: the path
``logprobs_from_logits`` takes without flash-attn's cross-entropy kernel or with
``VERL_DISABLE_FLASH_ATTN_CE=1``, and without NPU kernels) while the no-grad prepass runs;
restored afterwards. verl loops over rows and allocates one row of temporaries per
``logsumexp``; for float32/float64 logits the patch computes ``label_logit - logsumexp`` for
all rows at once, in place in the logits (which the prepass reads nothing else from:
entropy, sum(pi^2) and distillation are off and verl computes them before the log-probs), so it
allocates only per-row vectors: less than verl's loop. On any device. What holds:

* CPU: bit-identical to verl's loop when verl sums each row in one thread (rows of at most
  32,768 logits, torch's reduction grain, or one intra-op thread). For wider rows with several
  threads verl's loop splits each row's sum over threads (its values depend on the thread
  count); the batched path sums every row in one thread, independent of the thread count and
  of how many rows share the call: the last bits may differ from verl's loop.
* Accelerators: self-consistency only. The same rows in the same micro-batch shapes give the
  same values run after run (reductions are deterministic), which is what the selection needs;
  the last bits may differ from verl's loop and between micro-batch shapes, as the model's
  own matmuls already do.

bf16/fp16 logits, grad-enabled calls and non-contiguous logits keep verl's path.

Observability: the prepass and the selection run under ``torch.profiler.record_function``
names :data:`PREPASS_RECORD_NAME` and :data:`SELECTION_RECORD_NAME`. Metrics added to verl's
step metrics (prefix: the mode's, ``actor/kl_cov/`` or ``actor/clip_cov/``): ``prepass_seconds`` (forward, including any
optimizer-state moves), ``selection_seconds``, ``prepass_share`` ((prepass + selection) /
wall time of the whole wrapped ``train_batch``: verl's ``mfu`` divides the training FLOPs by
that wall time) and ``selected_in_micro_batch`` (explicitly ``AggregationType.MEAN``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import sys
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

from . import driver
from .config import MASK_KEY, SUPPORTED_STRATEGIES
from .loss import provide_selection_mask
from .modes import KL_COV, GlobalLossMode, Selection, fit_width, global_mode_of, padded  # noqa: F401 (re-exported)
from .seams import known_versions_text

#: ``torch.profiler.record_function`` names of the prepass forward and of the selection.
PREPASS_RECORD_NAME = "verl_klcov_global.prepass"
SELECTION_RECORD_NAME = "verl_klcov_global.selection"
#: Selected tokens in one micro-batch's slice of the mask; MEAN over the micro-batches of an
#: optimizer step and the DP ranks (verl's ``Metric.aggregate_dp``), then over the optimizer steps.
#: Name of the per-micro-batch count of selected tokens, after the mode's metric prefix.
SELECTED_IN_MICRO_BATCH = "selected_in_micro_batch"
_ORIGINAL_ATTR = "__verl_klcov_global_original__"
_SELECTION_OBSERVERS: list[Callable[[BaseEngine, "PrepassResult"], None]] = []


class UnsupportedEngineError(RuntimeError):
    """A global loss mode was selected on an engine the prepass hook does not cover."""


@dataclass(frozen=True)
class PrepassResult:
    """Outcome of one optimizer step's prepass and selection.

    ``selection.mask`` is (batch, response_len) bool over this rank's minibatch,
    in its original sample order; ``mode`` is the loss mode that made it.
    ``optimizer_states_offloaded``: the optimizer states were moved off the device for the
    prepass (see :func:`optimizer_states_off_device`).
    """

    selection: Selection
    prepass_seconds: float
    selection_seconds: float
    mode: GlobalLossMode = KL_COV
    optimizer_states_offloaded: bool = False


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
            f"verl_klcov_global: seam BaseEngine.train_batch(self, data, loss_function) moved, found parameters "
            f"{params}. Known to work: verl {known_versions_text()}; install one of them or update the plugin."
        )

    @functools.wraps(current)
    def train_batch(self, data: TensorDict, loss_function: Callable) -> Any:
        return _train_batch_with_prepass(current, self, data, loss_function)

    setattr(train_batch, _ORIGINAL_ATTR, current)
    BaseEngine.train_batch = train_batch


#: Parameters of ``verl.utils.config.validate_config`` (verl 0.8.0 and 0.9.1 ``utils/config.py``).
VALIDATE_CONFIG_PARAMETERS = ["config", "use_reference_policy", "use_critic"]


def install_driver_checks() -> None:
    """Install PATCH ``validate_config_driver_checks`` (idempotent). Raises if verl's target moved.

    Wraps ``verl.utils.config.validate_config(config, use_reference_policy, use_critic)``, which
    verl's ``main_ppo`` (and ``main_ppo_v0``) calls in the driver before ``ray.init``:
    :func:`verl_klcov_global.driver.prepare_trainer_config` runs first (knob checks on the raw
    config, worker loading through the Ray runtime env), then verl's own checks. The plugin is
    imported on ``import verl``, before ``main_ppo`` runs ``from verl.utils.config import
    validate_config``, so ``main_ppo`` gets the wrapper; a ``verl.trainer.main_ppo`` module imported
    earlier is updated too.
    """
    import verl.utils.config as verl_config

    current = verl_config.validate_config
    if getattr(current, _ORIGINAL_ATTR, None) is not None:
        return
    params = list(inspect.signature(current).parameters)
    if params != VALIDATE_CONFIG_PARAMETERS:
        raise RuntimeError(
            f"verl_klcov_global: verl.utils.config.validate_config{tuple(VALIDATE_CONFIG_PARAMETERS)} was expected "
            f"(known to work: verl {known_versions_text()}), found parameters {params}: the plugin's driver checks "
            "cannot hook in. Install one of those verl versions or update the plugin."
        )

    @functools.wraps(current)
    def validate_config(config, *args, **kwargs):
        driver.prepare_trainer_config(config)
        return current(config, *args, **kwargs)

    setattr(validate_config, _ORIGINAL_ATTR, current)
    verl_config.validate_config = validate_config
    for name in ("verl.trainer.main_ppo", "verl.trainer.main_ppo_v0", "__main__"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "validate_config", None) is current:
            module.validate_config = validate_config


def uninstall_driver_checks() -> None:
    """Restore verl's own ``validate_config`` (for tests)."""
    import verl.utils.config as verl_config

    original = getattr(verl_config.validate_config, _ORIGINAL_ATTR, None)
    if original is not None:
        verl_config.validate_config = original


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

    started = time.perf_counter()
    # verl's train_batch starts with this very call (set_to_none): made before the prepass, it frees
    # the previous step's gradients for it instead of after it.
    engine.optimizer_zero_grad()
    prepass = run_prepass_and_select(engine, data, settings, mode)
    for observer in list(_SELECTION_OBSERVERS):
        observer(engine, prepass)
    data[MASK_KEY] = mask_in_layout_of(prepass.selection.mask, data["response_mask"])
    try:
        outputs = original(
            engine, data, functools.partial(_loss_with_mask_slice, loss_function, prepass.selection.figures(),
                                            f"{mode.metric_prefix}{SELECTED_IN_MICRO_BATCH}")
        )
    finally:
        del data[MASK_KEY]
    step_seconds = time.perf_counter() - started
    if isinstance(outputs, dict) and isinstance(outputs.get("metrics"), dict):
        prefix = mode.metric_prefix
        plugin_seconds = prepass.prepass_seconds + prepass.selection_seconds
        outputs["metrics"].update({
            f"{prefix}prepass_seconds": Metric(AggregationType.MEAN, prepass.prepass_seconds),
            f"{prefix}selection_seconds": Metric(AggregationType.MEAN, prepass.selection_seconds),
            f"{prefix}prepass_share": Metric(AggregationType.MEAN, plugin_seconds / max(step_seconds, 1e-12)),
        })
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


def _loss_with_mask_slice(loss_function: Callable, figures: dict, selected_metric: str, *args, **kwargs):
    """verl's loss function, called inside ``provide_selection_mask`` with this micro-batch's mask slice.

    verl also passes the same function as a logits processor for top-k distillation
    (``logits_processor_func(student_logits=..., data=...)``, verl 0.9.1
    transformer_impl.py ~1413): such calls compute no policy loss and go through untouched.
    """
    if "student_logits" in kwargs:
        return loss_function(*args, **kwargs)
    return _policy_loss_with_mask_slice(loss_function, figures, selected_metric, *args, **kwargs)


def _policy_loss_with_mask_slice(loss_function: Callable, figures: dict, selected_metric: str, model_output,
                                 data: TensorDict,
                                 dp_group=None):
    """``(loss, metrics)`` of verl's loss on this micro-batch, plus ``selected_metric`` (the mode's
    ``<prefix>selected_in_micro_batch``).

    verl wraps a policy loss's plain metrics as ``Metric(MEAN)`` (``ppo_loss``); this sets the
    micro-batch count explicitly with that aggregation, so its meaning does not rest on a default.
    """
    if MASK_KEY not in data.keys():
        raise RuntimeError(
            f"micro-batch lost the per-token field {MASK_KEY!r} on its way from the minibatch: verl's micro-batch "
            f"splitting changed (known to work: verl {known_versions_text()})"
        )
    # Same conversion verl's ppo_loss applies to response_mask, so the shapes match.
    mask = data.select("response_mask", MASK_KEY).to_padded_tensor()[MASK_KEY].bool()
    with provide_selection_mask(mask, figures):
        loss, metrics = loss_function(model_output=model_output, data=data, dp_group=dp_group)
    metrics[selected_metric] = Metric(AggregationType.MEAN, float(mask.sum().item()))
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# Prepass and selection


def run_prepass_and_select(engine: BaseEngine, data: TensorDict, settings: Any,
                           mode: GlobalLossMode = KL_COV) -> PrepassResult:
    """No-grad log-probs of the whole minibatch, then ``mode``'s one selection over it and the DP group."""
    started = time.perf_counter()
    with torch.profiler.record_function(PREPASS_RECORD_NAME):
        with optimizer_states_off_device(engine, settings.prepass_layout) as offloaded:
            log_probs = compute_prepass_log_probs(engine, data, settings.prepass_layout)
    selected_at = time.perf_counter()
    group = engine.get_data_parallel_group() if dist.is_available() and dist.is_initialized() else None
    with torch.profiler.record_function(SELECTION_RECORD_NAME):
        selection = mode.select(log_probs, data, settings, group)
    finished = time.perf_counter()
    return PrepassResult(
        selection=selection, prepass_seconds=selected_at - started, selection_seconds=finished - selected_at,
        mode=mode, optimizer_states_offloaded=offloaded,
    )


@contextlib.contextmanager
def optimizer_states_off_device(engine: BaseEngine, layout: str) -> Iterator[bool]:
    """Keep an offloaded optimizer's states on the host during an ``infer``-layout prepass; yields whether it did.

    With ``optimizer_offload=True`` verl's train-mode context has loaded the states onto the
    device before the step, while verl's ``compute_log_prob`` runs without them. For the
    ``infer`` layout (the log-prob budget, often larger than the training one) they are moved
    to the host with verl's ``engine.to(device="cpu", model=False, optimizer=True, grad=False)``
    and back with ``engine.to(device=<device>, ...)``, the calls verl's context makes: two
    copies of this rank's optimizer-state shard per optimizer step. Nothing moves when
    offloading is off (the states are on the device in ``compute_log_prob`` as well), for the
    ``train`` layout (its forwards are the training micro-batches' forwards without autograd),
    or when no state tensor is on the device (none yet before the first step, or the caller
    keeps them on the host).
    """
    from verl.utils.device import get_device_name

    device = get_device_name()
    optimizer = getattr(engine, "optimizer", None)
    move = (
        layout == "infer"
        and bool(getattr(engine, "is_optimizer_offload_enabled", False))
        and optimizer is not None
        and any(value.device.type == device for value in _optimizer_state_tensors(optimizer))
    )
    if not move:
        yield False
        return
    engine.to(device="cpu", model=False, optimizer=True, grad=False)
    try:
        yield True
    finally:
        engine.to(device=device, model=False, optimizer=True, grad=False)


def _optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def prepass_forward_batches(engine: BaseEngine, data: TensorDict, layout: str) -> list[TensorDict]:
    """The batches the prepass hands to ``engine.infer_batch``, one call each, with their micro-batch keys.

    Sets those keys on ``data`` itself: pass the prepass's own shallow copy, never the training batch.
    ``layout="train"``: ``[data]`` with its own (training) keys. ``"infer"``, dynamic batching:
    ``[data]`` with ``max_token_len_per_gpu = infer_max_token_len_per_gpu``. ``"infer"``, static:
    ``ceil(rows / infer_micro_batch_size_per_gpu)`` forwards (agreed over the DP group, see
    :func:`static_prepass_chunk_sizes`); ``[data]`` with that micro-batch size when the rows split
    evenly, else one consecutive chunk of rows per forward, each its own single micro-batch.
    """
    if layout == "train":
        return [data]
    use_dynamic_bsz = tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True)
    engine_config = engine.engine_config
    if use_dynamic_bsz:
        if engine_config.infer_max_token_len_per_gpu is None:
            raise ValueError(
                "kl_cov_global's prepass uses the log-prob inference layout, but infer_max_token_len_per_gpu is not "
                "set: set actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu, or "
                "actor_rollout_ref.actor.policy_loss.prepass_layout=train"
            )
        tu.assign_non_tensor(data, max_token_len_per_gpu=engine_config.infer_max_token_len_per_gpu)
        return [data]
    if engine_config.infer_micro_batch_size_per_gpu is None:
        raise ValueError(
            "kl_cov_global's prepass uses the log-prob inference layout, but infer_micro_batch_size_per_gpu is not "
            "set: set actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu, or "
            "actor_rollout_ref.actor.policy_loss.prepass_layout=train"
        )
    group = engine.get_data_parallel_group() if dist.is_available() and dist.is_initialized() else None
    sizes = static_prepass_chunk_sizes(len(data), engine_config.infer_micro_batch_size_per_gpu, group)
    if len(set(sizes)) == 1:
        tu.assign_non_tensor(data, micro_batch_size_per_gpu=sizes[0])
        return [data]
    chunks, start = [], 0
    for size in sizes:
        chunk = tu.index_select_tensor_dict(data, list(range(start, start + size)))
        tu.assign_non_tensor(chunk, micro_batch_size_per_gpu=size)
        chunks.append(chunk)
        start += size
    return chunks


def static_prepass_chunk_sizes(rows: int, size: int, group=None) -> list[int]:
    """Row counts of the static prepass's forwards: ``n = ceil(rows / size)`` of them, differing by at most one.

    With a process group, ``n`` is the maximum over its ranks (one all-reduce of two integers),
    since every forward all-gathers FSDP parameters on every rank. A rank with fewer than ``n``
    rows would need an empty forward: then every rank raises the same ``ValueError``.
    """
    if size < 1:
        raise ValueError(f"log-prob micro-batch size must be >= 1, got {size}")
    count = max(1, math.ceil(rows / size))
    fewest_rows, most_rows = rows, rows
    if group is not None and dist.get_world_size(group) > 1:
        from verl.utils.device import get_device_id

        agreed = torch.tensor([count, -rows, rows], dtype=torch.int64, device=get_device_id())
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        count, fewest_rows, most_rows = int(agreed[0]), -int(agreed[1]), int(agreed[2])
    if fewest_rows < count:
        raise ValueError(
            f"kl_cov_global's static prepass runs the same number of forwards on every data-parallel rank (each "
            f"all-gathers FSDP parameters): {count} forwards of at most {size} rows "
            f"(log_prob_micro_batch_size_per_gpu), but the ranks hold between {fewest_rows} and {most_rows} rows. "
            "Give every rank the same number of rows (verl's minibatch split does), or use dynamic batching "
            "(use_dynamic_bsz=True)"
        )
    base, extra = divmod(rows, count)
    return [base + 1] * extra + [base] * (count - extra)


def largest_divisor_at_most(rows: int, limit: int) -> int:
    """The largest micro-batch size <= ``limit`` that divides ``rows`` (verl's static split needs a divisor).

    Not used by the prepass (see :func:`static_prepass_chunk_sizes`); the experiment uses it for
    training micro-batch sizes.
    """
    return max(size for size in range(1, max(1, min(rows, limit)) + 1) if rows % size == 0)


def compute_prepass_log_probs(engine: BaseEngine, data: TensorDict, layout: str) -> torch.Tensor:
    """Current-policy log-probs of every response token of ``data``: (batch, max_response_len), padded.

    A no-grad forward in eval mode (no dropout) that computes only log-probs: no
    entropy, no distillation, micro-batched by :func:`prepass_forward_batches`; the module's
    mode and the CPU/device RNG states are restored afterwards, so the training step that
    follows is unchanged. (verl's kl_cov scores tokens with the training forward's train-mode
    log-probs; the two differ only for models with active dropout or router noise.)
    Mode-agnostic: it knows nothing of the loss or the selection.
    """
    prepass_data = data.copy()  # shallow: new keys here do not reach the training step
    tu.assign_non_tensor(
        prepass_data,
        calculate_entropy=False,
        calculate_sum_pi_squared=False,
        distillation_use_topk=False,
        distillation_only=False,
    )
    batches = prepass_forward_batches(engine, prepass_data, layout)
    width = padded(data["response_mask"]).shape[1]
    module = engine.module
    was_training = module.training
    parts = []
    with preserved_rng_states(), batched_logsumexp():
        module.eval()
        try:
            for batch in batches:
                output = engine.infer_batch(batch, loss_function=None)
                parts.append(fit_width(no_padding_2_padding(output["model_output"]["log_probs"], batch), width))
        finally:
            module.train(was_training)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@contextlib.contextmanager
def batched_logsumexp() -> Iterator[None]:
    """PATCH ``prepass_batched_logsumexp``: no-grad float32/64 log-probs of all rows at once, in place in the logits."""
    import verl.utils.torch_functional as verl_F

    original = verl_F.logprobs_from_logits_v2
    if list(inspect.signature(original).parameters) != ["logits", "labels"]:
        raise RuntimeError(
            "verl_klcov_global: seam logprobs_from_logits_v2(logits, labels) moved. Known to work: verl "
            f"{known_versions_text()}; install one of them or update the plugin."
        )

    def logprobs_from_logits_batched(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        exact_dtype = logits.dtype in (torch.float32, torch.float64)  # verl's bf16/fp16 path stays untouched
        if (torch.is_grad_enabled() or not exact_dtype or logits.dim() < 2 or not logits.shape[0]
                or not logits.is_contiguous()):
            return original(logits, labels)
        return log_probs_in_place(logits, labels)

    verl_F.logprobs_from_logits_v2 = logprobs_from_logits_batched
    try:
        yield
    finally:
        verl_F.logprobs_from_logits_v2 = original


@torch.no_grad()
def log_probs_in_place(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``logits[..., label] - logsumexp(logits, -1)`` over all rows at once; overwrites ``logits``.

    ``logits`` (..., vocab) float, ``labels`` (...) int: returns (...). The same operations as
    ``torch.logsumexp`` (max, infinite maxima set to 0, exp of the difference, sum, log, add the
    max), done in place so that only per-row vectors are allocated.
    """
    label_logits = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
    maxima = torch.amax(logits, dim=-1, keepdim=True)
    maxima.masked_fill_(maxima.abs() == math.inf, 0)
    sums = logits.sub_(maxima).exp_().sum(dim=-1)
    return label_logits - sums.log_().add_(maxima.squeeze(-1))


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
