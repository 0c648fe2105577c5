"""The authors' per-micro-batch rules, the lab's comparators of the global modes that have no verl counterpart.

Three comparators, each registered in verl's ``POLICY_LOSS_REGISTRY`` in-process by the lab (``diagnose``, the
experiment, the research harness), never by the plugin or its entry point:

* :data:`COMPARATOR` (``high_entropy_per_micro_batch``), ``high_entropy_global``'s: below;
* :data:`STARE_COMPARATOR` (``stare_per_micro_batch``), ``stare_global``'s: section "STARE" further down.
* :data:`LP_REG_COMPARATOR` (``lp_reg_per_micro_batch``), ``lp_reg_global``'s: section "Lp-Reg" at the end.

High-entropy rule (``high_entropy_per_micro_batch``).

*Beyond the 80/20 Rule* (arXiv:2506.01939) keeps the PPO-clip loss only on the top ρ of tokens
by entropy. Every implementation people run takes that threshold per training micro-batch; this
module is TRL's public rule (``GRPOTrainer.get_high_entropy_mask``):

* per micro-batch, ``threshold = torch.quantile(valid entropies, 1 - ρ)`` (linear interpolation);
* every valid token with entropy ``>=`` the threshold keeps verl's ``vanilla`` PPO-clip loss, the
  others get 0 (their advantage is set to 0: verl's vanilla then gives exactly 0 loss and gradient,
  dual clip included);
* aggregated with verl's ``agg_loss`` over all valid tokens (the paper's 1/Σ|oᵢ| for token-mean).

It is registered in verl's ``POLICY_LOSS_REGISTRY`` under :data:`COMPARATOR` by
:func:`register_comparator`, which the lab (``diagnose``, the experiment) and the research
harness call in-process. The plugin and its entry point never register it.

Where the entropy comes from: a registered policy loss never sees entropy, but verl's ``ppo_loss``
gets ``model_output["entropy"]`` when the micro-batch's ``calculate_entropy`` is set. The lab's loss
function (:func:`ppo_loss_with_entropy`) converts it to the padded layout with verl's
``no_padding_2_padding`` and calls ``ppo_loss`` inside :func:`provide_micro_batch_entropy`; the
comparator reads it from there and raises :class:`MicroBatchEntropyUnavailableError` otherwise.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, replace
from typing import Any, Iterator, Optional

import torch
from verl.workers.config import PolicyLossConfig

from .. import config as _config

__all__ = [
    "COMPARATOR",
    "HighEntropyPerMicroBatchPolicyLossConfig",
    "LP_REG_COMPARATOR",
    "LP_REG_SELECTED_METRIC",
    "LP_REG_SWITCHED_OFF_METRIC",
    "LpRegPerMicroBatchPolicyLossConfig",
    "MicroBatchProxyUnavailableError",
    "MicroBatchEntropyUnavailableError",
    "SELECTED_METRIC",
    "SELECTED_METRICS",
    "STARE_COMPARATOR",
    "STARE_GATE_METRIC",
    "STARE_SELECTED_METRIC",
    "StarePerMicroBatchPolicyLossConfig",
    "THRESHOLD_METRIC",
    "compute_policy_loss_high_entropy_per_micro_batch",
    "compute_policy_loss_lp_reg_per_micro_batch",
    "compute_policy_loss_stare_per_micro_batch",
    "per_micro_batch_entropy_mask",
    "per_micro_batch_lp_reg_mask",
    "per_micro_batch_stare_mask",
    "ppo_loss_with_entropy",
    "provide_micro_batch_entropy",
    "provide_micro_batch_proxy",
    "register_comparator",
    "register_lp_reg_comparator",
    "register_stare_comparator",
]

#: The lab-only loss name of the per-micro-batch rule (``policy_loss.loss_mode``).
COMPARATOR = "high_entropy_per_micro_batch"
#: Tokens the rule kept in one micro-batch, and its threshold (``ppo_loss`` metrics, mean over micro-batches).
SELECTED_METRIC = f"actor/{COMPARATOR}/selected_in_micro_batch"
THRESHOLD_METRIC = f"actor/{COMPARATOR}/entropy_threshold"


class MicroBatchEntropyUnavailableError(RuntimeError):
    """The comparator was called without the micro-batch's entropy."""


