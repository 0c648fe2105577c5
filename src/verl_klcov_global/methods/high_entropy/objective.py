"""The 80/20 rule's per-token objective on a given mask (verl ``vanilla`` on the selected tokens' advantages), and
its no-mask error."""

from __future__ import annotations

import torch

from ...loss import SelectionMaskUnavailableError, dual_clip_ppo_losses


class HighEntropyMaskUnavailableError(SelectionMaskUnavailableError):
    """The ``high_entropy_global`` loss was called without a precomputed selection mask."""


def high_entropy_objective(old_log_prob, log_prob, advantages, response_mask, mask, settings):
    """verl's ``vanilla`` PPO-clip per-token loss (``core_algos.compute_policy_loss_vanilla``) on ``where(mask, A, 0)``.

    The paper's objective (Wang et al. 2025, arXiv:2506.01939, J_HighEnt): the clipped surrogate
    of every token times the indicator ``H_t >= tau`` (here: ``mask``, the top ``entropy_top_ratio``
    over the minibatch), normalised by all tokens. Per token, with ``r = exp(clamp(logp - old_logp, -20, 20))``
    and ``A' = A`` where ``mask`` is set, else ``0``:
    ``l1 = max(-A' r, -A' clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high))``; where ``A' < 0``,
    ``min(l1, -A' clip_ratio_c)`` (dual clip), else ``l1``. An unselected token has ``A' = 0``, so its
    loss and its gradient are exactly 0 (also when its advantage is not finite), while it still counts
    in the aggregation's denominators: :func:`global_policy_loss` multiplies by ``rollout_is_weights``
    and aggregates with verl's ``agg_loss`` over the whole ``response_mask``, as ``vanilla`` does; for
    ``token-mean`` that is the paper's ``1 / sum_i |o_i|``. Metrics ``actor/pg_clipfrac``,
    ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``: ``vanilla``'s, on ``A'``.
    """
    masked_advantages = torch.where(mask, advantages, advantages.new_zeros(()))
    return dual_clip_ppo_losses(old_log_prob, log_prob, masked_advantages, response_mask, settings)
