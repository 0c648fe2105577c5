"""The pure Clip-Cov selection: upstream semantics applied once, a reproducible uniform sampler, bad input.

The sampler statistic (chi-square over many seeds) is printed with ``-s``.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from verl_klcov_global.methods.clip_cov.selection import clip_cov_quota, select_clip_cov_tokens
from verl_klcov_global.selection.keys import (
    sequence_hashes,
    splitmix64_reference,
    token_key_reference,
    token_keys,
)

from ..support.batches import CLIP_COV_KNOBS as KNOBS
from ..support.batches import clip_cov_inputs, reference_candidates

P_VALUE_FLOOR = 1e-3  # deterministic seeds: a uniform sampler passes or fails the same way every run


def select(inputs, **knobs):
    return select_clip_cov_tokens(**inputs, **{**KNOBS, **knobs})


def upstream_clip_cov_selection(advantages, log_probs, old_log_probs, response_mask, ratio, lb, ub, low, high):
    """verl 0.9.1 clip_cov's own selection code (core_algos.py ~1798-1822): the candidates and its quota."""
    import verl.utils.torch_functional as verl_F

    negative_approx_kl = log_probs - old_log_probs
    r = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * r
    pg_losses2 = -advantages * torch.clamp(r, 1 - low, 1 + high)
    clip_by_origin = (pg_losses2 > pg_losses1) & (response_mask > 0)
    cov_all = (advantages - verl_F.masked_mean(advantages, response_mask)) * (
        log_probs - verl_F.masked_mean(log_probs.detach(), response_mask)
    )
    cov_all[response_mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(ratio * response_mask.sum().item()), 1)
    candidates = (cov_all < ub) & (cov_all > lb) & (response_mask > 0)
    return candidates, clip_num, cov_all


# ---------------------------------------------------------------------------------------------
# Keys: the hash is well defined, device-independent arithmetic


def test_splitmix64_reference_matches_the_published_first_output():
    assert splitmix64_reference(0) == 0xE220A8397B1DCDAF  # splitmix64 with state 0 (Vigna's splitmix64.c)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**53 - 1), rows=st.lists(
    st.lists(st.one_of(st.integers(0, 600), st.integers(0, 2**32 - 1), st.integers(-(2**62), 2**62)),
             min_size=0, max_size=12), min_size=1, max_size=5), left_pad=st.integers(0, 3),
       step=st.one_of(st.just(0), st.integers(1, 2**53 - 1)))
def test_torch_keys_equal_the_pure_python_definition(seed, rows, left_pad, step):
    width = left_pad + max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, left_pad:left_pad + len(row)] = torch.tensor(row, dtype=torch.int64)
        mask[i, left_pad:left_pad + len(row)] = True
    ids[~mask] = 12345  # padding content must not matter
    high, low = sequence_hashes(ids, mask)
    positions = torch.arange(7).expand(len(rows), 7)
    keys = token_keys(seed, (high[:, None].expand(-1, 7), low[:, None].expand(-1, 7)), positions, step)
    expected = [[token_key_reference(seed, row, t, step) for t in range(7)] for row in rows]
    assert keys.tolist() == expected
    again = token_keys(seed, sequence_hashes(ids.clone(), mask.clone()), torch.full((len(rows),), 3), step)
    assert again.tolist() == [e[3] for e in expected]


