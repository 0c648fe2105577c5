"""STARE as its authors run it: the selection inside each loss call (hp-luo/STARE ``compute_policy_loss_stare``,
core_algos.py l.1201-1293 at bffb9e7), the lab's comparator of ``stare_global`` (``stare_per_micro_batch``).

Registered by the lab only (:func:`verl_klcov_global.lab.per_micro_batch.register`), never by the plugin.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ...per_call import Comparator
from ...loss import aggregate_policy_loss, provided_selection, verl_policy_loss
from .config import StareGlobalPolicyLossConfig, read_stare_settings
from .objective import stare_objective
from .selection import select_stare_tokens

#: The lab-only loss name of STARE's per-loss-call rule (``policy_loss.loss_mode``).
NAME = "stare_per_micro_batch"
#: Tokens the rule weighted in one micro-batch (``L+ | L-``), and the gate it applied (1 open, 0 closed).
SELECTED_METRIC = f"actor/{NAME}/selected_in_micro_batch"
GATE_METRIC = f"actor/{NAME}/gate_on"


@dataclass
class StarePerMicroBatchPolicyLossConfig(StareGlobalPolicyLossConfig):
    """``stare_global``'s config class (its knobs, defaults and validation) under the comparator's ``loss_mode``.
    The schedule's knobs (``stare_adaptive``, ``stare_alpha``, ``stare_w_max``, ``stare_m_min``) and
    ``stare_target_entropy`` are carried and validated but not read: the comparator has no gate or schedule of its
    own (:func:`per_micro_batch_stare_mask`)."""

    loss_mode: str = NAME


def per_micro_batch_stare_mask(log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
                               top_ratio: float, with_negative: bool):
    """The fork's selection on one loss call's tensors: :func:`verl_klcov_global.methods.stare.selection.select_stare_tokens`
    with no group, i.e. per set of ``n`` candidates of this micro-batch ``k = min(n, max(1, int(n * P + 0.999999)))``
    (:func:`~verl_klcov_global.methods.stare.selection.stare_quota`) most surprising tokens (``-log_prob``, detached).

    Ties at the k-th surprisal: the fork's ``torch.topk`` leaves the order unspecified; here (row, position) within
    the micro-batch, deterministic. Tokens with a non-finite log-prob or advantage are never selected (the fork
    would rank a NaN surprisal as largest). Returns the :class:`~verl_klcov_global.methods.stare.selection.StareSelection`."""
    return select_stare_tokens(log_prob.detach(), advantages.detach(), response_mask, top_ratio,
                               with_negative=with_negative, group=None)


def _stare_settings_of(config: Any):
    """The comparator's settings: ``stare_global``'s reader on the actor config (knobs, clip range, dual-clip
    bound; W and M as configured, the gate open), then the step settings (gate, W, M) a
    :func:`verl_klcov_global.loss.provide_selection_mask` block around this call hands the loss, if one does."""
    try:
        settings = read_stare_settings(config)
    except ValueError as error:
        raise ValueError(f"{NAME}: {error}; use StarePerMicroBatchPolicyLossConfig") from None
    provided = provided_selection()
    step = None if provided is None else provided.settings
    if step is not None and all(hasattr(step, key) for key in ("gate_on", "reweight_w", "reweight_m")):
        settings = replace(settings, gate_on=bool(step.gate_on), reweight_w=float(step.reweight_w),
                           reweight_m=float(step.reweight_m))
    return settings


def _stare_per_micro_batch(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights):
    """STARE as the authors run it (hp-luo/STARE ``compute_policy_loss_stare``, core_algos.py l.1201-1293 at
    bffb9e7), as a verl policy loss: the selection inside each loss call, i.e. per training micro-batch, which is
    what ``stare_global`` fixes.

    * Selection: :func:`per_micro_batch_stare_mask` on this call's ``log_prob`` (the training forward's, as the
      fork's ``compute_stare_token_weights`` reads it): ``L+`` the top ``stare_top_ratio`` of the ``A > 0`` tokens by
      surprisal, and with ``stare_variant=C2`` ``L-`` of the ``A < 0`` tokens, each quota per micro-batch;
    * loss: :func:`verl_klcov_global.methods.stare.objective.stare_objective` on that mask (verl's ``vanilla`` dual-clip surrogate times
      ``omega``: W on ``L+``, M on ``L-``, 1 elsewhere), times ``rollout_is_weights``, aggregated with verl's
      ``agg_loss(..., **config.global_batch_info)``: ``stare_global``'s loss, only the selection differs;
    * gate and weights: the fork reads them from its trainer's ``STAREController`` (once per trainer step, from the
      batch's mean entropy) and, without it, applies the configured W and M with the gate open (l.1132-1142). The
      comparator does the latter: configured W and M, gate open, so ``stare_target_entropy`` and the schedule's
      knobs are not read. Called inside a :func:`verl_klcov_global.loss.provide_selection_mask` block that carries
      step settings (as ``stare_global``'s loss is in the engine), it applies their gate, W and M instead, so the
      two can be compared under one trainer step's rule. The lab runs the comparator outside any such block.

    Metrics: ``vanilla``'s (``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``),
    :data:`SELECTED_METRIC` (``|L+| + |L-|`` in this micro-batch) and :data:`GATE_METRIC`.
    """
    settings = _stare_settings_of(config)
    selection = per_micro_batch_stare_mask(log_prob, advantages, response_mask, settings.stare_top_ratio,
                                           settings.with_negative)
    pg_losses, metrics = stare_objective(old_log_prob, log_prob, advantages, response_mask, selection.mask, settings)
    pg_loss = aggregate_policy_loss(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    metrics = dict(metrics)
    metrics[SELECTED_METRIC] = float(selection.num_selected)
    metrics[GATE_METRIC] = float(settings.gate_on)
    return pg_loss, metrics


compute_policy_loss_stare_per_micro_batch = verl_policy_loss(NAME, _stare_per_micro_batch)

#: The comparator the lab registers (``ModeSpec.comparator`` of ``stare_global`` names this module).
COMPARATOR = Comparator(NAME, compute_policy_loss_stare_per_micro_batch, StarePerMicroBatchPolicyLossConfig,
                        SELECTED_METRIC)
