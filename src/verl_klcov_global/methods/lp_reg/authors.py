"""Lp-Reg as its authors run it: the quota inside each loss call, with their ``k > 1`` rule (Lp-Reg-dev
``compute_policy_loss_lp_reg``, core_algos.py l.648-745 at 33b27e2), the lab's comparator of ``lp_reg_global``
(``lp_reg_per_micro_batch``).

Registered by the lab only (:func:`verl_klcov_global.lab.per_micro_batch.register`), never by the plugin. It reads
its micro-batch's proxy log-probs (``reads="proxy"``), held from the same log-prob pass as ``lp_reg_global`` reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...per_call import Comparator, MicroBatchProxyUnavailableError, micro_batch_proxy
from ...loss import aggregate_policy_loss, verl_policy_loss
from .config import LpRegGlobalPolicyLossConfig, read_lp_reg_settings
from .objective import LP_REG_PREFIX, lp_reg_objective
from .selection import select_lp_reg_tokens

#: The lab-only loss name of Lp-Reg's per-loss-call rule (``policy_loss.loss_mode``).
NAME = "lp_reg_per_micro_batch"
#: Tokens the rule selected in one micro-batch (both signs, after the ``k > 1`` rule), and the tokens its ``k > 1``
#: rule switched off there.
SELECTED_METRIC = f"actor/{NAME}/selected_in_micro_batch"
SWITCHED_OFF_METRIC = f"actor/{NAME}/switched_off_in_micro_batch"


@dataclass
class LpRegPerMicroBatchPolicyLossConfig(LpRegGlobalPolicyLossConfig):
    """``lp_reg_global``'s config class (its knobs, defaults and validation) under the comparator's ``loss_mode``."""

    loss_mode: str = NAME


def per_micro_batch_lp_reg_mask(log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
                                neg_ratio: float, pos_ratio: float) -> tuple[torch.Tensor, int]:
    """The authors' selection on one loss call's tensors (Lp-Reg-dev ``compute_policy_loss_lp_reg`` l.722-741): per
    advantage sign, ``k = max(1, int(n * rho))`` lowest log-probs (detached) of this call's ``n`` tokens, taken only
    when ``k > 1``. Returns (the mask, the tokens of the signs switched off by ``k <= 1``). Ties at the k-th
    log-prob: (row, position) within the call (the authors' ``torch.topk`` leaves them unspecified); tokens with a
    non-finite log-prob or advantage are never selected."""
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


def _lp_reg_per_micro_batch(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights):
    """Lp-Reg as the authors run it, as a verl policy loss: the quota inside each loss call, i.e. per training
    micro-batch, with their ``k > 1`` rule, which is what ``lp_reg_global`` fixes. Selection:
    :func:`per_micro_batch_lp_reg_mask` on this call's ``log_prob`` (the training forward's, as their code reads
    it); loss: :func:`verl_klcov_global.methods.lp_reg.objective.lp_reg_objective` on that mask with this micro-batch's proxy
    (:func:`provide_micro_batch_proxy`, which the lab's experiment sets from the same held log-prob pass as
    ``lp_reg_global`` reads), times ``rollout_is_weights``, aggregated with verl's ``agg_loss``: ``lp_reg_global``'s
    loss, only the selection differs. Metrics: :data:`SELECTED_METRIC`, :data:`SWITCHED_OFF_METRIC`."""
    proxy = micro_batch_proxy()
    if proxy is None:
        raise MicroBatchProxyUnavailableError(
            f"loss_mode={NAME} is the lab's comparator and needs each micro-batch's proxy log-probs: run "
            "it through verl_klcov_global.lab.experiment.one_update. For training, use loss_mode=lp_reg_global")
    if proxy.shape != response_mask.shape:
        raise ValueError(f"{NAME}: proxy has shape {tuple(proxy.shape)} but response_mask "
                         f"{tuple(response_mask.shape)}: it belongs to another micro-batch")
    try:
        settings = read_lp_reg_settings(config)
    except ValueError as error:
        raise ValueError(f"{NAME}: {error}; use LpRegPerMicroBatchPolicyLossConfig") from None
    mask, switched_off = per_micro_batch_lp_reg_mask(log_prob, advantages, response_mask, settings.neg_ratio,
                                                     settings.pos_ratio)
    pg_losses, metrics = lp_reg_objective(old_log_prob, log_prob, advantages, response_mask, mask, settings,
                                          proxy.to(log_prob.device))
    pg_loss = aggregate_policy_loss(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    metrics = {name: value for name, value in metrics.items() if not name.startswith(LP_REG_PREFIX)}
    metrics[SELECTED_METRIC] = float(mask.sum().item())
    metrics[SWITCHED_OFF_METRIC] = float(switched_off)
    return pg_loss, metrics


compute_policy_loss_lp_reg_per_micro_batch = verl_policy_loss(NAME, _lp_reg_per_micro_batch)

#: The comparator the lab registers (``ModeSpec.comparator`` of ``lp_reg_global`` names this module).
COMPARATOR = Comparator(NAME, compute_policy_loss_lp_reg_per_micro_batch, LpRegPerMicroBatchPolicyLossConfig,
                        SELECTED_METRIC, reads="proxy")
