"""STARE's selection against an independent sort-based reference, and over 2 gloo ranks bit for bit."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from verl_klcov_global.methods.stare.selection import (
    select_stare_tokens,
    stare_quota,
    stare_weights,
    validate_stare_top_ratio,
)

from ..support.batches import random_minibatch
from ..support.gloo import spawn_gloo


def reference(log_probs, advantages, response_mask, ratio, with_negative):
    """The definition in plain Python: valid = in the mask, log-prob and advantage finite; per sign, k = the fork's
    ceiling (at least 1, at most n; 0 for n = 0 or P = 0); sort by (surprisal descending, row, position)."""
    rows, cols = log_probs.shape
    lp, adv, inside = log_probs.double().tolist(), advantages.double().tolist(), response_mask.bool().tolist()
    valid = [(r, c) for r in range(rows) for c in range(cols)
             if inside[r][c] and math.isfinite(lp[r][c]) and math.isfinite(adv[r][c])]
    mask = torch.zeros(rows, cols, dtype=torch.bool)
    quotas = []
    for sign, take in ((1, True), (-1, with_negative)):
        candidates = [(-lp[r][c], r, c) for r, c in valid if adv[r][c] * sign > 0]
        n = len(candidates)
        k = 0 if (n == 0 or ratio == 0 or not take) else min(n, max(1, int(n * ratio + 0.999999)))
        quotas.append((k, n))
        for _, r, c in sorted(candidates, key=lambda t: (-t[0], t[1], t[2]))[:k]:
            mask[r, c] = True
    total = sum(Fraction(-lp[r][c]) for r, c in valid)
    chosen = sum(Fraction(-lp[r][c]) for r, c in valid if mask[r, c])
    return mask, quotas, len(valid), (float(chosen / total) if total > 0 else math.nan)


def _cases():
    cases = []
    for seed in range(30):
        a, lp, m = random_minibatch(seed, batch=10, length=12)
        cases.append((f"random-{seed}", lp, a, m, [0.0, 0.01, 0.1, 0.5, 1.0][seed % 5], seed % 2 == 1, seed % 11))
    ties_a = torch.ones(8, 6)
    ties_a[::2] = -1.0
    ties_a[1, :3] = 0.0  # A = 0: in neither set
    cases.append(("exact-ties", torch.full((8, 6), -1.25), ties_a, torch.ones(8, 6, dtype=torch.bool), 0.3, True, 3))
    a, lp, m = random_minibatch(77, batch=8, length=10)
    lp[0, 0], a[1, 1], lp[2, 2] = math.nan, math.inf, -math.inf  # never selected, counted
    m[5:] = False  # rank 1 holds only padding when split at 5
    cases.append(("nonfinite-and-padding", lp, a, m, 0.2, True, 5))
    return cases


@pytest.mark.parametrize("case", _cases(), ids=lambda case: case[0])
def test_the_selection_is_the_definition(case):
    name, lp, a, m, ratio, with_negative, _ = case
    chosen = select_stare_tokens(lp, a, m, ratio, with_negative=with_negative)
    mask, ((k_pos, n_pos), (k_neg, n_neg)), n_valid, share = reference(lp, a, m, ratio, with_negative)
    assert torch.equal(chosen.mask, mask)
    assert (chosen.positive_quota, chosen.positive_candidates, chosen.negative_quota) == (k_pos, n_pos, k_neg)
    assert chosen.negative_candidates == n_neg and chosen.num_valid == n_valid
    assert chosen.num_selected == int(mask.sum()) == k_pos + k_neg
    if not math.isnan(share):  # a fixed-point sum: within one grid step of the exact share
        assert chosen.selected_surprisal_share == pytest.approx(share, rel=1e-12, abs=1e-15)


def test_the_fork_rounding_of_the_quota():
    assert [stare_quota(n, 0.1) for n in (0, 1, 9, 10, 11, 100)] == [0, 1, 1, 1, 2, 10]
    assert stare_quota(7, 0.0) == 0 and stare_quota(7, 1.0) == 7
    assert stare_quota(3, 0.999) == 3  # ceil, at most n


def test_the_ratio_is_a_fraction_in_zero_one():
    assert validate_stare_top_ratio(0) == 0.0
    for bad in (-0.1, 1.5, 10, True, "0.1", math.nan):
        with pytest.raises(ValueError, match="stare_top_ratio must be finite and in \\[0, 1\\]"):
            validate_stare_top_ratio(bad)


def test_the_weights_follow_the_sign_and_the_gate():
    a = torch.tensor([[1.0, -1.0, 0.0, 2.0]])
    mask = torch.tensor([[True, True, True, False]])
    omega = stare_weights(mask, a, reweight_w=1.1, reweight_m=0.9, gate_on=True)
    assert omega.tolist() == [[pytest.approx(1.1), pytest.approx(0.9), 1.0, 1.0]]
    assert stare_weights(mask, a, reweight_w=1.1, reweight_m=0.9, gate_on=False).tolist() == [[1.0] * 4]


def _split_cases(rank, world_size):
    results = []
    for name, lp, a, m, ratio, with_negative, split in _cases():
        whole = select_stare_tokens(lp, a, m, ratio, with_negative=with_negative)
        rows = slice(0, split) if rank == 0 else slice(split, lp.shape[0])
        part = select_stare_tokens(lp[rows], a[rows], m[rows], ratio, with_negative=with_negative,
                                   group=dist.group.WORLD)
        results.append((name, torch.equal(part.mask, whole.mask[rows]), part.figures() == whole.figures()))
    dist.destroy_process_group()
    return results


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_give_the_single_process_selection_bit_for_bit():
    for rank_results in spawn_gloo(_split_cases, 2):
        for name, mask_equal, figures_equal in rank_results:
            assert mask_equal and figures_equal, name