@dataclass
class HighEntropyPerMicroBatchPolicyLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus ``entropy_top_ratio`` (ρ, the fraction kept), for the comparator."""

    loss_mode: str = COMPARATOR
    entropy_top_ratio: float = 0.2


_ENTROPY: contextvars.ContextVar[Optional[torch.Tensor]] = contextvars.ContextVar(
    "verl_klcov_global_lab_micro_batch_entropy", default=None
)


@contextlib.contextmanager
def provide_micro_batch_entropy(entropy: torch.Tensor) -> Iterator[None]:
    """Make ``entropy`` (batch, response_len), aligned with the loss's ``response_mask``, the entropy
    the comparator reads inside this block."""
    token = _ENTROPY.set(entropy)
    try:
        yield
    finally:
        _ENTROPY.reset(token)


def per_micro_batch_entropy_mask(entropy: torch.Tensor, response_mask: torch.Tensor,
                                 entropy_top_ratio: float) -> tuple[torch.Tensor, Optional[float]]:
    """TRL's rule on one micro-batch: ``(mask, threshold)``.

    ``threshold = torch.quantile(entropy[valid].float(), 1 - entropy_top_ratio)`` (linear), mask =
    valid tokens with entropy ``>=`` it. No valid token: an empty mask and None.
    """
    valid = response_mask.bool()
    values = entropy.detach()[valid].float()
    if values.numel() == 0:
        return torch.zeros_like(valid), None
    threshold = torch.quantile(values, 1.0 - float(entropy_top_ratio))
    return (entropy.detach().float() >= threshold) & valid, float(threshold)


def _ratio_of(config: Any) -> float:
    policy_loss = getattr(config, "policy_loss", None)
    ratio = getattr(policy_loss, "entropy_top_ratio", None)
    if ratio is None and hasattr(policy_loss, "get"):
        ratio = policy_loss.get("entropy_top_ratio", None)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < float(ratio) <= 1.0:
        raise ValueError(
            f"{COMPARATOR}: actor.policy_loss.entropy_top_ratio must be a fraction in (0, 1] (0.2 keeps the top "
            f"20% of each micro-batch's tokens), got {ratio!r}; use HighEntropyPerMicroBatchPolicyLossConfig"
        )
    return float(ratio)


def compute_policy_loss_high_entropy_per_micro_batch(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The per-micro-batch rule as a verl policy loss (see the module docstring)."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    entropy = _ENTROPY.get()
    if entropy is None:
        raise MicroBatchEntropyUnavailableError(
            f"loss_mode={COMPARATOR} is the lab's comparator and needs each micro-batch's entropy: call verl's "
            f"ppo_loss through verl_klcov_global.lab.per_micro_batch.ppo_loss_with_entropy (the lab's experiment "
            f"does), with calculate_entropy=True on the minibatch. For training, use loss_mode=high_entropy_global"
        )
    if entropy.shape != response_mask.shape:
        raise ValueError(f"{COMPARATOR}: entropy has shape {tuple(entropy.shape)} but response_mask "
                         f"{tuple(response_mask.shape)}: it belongs to another micro-batch")
    mask, threshold = per_micro_batch_entropy_mask(entropy, response_mask, _ratio_of(config))
    pg_loss, metrics = compute_policy_loss_vanilla(
        old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages * mask.to(advantages.dtype),
        response_mask=response_mask, loss_agg_mode=loss_agg_mode, config=config,
        rollout_is_weights=rollout_is_weights,
    )
    metrics = dict(metrics)
    metrics[SELECTED_METRIC] = float(mask.sum().item())
    if threshold is not None:
        metrics[THRESHOLD_METRIC] = threshold
    return pg_loss, metrics


def register_comparator() -> str:
    """Register the comparator in verl's ``POLICY_LOSS_REGISTRY`` in this process (idempotent); returns its name."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss

    if POLICY_LOSS_REGISTRY.get(COMPARATOR) is not compute_policy_loss_high_entropy_per_micro_batch:
        register_policy_loss(COMPARATOR)(compute_policy_loss_high_entropy_per_micro_batch)
    return COMPARATOR


