"""Two small policy losses a user might register, for ``diagnose --import ... --loss-mode ...`` tests.

* :data:`TOP_K` keeps verl's ``vanilla`` PPO-clip loss only on the top 10% of the valid tokens of
  **each loss call** by surprisal (``-log_prob``), as STARE's ``torch.topk`` does: the engine calls the
  loss once per micro-batch, so the split changes which tokens count. Not invariant.
  Its knob ``top_fraction`` (default 0.1) comes from its own config class, :class:`TopSurprisalConfig`,
  selected with ``actor_rollout_ref.actor.policy_loss._target_=two_user_losses.TopSurprisalConfig``;
  at 1.0 every token is kept and the loss is verl's ``vanilla``.
* :data:`PER_TOKEN` is ``-A * log_prob`` per token, aggregated by verl's ``agg_loss`` with the
  global batch info verl hands every call: no statistic of the call. Invariant.

Importing the module registers both (verl's ``register_policy_loss``). Standalone on purpose: the
CLI tests copy it into a scratch folder and run diagnose there with ``--import two_user_losses``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from verl.trainer.ppo.core_algos import agg_loss, compute_policy_loss_vanilla, register_policy_loss
from verl.workers.config import PolicyLossConfig

TOP_K = "test_top_surprisal_per_call"
PER_TOKEN = "test_per_token_reinforce"


@dataclass
class TopSurprisalConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus the knob of :data:`TOP_K`: the fraction of each call's tokens kept."""

    loss_mode: str = TOP_K
    top_fraction: float = 0.1


@register_policy_loss(TOP_K)
def top_surprisal_per_call(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                           response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                           rollout_is_weights: Optional[torch.Tensor] = None):
    """PPO-clip on this call's top ``top_fraction`` of valid tokens by surprisal, 0 elsewhere."""
    top_fraction = getattr(config.policy_loss, "top_fraction", TopSurprisalConfig.top_fraction)
    valid = response_mask.bool()
    surprisal = (-log_prob.detach()).masked_fill(~valid, float("-inf")).flatten()
    k = max(1, int(valid.sum().item() * top_fraction))
    keep = torch.zeros_like(surprisal, dtype=torch.bool)
    keep[torch.topk(surprisal, k).indices] = True
    kept = keep.view_as(valid) & valid
    return compute_policy_loss_vanilla(old_log_prob, log_prob, advantages * kept.to(advantages.dtype), response_mask,
                                       loss_agg_mode, config, rollout_is_weights)


@register_policy_loss(PER_TOKEN)
def per_token_reinforce(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                        response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                        rollout_is_weights: Optional[torch.Tensor] = None):
    """``-A * log_prob`` per token, aggregated over the global batch as verl's own losses are."""
    losses = -advantages * log_prob
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights
    return agg_loss(loss_mat=losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                    **config.global_batch_info), {}
