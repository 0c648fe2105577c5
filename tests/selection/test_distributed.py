"""The selection over 2 gloo processes equals the single-process selection bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from verl_klcov_global.selection import collectives
from verl_klcov_global.methods.kl_cov.selection import select_kl_cov_tokens
from verl_klcov_global.selection.collectives import RADIX_BINS, RADIX_ROUNDS

from ..support.batches import random_minibatch
from ..support.gloo import spawn_gloo

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # 2 gloo processes, ~30 s each


def _cases():
    """(name, advantages, log_probs, response_mask, ratio, rows on rank 0) of the whole minibatch."""
    cases = []
    for seed in range(40):
        a, lp, m = random_minibatch(seed, batch=10, length=12)
        ratio = [0.0002, 0.01, 0.1, 0.5, 1.0][seed % 5]
        cases.append((f"random-{seed}", a, lp, m, ratio, seed % 11))  # rank 0 holds 0..10 rows
    for seed in range(20):  # float64 values use every mantissa bit: the fixed-point scale must not depend on W
        a, lp, m = random_minibatch(500 + seed, batch=10, length=12, min_len=12)
        gen = torch.Generator().manual_seed(seed)
        a = a.double() + 1e-9 * torch.rand(a.shape, generator=gen, dtype=torch.float64)
        lp = lp.double() - 1e-9 * torch.rand(lp.shape, generator=gen, dtype=torch.float64)
        cases.append((f"float64-skewed-{seed}", a, lp, m, 0.1, 8 if seed % 2 else 2))
    a, lp, m = random_minibatch(99, batch=8, length=12)
    m[4:] = False  # rank 1 holds only padding
    cases.append(("rank1-only-padding", a, lp, m, 0.1, 4))
    ties_a = torch.ones(8, 6)
    ties_a[::2] = -1.0
    ties_lp = torch.where(ties_a > 0, -0.5, -2.5)
    cases.append(("exact-ties", ties_a, ties_lp, torch.ones(8, 6, dtype=torch.bool), 0.3, 3))
    const_a = torch.full((8, 6), 0.1)
    cases.append(("constant-advantage", const_a, -torch.rand(8, 6, generator=torch.Generator().manual_seed(1)),
                  torch.ones(8, 6, dtype=torch.bool), 0.25, 5))
    return cases


class _CountingDist:
    """Proxy of torch.distributed that counts the numbers each collective sends."""

    def __init__(self):
        self.numbers = 0

    def __getattr__(self, name):
        return getattr(dist, name)

    def all_reduce(self, tensor, *args, **kwargs):
        self.numbers += tensor.numel()
        return dist.all_reduce(tensor, *args, **kwargs)

    def all_gather(self, outputs, tensor, *args, **kwargs):
        self.numbers += tensor.numel()
        return dist.all_gather(outputs, tensor, *args, **kwargs)


def _run_cases(rank, world_size):
    counting = _CountingDist()
    collectives.dist = counting
    results = []
    for name, a, lp, m, ratio, split in _cases():
        reference = select_kl_cov_tokens(a, lp, m, ratio)  # single process, whole minibatch
        rows = slice(0, split) if rank == 0 else slice(split, a.shape[0])
        counting.numbers = 0
        sharded = select_kl_cov_tokens(a[rows], lp[rows], m[rows], ratio, group=dist.group.WORLD)
        results.append(dict(
            name=name,
            equal=torch.equal(sharded.mask, reference.mask[rows]),
            figures_equal=sharded.figures() == reference.figures() or (sharded.quota == 0 == reference.quota),
            # bit-identical means, not just the same mask: near-ties must not be able to flip
            means_equal=(sharded.mean_advantage, sharded.mean_log_prob)
            == (reference.mean_advantage, reference.mean_log_prob),
            numbers_sent=counting.numbers,
            quota=sharded.quota,
        ))
    collectives.dist = dist
    dist.destroy_process_group()
    return results


def test_two_ranks_give_the_single_process_mask_bit_for_bit():
    per_rank = spawn_gloo(_run_cases, 2)
    for rank_results in per_rank:
        for result in rank_results:
            assert result["equal"], result["name"]
            assert result["figures_equal"], result["name"]
            assert result["means_equal"], result["name"]
            # 5 per-rank stats + 2 sums + <= 8 histograms of 256 bins + 1 last number + 4 covariance sums:
            # independent of k and N
            assert result["numbers_sent"] <= 5 + 2 + RADIX_ROUNDS * RADIX_BINS + 1 + 4, result


def _disagreeing_ratios(rank, world_size):
    a, lp, m = random_minibatch(3, batch=4, length=8)
    try:
        select_kl_cov_tokens(a, lp, m, 0.1 if rank == 0 else 0.2, group=dist.group.WORLD)
    except ValueError as error:
        return str(error)
    finally:
        dist.destroy_process_group()
    return None


def test_ranks_disagreeing_on_the_ratio_all_raise_instead_of_hanging():
    messages = spawn_gloo(_disagreeing_ratios, 2)
    assert all(m is not None and "disagree on kl_cov_ratio" in m for m in messages), messages


# ---------------------------------------------------------------------------------------------
# Clip-Cov: the same sampled tokens on 2 ranks as on 1, also when a rank has no candidates


def _clip_cov_cases():
    """(name, inputs of the whole minibatch, knobs, rows on rank 0)."""
    from ..support.batches import CLIP_COV_KNOBS as KNOBS
    from ..support.batches import clip_cov_inputs

    cases = []
    for seed in range(24):
        inputs = clip_cov_inputs(seed, 10, 14)
        knobs = {**KNOBS, "clip_cov_ratio": [0.002, 0.01, 0.05, 0.5][seed % 4], "clip_cov_lb": 0.0,
                 "seed": seed * 7919}
        cases.append((f"random-{seed}", inputs, knobs, seed % 11))  # rank 0 holds 0..10 rows
    inputs = clip_cov_inputs(77, 8, 14)
    # rank 1: A > 0 and r = e > 1 + clip_ratio_high: every token PPO-clipped -> no candidates there
    inputs["advantages"][4:] = inputs["advantages"][4:].abs() + 0.1
    inputs["old_log_probs"][4:] = inputs["log_probs"][4:] - 1.0
    cases.append(("rank1-without-candidates", inputs, {**KNOBS, "clip_cov_ratio": 0.01, "clip_cov_lb": 0.0}, 4))
    inputs = clip_cov_inputs(78, 8, 14)
    inputs["response_mask"][:4] = False  # rank 0: padding only
    cases.append(("rank0-padding-only", inputs, {**KNOBS, "clip_cov_ratio": 0.01, "clip_cov_lb": 0.0}, 4))
    inputs = clip_cov_inputs(79, 6, 14, min_len=14)
    for key in inputs:
        inputs[key][3] = inputs[key][2]  # the same sequence on both sides of the split: tied keys
    cases.append(("duplicate-across-ranks", inputs, {**KNOBS, "clip_cov_ratio": 0.05, "clip_cov_lb": -1e9,
                                                      "clip_cov_ub": 1e9}, 3))
    return cases


def _run_clip_cov_cases(rank, world_size):
    from verl_klcov_global.methods.clip_cov.selection import select_clip_cov_tokens

    from ..support.batches import reference_candidates

    counting = _CountingDist()
    collectives.dist = counting
    results = []
    for name, inputs, knobs, split in _clip_cov_cases():
        reference = select_clip_cov_tokens(**inputs, **knobs)
        rows = slice(0, split) if rank == 0 else slice(split, len(inputs["advantages"]))
        counting.numbers = 0
        sharded = select_clip_cov_tokens(**{k: v[rows] for k, v in inputs.items()}, **knobs, group=dist.group.WORLD)
        results.append(dict(
            name=name, equal=torch.equal(sharded.mask, reference.mask[rows]),
            figures_equal=sharded.figures() == reference.figures(),
            sampled=reference.num_selected < reference.num_candidates,
            local_candidates=int(reference_candidates({k: v[rows] for k, v in inputs.items()}, knobs["clip_cov_lb"],
                                                      knobs["clip_cov_ub"], 0.2, 0.28)[0].sum()),
            numbers_sent=counting.numbers,
        ))
    collectives.dist = dist
    try:  # ranks disagreeing on the seed all raise instead of hanging
        select_clip_cov_tokens(**_clip_cov_cases()[0][1], **{**_clip_cov_cases()[0][2], "seed": rank},
                               group=dist.group.WORLD)
        disagreement = None
    except ValueError as error:
        disagreement = str(error)
    dist.destroy_process_group()
    return results, disagreement


def test_clip_cov_two_ranks_give_the_single_process_sample_bit_for_bit():
    per_rank = spawn_gloo(_run_clip_cov_cases, 2)
    for rank_results, disagreement in per_rank:
        assert disagreement is not None and "disagree on clip_cov_seed" in disagreement, disagreement
        assert sum(r["sampled"] for r in rank_results) >= 10  # most cases draw (quota < candidates)
        for result in rank_results:
            assert result["equal"], result["name"]
            assert result["figures_equal"], result["name"]
            # 11 per-rank stats + 3 sums + 2 counts and 4 covariance sums + <= 8 histograms of 256 bins + 1 last
            # number + 2 covariance sums over the drawn tokens
            assert result["numbers_sent"] <= 11 + 3 + 2 + 4 + RADIX_ROUNDS * RADIX_BINS + 1 + 2, result
    rank1 = {r["name"]: r for r in per_rank[1][0]}
    assert rank1["rank1-without-candidates"]["sampled"] and rank1["rank1-without-candidates"]["local_candidates"] == 0
    assert {r["name"]: r for r in per_rank[0][0]}["duplicate-across-ranks"]["sampled"]
