"""Distributed primitives shared by every selection: group-wide exact means and a k-largest agreement.

Pure torch; every collective of every selection goes through this module's ``dist``
(one place to count or replace them). Each function must be called by every rank of
``group`` in the same order, also by a rank that holds no tokens.

* :func:`agree_and_mean` -- one all-gather of a few per-rank figures (maxima, counts and the
  knobs every rank must agree on) and one all-reduce of 64-bit fixed-point sums: group-wide
  means that are bit-identical however the tokens are split over ranks.
* :func:`select_largest_keys` -- marks the ``k`` largest int64 keys over the group, ties broken
  by (rank, flat position), with an exchange whose size does not depend on ``k`` or on the
  number of tokens: a most-significant-digit-first radix search for the k-th largest key over
  all-reduced 256-bin histograms (at most 8 rounds), then one small collective that either
  pins the exact threshold or splits the ties.
* :func:`float_order_keys` / :func:`key_to_float` -- a float64 <-> int64 bijection that keeps
  order (signed int64 comparison of keys = float comparison of values, with -0.0 == +0.0).

Exchange of :func:`select_largest_keys` per call and rank (``W`` ranks, bins of 4 bytes
while the group holds fewer than 2**31 eligible tokens, else 8): at most 8 all-reduces of
256 bins (1 KiB each) and then either one all-reduce of one int64 (the bucket held exactly
the remaining quota) or one all-gather of one int64 per rank (the k-th key is tied).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

# Fixed-point budget: |value| * 2**scale_exponent * token_bound stays below 2**62.
_FIXED_POINT_BITS = 62
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
RADIX_BITS = 8
RADIX_BINS = 1 << RADIX_BITS
RADIX_ROUNDS = 64 // RADIX_BITS


def world_of(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    """(rank in ``group``, size of ``group``); (0, 1) for ``None`` (a single process)."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_reduce(tensor: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_gather(tensor: torch.Tensor, group, world_size: int) -> torch.Tensor:
    """Stack of every rank's ``tensor`` along a new dim 0 (rank order)."""
    if group is None:
        return tensor.unsqueeze(0)
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.stack(parts)


# ---------------------------------------------------------------------------------------------
# Exact group-wide means


@dataclass(frozen=True)
class GroupMeans:
    """Result of :func:`agree_and_mean`.

    ``values`` are float64 copies of the inputs, zero outside ``valid`` (the caller may
    overwrite them); ``means`` float64 0-d tensors on the inputs' device, one per input;
    ``num_valid`` / ``num_nonfinite`` group-wide counts; ``maxima`` the group-wide largest
    ``|input|`` over valid tokens (float64 0-d tensors), the same on every rank.
    """

    valid: torch.Tensor
    values: tuple[torch.Tensor, ...]
    means: tuple[torch.Tensor, ...]
    num_valid: int
    num_nonfinite: int
    maxima: tuple[torch.Tensor, ...] = ()


def _fixed_point_exponent(max_abs: torch.Tensor, token_bound: torch.Tensor) -> torch.Tensor:
    """Exponent s such that sum of round(v * 2**s) over <= token_bound values fits in int64."""
    bound = (max_abs * token_bound).clamp_min(2.0**-900)
    return torch.floor(_FIXED_POINT_BITS - torch.log2(bound))