def ppo_loss_with_entropy(config, model_output, data, dp_group=None):
    """verl's ``ppo_loss``; for the comparator, inside :func:`provide_micro_batch_entropy` with this
    micro-batch's entropy (``model_output["entropy"]``, padded as ``ppo_loss`` pads it)."""
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    loss_mode = config.policy_loss.get("loss_mode", "vanilla")
    if loss_mode == LP_REG_COMPARATOR:  # the proxy held from the log-prob pass, a per-token field of the minibatch
        from ..layout import micro_batch_values

        if _config.PROXY_FIELD not in data.keys():
            raise MicroBatchProxyUnavailableError(
                f"loss_mode={LP_REG_COMPARATOR}: the micro-batch has no {_config.PROXY_FIELD} field "
                "(verl_klcov_global.lab.experiment.one_update stores it)")
        with provide_micro_batch_proxy(micro_batch_values(data, _config.PROXY_FIELD)):
            return ppo_loss(config, model_output, data, dp_group)
    if loss_mode != COMPARATOR:
        return ppo_loss(config, model_output, data, dp_group)
    entropy = model_output.get("entropy", None)
    if entropy is None:
        raise MicroBatchEntropyUnavailableError(
            f"loss_mode={COMPARATOR}: the engine computed no entropy for this micro-batch; set the minibatch's "
            f"non-tensor key calculate_entropy=True (verl_klcov_global.lab.experiment.one_update does)"
        )
    with provide_micro_batch_entropy(no_padding_2_padding(entropy, data).detach()):
        return ppo_loss(config, model_output, data, dp_group)


# -------------------------------------------------------------------------------------------------------------
# STARE


#: The lab-only loss name of STARE's per-loss-call rule, ``stare_global``'s comparator (``policy_loss.loss_mode``).
STARE_COMPARATOR = "stare_per_micro_batch"
#: Tokens the rule weighted in one micro-batch (``L+ | L-``), and the gate it applied (1 open, 0 closed).
STARE_SELECTED_METRIC = f"actor/{STARE_COMPARATOR}/selected_in_micro_batch"
STARE_GATE_METRIC = f"actor/{STARE_COMPARATOR}/gate_on"
#: Every lab comparator's selected-count metric (what the lab's counting loss function reads).
SELECTED_METRICS = (SELECTED_METRIC, STARE_SELECTED_METRIC, "actor/lp_reg_per_micro_batch/selected_in_micro_batch")


