"""Random (batch, response_len) tensors shaped like a PPO minibatch, for the pure tests (kl_cov and clip_cov)."""

from __future__ import annotations

import math

import torch

from verl_klcov_global.methods.kl_cov.selection import kl_cov_quota


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


CLIP_COV_KNOBS = dict(clip_cov_ratio=0.05, clip_cov_lb=0.5, clip_cov_ub=4.0, clip_ratio_low=0.2, clip_ratio_high=0.28,
                      seed=0)


def clip_cov_inputs(seed, batch=12, length=20, *, noise=0.1, min_len=1, prompt_len=5):
    """advantages, log_probs, old_log_probs, response_mask (batch, length); token_ids (batch, prompt+length)."""
    advantages, log_probs, response_mask = random_minibatch(seed, batch, length, min_len=min_len)
    gen = torch.Generator().manual_seed(seed + 1)
    old_log_probs = (log_probs + noise * torch.randn(log_probs.shape, generator=gen)) * response_mask
    prompts = torch.randint(3, 500, (batch, prompt_len), generator=gen)
    responses = torch.randint(3, 500, (batch, length), generator=gen) * response_mask
    token_mask = torch.cat([torch.ones(batch, prompt_len, dtype=torch.bool), response_mask], dim=1)
    return dict(advantages=advantages, log_probs=log_probs, old_log_probs=old_log_probs,
                response_mask=response_mask, token_ids=torch.cat([prompts, responses], dim=1), token_mask=token_mask)


def reference_candidates(inputs, lb, ub, low, high):
    """Candidates by the definition, in float64 from scratch: valid, not PPO-clipped, lb < cov < ub."""
    a, lp, old, m = (inputs[k] for k in ("advantages", "log_probs", "old_log_probs", "response_mask"))
    valid = m.bool() & a.isfinite() & lp.isfinite() & old.isfinite()
    ratio = torch.exp(lp - old)
    clipped = (-a * torch.clamp(ratio, 1 - low, 1 + high)) > (-a * ratio)
    a64, lp64 = a.double(), lp.double()
    cov = (a64 - a64[valid].mean()) * (lp64 - lp64[valid].mean())
    return valid & ~clipped & (cov > lb) & (cov < ub), valid, clipped & valid, cov