def test_keys_depend_on_seed_step_tokens_and_position():
    ids = torch.arange(10).reshape(2, 5)
    hashes = sequence_hashes(ids)
    base = token_keys(0, hashes, torch.zeros(2, dtype=torch.int64))
    assert base[0] != base[1]  # different sequences
    assert not torch.equal(base, token_keys(1, hashes, torch.zeros(2, dtype=torch.int64)))  # seed
    assert not torch.equal(base, token_keys(0, hashes, torch.ones(2, dtype=torch.int64)))  # position
    assert torch.equal(base, token_keys(0, hashes, torch.zeros(2, dtype=torch.int64), 0))  # step 0: the seed's draw
    assert not torch.equal(base, token_keys(0, hashes, torch.zeros(2, dtype=torch.int64), 1))  # optimizer step
    # seed s at step t and seed t at step s are different draws (the step's stream is tagged)
    assert not torch.equal(token_keys(1, hashes, torch.zeros(2, dtype=torch.int64), 2),
                           token_keys(2, hashes, torch.zeros(2, dtype=torch.int64), 1))
    swapped = sequence_hashes(ids[:, [1, 0, 2, 3, 4]])  # token order matters
    assert not torch.equal(token_keys(0, swapped, torch.zeros(2, dtype=torch.int64)), base)


# ---------------------------------------------------------------------------------------------
# Upstream semantics


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), ratio=st.sampled_from([0.2, 0.5, 1.0]), batch=st.integers(1, 16),
       length=st.integers(1, 30), window=st.sampled_from([(0.1, 5.0), (0.5, 2.0), (-1.0, 0.3)]),
       clip=st.sampled_from([(0.2, 0.2), (0.02, 0.05)]))
def test_equals_upstream_when_every_candidate_fits_the_quota(seed, ratio, batch, length, window, clip):
    inputs = clip_cov_inputs(seed, batch, length)
    lb, ub = window
    upstream, clip_num, cov32 = upstream_clip_cov_selection(
        inputs["advantages"], inputs["log_probs"], inputs["old_log_probs"], inputs["response_mask"],
        ratio, lb, ub, *clip)
    assume(int(upstream.sum()) <= clip_num)  # upstream is deterministic only here
    # float32 (upstream) vs exact float64 (ours) covariance: compare where no token sits on the window's edge
    finite = cov32[cov32.isfinite()].double()
    assume(finite.numel() == 0 or float(torch.minimum((finite - lb).abs(), (finite - ub).abs()).min()) > 1e-4)
    result = select(inputs, clip_cov_ratio=ratio, clip_cov_lb=lb, clip_cov_ub=ub, clip_ratio_low=clip[0],
                    clip_ratio_high=clip[1])
    assert torch.equal(result.mask, upstream)
    assert result.quota == clip_num
    assert result.num_selected == result.num_candidates == int(upstream.sum())


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), ratio=st.sampled_from([0.002, 0.02, 0.1, 0.5]), batch=st.integers(0, 16),
       length=st.integers(1, 30), clip_seed=st.integers(0, 2**53 - 1), noise=st.sampled_from([0.05, 0.5]))
def test_count_is_min_of_quota_and_candidates_all_inside_the_window(seed, ratio, batch, length, clip_seed, noise):
    inputs = clip_cov_inputs(seed, batch, length, noise=noise)
    lb, ub = 0.2, 3.0
    result = select(inputs, clip_cov_ratio=ratio, clip_cov_lb=lb, clip_cov_ub=ub, seed=clip_seed)
    candidates, valid, ppo_clipped, _ = reference_candidates(inputs, lb, ub, 0.2, 0.28)
    assert result.num_valid == int(valid.sum())
    assert result.num_candidates == int(candidates.sum())
    assert result.num_ppo_clipped == int(ppo_clipped.sum())
    assert result.quota == clip_cov_quota(result.num_valid, ratio)
    assert int(result.mask.sum()) == result.num_selected == min(result.quota, result.num_candidates)
    assert not (result.mask & ~candidates).any()  # never padding, PPO-clipped or outside the window


