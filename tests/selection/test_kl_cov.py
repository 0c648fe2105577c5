"""The pure selection core: upstream semantics applied once, exact ties, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from verl_klcov_global.methods.kl_cov.selection import kl_cov_quota, select_kl_cov_tokens

from ..support import legacy_selection

from ..support.batches import boundary_gap, random_minibatch


def upstream_selected_indices(advantages, log_probs, response_mask, ratio):
    """verl 0.9.1 kl_cov's own selection code (core_algos.py ~1896-1913), returning flat indices."""
    all_valid = response_mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = advantages[all_valid].detach().reshape(-1).cpu()
    all_valid_logp = log_probs[all_valid].detach().reshape(-1).cpu()
    cov = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
    k = max(1, int(len(cov) * ratio))
    return set(all_valid_idx[torch.topk(cov, k, largest=True).indices].tolist())


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), ratio=st.sampled_from([0.0002, 0.01, 0.05, 0.3, 1.0]),
       batch=st.integers(1, 24), length=st.integers(1, 40))
def test_matches_upstream_selection_on_whole_minibatch(seed, ratio, batch, length):
    advantages, log_probs, response_mask = random_minibatch(seed, batch, length)
    # At an (exact or float32-rounding) tie on the boundary upstream's torch.topk picks arbitrarily;
    # our deterministic tie-break is tested on its own below.
    assume(boundary_gap(advantages, log_probs, response_mask, ratio) > 1e-5)
    result = select_kl_cov_tokens(advantages, log_probs, response_mask, ratio)
    expected = upstream_selected_indices(advantages, log_probs, response_mask, ratio)
    assert set(torch.nonzero(result.mask.reshape(-1)).flatten().tolist()) == expected
    assert result.quota == result.num_selected == len(expected)
    assert result.num_valid == int(response_mask.sum())


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10_000), ratio=st.sampled_from([0.0002, 0.01, 0.05, 0.3, 0.7, 1.0]),
       batch=st.integers(0, 24), length=st.integers(1, 40), kind=st.sampled_from(["f32", "f64", "ties", "nan"]))
def test_masks_are_bit_identical_to_the_v0_1_gather_design(seed, ratio, batch, length, kind):
    """The radix agreement changed the exchange, not the result: same mask, threshold and figures as 0.1.0
    (0.1.0's figures; the covariance figures came later, tests/selection/test_covariance.py)."""
    advantages, log_probs, response_mask = random_minibatch(seed, batch, length)
    if kind == "f64":
        gen = torch.Generator().manual_seed(seed)
        advantages = advantages.double() + 1e-9 * torch.rand(advantages.shape, generator=gen, dtype=torch.float64)
    elif kind == "ties":  # few distinct values: ties at the boundary are the rule
        advantages, log_probs = advantages.round(), (log_probs / 4).round()
    elif kind == "nan" and advantages.numel():
        advantages.view(-1)[seed % advantages.numel()] = math.nan
        log_probs.view(-1)[(seed * 7) % log_probs.numel()] = -math.inf
    new = select_kl_cov_tokens(advantages, log_probs, response_mask, ratio)
    old = legacy_selection.select_kl_cov_tokens(advantages, log_probs, response_mask, ratio)
    assert torch.equal(new.mask, old.mask)
    assert {name: new.figures()[name] for name in old.figures()} == old.figures()
    assert (new.mean_advantage, new.mean_log_prob) == (old.mean_advantage, old.mean_log_prob)


def test_quota_for_8192_tokens_at_ratio_0_0002_is_one_whatever_the_split():
    assert kl_cov_quota(8192, 0.0002) == 1
    advantages, log_probs, _ = random_minibatch(0, batch=64, length=128)
    response_mask = torch.ones(64, 128, dtype=torch.bool)
    result = select_kl_cov_tokens(advantages, log_probs, response_mask, 0.0002)
    assert result.quota == 1 and int(result.mask.sum()) == 1
    # what upstream kl_cov does per micro-batch: one token in each of 8 micro-batches
    per_micro_batch = [kl_cov_quota(int(response_mask[i : i + 8].sum()), 0.0002) for i in range(0, 64, 8)]
    assert sum(per_micro_batch) == 8


