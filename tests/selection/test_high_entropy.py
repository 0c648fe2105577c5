"""The high-entropy selection against an independent sort-based reference: exact k, ties, zeros, non-finite, rho = 1."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_klcov_global import HighEntropySelection, high_entropy_quota, select_high_entropy_tokens
from verl_klcov_global.methods.high_entropy.selection import validate_entropy_top_ratio


def reference_selection(entropy: torch.Tensor, response_mask: torch.Tensor, ratio: float):
    """The definition, in plain Python: valid = in the mask and finite; k = max(1, int(N * ratio)) (0 if N = 0);
    sort the valid tokens by (entropy descending, row, position) and take the first k.

    Returns (mask, k, N, non-finite count, threshold, exact mean, exact selected mean, exact share) with the
    figures as exact rationals of the float values (Fraction), rounded to float at the end.
    """
    rows, cols = entropy.shape
    values = entropy.double().tolist()
    inside = response_mask.bool().tolist()
    valid = [(values[r][c], r, c) for r in range(rows) for c in range(cols) if inside[r][c] and math.isfinite(values[r][c])]
    nonfinite = sum(1 for r in range(rows) for c in range(cols) if inside[r][c] and not math.isfinite(values[r][c]))
    n = len(valid)
    k = 0 if n == 0 else max(1, int(n * ratio))
    chosen = sorted(valid, key=lambda t: (-t[0], t[1], t[2]))[:k]
    mask = torch.zeros(rows, cols, dtype=torch.bool)
    for _, r, c in chosen:
        mask[r, c] = True
    total = sum(Fraction(v) for v, _, _ in valid)
    selected = sum(Fraction(v) for v, _, _ in chosen)
    figures = {
        "threshold": chosen[-1][0] if k else math.nan,
        "mean": float(total / n) if n else math.nan,
        "selected_mean": float(selected / k) if k else math.nan,
        "share": float(selected / total) if total > 0 else math.nan,
    }
    return mask, k, n, nonfinite, figures


def _entropies(seed: int, batch: int, length: int, kind: str):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    response_mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    entropy = torch.rand(batch, length, generator=gen) * 3.0  # the entropy of a vocab of ~20 tokens at most
    if kind == "ties":  # few distinct values, many exact zeros: ties at the boundary are the rule
        entropy = (entropy * 2).floor() / 2
    elif kind == "zeros":
        entropy = torch.where(torch.rand(batch, length, generator=gen) < 0.7, 0.0, entropy)
    elif kind == "nonfinite" and entropy.numel():
        flat = entropy.view(-1)
        for j, value in enumerate((math.nan, math.inf, -math.inf)):
            flat[(seed * (j + 3)) % flat.numel()] = value
    elif kind == "float64":
        entropy = entropy.double() + 1e-12 * torch.rand(batch, length, generator=gen, dtype=torch.float64)
    # padding holds garbage, larger than any real entropy: never selected
    return torch.where(response_mask, entropy, torch.full_like(entropy, 1e6)), response_mask


def _assert_matches_reference(entropy, response_mask, ratio):
    result = select_high_entropy_tokens(entropy, response_mask, ratio)
    mask, k, n, nonfinite, figures = reference_selection(entropy, response_mask, ratio)
    assert torch.equal(result.mask, mask)
    assert (result.quota, result.num_selected, result.num_valid, result.num_nonfinite) == (k, k, n, nonfinite)
    assert int(result.mask.sum()) == k  # exactly k, whatever the ties
    got = {"threshold": result.threshold, "mean": result.entropy_mean,
           "selected_mean": result.selected_entropy_mean, "share": result.selected_entropy_share}
    for name, expected in figures.items():
        if math.isnan(expected):
            assert math.isnan(got[name]), name
        elif name == "threshold":
            assert got[name] == expected  # exact: the k-th largest value itself
        else:  # 62-bit fixed-point sums: the exact figure to a few ulps
            assert got[name] == pytest.approx(expected, rel=1e-12, abs=1e-15), name
    return result


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10_000), ratio=st.sampled_from([0.001, 0.05, 0.2, 0.37, 0.5, 1.0]),
       batch=st.integers(0, 16), length=st.integers(1, 24),
       kind=st.sampled_from(["random", "ties", "zeros", "nonfinite", "float64"]))
def test_matches_the_sort_based_reference(seed, ratio, batch, length, kind):
    entropy, response_mask = _entropies(seed, batch, length, kind)
    _assert_matches_reference(entropy, response_mask, ratio)


def test_ties_are_broken_by_row_then_position_and_k_is_exact():
    entropy = torch.tensor([[1.0, 2.0, 2.0, 0.0], [2.0, 2.0, 0.5, 0.0], [2.0, 0.0, 0.0, 0.0]])
    response_mask = torch.ones(3, 4, dtype=torch.bool)
    result = select_high_entropy_tokens(entropy, response_mask, 0.25)  # N = 12, k = 3 of the five 2.0s
    expected = torch.zeros(3, 4, dtype=torch.bool)
    expected[0, 1] = expected[0, 2] = expected[1, 0] = True
    assert torch.equal(result.mask, expected) and result.threshold == 2.0
    # TRL's rule (every token >= the quantile) would keep all five: 5 > k
    assert int((entropy >= torch.quantile(entropy.flatten(), 0.75)).sum()) == 5


def test_zero_entropies_are_ordinary_keys():
    # all tokens deterministic: N counts them, and k of them are selected in sequence order
    response_mask = torch.ones(2, 5, dtype=torch.bool)
    response_mask[0, 3:] = False
    result = select_high_entropy_tokens(torch.zeros(2, 5), response_mask, 0.5)
    assert (result.num_valid, result.quota) == (8, 4)
    assert result.mask.nonzero().tolist() == [[0, 0], [0, 1], [0, 2], [1, 0]]
    assert result.threshold == 0.0 and result.entropy_mean == 0.0 and result.selected_entropy_mean == 0.0
    assert "selected_entropy_share" not in result.figures()  # 0 / 0: undefined, no NaN for the logger
    # -0.0 ties with +0.0
    signed = torch.tensor([[0.0, -0.0, 0.0, -0.0]])
    assert select_high_entropy_tokens(signed, torch.ones(1, 4), 0.5).mask.tolist() == [[True, True, False, False]]


def test_nonfinite_entropies_are_never_selected_and_are_counted():
    entropy = torch.tensor([[math.nan, 0.1, math.inf], [-math.inf, 0.2, 0.3]])
    response_mask = torch.ones(2, 3, dtype=torch.bool)
    result = select_high_entropy_tokens(entropy, response_mask, 1.0)
    assert (result.num_valid, result.num_nonfinite, result.quota) == (3, 3, 3)
    assert result.mask.tolist() == [[False, True, False], [False, True, True]]
    assert all(math.isfinite(v) for v in result.figures().values())


def test_ratio_one_selects_every_valid_token_and_is_vanilla():
    entropy, response_mask = _entropies(3, 8, 12, "random")
    result = _assert_matches_reference(entropy, response_mask, 1.0)
    assert torch.equal(result.mask, response_mask)
    assert result.selected_entropy_share == 1.0 and result.selected_entropy_mean == result.entropy_mean


def test_no_valid_tokens_gives_an_empty_selection_and_only_defined_figures():
    result = select_high_entropy_tokens(torch.rand(3, 4), torch.zeros(3, 4, dtype=torch.bool), 0.2)
    assert (result.quota, result.num_selected, result.num_valid) == (0, 0, 0) and not result.mask.any()
    assert result.figures() == {"quota": 0.0, "selected": 0.0, "valid_tokens": 0.0, "nonfinite_tokens": 0.0}
    empty = select_high_entropy_tokens(torch.zeros(0, 4), torch.zeros(0, 4), 0.2)
    assert empty.mask.shape == (0, 4) and empty.quota == 0


def test_quota_is_ratio_quota_and_one_token_at_least():
    assert high_entropy_quota(0, 0.2) == 0
    assert high_entropy_quota(4, 0.2) == 1  # int(0.8) = 0 -> 1
    assert high_entropy_quota(10, 0.2) == 2 and high_entropy_quota(8192, 0.2) == 1638
    result = select_high_entropy_tokens(torch.rand(1, 4), torch.ones(1, 4), 0.2)
    assert result.num_selected == 1


def test_figures_are_named_as_the_other_modes_counts_and_the_entropy_figures():
    entropy, response_mask = _entropies(5, 6, 10, "random")
    result = select_high_entropy_tokens(entropy, response_mask, 0.2)
    assert isinstance(result, HighEntropySelection)
    assert set(result.figures()) == {"quota", "selected", "valid_tokens", "nonfinite_tokens", "entropy_threshold",
                                     "entropy_mean", "selected_entropy_mean", "selected_entropy_share"}
    assert result.selected_entropy_mean >= result.entropy_mean
    assert 0.2 <= result.selected_entropy_share <= 1.0


def test_reduced_precision_inputs_are_compared_in_their_own_precision():
    entropy, response_mask = _entropies(11, 8, 16, "random")
    bf16 = entropy.bfloat16()
    result = select_high_entropy_tokens(bf16, response_mask, 0.2)
    expected, *_ = reference_selection(bf16.float(), response_mask, 0.2)  # bf16 -> f32 is exact
    assert torch.equal(result.mask, expected)


@pytest.mark.parametrize("ratio", [0.0, -0.1, 20, 1.5, math.nan, math.inf, True, "0.2", None])
def test_bad_ratio_names_the_key_and_says_it_is_a_fraction(ratio):
    with pytest.raises(ValueError) as error:
        select_high_entropy_tokens(torch.rand(2, 3), torch.ones(2, 3), ratio)
    message = str(error.value)
    assert "actor_rollout_ref.actor.policy_loss.entropy_top_ratio" in message
    assert "fraction" in message and "0.2" in message and "20%" in message
    with pytest.raises(ValueError, match="entropy_top_ratio"):
        validate_entropy_top_ratio(ratio)


def test_mismatched_shapes_raise():
    with pytest.raises(ValueError, match="same shape"):
        select_high_entropy_tokens(torch.zeros(2, 3), torch.ones(2, 4), 0.2)


# ---------------------------------------------------------------------------------------------
# 2 gloo processes: the single-process selection and figures, bit for bit, with a bounded exchange

#: Bytes one rank sends per call (module docstring): 4 float64 + 1 int64 + <= 8 histograms of 256 int32 bins
#: + 8 bytes + 2 int64.
EXCHANGE_BYTES = 32 + 8 + 8 * 256 * 4 + 8 + 16
EXCHANGE_COLLECTIVES = 12


def _sharded_cases():
    """(name, entropy, response_mask, ratio, rows on rank 0) of the whole minibatch."""
    cases = []
    kinds = ["random", "ties", "zeros", "nonfinite", "float64"]
    for seed in range(30):
        entropy, mask = _entropies(seed, 10, 12, kinds[seed % 5])
        cases.append((f"{kinds[seed % 5]}-{seed}", entropy, mask, [0.001, 0.2, 0.5, 1.0][seed % 4], seed % 11))
    entropy, mask = _entropies(99, 8, 12, "random")
    mask[4:] = False
    cases.append(("rank1-only-padding", entropy, mask, 0.2, 4))
    cases.append(("rank0-no-rows", *_entropies(98, 8, 12, "ties"), 0.2, 0))
    cases.append(("rank1-no-rows", *_entropies(97, 8, 12, "ties"), 0.2, 8))
    ties = torch.ones(8, 6)  # every token tied: the quota split over both ranks in sequence order
    cases.append(("all-tied", ties, torch.ones(8, 6, dtype=torch.bool), 0.6, 3))
    cases.append(("all-zero", torch.zeros(8, 6), torch.ones(8, 6, dtype=torch.bool), 0.2, 5))
    cases.append(("no-valid-token", torch.rand(8, 6), torch.zeros(8, 6, dtype=torch.bool), 0.2, 4))
    return cases


def _run_sharded(rank, world_size):
    import torch.distributed as dist

    from verl_klcov_global.selection import collectives

    from ..support.counting_dist import CountingDist

    counting = CountingDist()
    collectives.dist = counting
    results = []
    try:
        for name, entropy, mask, ratio, split in _sharded_cases():
            reference = select_high_entropy_tokens(entropy, mask, ratio)
            rows = slice(0, split) if rank == 0 else slice(split, entropy.shape[0])
            counting.calls.clear()
            sharded = select_high_entropy_tokens(entropy[rows], mask[rows], ratio, group=dist.group.WORLD)
            results.append(dict(
                name=name, equal=torch.equal(sharded.mask, reference.mask[rows]),
                figures_equal=sharded.figures() == reference.figures(),
                selected_here=int(sharded.mask.sum()), quota=sharded.quota,
                bytes=sum(size for _, size in counting.calls), collectives=len(counting.calls),
            ))
        collectives.dist = dist
        try:  # ranks disagreeing on the ratio all raise instead of hanging
            select_high_entropy_tokens(torch.rand(2, 3), torch.ones(2, 3), 0.2 if rank == 0 else 0.3,
                                       group=dist.group.WORLD)
            disagreement = None
        except ValueError as error:
            disagreement = str(error)
    finally:
        collectives.dist = dist
        dist.destroy_process_group()
    return results, disagreement


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_give_the_single_process_selection_and_figures_bit_for_bit():
    from ..support.gloo import spawn_gloo

    (rank0, disagreement0), (rank1, disagreement1) = spawn_gloo(_run_sharded, 2)
    for disagreement in (disagreement0, disagreement1):
        assert disagreement is not None and "disagree on entropy_top_ratio" in disagreement
    for results in (rank0, rank1):
        for result in results:
            assert result["equal"], result["name"]
            assert result["figures_equal"], result["name"]
            assert result["bytes"] <= EXCHANGE_BYTES and result["collectives"] <= EXCHANGE_COLLECTIVES, result
    for first, second in zip(rank0, rank1):  # exactly k over the group
        assert first["selected_here"] + second["selected_here"] == first["quota"], first["name"]
    assert {r["name"]: r for r in rank1}["all-tied"]["selected_here"] > 0  # the tie split reaches rank 1