def test_ppo_clipped_padding_and_nonfinite_tokens_are_never_chosen():
    inputs = clip_cov_inputs(3, 8, 16, noise=0.4, min_len=4)  # large log-ratios: many PPO-clipped tokens
    a, lp, old, m = (inputs[k] for k in ("advantages", "log_probs", "old_log_probs", "response_mask"))
    a[~m], lp[~m] = 50.0, 50.0  # padding with a huge covariance
    a[0, 0], lp[1, 1], old[2, 2] = math.nan, -math.inf, math.inf
    result = select(inputs, clip_cov_ratio=1.0, clip_cov_lb=-1e9, clip_cov_ub=1e9)  # window: everything
    _, valid, ppo_clipped, _ = reference_candidates(inputs, -1e9, 1e9, 0.2, 0.28)
    assert int(ppo_clipped.sum()) >= 5 and result.num_ppo_clipped == int(ppo_clipped.sum())
    assert result.num_nonfinite == 3 and result.num_valid == int(m.sum()) - 3
    assert torch.equal(result.mask, valid & ~ppo_clipped)  # the quota covers all: exactly the candidates


def test_no_valid_tokens_or_no_candidates_gives_an_empty_selection():
    inputs = clip_cov_inputs(0, 4, 6)
    empty_mask = {**inputs, "response_mask": torch.zeros_like(inputs["response_mask"])}
    result = select(empty_mask)
    assert result.quota == 0 and result.num_selected == 0 and not result.mask.any()
    nothing_in_window = select(inputs, clip_cov_lb=1e6, clip_cov_ub=1e7)
    assert nothing_in_window.quota >= 1 and nothing_in_window.num_candidates == 0
    assert not nothing_in_window.mask.any()
    no_rows = {k: v[:0] for k, v in inputs.items()}
    assert select(no_rows).mask.shape == (0, 6)


# ---------------------------------------------------------------------------------------------
# The sampler: reproducible, a pure function of the tokens, uniform


def test_repeated_calls_are_identical_and_leave_the_global_rng_alone():
    inputs = clip_cov_inputs(5, 16, 24)
    state = torch.random.get_rng_state()
    first = select(inputs, clip_cov_ratio=0.01, clip_cov_lb=0.0)
    assert 0 < first.num_selected < first.num_candidates  # a real draw
    for _ in range(3):
        assert torch.equal(select({k: v.clone() for k, v in inputs.items()}, clip_cov_ratio=0.01,
                                  clip_cov_lb=0.0).mask, first.mask)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert not torch.equal(select(inputs, clip_cov_ratio=0.01, clip_cov_lb=0.0, seed=1).mask, first.mask)


def test_each_optimizer_step_draws_afresh_among_the_same_candidates():
    """The same minibatch at optimizer steps 0, 1, 2, ... (later PPO epochs): the same candidates and quota, a new
    draw at every step; a step drawn twice gives the same tokens."""
    inputs = clip_cov_inputs(5, 16, 24)
    draws = [select(inputs, clip_cov_ratio=0.01, clip_cov_lb=0.0, optimizer_step=step) for step in range(4)]
    assert len({(d.num_candidates, d.num_selected) for d in draws}) == 1 and draws[0].num_selected < draws[0].num_candidates
    masks = [d.mask for d in draws]
    assert all(not torch.equal(masks[i], masks[j]) for i in range(4) for j in range(i))
    assert torch.equal(select(inputs, clip_cov_ratio=0.01, clip_cov_lb=0.0).mask, masks[0])  # step 0 by default
    assert torch.equal(select(inputs, clip_cov_ratio=0.01, clip_cov_lb=0.0, optimizer_step=3).mask, masks[3])


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), extra_padding=st.integers(0, 5), data=st.data())
def test_the_draw_follows_the_sequences_not_their_order_or_padding(seed, extra_padding, data):
    inputs = clip_cov_inputs(seed, 10, 16)
    knobs = dict(clip_cov_ratio=0.01, clip_cov_lb=0.0)
    reference = select(inputs, **knobs)
    order = torch.tensor(data.draw(st.permutations(range(10))))
    permuted = {k: v[order] for k, v in inputs.items()}
    pad = lambda x, value: torch.nn.functional.pad(x, (0, extra_padding), value=value)  # noqa: E731
    permuted["token_ids"] = pad(permuted["token_ids"], 7)
    permuted["token_mask"] = pad(permuted["token_mask"], False)
    assert torch.equal(select(permuted, **knobs).mask, reference.mask[order])


