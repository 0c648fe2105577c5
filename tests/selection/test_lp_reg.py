"""Lp-Reg's selection against an independent sort-based reference, and over 2 gloo ranks bit for bit."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from verl_klcov_global.methods.lp_reg.selection import lp_reg_quota, select_lp_reg_tokens, validate_lp_reg_ratio

from ..support.batches import random_minibatch
from ..support.gloo import spawn_gloo


def reference(log_probs, advantages, response_mask, neg_ratio, pos_ratio):
    """The definition in plain Python: valid = in the mask, log-prob and advantage finite; per sign, k = the fork's
    max(1, int(n * rho)) (at most n; 0 for n = 0 or rho = 0), taken also when it is 1; sort by (log-prob ascending,
    row, position)."""
    rows, cols = log_probs.shape
    lp, adv, inside = log_probs.double().tolist(), advantages.double().tolist(), response_mask.bool().tolist()
    valid = [(r, c) for r in range(rows) for c in range(cols)
             if inside[r][c] and math.isfinite(lp[r][c]) and math.isfinite(adv[r][c])]
    mask = torch.zeros(rows, cols, dtype=torch.bool)
    quotas = []
    for sign, ratio in ((-1, neg_ratio), (1, pos_ratio)):
        candidates = [(lp[r][c], r, c) for r, c in valid if adv[r][c] * sign > 0]
        n = len(candidates)
        k = 0 if (n == 0 or ratio == 0) else min(n, max(1, int(n * ratio)))
        quotas.append((k, n))
        for _, r, c in sorted(candidates)[:k]:
            mask[r, c] = True
    chosen = [Fraction(lp[r][c]) for r, c in valid if mask[r, c]]
    return mask, quotas, len(valid), (float(sum(chosen) / len(chosen)) if chosen else math.nan)


def _cases():
    cases = []
    for seed in range(30):
        a, lp, m = random_minibatch(seed, batch=10, length=12)
        neg, pos = [(0.01, 0.0), (0.05, 0.0), (0.2, 0.1), (0.0, 0.3), (1.0, 1.0)][seed % 5]
        cases.append((f"random-{seed}", lp, a, m, neg, pos, seed % 11))
    ties_a = torch.ones(8, 6)
    ties_a[::2] = -1.0
    ties_a[1, :3] = 0.0  # A = 0: in neither set
    cases.append(("exact-ties", torch.full((8, 6), -1.25), ties_a, torch.ones(8, 6, dtype=torch.bool), 0.3, 0.2, 3))
    a, lp, m = random_minibatch(77, batch=8, length=10)
    lp[0, 0], a[1, 1], lp[2, 2] = math.nan, math.inf, -math.inf  # never selected, counted
    m[5:] = False  # rank 1 holds only padding when split at 5
    cases.append(("nonfinite-and-padding", lp, a, m, 0.2, 0.0, 5))
    return cases


@pytest.mark.parametrize("case", _cases(), ids=lambda case: case[0])
def test_the_selection_is_the_definition(case):
    name, lp, a, m, neg, pos, _ = case
    chosen = select_lp_reg_tokens(lp, a, m, neg, pos)
    mask, ((k_neg, n_neg), (k_pos, n_pos)), n_valid, selected_mean = reference(lp, a, m, neg, pos)
    assert torch.equal(chosen.mask, mask)
    assert (chosen.negative_quota, chosen.negative_candidates, chosen.positive_quota) == (k_neg, n_neg, k_pos)
    assert chosen.positive_candidates == n_pos and chosen.num_valid == n_valid
    assert chosen.num_selected == int(mask.sum()) == k_neg + k_pos
    if not math.isnan(selected_mean):  # a fixed-point sum: within a grid step of the exact mean
        assert chosen.selected_log_prob_mean == pytest.approx(selected_mean, rel=1e-9, abs=1e-12)


def test_a_quota_of_one_is_taken_where_the_fork_takes_none():
    """The fork regularises a set only when max(1, int(n * rho)) > 1; here k = 1 selects the lowest token."""
    assert [lp_reg_quota(n, 0.01) for n in (0, 1, 199, 200, 299, 300)] == [0, 1, 1, 2, 2, 3]
    assert lp_reg_quota(7, 0.0) == 0 and lp_reg_quota(7, 1.0) == 7
    lp = torch.tensor([[-0.5, -3.0, -0.1, -2.0]])
    a = torch.tensor([[-1.0, -1.0, -1.0, 1.0]])
    chosen = select_lp_reg_tokens(lp, a, torch.ones_like(a, dtype=torch.bool), 0.01)
    assert chosen.mask.tolist() == [[False, True, False, False]] and chosen.negative_quota == 1


def test_the_ratios_are_fractions_in_zero_one():
    assert validate_lp_reg_ratio(0) == 0.0
    for bad in (-0.1, 1.5, 10, True, "0.01", math.nan):
        with pytest.raises(ValueError, match="lp_reg_neg_ratio must be finite and in \\[0, 1\\]"):
            validate_lp_reg_ratio(bad)
    with pytest.raises(ValueError, match="lp_reg_pos_ratio"):
        select_lp_reg_tokens(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), 0.01, -1.0)


def _split_cases(rank, world_size):
    results = []
    for name, lp, a, m, neg, pos, split in _cases():
        whole = select_lp_reg_tokens(lp, a, m, neg, pos)
        rows = slice(0, split) if rank == 0 else slice(split, lp.shape[0])
        part = select_lp_reg_tokens(lp[rows], a[rows], m[rows], neg, pos, group=dist.group.WORLD)
        results.append((name, torch.equal(part.mask, whole.mask[rows]), part.figures() == whole.figures()))
    dist.destroy_process_group()
    return results


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_give_the_single_process_selection_bit_for_bit():
    for rank_results in spawn_gloo(_split_cases, 2):
        for name, mask_equal, figures_equal in rank_results:
            assert mask_equal and figures_equal, name