def test_exact_ties_are_broken_by_sequence_then_position():
    # every valid token has the same covariance: pick the first k in (row, position) order
    advantages = torch.zeros(4, 5)
    advantages[:2] = 1.0
    advantages[2:] = -1.0
    log_probs = torch.where(advantages > 0, -1.0, -3.0)
    response_mask = torch.ones(4, 5, dtype=torch.bool)
    response_mask[0, 3:] = False
    result = select_kl_cov_tokens(advantages, log_probs, response_mask, 0.5)
    assert result.quota == 9
    expected = torch.zeros(4, 5, dtype=torch.bool)
    expected[0, :3] = True
    expected[1, :] = True
    expected[2, :1] = True
    assert torch.equal(result.mask, expected)


def test_constant_advantages_give_a_deterministic_selection():
    advantages = torch.full((6, 7), 0.1)
    log_probs = -torch.rand(6, 7, generator=torch.Generator().manual_seed(3))
    response_mask = torch.ones(6, 7, dtype=torch.bool)
    first = select_kl_cov_tokens(advantages, log_probs, response_mask, 0.2)
    again = select_kl_cov_tokens(advantages.clone(), log_probs.clone(), response_mask, 0.2)
    assert torch.equal(first.mask, again.mask) and first.num_selected == first.quota == 8


def test_padding_is_never_selected_even_with_extreme_values():
    advantages, log_probs, response_mask = random_minibatch(5, 8, 16, min_len=2)
    advantages = torch.where(response_mask, advantages, 1e6)
    log_probs = torch.where(response_mask, log_probs, 1e6)
    result = select_kl_cov_tokens(advantages, log_probs, response_mask, 1.0)
    assert not (result.mask & ~response_mask).any()
    assert torch.equal(result.mask, response_mask)


def test_nonfinite_tokens_are_not_selected_and_are_counted():
    advantages, log_probs, response_mask = random_minibatch(7, 8, 16, min_len=16)
    advantages[0, 0] = math.nan
    log_probs[1, 1] = math.inf
    log_probs[2, 2] = -math.inf
    advantages[3, 15] = math.inf
    advantages[4, 4] = 1e30  # finite, huge: a legitimate top covariance (log-prob above the mean)
    log_probs[4, 4] = 0.0
    result = select_kl_cov_tokens(advantages, log_probs, response_mask, 0.05)
    assert result.num_nonfinite == 4
    assert result.num_valid == int(response_mask.sum()) - 4
    for r, c in [(0, 0), (1, 1), (2, 2), (3, 15)]:
        assert not result.mask[r, c]
    assert result.mask[4, 4]
    assert math.isfinite(result.threshold)


def test_no_valid_tokens_gives_an_empty_selection():
    result = select_kl_cov_tokens(torch.zeros(3, 4), torch.zeros(3, 4), torch.zeros(3, 4, dtype=torch.bool), 0.5)
    assert result.quota == 0 and result.num_selected == 0 and not result.mask.any()
    assert "cov_threshold" not in result.figures()  # undefined: no NaN for the logger
    empty = select_kl_cov_tokens(torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0, 4), 0.5)
    assert empty.mask.shape == (0, 4)


@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.5, math.nan, math.inf, "a", None])
def test_bad_ratio_raises_a_clear_error(ratio):
    a, lp, m = random_minibatch(0, 2, 3)
    with pytest.raises(ValueError, match="kl_cov_ratio"):
        select_kl_cov_tokens(a, lp, m, ratio)


def test_mismatched_shapes_raise():
    with pytest.raises(ValueError, match="same shape"):
        select_kl_cov_tokens(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 0.5)


def test_float64_statistics_on_float32_and_bfloat16_inputs():
    advantages, log_probs, response_mask = random_minibatch(11, 8, 16)
    full = select_kl_cov_tokens(advantages.double(), log_probs.double(), response_mask, 0.1)
    as_f32 = select_kl_cov_tokens(advantages, log_probs, response_mask, 0.1)
    assert torch.equal(full.mask, as_f32.mask)
    as_bf16 = select_kl_cov_tokens(advantages.bfloat16(), log_probs.bfloat16(), response_mask, 0.1)
    assert as_bf16.mask.dtype == torch.bool and as_bf16.num_selected == as_bf16.quota
