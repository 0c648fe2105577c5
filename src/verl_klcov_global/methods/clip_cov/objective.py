"""Clip-Cov's per-token objective on a given mask (verl's ``clip_cov`` formula), and its no-mask error."""

from __future__ import annotations

import torch
import verl.utils.torch_functional as verl_F

from ...loss import SelectionMaskUnavailableError


class ClipCovMaskUnavailableError(SelectionMaskUnavailableError):
    """The ``clip_cov_global`` loss was called without a precomputed selection mask."""


def clip_cov_objective(old_log_prob, log_prob, advantages, response_mask, mask, settings):
    """verl's ``clip_cov`` per-token loss (``core_algos.compute_policy_loss_clip_cov``) with its random selection
    replaced by ``mask``.

    With ``r = exp(logp - old_logp)``: ``max(-A r, -A clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high))``,
    times ``corr = 0`` where ``mask`` is set (1 elsewhere; those tokens still count in the
    aggregation's denominators). Metrics ``actor/pg_clipfrac`` (masked mean of ``corr == 0``) and
    ``actor/ppo_kl`` (masked mean of ``old_logp - logp``), as ``clip_cov`` reports them.
    """
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = verl_F.masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - settings.clip_ratio_low, 1 + settings.clip_ratio_high)
    corr = torch.ones_like(advantages)
    corr[mask] = 0
    pg_clipfrac = verl_F.masked_mean((corr == 0).float(), response_mask)
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr
    return pg_losses, {"actor/pg_clipfrac": pg_clipfrac.detach().item(), "actor/ppo_kl": ppo_kl.detach().item()}
