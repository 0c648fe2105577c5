"""The shared selection primitives: order-preserving keys and the k-largest agreement (1 and 2 processes)."""

from __future__ import annotations

import math
import struct

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from ..support.counting_dist import CountingDist
from ..support.gloo import spawn_gloo
from verl_klcov_global.selection import collectives
from verl_klcov_global.selection.collectives import (
    RADIX_BINS,
    RADIX_ROUNDS,
    float_order_keys,
    key_to_float,
    select_largest_keys,
)


def reference_largest(keys: torch.Tensor, eligible: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest eligible keys, ties in flat-position order: a stable sort, no cleverness."""
    flat, ok = keys.reshape(-1).tolist(), eligible.reshape(-1).tolist()
    order = sorted((i for i in range(len(flat)) if ok[i]), key=lambda i: (-flat[i], i))
    mask = torch.zeros(len(flat), dtype=torch.bool)
    mask[order[:k]] = True
    return mask.reshape(keys.shape)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(allow_nan=False, width=64), min_size=2, max_size=40))
def test_float_order_keys_preserve_order_and_invert(values):
    x = torch.tensor(values, dtype=torch.float64)
    keys = float_order_keys(x).tolist()
    for i in range(len(values)):
        assert key_to_float(keys[i]) == values[i]
        for j in range(len(values)):
            assert (keys[i] < keys[j]) == (values[i] < values[j])
            assert (keys[i] == keys[j]) == (values[i] == values[j])  # -0.0 == +0.0 share a key


def test_float_order_keys_cover_the_extremes():
    values = [-math.inf, -1e308, -1.0, -5e-324, -0.0, 0.0, 5e-324, 1.0, 1e308, math.inf]
    keys = float_order_keys(torch.tensor(values, dtype=torch.float64)).tolist()
    assert keys == sorted(keys) and keys[4] == keys[5] == 0
    assert [struct.pack("<d", key_to_float(k)) for k in keys][0] == struct.pack("<d", -math.inf)


key_lists = st.lists(
    st.one_of(st.integers(-3, 3), st.integers(-(2**63), 2**63 - 1), st.sampled_from([-(2**63), 2**63 - 1])),
    min_size=0, max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(keys=key_lists, data=st.data())
def test_largest_keys_equal_a_stable_sort(keys, data):
    eligible = data.draw(st.lists(st.booleans(), min_size=len(keys), max_size=len(keys)))
    n = sum(eligible)
    k = data.draw(st.integers(0, n))
    key_tensor = torch.tensor(keys, dtype=torch.int64).reshape(-1, 1).expand(-1, 2).clone()  # 2-D input
    key_tensor[:, 1] = key_tensor[:, 1] // 2
    eligible_tensor = torch.tensor(eligible, dtype=torch.bool).reshape(-1, 1).expand(-1, 2).clone()
    eligible_tensor[:, 1] = False
    top = select_largest_keys(key_tensor, eligible_tensor, k, n, None)
    assert torch.equal(top.mask, reference_largest(key_tensor, eligible_tensor, k))
    assert 0 <= top.rounds <= RADIX_ROUNDS
    if k:
        assert top.threshold == sorted((x for x, ok in zip(keys, eligible) if ok), reverse=True)[k - 1]


def test_bad_k_raises():
    with pytest.raises(ValueError, match="k must be in"):
        select_largest_keys(torch.zeros(3, dtype=torch.int64), torch.ones(3, dtype=torch.bool), 4, 3, None)


# ---------------------------------------------------------------------------------------------
# 2 gloo processes: the same marks as one process, with an exchange that does not grow with k


def _key_cases():
    """(name, keys, eligible, k, rows on rank 0) of the whole minibatch (rows, 16)."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for seed in range(12):
        rows = 4 + seed
        keys = torch.randint(-(2**62), 2**62, (rows, 16), generator=gen)
        eligible = torch.rand(rows, 16, generator=gen) < 0.8
        n = int(eligible.sum())
        for k in (0, 1, n // 7, n // 2, n - 1, n):
            cases.append((f"random-{seed}-k{k}", keys, eligible, max(k, 0), seed % (rows + 1)))
    ties = torch.randint(0, 3, (10, 16), generator=gen)  # three distinct keys, ties straddle the ranks
    everyone = torch.ones(10, 16, dtype=torch.bool)
    for k in range(0, 161, 13):
        cases.append((f"ties-k{k}", ties, everyone, k, 5))
    constant = torch.full((6, 16), -7, dtype=torch.int64)
    cases.append(("one-key", constant, everyone[:6], 50, 2))
    cases.append(("rank0-empty", ties[:4], everyone[:4], 20, 0))
    near = torch.tensor([[2**62 + i for i in range(16)]] * 4) + torch.arange(4).unsqueeze(1) * 256
    cases.append(("low-bits-only", near, everyone[:4], 33, 1))
    return cases


def _run_key_cases(rank, world_size):
    counting = CountingDist()
    collectives.dist = counting
    out = []
    try:
        for name, keys, eligible, k, split in _key_cases():
            rows = slice(0, split) if rank == 0 else slice(split, keys.shape[0])
            counting.calls.clear()
            top = select_largest_keys(keys[rows], eligible[rows], k, int(eligible.sum()), dist.group.WORLD)
            expected = reference_largest(keys, eligible, k)[rows]
            out.append(dict(name=name, equal=torch.equal(top.mask, expected), calls=list(counting.calls),
                            rounds=top.rounds))
    finally:
        collectives.dist = dist
        dist.destroy_process_group()
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_mark_the_single_process_keys_with_a_bounded_exchange():
    per_rank = spawn_gloo(_run_key_cases, 2)
    bound = RADIX_ROUNDS * RADIX_BINS * 4 + 8  # int32 bins, then one 8-byte collective
    for rank_results in per_rank:
        for result in rank_results:
            assert result["equal"], result["name"]
            assert len(result["calls"]) <= RADIX_ROUNDS + 1, result
            assert sum(b for _, b in result["calls"]) <= bound, result
    # the exchange never depends on k: the same bound holds from k = 1 to k = N
    assert max(sum(b for _, b in r["calls"]) for r in per_rank[0]) <= bound
