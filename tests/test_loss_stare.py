"""The STARE objective against the authors' formula (hp-luo/STARE compute_policy_loss_stare and
compute_stare_token_weights at bffb9e7, transcribed here as the oracle) on one micro-batch that holds the whole
minibatch: the fork's per-call selection is then the global one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from verl_klcov_global.methods.stare.objective import stare_objective
from verl_klcov_global.methods.stare.selection import select_stare_tokens

from .support.batches import random_minibatch


def fork_pg_losses(old_log_prob, log_prob, advantages, response_mask, *, top_ratio, variant, w, m, gate_on,
                   clip_low=0.2, clip_high=0.2, clip_c=3.0):
    """The fork's per-token losses before agg_loss: dual-clip vanilla, times its token weights (torch.topk per sign,
    k = max(1, int(n * P + 0.999999)) capped at n)."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    clip_pg_losses2 = torch.min(-advantages * clip_c, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    valid = response_mask > 0
    surprisal = -log_prob.detach()

    def top(candidates):
        n = int(candidates.sum())
        chosen = torch.zeros_like(candidates)
        if n == 0 or top_ratio <= 0:
            return chosen
        k = min(n, max(1, int(n * top_ratio + 0.999999)))
        idx = torch.topk(surprisal[candidates], k).indices
        flat = torch.nonzero(candidates.reshape(-1), as_tuple=True)[0][idx]
        chosen.view(-1)[flat] = True
        return chosen

    l_plus = top(valid & (advantages > 0))
    l_minus = top(valid & (advantages < 0)) if variant == "C2" else torch.zeros_like(valid)
    weights = torch.ones_like(advantages)
    if gate_on:
        weights = torch.where(l_plus, torch.full_like(weights, w), weights)
        if variant == "C2":
            weights = torch.where(l_minus, torch.full_like(weights, m), weights)
    return pg_losses * weights


@pytest.mark.parametrize("variant", ["O1", "C2"])
@pytest.mark.parametrize("gate_on", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_the_objective_is_the_forks_on_a_whole_minibatch(variant, gate_on, seed):
    advantages, log_probs, mask = random_minibatch(seed, batch=12, length=16)
    gen = torch.Generator().manual_seed(100 + seed)
    old = log_probs + 0.3 * torch.randn(log_probs.shape, generator=gen)  # ratios beyond both clips
    settings = SimpleNamespace(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, reweight_w=1.1,
                               reweight_m=0.9, gate_on=gate_on)
    chosen = select_stare_tokens(log_probs, advantages, mask, 0.1, with_negative=variant == "C2")
    ours, _ = stare_objective(old, log_probs, advantages, mask, chosen.mask, settings)
    theirs = fork_pg_losses(old, log_probs, advantages, mask, top_ratio=0.1, variant=variant, w=1.1, m=0.9,
                            gate_on=gate_on)
    inside = mask.bool()  # random surprisals: no ties, so torch.topk's order cannot differ from ours
    assert torch.equal(ours[inside], theirs[inside])