def test_identical_sequences_tie_and_are_taken_in_minibatch_order():
    inputs = clip_cov_inputs(9, 4, 12, min_len=12)
    for key in inputs:
        inputs[key][1] = inputs[key][0]  # rows 0 and 1: the same sequence, same advantages
    result = select(inputs, clip_cov_ratio=1 / 48, clip_cov_lb=-1e9, clip_cov_ub=1e9)  # quota 1
    assert result.num_selected == 1
    again = select(inputs, clip_cov_ratio=1 / 48, clip_cov_lb=-1e9, clip_cov_ub=1e9)
    assert torch.equal(result.mask, again.mask)
    if result.mask[:2].any():
        assert result.mask[0].any() and not result.mask[1].any()


def _chi_square(counts: list[int], expected: float) -> tuple[float, float]:
    """Pearson's statistic and its p-value (chi-square with len(counts) - 1 degrees of freedom)."""
    statistic = sum((c - expected) ** 2 / expected for c in counts)
    dof = len(counts) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(statistic / 2, dtype=torch.float64)))
    return statistic, p_value


def _uniform_inputs(batch, length):
    """Every token a candidate (old = current: nothing PPO-clipped; window: everything)."""
    inputs = clip_cov_inputs(21, batch, length, min_len=length)
    inputs["old_log_probs"] = inputs["log_probs"].clone()
    return inputs, dict(clip_cov_lb=-1e9, clip_cov_ub=1e9)