@dataclass
class StarePerMicroBatchPolicyLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus ``stare_global``'s knobs (the same names, defaults and validation:
    :func:`verl_klcov_global.config.validate_stare_knobs`), for the comparator. The schedule's knobs
    (``stare_adaptive``, ``stare_alpha``, ``stare_w_max``, ``stare_m_min``) and ``stare_target_entropy`` are carried
    and validated but not read: the comparator has no gate or schedule of its own (:func:`per_micro_batch_stare_mask`).
    """

    loss_mode: str = STARE_COMPARATOR
    stare_top_ratio: float = _config.DEFAULT_STARE_TOP_RATIO
    stare_reweight_w: float = _config.DEFAULT_STARE_REWEIGHT_W
    stare_reweight_m: float = _config.DEFAULT_STARE_REWEIGHT_M
    stare_variant: str = _config.DEFAULT_STARE_VARIANT
    stare_target_entropy: float = _config.DEFAULT_STARE_TARGET_ENTROPY
    stare_adaptive: bool = False
    stare_alpha: float = _config.DEFAULT_STARE_ALPHA
    stare_w_max: float = _config.DEFAULT_STARE_W_MAX
    stare_m_min: float = _config.DEFAULT_STARE_M_MIN

    def __post_init__(self):
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        _config.validate_stare_knobs(self)


def per_micro_batch_stare_mask(log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
                               top_ratio: float, with_negative: bool):
    """The fork's selection on one loss call's tensors: :func:`verl_klcov_global.selection.stare.select_stare_tokens`
    with no group, i.e. per set of ``n`` candidates of this micro-batch ``k = min(n, max(1, int(n * P + 0.999999)))``
    (:func:`~verl_klcov_global.selection.stare.stare_quota`) most surprising tokens (``-log_prob``, detached).

    Ties at the k-th surprisal: the fork's ``torch.topk`` leaves the order unspecified; here (row, position) within
    the micro-batch, deterministic. Tokens with a non-finite log-prob or advantage are never selected (the fork
    would rank a NaN surprisal as largest). Returns the :class:`~verl_klcov_global.selection.stare.StareSelection`."""
    from ..selection.stare import select_stare_tokens

    return select_stare_tokens(log_prob.detach(), advantages.detach(), response_mask, top_ratio,
                               with_negative=with_negative, group=None)


def _stare_settings_of(config: Any):
    """The comparator's settings: ``stare_global``'s reader on the actor config (knobs, clip range, dual-clip
    bound; W and M as configured, the gate open), then the step settings (gate, W, M) a
    :func:`verl_klcov_global.loss.provide_selection_mask` block around this call hands the loss, if one does."""
    from .. import loss as _loss

    try:
        settings = _config.read_stare_settings(config)
    except ValueError as error:
        raise ValueError(f"{STARE_COMPARATOR}: {error}; use StarePerMicroBatchPolicyLossConfig") from None
    provided = _loss.provided_selection()
    step = None if provided is None else provided.settings
    if step is not None and all(hasattr(step, key) for key in ("gate_on", "reweight_w", "reweight_m")):
        settings = replace(settings, gate_on=bool(step.gate_on), reweight_w=float(step.reweight_w),
                           reweight_m=float(step.reweight_m))
    return settings


def compute_policy_loss_stare_per_micro_batch(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """STARE as the authors run it (hp-luo/STARE ``compute_policy_loss_stare``, core_algos.py l.1201-1293 at
    bffb9e7), as a verl policy loss: the selection inside each loss call, i.e. per training micro-batch, which is
    what ``stare_global`` fixes.

    * Selection: :func:`per_micro_batch_stare_mask` on this call's ``log_prob`` (the training forward's, as the
      fork's ``compute_stare_token_weights`` reads it): ``L+`` the top ``stare_top_ratio`` of the ``A > 0`` tokens by
      surprisal, and with ``stare_variant=C2`` ``L-`` of the ``A < 0`` tokens, each quota per micro-batch;
    * loss: :func:`verl_klcov_global.loss.stare_objective` on that mask (verl's ``vanilla`` dual-clip surrogate times
      ``omega``: W on ``L+``, M on ``L-``, 1 elsewhere), times ``rollout_is_weights``, aggregated with verl's
      ``agg_loss(..., **config.global_batch_info)``: ``stare_global``'s loss, only the selection differs;
    * gate and weights: the fork reads them from its trainer's ``STAREController`` (once per trainer step, from the
      batch's mean entropy) and, without it, applies the configured W and M with the gate open (l.1132-1142). The
      comparator does the latter: configured W and M, gate open, so ``stare_target_entropy`` and the schedule's
      knobs are not read. Called inside a :func:`verl_klcov_global.loss.provide_selection_mask` block that carries
      step settings (as ``stare_global``'s loss is in the engine), it applies their gate, W and M instead, so the
      two can be compared under one trainer step's rule. The lab runs the comparator outside any such block.

    Metrics: ``vanilla``'s (``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``),
    :data:`STARE_SELECTED_METRIC` (``|L+| + |L-|`` in this micro-batch) and :data:`STARE_GATE_METRIC`.
    """
    from verl.trainer.ppo.core_algos import agg_loss

    from ..loss import stare_objective

    settings = _stare_settings_of(config)
    selection = per_micro_batch_stare_mask(log_prob, advantages, response_mask, settings.stare_top_ratio,
                                           settings.with_negative)
    pg_losses, metrics = stare_objective(old_log_prob, log_prob, advantages, response_mask, selection.mask, settings)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                       **config.global_batch_info)
    metrics = dict(metrics)
    metrics[STARE_SELECTED_METRIC] = float(selection.num_selected)
    metrics[STARE_GATE_METRIC] = float(settings.gate_on)
    return pg_loss, metrics


def register_stare_comparator() -> str:
    """Register :data:`STARE_COMPARATOR` in verl's ``POLICY_LOSS_REGISTRY`` in this process (idempotent); returns its
    name. The lab's, never the plugin's (as :func:`register_comparator`)."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss

    if POLICY_LOSS_REGISTRY.get(STARE_COMPARATOR) is not compute_policy_loss_stare_per_micro_batch:
        register_policy_loss(STARE_COMPARATOR)(compute_policy_loss_stare_per_micro_batch)
    return STARE_COMPARATOR


# -------------------------------------------------------------------------------------------------------------
# Lp-Reg


#: The lab-only loss name of Lp-Reg's per-loss-call rule, ``lp_reg_global``'s comparator (``policy_loss.loss_mode``).
LP_REG_COMPARATOR = "lp_reg_per_micro_batch"
#: Tokens the rule selected in one micro-batch (both signs, after the ``k > 1`` rule), and the tokens its ``k > 1``
#: rule switched off there.
LP_REG_SELECTED_METRIC = f"actor/{LP_REG_COMPARATOR}/selected_in_micro_batch"
LP_REG_SWITCHED_OFF_METRIC = f"actor/{LP_REG_COMPARATOR}/switched_off_in_micro_batch"

_PROXY: contextvars.ContextVar[Optional[torch.Tensor]] = contextvars.ContextVar("verl_klcov_global_lab_proxy",
                                                                                default=None)


class MicroBatchProxyUnavailableError(RuntimeError):
    """The Lp-Reg comparator was called without its micro-batch's proxy log-probs."""


@dataclass
class LpRegPerMicroBatchPolicyLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus ``lp_reg_global``'s knobs (the same names, defaults and validation:
    :func:`verl_klcov_global.config.validate_lp_reg_knobs`), for the comparator."""

    loss_mode: str = LP_REG_COMPARATOR
    lp_reg_neg_ratio: float = _config.DEFAULT_LP_REG_NEG_RATIO
    lp_reg_pos_ratio: float = _config.DEFAULT_LP_REG_POS_RATIO
    lp_reg_min_p: float = _config.DEFAULT_LP_REG_MIN_P
    lp_reg_kl_coef: float = _config.DEFAULT_LP_REG_KL_COEF

    def __post_init__(self):
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        _config.validate_lp_reg_knobs(self)


@contextlib.contextmanager
def provide_micro_batch_proxy(proxy: torch.Tensor) -> Iterator[None]:
    """Make ``proxy`` ((batch, response_len) log pi_proxy) the one the Lp-Reg comparator's loss call reads."""
    token = _PROXY.set(proxy)
    try:
        yield
    finally:
        _PROXY.reset(token)