def _masked(values: torch.Tensor, keep: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``where(keep, values, 0)`` and its largest absolute value (0 when empty), in the input's dtype.

    ``zero`` is a 0-d tensor: ``torch.where`` with the Python scalar 0.0 takes a slow
    path on CPU (~20x slower on 10^6 float64 tokens, torch 2.13). ``max|x|`` is taken as
    ``max(max x, -min x)`` (exact, one pass, no temporary).
    """
    kept = torch.where(keep, values, zero)
    if not kept.numel():
        return kept, zero.to(torch.float64)
    low, high = torch.aminmax(kept)
    return kept, torch.maximum(high, -low).to(torch.float64)


def agree_and_mean(
    inputs: tuple[torch.Tensor, ...],
    in_mask: torch.Tensor,
    agreed: Mapping[str, float],
    group: Optional[dist.ProcessGroup],
) -> GroupMeans:
    """Validity mask and group-wide means of each input over valid tokens, bit-identical for any split.

    Args:
        inputs: floating-point tensors of one shape (any precision): masking and maxima are
            exact in it, so they run before the (exact) cast to float64.
        in_mask: bool, same shape: the tokens that count (``response_mask``). A token is
            *valid* when it is in the mask and every input is finite there.
        agreed: knobs every rank must hold the same values of (e.g. ``{"kl_cov_ratio": 0.002}``);
            ranks that disagree all raise the same ValueError instead of hanging in a later
            collective whose size depends on them. A name without a dot is a ``policy_loss``
            key; a dotted name is the knob's full config path (e.g. ``actor_rollout_ref.actor.clip_ratio_low``).
        group: the data-parallel group, or None.

    Communication: one all-gather of ``len(inputs) + 2 + len(agreed)`` float64 per rank (each input's
    maximum, two counts, the agreed knobs), one
    all-reduce(SUM) of ``len(inputs)`` int64. The fixed-point scale depends only on the
    group-wide maxima and the group-wide N -- never on how tokens are spread over ranks. One
    extra host sync (are the maxima finite?) lets the usual all-finite case skip the
    finiteness passes.
    """
    _, world_size = world_of(group)
    zeros = [x.new_zeros(()) for x in inputs]
    masked = [_masked(x, in_mask, zero) for x, zero in zip(inputs, zeros)]
    valid = in_mask
    if not all(bool(torch.isfinite(m)) for _, m in masked):  # rare: NaN/inf under the mask
        valid = in_mask.clone()
        for x in inputs:
            valid &= torch.isfinite(x)
        masked = [_masked(x, valid, zero) for x, zero in zip(inputs, zeros)]
    n_in = in_mask.sum()
    n_local = n_in if valid is in_mask else valid.sum()
    device = masked[0][1].device
    knob_names = sorted(agreed)
    local_stats = torch.stack(
        [m for _, m in masked]
        + [n_local.to(torch.float64), (n_in - n_local).to(torch.float64)]
        + [torch.tensor(float(agreed[name]), dtype=torch.float64, device=device) for name in knob_names]
    )
    stats = all_gather(local_stats, group, world_size)  # (W, ...); counts are exact in float64
    n_inputs = len(inputs)
    if knob_names:
        knobs = stats[:, n_inputs + 2 :].tolist()  # host sync: knobs size later collectives
        for j, name in enumerate(knob_names):
            column = [row[j] for row in knobs]
            if any(not (value == column[0]) for value in column):  # NaN counts as disagreement
                key = name if "." in name else f"actor_rollout_ref.actor.policy_loss.{name}"
                raise ValueError(
                    f"ranks of the data-parallel group disagree on {name} (from {min(column)} to {max(column)}): "
                    f"every rank must use the same {key}"
                )
    # amax, not max(dim=0): torch 2.13 CPU spends ~15 ms in max(dim=0) (values+indices) even on a (1, 3) tensor
    global_max = stats[:, :n_inputs].amax(dim=0)
    num_valid, num_nonfinite = (int(x) for x in stats[:, n_inputs : n_inputs + 2].sum(dim=0).tolist())
    token_bound = torch.tensor(float(max(num_valid, 1)), dtype=torch.float64, device=device)
    exponents = [_fixed_point_exponent(global_max[i], token_bound) for i in range(n_inputs)]
    values = tuple(kept.to(torch.float64) for kept, _ in masked)
    fixed = [(v * torch.exp2(e)).round_().sum(dtype=torch.int64) for v, e in zip(values, exponents)]
    sums = all_reduce(torch.stack(fixed), dist.ReduceOp.SUM, group)
    denom = max(num_valid, 1)
    means = tuple(sums[i].to(torch.float64) * torch.exp2(-exponents[i]) / denom for i in range(n_inputs))
    return GroupMeans(valid=valid, values=values, means=means, num_valid=num_valid, num_nonfinite=num_nonfinite,
                      maxima=tuple(global_max[i] for i in range(n_inputs)))


def fixed_point_sums(values: tuple[torch.Tensor, ...], bound: torch.Tensor, token_bound: int) -> torch.Tensor:
    """This rank's part of exact group sums: an int64 tensor, one fixed-point sum per tensor of ``values``.

    ``bound`` (float64 0-d) bounds every ``|value|`` on every rank and ``token_bound`` the number of
    non-zero terms over the group; both must be the same on every rank (group-wide figures), so that
    every rank uses the same scale. Then the all-reduced (SUM) integers, times
    :func:`fixed_point_scale`, are the sums of the values rounded to one grid -- bit-identical
    however the terms are spread over ranks. Pass the result through one all-reduce, possibly
    stacked with other int64 figures (no collective of its own).
    """
    exponent = _fixed_point_exponent(bound, torch.tensor(float(max(token_bound, 1)), dtype=torch.float64,
                                                         device=bound.device))
    scale = torch.exp2(exponent)
    return torch.stack([(v.to(torch.float64) * scale).round_().sum(dtype=torch.int64) for v in values])


def fixed_point_scale(bound: torch.Tensor, token_bound: int) -> float:
    """The factor turning all-reduced :func:`fixed_point_sums` back into float sums."""
    exponent = _fixed_point_exponent(bound, torch.tensor(float(max(token_bound, 1)), dtype=torch.float64,
                                                         device=bound.device))
    return float(torch.exp2(-exponent))


# ---------------------------------------------------------------------------------------------
# k largest keys over the group


def float_order_keys(values: torch.Tensor) -> torch.Tensor:
    """int64 keys of float64 ``values`` whose signed order is the values' order.

    -0.0 and +0.0 get the same key (they compare equal as floats); NaN maps above +inf
    (callers exclude NaN through ``eligible``). Inverse: :func:`key_to_float`.
    """
    bits = (values.to(torch.float64) + 0.0).view(torch.int64)  # + 0.0 turns -0.0 into +0.0 (and copies)
    # negative floats: flip every bit but the sign (bits >> 63 is all ones exactly for them)
    return bits.bitwise_xor_((bits >> 63) & _INT64_MAX)


def key_to_float(key: int) -> float:
    """The float64 whose :func:`float_order_keys` key is ``key``."""
    bits = key ^ _INT64_MAX if key < 0 else key
    return torch.tensor(bits, dtype=torch.int64).view(torch.float64).item()


@dataclass(frozen=True)
class TopKeys:
    """Result of :func:`select_largest_keys`.

    ``mask`` has the keys' shape; ``threshold`` is the k-th largest key over the group
    (``None`` when ``k == 0``); ``rounds`` the number of histogram rounds the search took.
    """

    mask: torch.Tensor
    threshold: Optional[int]
    rounds: int


def largest_selection_fields(top: TopKeys, quota: int, means: GroupMeans) -> dict[str, Any]:
    """The result fields every selection of the ``quota`` largest keys reports, as keyword arguments: ``mask``,
    ``quota`` and ``num_selected`` (equal: ties are broken exactly), ``num_valid`` and ``num_nonfinite`` (from
    ``means``), ``threshold`` (the k-th largest key as a float, NaN when nothing is selected), ``search_rounds``."""
    return {
        "mask": top.mask,
        "quota": quota,
        "num_selected": quota,
        "num_valid": means.num_valid,
        "num_nonfinite": means.num_nonfinite,
        "threshold": math.nan if top.threshold is None else key_to_float(top.threshold),
        "search_rounds": top.rounds,
    }


def _digits(biased: torch.Tensor, shift: int) -> torch.Tensor:
    # ``biased`` = key XOR INT64_MIN: its digits, read as unsigned, order like the keys.
    return (biased >> shift) & (RADIX_BINS - 1)


def select_largest_keys(
    keys: torch.Tensor,
    eligible: torch.Tensor,
    k: int,
    num_eligible: int,
    group: Optional[dist.ProcessGroup],
) -> TopKeys:
    """Mark the ``k`` largest ``keys`` among the ``eligible`` tokens of the whole group.

    Args:
        keys: int64, any shape: this rank's keys (signed order).
        eligible: bool, same shape: the tokens that may be selected.
        k: how many tokens to mark over the group, ``0 <= k <= num_eligible``; the same on
            every rank.
        num_eligible: eligible tokens over the group (the same on every rank); it only
            chooses the histogram's integer width, so that every rank agrees on it.
        group: data-parallel group (rank r holds the r-th block of the concatenated
            minibatch), or None.

    Every eligible key above the k-th largest is marked; tokens whose key equals it are
    marked in (rank, flat position) order until ``k`` are marked over the group. The
    search needs no gather of candidates: each round all-reduces a histogram of the next
    8 bits of the keys that share the prefix found so far, and narrows to the bin that
    holds the k-th largest. When that bin holds exactly the keys still needed, every key
    at or above its smallest key is marked (one all-reduce(MIN) pins that key); when all
    64 bits are fixed, the remaining quota is split over the tied tokens in rank order
    (one all-gather of each rank's tie count).
    """
    if not (0 <= k <= num_eligible):
        raise ValueError(f"k must be in [0, num_eligible={num_eligible}], got {k}")
    rank, world_size = world_of(group)
    flat_keys = keys.reshape(-1)
    flat_eligible = eligible.reshape(-1)
    if k == 0:
        return TopKeys(mask=torch.zeros_like(eligible, dtype=torch.bool), threshold=None, rounds=0)
    count_dtype = torch.int32 if num_eligible < 2**31 else torch.int64
    # biased keys of this rank's eligible tokens (no compaction when all are eligible: one pass less)
    candidates = (flat_keys if bool(flat_eligible.all()) else flat_keys[flat_eligible]) ^ _INT64_MIN
    remaining = k  # how many of the candidates' largest keys are still to be marked
    prefix = 0  # biased digits fixed so far
    for round_index in range(RADIX_ROUNDS):
        shift = 64 - RADIX_BITS * (round_index + 1)
        digits = _digits(candidates, shift)
        histogram = torch.bincount(digits, minlength=RADIX_BINS).to(count_dtype)
        counts = all_reduce(histogram, dist.ReduceOp.SUM, group).tolist()  # host sync: picks the bin
        above = 0
        for bin_index in range(RADIX_BINS - 1, -1, -1):
            if above + counts[bin_index] >= remaining:
                break
            above += counts[bin_index]
        remaining -= above
        prefix = (prefix << RADIX_BITS) | bin_index
        in_bin = digits == bin_index
        candidates = candidates[in_bin]
        if counts[bin_index] == remaining:
            # Every key in this bin is marked: the threshold is the bin's smallest key.
            # (unbiased keys: the all-reduce compares signed int64; a rank without any sends the maximum)
            local_min = (candidates ^ _INT64_MIN).min() if candidates.numel() else torch.tensor(
                _INT64_MAX, dtype=torch.int64, device=candidates.device)
            threshold = int(all_reduce(local_min.reshape(1).clone(), dist.ReduceOp.MIN, group).item())
            mask = flat_eligible & (flat_keys >= threshold)
            return TopKeys(mask=mask.reshape(eligible.shape), threshold=threshold, rounds=round_index + 1)
    # All 64 bits fixed: ``remaining`` of the tokens with exactly this key are marked, lowest ranks first.
    threshold = (prefix - 2**64 if prefix >= 2**63 else prefix) ^ _INT64_MIN
    tied = flat_eligible & (flat_keys == threshold)
    tie_counts = all_gather(tied.sum().reshape(1).to(torch.int64), group, world_size).reshape(-1).tolist()
    take_here = min(max(remaining - sum(tie_counts[:rank]), 0), tie_counts[rank])
    above_threshold = flat_eligible & (flat_keys > threshold)
    if take_here == tie_counts[rank]:
        mask = above_threshold | tied
    else:
        mask = above_threshold | (tied & (torch.cumsum(tied.to(torch.int64), 0) <= take_here))
    return TopKeys(mask=mask.reshape(eligible.shape), threshold=threshold, rounds=RADIX_ROUNDS)
