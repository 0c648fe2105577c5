"""KL-Cov's per-token objective on a given mask (verl's ``kl_cov`` formula), and its no-mask error."""

from __future__ import annotations

import torch
import verl.utils.torch_functional as verl_F

from ...loss import SelectionMaskUnavailableError


class KLCovMaskUnavailableError(SelectionMaskUnavailableError):
    """The ``kl_cov_global`` loss was called without a precomputed selection mask."""


def kl_cov_objective(old_log_prob, log_prob, advantages, response_mask, mask, settings):
    """verl's ``kl_cov`` per-token loss (``core_algos.compute_policy_loss_kl_cov``) on ``mask``.

    ``-A * r`` with ``r = exp(logp - old_logp)``, plus ``settings.ppo_kl_coef * |logp - old_logp|``
    where ``mask`` is set. No PPO clipping, exactly like ``kl_cov``. Metric ``actor/ppo_kl``
    (masked mean |log-ratio|, as ``kl_cov`` reports it).
    """
    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    pg_losses = -advantages * ratio
    pg_losses_kl = pg_losses + settings.ppo_kl_coef * abs_kl
    pg_losses = torch.where(mask, pg_losses_kl, pg_losses)
    return pg_losses, {"actor/ppo_kl": verl_F.masked_mean(abs_kl, response_mask).detach().item()}
