"""Random (batch, response_len) tensors shaped like a PPO minibatch, for the pure tests."""

from __future__ import annotations

import torch


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
