"""The wrapped optimizer step: prepass, mask stored per token, verl's own ``train_batch``, the step's metrics.

:func:`train_batch_with_prepass` is what PATCH ``train_batch_prepass`` (:mod:`.patches`) runs in
place of ``BaseEngine.train_batch`` (one call per optimizer step, made by
``TrainingWorker.train_batch`` for every minibatch and PPO epoch). When the loss function's
actor config selects a mode of the table (:func:`verl_klcov_global.modes.global_mode_of`), before
verl's own step it:

0. checks the engine (:func:`require_supported_engine`: verl's FSDP engine, fsdp or fsdp2) and
   frees the previous step's gradients (``engine.optimizer_zero_grad()``, set to None): verl's
   ``train_batch`` does exactly that as its first call, so doing it before the prepass changes
   nothing but the prepass's memory;
1. runs the prepass and the mode's selection (:func:`.prepass.run_prepass_and_select`);
2. stores the mask as the per-token field :data:`verl_klcov_global.config.MASK_FIELD` of the
   minibatch, in the layout of ``response_mask`` (nested or padded), so verl's micro-batch
   splitting (static or dynamic, which reorders samples) carries each slice to its micro-batch;
3. calls verl's ``train_batch`` with the loss function wrapped so that each micro-batch's loss
   call runs inside ``provide_selection_mask(<its slice>, settings=<the settings the selection used>)``
   (:mod:`verl_klcov_global.loss`): the loss never re-reads the config, so it cannot disagree with its own mask.

The step's settings are the config's, then moved by what the mode's row asks for, in this order: a once-per-trainer-
step rule (``ModeSpec.update_rule``: STARE's gate and weights, :func:`.schedule.settings_for_step`), the optimizer
step count (``ModeSpec.reads_optimizer_step``: Clip-Cov's per-step draw, :mod:`.step_count`), the entropy
controller's ratio (:mod:`.control`, inside the prepass). The selection and every micro-batch's loss use the result.

Every other loss mode runs verl's ``train_batch`` untouched.

Metrics this module adds to verl's step metrics (prefix: the mode's, e.g. ``actor/kl_cov/``), once per
optimizer step:

* the selection's figures (``Selection.figures()``: ``quota``, ``selected``, ...) and, with the entropy
  controller on, its figures (``entropy_target``, ``entropy_measured``, ``<ratio knob>_in_use``; with a
  prediction horizon ``entropy_predicted``), each as
  one ``Metric(AggregationType.MAX, value)``. They are the same on every data-parallel rank (group-wide
  figures), and verl reduces a MAX metric over the ranks by ``np.max``, which returns one of the identical
  values exactly, where MEAN's ``np.mean`` of 3, 6 or 7 identical copies can move the last bit. verl's
  trainer then logs the mean over the trainer step's optimizer steps (``reduce_metrics``), computed from
  the same per-step values whatever the micro-batch or DP split;
* ``prepass_seconds`` (forward, including any optimizer-state moves), ``selection_seconds`` and
  ``prepass_share`` ((prepass + selection) / wall time of the whole wrapped ``train_batch``: verl's
  ``mfu`` divides the training FLOPs by that wall time), as MEAN: timings differ per rank.

The loss writes one per-micro-batch metric, ``selected_in_micro_batch``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Any, Callable, Iterator, Optional

import torch
from tensordict import TensorDict
from verl.utils.metric import AggregationType, Metric
from verl.workers.engine.base import BaseEngine

from ..mode_config import MASK_FIELD, PROXY_FIELD, SUPPORTED_STRATEGIES, unsupported_strategy_message
from ..layout import mask_in_layout_of, micro_batch_mask, micro_batch_values, values_in_layout_of
from ..loss import provide_selection_mask
from ..modes import ModeSpec, global_mode_of
from ..seams import known_versions_text
from . import reuse
from .prepass import PrepassResult, run_prepass_and_select
from .schedule import settings_for_step
from .step_count import next_optimizer_step

__all__ = ["ProxyUnavailableError", "UnsupportedEngineError", "actor_config_of", "observe_selections", "require_supported_engine",
           "train_batch_with_prepass"]

_SELECTION_OBSERVERS: list[Callable[[BaseEngine, PrepassResult], None]] = []


class UnsupportedEngineError(RuntimeError):
    """A global loss mode was selected on an engine the prepass does not cover."""


class ProxyUnavailableError(RuntimeError):
    """A mode that reads a proxy from verl's log-prob pass (``ModeSpec.proxy_min_p``) found none held for this
    optimizer step's rows (raised on every rank)."""