def per_micro_batch_lp_reg_mask(log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
                                neg_ratio: float, pos_ratio: float) -> tuple[torch.Tensor, int]:
    """The authors' selection on one loss call's tensors (Lp-Reg-dev ``compute_policy_loss_lp_reg`` l.722-741): per
    advantage sign, ``k = max(1, int(n * rho))`` lowest log-probs (detached) of this call's ``n`` tokens, taken only
    when ``k > 1``. Returns (the mask, the tokens of the signs switched off by ``k <= 1``). Ties at the k-th
    log-prob: (row, position) within the call (the authors' ``torch.topk`` leaves them unspecified); tokens with a
    non-finite log-prob or advantage are never selected."""
    from ..selection.lp_reg import select_lp_reg_tokens

    mask = torch.zeros_like(response_mask, dtype=torch.bool)
    switched_off = 0
    for neg, pos in ((neg_ratio, 0.0), (0.0, pos_ratio)):
        if neg == 0.0 and pos == 0.0:
            continue
        selection = select_lp_reg_tokens(log_prob.detach(), advantages.detach(), response_mask, neg, pos, group=None)
        candidates = selection.negative_candidates if neg else selection.positive_candidates
        if selection.quota > 1:
            mask |= selection.mask
        else:
            switched_off += candidates
    return mask, switched_off


