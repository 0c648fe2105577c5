"""``lp_reg_objective`` (loss.py) on given tensors: the authors' formula (``tests/engine/test_engine_lp_reg.py``'s
transcription) where a mask is the authors' per-call selection, no NaN gradient from a ``-inf`` proxy or a huge
log-ratio on unregularised tokens, the tallies, and the per-call switch-off count."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from verl_klcov_global.methods.lp_reg.authors import per_micro_batch_lp_reg_mask
from verl_klcov_global.methods.lp_reg.objective import LP_REG_PREFIX, lp_reg_objective, lp_reg_per_call_switched_off

from .engine.test_engine_lp_reg import _authors_pg_losses

SETTINGS = SimpleNamespace(neg_ratio=0.05, pos_ratio=0.05, kl_coef=1.0, clip_ratio_low=1.0, clip_ratio_high=9.0,
                           clip_ratio_c=10.0)


def _tensors(seed=0, batch=6, width=40):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, width, generator=g, dtype=torch.float64) * 6
    new = old + 0.05 * torch.randn(batch, width, generator=g, dtype=torch.float64)
    advantages = torch.randn(batch, 1, generator=g, dtype=torch.float64).expand(batch, width).clone()
    response_mask = torch.ones(batch, width)
    response_mask[:, 30:] = 0
    proxy = old + torch.rand(batch, width, generator=g, dtype=torch.float64) * 0.5 - 0.1
    proxy[torch.rand(batch, width, generator=g) < 0.2] = -math.inf  # outside the min-p support
    return old, new.requires_grad_(True), advantages, response_mask, proxy


def test_on_the_authors_selection_the_loss_is_their_formula():
    old, new, advantages, response_mask, proxy = _tensors()
    mask, switched_off = per_micro_batch_lp_reg_mask(new, advantages, response_mask, SETTINGS.neg_ratio,
                                                     SETTINGS.pos_ratio)
    assert mask.any() and switched_off == lp_reg_per_call_switched_off(advantages, response_mask, SETTINGS)
    ours, metrics = lp_reg_objective(old, new, advantages, response_mask, mask, SETTINGS, proxy)
    theirs = _authors_pg_losses(old, new, proxy, advantages, response_mask, neg=SETTINGS.neg_ratio,
                                pos=SETTINGS.pos_ratio, coef=1.0, low=1.0, high=9.0)
    valid = response_mask.bool()
    torch.testing.assert_close(ours[valid], theirs[valid], rtol=1e-12, atol=0)
    regularised = mask & valid & (new.detach() < proxy)
    assert metrics[f"{LP_REG_PREFIX}regularised_in_micro_batch"] == float(regularised.sum()) > 0
    assert metrics[f"{LP_REG_PREFIX}selected_in_support_in_micro_batch"] == float((mask & torch.isfinite(proxy)).sum())


def test_no_nan_gradient_from_an_infinite_proxy_or_a_huge_log_ratio():
    """Selected tokens outside the support (proxy -inf) and an overflowing ratio on an unregularised token do not
    reach the regularised branch's exponent or KL: every gradient of the other tokens is finite."""
    old, new, advantages, response_mask, proxy = _tensors(1)
    with torch.no_grad():
        new[0, 0] = old[0, 0] + 800.0  # exp overflows where it is not regularised
    mask = torch.zeros_like(response_mask, dtype=torch.bool)
    mask[1:, :5] = True
    assert (mask & torch.isinf(proxy)).any()
    losses, _ = lp_reg_objective(old, new, advantages, response_mask, mask, SETTINGS, proxy)
    (losses[1:].sum() + losses[0, 1:].sum()).backward()  # the huge ratio's own token is left out: vanilla's inf
    assert torch.isfinite(new.grad).all()


def test_the_per_call_switch_off_is_the_authors_k_above_one_rule():
    response_mask = torch.ones(1, 300)
    advantages = torch.full((1, 300), -1.0)
    advantages[0, :150] = 1.0
    settings = SimpleNamespace(neg_ratio=0.01, pos_ratio=0.0)
    # 150 A < 0 tokens at 1%: k = max(1, 1) = 1, not > 1: all 150 switched off; 200 would give k = 2
    assert lp_reg_per_call_switched_off(advantages, response_mask, settings) == 150
    advantages[0, 100:150] = -1.0
    assert lp_reg_per_call_switched_off(advantages, response_mask, settings) == 0
    mask, switched = per_micro_batch_lp_reg_mask(torch.zeros(1, 300), advantages, response_mask, 0.01, 0.0)
    assert switched == 0 and int(mask.sum()) == 2