@contextlib.contextmanager
def observe_selections(callback: Callable[[BaseEngine, PrepassResult], None]) -> Iterator[None]:
    """Call ``callback(engine, result)`` after every prepass selection made inside this block.

    For diagnostics and tests: the mask is deleted from the minibatch after the step.
    """
    _SELECTION_OBSERVERS.append(callback)
    try:
        yield
    finally:
        _SELECTION_OBSERVERS.remove(callback)


def actor_config_of(loss_function: Optional[Callable]) -> Any:
    """The actor config bound into verl's loss function (``partial(ppo_loss, config=...)``), or None."""
    keywords = getattr(loss_function, "keywords", None) or {}
    return keywords.get("config")


def train_batch_with_prepass(original: Callable, engine: BaseEngine, data: TensorDict, loss_function: Callable):
    """verl's ``original(engine, data, loss_function)`` with the prepass before it when a global mode is selected."""
    actor_config = actor_config_of(loss_function)
    mode = global_mode_of(actor_config)
    if mode is None:
        return original(engine, data, loss_function)
    settings = mode.read_settings(actor_config)
    require_supported_engine(engine, mode)

    started = time.perf_counter()
    # verl's train_batch starts with this very call (set_to_none): made before the prepass, it frees
    # the previous step's gradients for it instead of after it.
    engine.optimizer_zero_grad()
    rule_figures = {}
    if mode.update_rule is not None:  # once per trainer step, read at every optimizer step (engine/schedule.py)
        settings, rule_figures = settings_for_step(engine, mode, settings)
    if mode.reads_optimizer_step:  # e.g. a seeded draw, fresh at every optimizer step (engine/step_count.py)
        settings = dataclasses.replace(settings, optimizer_step=next_optimizer_step(engine))
    proxy = _held_proxy(engine, data, mode) if mode.proxy_min_p is not None else None
    prepass = run_prepass_and_select(engine, data, settings, mode)
    for observer in list(_SELECTION_OBSERVERS):
        observer(engine, prepass)
    data[MASK_FIELD] = mask_in_layout_of(prepass.selection.mask, data["response_mask"])
    token_fields = {}
    if proxy is not None:  # per token, so verl's micro-batch split carries each slice (as the mask)
        data[PROXY_FIELD] = values_in_layout_of(proxy, data["response_mask"], dtype=torch.float32)
        token_fields["proxy_log_prob"] = PROXY_FIELD
    try:
        outputs = original(engine, data, functools.partial(_loss_with_mask_slice, loss_function, prepass.settings,
                                                           _token_fields=token_fields))
    finally:
        del data[MASK_FIELD]
        if proxy is not None:
            del data[PROXY_FIELD]
    if mode.loss_tallies:  # collective: every rank, whatever its outputs
        rule_figures = {**rule_figures, **_tally_figures(engine, outputs, mode, prepass)}
    step_seconds = time.perf_counter() - started
    if isinstance(outputs, dict) and isinstance(outputs.get("metrics"), dict):
        prefix = mode.metric_prefix
        plugin_seconds = prepass.prepass_seconds + prepass.selection_seconds
        outputs["metrics"].update({f"{prefix}{name}": Metric(AggregationType.MAX, value)
                                   for name, value in {**prepass.figures(), **rule_figures}.items()})
        outputs["metrics"].update({
            f"{prefix}prepass_seconds": Metric(AggregationType.MEAN, prepass.prepass_seconds),
            f"{prefix}selection_seconds": Metric(AggregationType.MEAN, prepass.selection_seconds),
            f"{prefix}prepass_share": Metric(AggregationType.MEAN, plugin_seconds / max(step_seconds, 1e-12)),
            # [reuse] 1 where verl's log-prob pass stood in for the prepass; the same on every rank (MAX is exact)
            f"{prefix}prepass_reused": Metric(AggregationType.MAX, float(prepass.reused)),
        })
    return outputs