def compute_policy_loss_lp_reg_per_micro_batch(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Lp-Reg as the authors run it, as a verl policy loss: the quota inside each loss call, i.e. per training
    micro-batch, with their ``k > 1`` rule, which is what ``lp_reg_global`` fixes. Selection:
    :func:`per_micro_batch_lp_reg_mask` on this call's ``log_prob`` (the training forward's, as their code reads
    it); loss: :func:`verl_klcov_global.loss.lp_reg_objective` on that mask with this micro-batch's proxy
    (:func:`provide_micro_batch_proxy`, which the lab's experiment sets from the same held log-prob pass as
    ``lp_reg_global`` reads), times ``rollout_is_weights``, aggregated with verl's ``agg_loss``: ``lp_reg_global``'s
    loss, only the selection differs. Metrics: :data:`LP_REG_SELECTED_METRIC`, :data:`LP_REG_SWITCHED_OFF_METRIC`."""
    from verl.trainer.ppo.core_algos import agg_loss

    from ..loss import lp_reg_objective

    proxy = _PROXY.get()
    if proxy is None:
        raise MicroBatchProxyUnavailableError(
            f"loss_mode={LP_REG_COMPARATOR} is the lab's comparator and needs each micro-batch's proxy log-probs: run "
            "it through verl_klcov_global.lab.experiment.one_update. For training, use loss_mode=lp_reg_global")
    if proxy.shape != response_mask.shape:
        raise ValueError(f"{LP_REG_COMPARATOR}: proxy has shape {tuple(proxy.shape)} but response_mask "
                         f"{tuple(response_mask.shape)}: it belongs to another micro-batch")
    try:
        settings = _config.read_lp_reg_settings(config)
    except ValueError as error:
        raise ValueError(f"{LP_REG_COMPARATOR}: {error}; use LpRegPerMicroBatchPolicyLossConfig") from None
    mask, switched_off = per_micro_batch_lp_reg_mask(log_prob, advantages, response_mask, settings.neg_ratio,
                                                     settings.pos_ratio)
    pg_losses, metrics = lp_reg_objective(old_log_prob, log_prob, advantages, response_mask, mask, settings,
                                          proxy.to(log_prob.device))
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                       **config.global_batch_info)
    metrics = {name: value for name, value in metrics.items() if not name.startswith("actor/lp_reg/")}
    metrics[LP_REG_SELECTED_METRIC] = float(mask.sum().item())
    metrics[LP_REG_SWITCHED_OFF_METRIC] = float(switched_off)
    return pg_loss, metrics


def register_lp_reg_comparator() -> str:
    """Register :data:`LP_REG_COMPARATOR` in verl's ``POLICY_LOSS_REGISTRY`` in this process (idempotent); returns its
    name. The lab's, never the plugin's."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss

    if POLICY_LOSS_REGISTRY.get(LP_REG_COMPARATOR) is not compute_policy_loss_lp_reg_per_micro_batch:
        register_policy_loss(LP_REG_COMPARATOR)(compute_policy_loss_lp_reg_per_micro_batch)
    return LP_REG_COMPARATOR