@pytest.mark.slow  # ~15 s: 1,500 selections
def test_sampler_is_uniform_over_k_subsets_across_seeds(capsys):
    """6 candidates, quota 2: each of the 15 pairs should come up 1/15 of the time over 1,500 seeds."""
    inputs, window = _uniform_inputs(2, 3)
    subsets = {frozenset(s): 0 for s in itertools.combinations(range(6), 2)}
    seeds = 1500
    for seed in range(seeds):
        result = select(inputs, clip_cov_ratio=0.34, seed=seed, **window)
        assert result.num_candidates == 6 and result.num_selected == 2
        subsets[frozenset(torch.nonzero(result.mask.reshape(-1)).flatten().tolist())] += 1
    statistic, p_value = _chi_square(list(subsets.values()), seeds / 15)
    # the test has power: a sampler that prefers early tokens (first candidate always kept) fails it
    biased = [seeds // 5 if 0 in s else 0 for s in subsets]
    assert _chi_square(biased, seeds / 15)[1] < P_VALUE_FLOOR
    with capsys.disabled():
        print(f"\n[sampler, 15 pairs of 6 candidates, {seeds} seeds] chi2 = {statistic:.1f} (14 dof), p = {p_value:.3f}")
    assert p_value > P_VALUE_FLOOR


@pytest.mark.slow  # ~18 s: 2,000 selections
def test_sampler_marginals_are_uniform_across_seeds_and_across_sequences(capsys):
    """60 candidates, quota 6: every candidate is chosen 1/10 of the time, over seeds, token ids and optimizer steps."""
    inputs, window = _uniform_inputs(6, 10)
    draws = 1000
    by_seed, by_tokens, by_step = [0] * 60, [0] * 60, [0] * 60
    gen = random.Random(0)
    for i in range(draws):
        by_seed = [c + int(x) for c, x in zip(by_seed, select(inputs, clip_cov_ratio=0.1, seed=i, **window)
                                              .mask.reshape(-1).tolist())]
        by_step = [c + int(x) for c, x in zip(by_step, select(inputs, clip_cov_ratio=0.1, optimizer_step=i, **window)
                                              .mask.reshape(-1).tolist())]
        fresh = {**inputs, "token_ids": torch.tensor([[gen.randrange(3, 500) for _ in range(15)] for _ in range(6)])}
        by_tokens = [c + int(x) for c, x in zip(by_tokens, select(fresh, clip_cov_ratio=0.1, **window)
                                                .mask.reshape(-1).tolist())]
    assert sum(by_seed) == sum(by_tokens) == sum(by_step) == 6 * draws
    results = [_chi_square(counts, draws * 6 / 60) for counts in (by_seed, by_tokens, by_step)]
    with capsys.disabled():
        print(f"\n[sampler marginals, 60 candidates, quota 6, {draws} draws] over seeds chi2 = {results[0][0]:.1f}, "
              f"p = {results[0][1]:.3f}; over token ids chi2 = {results[1][0]:.1f}, p = {results[1][1]:.3f}; over "
              f"optimizer steps chi2 = {results[2][0]:.1f}, p = {results[2][1]:.3f} (59 dof)")
    assert all(p > P_VALUE_FLOOR for _, p in results)


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("ratio", [0, -0.1, 1.5, math.nan, math.inf, True, "0.1", None])
def test_bad_ratio(ratio):
    with pytest.raises(ValueError, match=r"clip_cov_ratio must be finite and in \(0, 1\].*policy_loss.clip_cov_ratio"):
        select(clip_cov_inputs(0, 2, 3), clip_cov_ratio=ratio)


@pytest.mark.parametrize("lb,ub,match", [
    (1.0, 1.0, "clip_cov_lb must be below clip_cov_ub"), (5.0, 1.0, "clip_cov_lb must be below clip_cov_ub"),
    (math.nan, 5.0, "clip_cov_lb must be a finite number"), (1.0, math.inf, "clip_cov_ub must be a finite number"),
    (-math.inf, 5.0, "clip_cov_lb must be a finite number"), (True, 5.0, "clip_cov_lb must be a finite number"),
    (1.0, "5", "clip_cov_ub must be a finite number"),
])
def test_bad_window(lb, ub, match):
    with pytest.raises(ValueError, match=match + ".*policy_loss.clip_cov_"):
        select(clip_cov_inputs(0, 2, 3), clip_cov_lb=lb, clip_cov_ub=ub)


@pytest.mark.parametrize("seed", [-1, 2**53, 1.0, True, "3", None])
def test_bad_seed(seed):
    with pytest.raises(ValueError, match=r"clip_cov_seed must be an integer in \[0, 2\*\*53\).*policy_loss.clip_cov_seed, e.g. =0"):
        select(clip_cov_inputs(0, 2, 3), seed=seed)


@pytest.mark.parametrize("step", [-1, 2**53, 1.0, True, None])
def test_bad_optimizer_step(step):
    with pytest.raises(ValueError, match=r"the draw's optimizer step must be an integer in \[0, 2\*\*53\)"):
        select(clip_cov_inputs(0, 2, 3), optimizer_step=step)


@pytest.mark.parametrize("key", ["clip_ratio_low", "clip_ratio_high"])
@pytest.mark.parametrize("value", [-0.1, math.nan, False, "0.2"])
def test_bad_clip_ratio(key, value):
    with pytest.raises(ValueError, match=f"{key} must be finite and >= 0.*actor_rollout_ref.actor.{key}"):
        select(clip_cov_inputs(0, 2, 3), **{key: value})


def test_mismatched_shapes_raise():
    inputs = clip_cov_inputs(0, 3, 4)
    with pytest.raises(ValueError, match="same shape"):
        select({**inputs, "old_log_probs": inputs["old_log_probs"][:, :3]})
    with pytest.raises(ValueError, match=r"token_ids must be integer \(batch=3, length\)"):
        select({**inputs, "token_ids": inputs["token_ids"][:2], "token_mask": inputs["token_mask"][:2]})
    with pytest.raises(ValueError, match=r"token_ids must be integer"):
        select({**inputs, "token_ids": inputs["token_ids"].float()})
    with pytest.raises(ValueError, match=r"token_mask must have the shape of token_ids"):
        select({**inputs, "token_mask": inputs["token_mask"][:, 1:]})