def require_supported_engine(engine: BaseEngine, mode: ModeSpec) -> None:
    """Raise :class:`UnsupportedEngineError` unless ``engine`` is verl's FSDP engine with a supported strategy.

    The one strategy check of the worker side; the driver refuses the same strategies earlier
    (:func:`verl_klcov_global.driver.check_trainer_config`, :data:`~verl_klcov_global.config.SUPPORTED_STRATEGIES`).
    """
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    strategy = getattr(getattr(engine, "engine_config", None), "strategy", None)
    if not isinstance(engine, FSDPEngineWithLMHead) or strategy not in SUPPORTED_STRATEGIES:
        raise UnsupportedEngineError(unsupported_strategy_message(
            mode.name, mode.upstream, f"this actor runs {type(engine).__name__} with strategy {strategy!r}"))


def _held_proxy(engine: BaseEngine, data: TensorDict, mode: ModeSpec):
    """pi_old's proxy log-probs of the minibatch's rows, held from verl's log-prob pass; every rank gets one, or every
    rank raises :class:`ProxyUnavailableError` (the decision is agreed first: no rank waits in a collective)."""
    proxy, missing = reuse.held_on_every_rank(reuse.held_proxy, engine, data)
    if missing is not None:
        raise ProxyUnavailableError(
            f"loss_mode={mode.name} reads its proxy pi_proxy, computed in verl's log-prob pass with the old policy and "
            f"held for the update, and {missing}. The plugin computes it where the actor's compute_log_prob runs through verl's engine TrainingWorker "
            "(the legacy or the v1 sync trainer, bypass_mode=False) with the plugin loaded in the worker")
    return proxy


def _tally_figures(engine: BaseEngine, outputs: Any, mode: ModeSpec, prepass: PrepassResult) -> dict:
    """The objective's per-micro-batch tallies (``mode.loss_tallies``) summed over this step's micro-batches and the
    DP group (one all-reduce of one float64 each), as the step's figures (``mode.tally_figures``, else the sums). The
    raw per-micro-batch entries are removed."""
    import torch.distributed as dist
    from verl.utils.device import get_device_id

    metrics = outputs.get("metrics") if isinstance(outputs, dict) else None
    totals = []
    for name in mode.loss_tallies:
        values = metrics.pop(f"{mode.metric_prefix}{name}_in_micro_batch", []) if isinstance(metrics, dict) else []
        values = getattr(values, "values", values)  # verl 0.9: a Metric per key (its .values, one per micro-batch)
        values = values if isinstance(values, list) else [values]
        totals.append(sum(float(v) for v in values))
    sums = torch.tensor(totals, dtype=torch.float64, device=get_device_id())
    group = engine.get_data_parallel_group()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    summed = dict(zip(mode.loss_tallies, sums.tolist()))
    return mode.tally_figures(summed, prepass.selection) if mode.tally_figures is not None else summed


def _loss_with_mask_slice(loss_function: Callable, step_settings: Any, *args, _token_fields: Optional[dict] = None,
                          **kwargs):
    """verl's loss function, called inside ``provide_selection_mask`` with this micro-batch's mask slice, the settings
    the step's selection used (``step_settings``), and ``_token_fields`` (objective argument -> per-token minibatch
    field, each sliced like the mask: the proxy of a mode with ``proxy_min_p``).

    verl also passes the same function as a logits processor for top-k distillation
    (``logits_processor_func(student_logits=..., data=...)``, in the FSDP engine's ``prepare_model_outputs``): such
    calls compute no policy loss and go through untouched.
    """
    if "student_logits" in kwargs:
        return loss_function(*args, **kwargs)
    return _policy_loss_with_mask_slice(loss_function, step_settings, _token_fields or {}, *args, **kwargs)


def _policy_loss_with_mask_slice(loss_function: Callable, step_settings: Any, token_fields: dict, model_output,
                                 data: TensorDict, dp_group=None):
    """``(loss, metrics)`` of verl's loss on this micro-batch, with its slice of the mask provided."""
    if MASK_FIELD not in data.keys():
        raise RuntimeError(
            f"micro-batch lost the per-token field {MASK_FIELD!r} on its way from the minibatch: verl's micro-batch "
            f"splitting changed (known to work: verl {known_versions_text()})"
        )
    fields = {name: micro_batch_values(data, key) for name, key in token_fields.items()}
    with provide_selection_mask(micro_batch_mask(data, MASK_FIELD), settings=step_settings, token_fields=fields):
        return loss_function(model_output=model_output, data=data, dp_group=dp_group)
