"""The 80/20 rule as its implementations run it: the entropy threshold per training micro-batch, the lab's comparator
of ``high_entropy_global`` (``high_entropy_per_micro_batch``).

*Beyond the 80/20 Rule* (arXiv:2506.01939) keeps the PPO-clip loss only on the top ρ of tokens by entropy. Every
implementation people run takes that threshold per training micro-batch; this module is TRL's public rule
(``GRPOTrainer.get_high_entropy_mask``):

* per micro-batch, ``threshold = torch.quantile(valid entropies, 1 - ρ)`` (linear interpolation);
* every valid token with entropy ``>=`` the threshold keeps verl's ``vanilla`` PPO-clip loss, the
  others get 0 (their advantage is set to 0: verl's vanilla then gives exactly 0 loss and gradient,
  dual clip included);
* aggregated with verl's ``agg_loss`` over all valid tokens (the paper's 1/Σ|oᵢ| for token-mean).

The lab registers it (:func:`verl_klcov_global.lab.per_micro_batch.register`); it reads each micro-batch's entropy
(``reads="entropy"``: :func:`~verl_klcov_global.lab.per_micro_batch.ppo_loss_with_entropy` provides it) and raises
:class:`~verl_klcov_global.lab.per_micro_batch.MicroBatchEntropyUnavailableError` without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from verl.workers.config import PolicyLossConfig

from ...per_call import Comparator, MicroBatchEntropyUnavailableError, micro_batch_entropy
from ...loss import verl_policy_loss
from .config import DEFAULT_ENTROPY_TOP_RATIO

#: The lab-only loss name of the per-micro-batch rule (``policy_loss.loss_mode``).
NAME = "high_entropy_per_micro_batch"
#: Tokens the rule kept in one micro-batch, and its threshold (``ppo_loss`` metrics, mean over micro-batches).
SELECTED_METRIC = f"actor/{NAME}/selected_in_micro_batch"
THRESHOLD_METRIC = f"actor/{NAME}/entropy_threshold"


@dataclass
class HighEntropyPerMicroBatchPolicyLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus ``entropy_top_ratio`` (ρ, the fraction kept; ``high_entropy_global``'s
    default), for the comparator. The ratio is validated by the loss call."""

    loss_mode: str = NAME
    entropy_top_ratio: float = DEFAULT_ENTROPY_TOP_RATIO


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
            f"{NAME}: actor.policy_loss.entropy_top_ratio must be a fraction in (0, 1] (0.2 keeps the top "
            f"20% of each micro-batch's tokens), got {ratio!r}; use HighEntropyPerMicroBatchPolicyLossConfig"
        )
    return float(ratio)


def _high_entropy_per_micro_batch(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights):
    """The per-micro-batch rule as a verl policy loss (see the module docstring)."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    entropy = micro_batch_entropy()
    if entropy is None:
        raise MicroBatchEntropyUnavailableError(
            f"loss_mode={NAME} is the lab's comparator and needs each micro-batch's entropy: call verl's "
            f"ppo_loss through verl_klcov_global.lab.per_micro_batch.ppo_loss_with_entropy (the lab's experiment "
            f"does), with calculate_entropy=True on the minibatch. For training, use loss_mode=high_entropy_global"
        )
    if entropy.shape != response_mask.shape:
        raise ValueError(f"{NAME}: entropy has shape {tuple(entropy.shape)} but response_mask "
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


compute_policy_loss_high_entropy_per_micro_batch = verl_policy_loss(NAME, _high_entropy_per_micro_batch)

#: The comparator the lab registers (``ModeSpec.comparator`` of ``high_entropy_global`` names this module).
COMPARATOR = Comparator(NAME, compute_policy_loss_high_entropy_per_micro_batch,
                        HighEntropyPerMicroBatchPolicyLossConfig, SELECTED_METRIC, reads="entropy")
