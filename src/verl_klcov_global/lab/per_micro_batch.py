"""The authors' high-entropy rule, per micro-batch: the comparator of ``high_entropy_global`` (lab only).

*Beyond the 80/20 Rule* (arXiv:2506.01939) keeps the PPO-clip loss only on the top ρ of tokens
by entropy. Every implementation people run takes that threshold per training micro-batch; this
module is TRL's public rule (``GRPOTrainer.get_high_entropy_mask``), which the issue names:

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
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from verl.workers.config import PolicyLossConfig

__all__ = [
    "COMPARATOR",
    "HighEntropyPerMicroBatchPolicyLossConfig",
    "MicroBatchEntropyUnavailableError",
    "SELECTED_METRIC",
    "THRESHOLD_METRIC",
    "compute_policy_loss_high_entropy_per_micro_batch",
    "per_micro_batch_entropy_mask",
    "ppo_loss_with_entropy",
    "provide_micro_batch_entropy",
    "register_comparator",
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

    if config.policy_loss.get("loss_mode", "vanilla") != COMPARATOR:
        return ppo_loss(config, model_output, data, dp_group)
    entropy = model_output.get("entropy", None)
    if entropy is None:
        raise MicroBatchEntropyUnavailableError(
            f"loss_mode={COMPARATOR}: the engine computed no entropy for this micro-batch; set the minibatch's "
            f"non-tensor key calculate_entropy=True (verl_klcov_global.lab.experiment.one_update does)"
        )
    with provide_micro_batch_entropy(no_padding_2_padding(entropy, data).detach()):
        return ppo_loss(config, model_output, data, dp_group)
