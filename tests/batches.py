"""Random (batch, response_len) tensors shaped like a PPO minibatch, for the pure tests."""

from __future__ import annotations

import math

import torch

from verl_klcov_global.selection import kl_cov_quota


def random_minibatch(seed: int, batch: int = 16, length: int = 24, *, min_len: int = 1, group: int = 4):
    """advantages, log_probs, response_mask: (batch, length) float32 / float32 / bool.

    Responses are right-padded with random lengths in [min_len, length]; advantages
    are GRPO-like (one value per group of ``group`` sequences) plus small per-token
    noise; log-probs are in (-8, 0].
    """
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, length + 1, (batch,), generator=gen)
    response_mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    per_group = torch.randn((batch + group - 1) // group, generator=gen).repeat_interleave(group)[:batch]
    advantages = per_group.unsqueeze(1) + 0.1 * torch.randn(batch, length, generator=gen)
    log_probs = -8 * torch.rand(batch, length, generator=gen)
    return advantages * response_mask, log_probs * response_mask, response_mask


def boundary_gap(advantages, log_probs, response_mask, ratio):
    """Relative gap between the k-th and (k+1)-th covariance (float64); inf when nothing is left out."""
    valid = response_mask.bool()
    a, lp = advantages[valid].double(), log_probs[valid].double()
    cov = ((a - a.mean()) * (lp - lp.mean())).sort(descending=True).values
    k = kl_cov_quota(len(cov), ratio)
    if k >= len(cov):
        return math.inf
    return float((cov[k - 1] - cov[k]) / cov.abs().max().clamp_min(1e-30))
