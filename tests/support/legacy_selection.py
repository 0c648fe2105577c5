"""verl-klcov-global 0.1.0's selection (the gather-k-candidates design), kept as a reference.

Not used by the plugin. ``benchmarks/bench_exchange.py`` measures its exchange against the
current design (``verl_klcov_global.selection``), and ``tests/selection/test_kl_cov.py`` checks that
both give bit-identical masks, thresholds and means. Its text below is 0.1.0's, unchanged.

This module is pure torch: it knows nothing about verl. It answers one question
for one optimizer minibatch, possibly sharded over a data-parallel group:
*which tokens are the top ``ratio`` fraction by covariance of advantage and
log-prob?*

Semantics (upstream ``kl_cov``'s, applied once over the whole minibatch):

* ``N`` = number of valid tokens over all ranks: positions where
  ``response_mask`` is set and both the advantage and the log-prob are finite.
  Non-finite tokens are excluded from ``N`` and from the means, never
  selected, and counted in :attr:`KLCovSelection.num_nonfinite`.
* quota ``k = max(1, int(N * ratio))`` (upstream's rounding); ``k = 0`` when
  ``N = 0``.
* covariance ``(A - mean A) * (logp - mean logp)`` with both means over the
  ``N`` valid tokens of the whole group, in float64.
* the ``k`` largest covariances are selected. Ties are broken by a total order
  that does not depend on micro-batching: (rank in ``group``, row, position),
  i.e. sequence order in the minibatch seen as the concatenation of the ranks'
  shards, lower ranks first.

Determinism across splits: the means come from sums in 64-bit fixed point whose
scale depends only on group-wide maxima and the group-wide ``N`` (integers add
associatively), so they are bit-identical however the minibatch is split over
ranks; every other quantity is per token. Hence the mask is a pure function of
the concatenated minibatch. (Which sequences form an optimizer minibatch is
verl's business: with several minibatches per step, minibatch i on W ranks is
the union of each rank's i-th slice, so its contents depend on W.)

Communication per call (``group`` with ``W`` ranks): one all-gather of 5 scalars
per rank (two maxima, two token counts and the ratio, so that ranks that disagree on
the ratio all raise instead of hanging), one all-reduce(SUM) of 2 integers, one
all-gather of ``k`` float64 candidate values per rank and one all-gather of 2
integers per rank (72 + 8k bytes sent per rank):
``O(k * W)`` numbers, never the valid tokens themselves. Every rank takes part
in every collective, also a rank without valid tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["KLCovSelection", "select_kl_cov_tokens", "kl_cov_quota", "validate_kl_cov_ratio"]

# Fixed-point budget: |value| * 2**scale_exponent * token_bound stays below 2**62.
_FIXED_POINT_BITS = 62


@dataclass(frozen=True)
class KLCovSelection:
    """Result of :func:`select_kl_cov_tokens`.

    Attributes:
        mask: bool tensor, same shape and device as the inputs; True where this
            rank's token is selected for the KL penalty.
        quota: ``k``, the number of tokens to select over the whole group.
        num_selected: tokens selected over the whole group (equals ``quota``).
        num_valid: ``N``, finite tokens under ``response_mask`` over the group.
        num_nonfinite: tokens under ``response_mask`` whose advantage or
            log-prob is NaN/inf, over the group; they are never selected.
        threshold: covariance of the last selected token (the k-th largest),
            ``nan`` when nothing is selected.
        mean_advantage: the group-wide mean of ``A`` used for the covariance.
        mean_log_prob: the group-wide mean of ``logp`` used for the covariance.
    """

    mask: torch.Tensor
    quota: int
    num_selected: int
    num_valid: int
    num_nonfinite: int
    threshold: float
    mean_advantage: float
    mean_log_prob: float

    def figures(self) -> dict[str, float]:
        """The scalar figures, for logging (names without a prefix).

        ``cov_threshold`` is left out when nothing is selected (it is undefined), so no NaN reaches a logger.
        """
        figures = {
            "quota": float(self.quota),
            "selected": float(self.num_selected),
            "valid_tokens": float(self.num_valid),
            "nonfinite_tokens": float(self.num_nonfinite),
        }
        if self.num_selected:
            figures["cov_threshold"] = self.threshold
        return figures


def validate_kl_cov_ratio(ratio: float) -> float:
    """Return ``ratio`` as float if it is finite and in (0, 1], else raise ValueError."""
    try:
        value = float(ratio)
    except (TypeError, ValueError):
        raise ValueError(f"kl_cov_ratio must be a number in (0, 1], got {ratio!r}") from None
    if not math.isfinite(value) or not (0.0 < value <= 1.0):
        raise ValueError(
            f"kl_cov_ratio must be finite and in (0, 1], got {ratio!r}; "
            "set actor_rollout_ref.actor.policy_loss.kl_cov_ratio, e.g. =0.0002 (the paper's value for 32B) "
            "or =0.002 (7B)"
        )
    return value


def kl_cov_quota(num_valid: int, ratio: float) -> int:
    """Upstream kl_cov's quota ``max(1, int(num_valid * ratio))``; 0 when there are no valid tokens."""
    if num_valid <= 0:
        return 0
    return max(1, int(num_valid * ratio))


def _world(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(tensor: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _all_gather(tensor: torch.Tensor, group, world_size: int) -> torch.Tensor:
    """Stack of every rank's ``tensor`` along a new dim 0 (rank order)."""
    if group is None:
        return tensor.unsqueeze(0)
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.stack(parts)


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


def _deterministic_means(
    advantages: torch.Tensor, log_probs: torch.Tensor, in_mask: torch.Tensor, ratio: float, group, world_size
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """Validity mask and group-wide means of A and logp over valid tokens, bit-identical for any split.

    ``advantages``/``log_probs`` are floating point in any precision: masking and the
    maxima are exact in it, so they run before the (exact) cast to float64.
    Returns ``valid``; A and logp as new float64 tensors, zero outside ``valid`` (the
    caller may overwrite them); mean_A and mean_logp as float64 0-d tensors on the inputs'
    device; the group-wide counts (valid, non-finite) as Python ints. One extra host sync
    (are the maxima finite?) lets the usual all-finite case skip the finiteness passes.

    Each rank's (max|A|, max|logp|, valid count, non-finite count, ratio) are all-gathered
    first, so that the fixed-point scale depends only on the group-wide maxima and the
    group-wide N -- never on how tokens are spread over ranks -- and so that ranks which
    disagree on the ratio (hence on k, the size of a later all-gather) all raise the same
    ValueError instead of hanging in that collective.
    """
    zero_a, zero_lp = advantages.new_zeros(()), log_probs.new_zeros(())
    a, max_a = _masked(advantages, in_mask, zero_a)
    lp, max_lp = _masked(log_probs, in_mask, zero_lp)
    valid = in_mask
    if not bool(torch.isfinite(max_a) & torch.isfinite(max_lp)):  # rare: NaN/inf under the mask
        valid = in_mask & torch.isfinite(advantages) & torch.isfinite(log_probs)
        a, max_a = _masked(advantages, valid, zero_a)
        lp, max_lp = _masked(log_probs, valid, zero_lp)
    n_in = in_mask.sum()
    n_local = n_in if valid is in_mask else valid.sum()
    local_stats = torch.stack([max_a, max_lp, n_local.to(torch.float64), (n_in - n_local).to(torch.float64),
                               torch.tensor(ratio, dtype=torch.float64, device=max_a.device)])
    stats = _all_gather(local_stats, group, world_size)  # (W, 5); counts are exact in float64
    ratios = stats[:, 4].tolist()  # the host sync we need: k sizes the later collectives
    if min(ratios) != max(ratios):
        raise ValueError(
            f"ranks of the data-parallel group disagree on kl_cov_ratio (from {min(ratios)} to {max(ratios)}): "
            "every rank must use the same actor_rollout_ref.actor.policy_loss.kl_cov_ratio"
        )
    global_max = stats[:, :2].max(dim=0).values
    num_valid, num_nonfinite = (int(x) for x in stats[:, 2:4].sum(dim=0).tolist())
    token_bound = torch.tensor(float(max(num_valid, 1)), dtype=torch.float64, device=max_a.device)
    exp_a = _fixed_point_exponent(global_max[0], token_bound)
    exp_lp = _fixed_point_exponent(global_max[1], token_bound)
    a, lp = a.to(torch.float64), lp.to(torch.float64)
    fixed_a = (a * torch.exp2(exp_a)).round_().sum(dtype=torch.int64)
    fixed_lp = (lp * torch.exp2(exp_lp)).round_().sum(dtype=torch.int64)
    sums = _all_reduce(torch.stack([fixed_a, fixed_lp]), dist.ReduceOp.SUM, group)
    denom = max(num_valid, 1)
    mean_a = sums[0].to(torch.float64) * torch.exp2(-exp_a) / denom
    mean_lp = sums[1].to(torch.float64) * torch.exp2(-exp_lp) / denom
    return valid, a, lp, mean_a, mean_lp, num_valid, num_nonfinite


def select_kl_cov_tokens(
    advantages: torch.Tensor,
    log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    ratio: float,
    *,
    group: Optional[dist.ProcessGroup] = None,
) -> KLCovSelection:
    """Select the top ``ratio`` fraction of tokens by covariance, over the whole group.

    Args:
        advantages: (batch, response_len) advantages A of this rank's shard.
        log_probs: (batch, response_len) current-policy log-probs of this rank's shard.
        response_mask: (batch, response_len), nonzero at real response tokens.
        ratio: ``kl_cov_ratio``, finite, in (0, 1].
        group: data-parallel process group over which the minibatch is sharded
            (rank r holds a contiguous block of sequences, lower ranks first),
            or None for a single process. Every rank of ``group`` must call this
            with the same ``ratio``; batch sizes may differ, including 0 rows.

    Returns:
        :class:`KLCovSelection` whose ``mask`` covers this rank's tokens.

    See the module docstring for the exact semantics and tie-breaking.
    """
    ratio = validate_kl_cov_ratio(ratio)
    if not (advantages.shape == log_probs.shape == response_mask.shape) or advantages.dim() != 2:
        raise ValueError(
            "advantages, log_probs and response_mask must be 2-D tensors of the same shape (batch, response_len); "
            f"got {tuple(advantages.shape)}, {tuple(log_probs.shape)}, {tuple(response_mask.shape)}"
        )
    rank, world_size = _world(group)
    a = advantages.detach()
    lp = log_probs.detach()
    a = a if a.is_floating_point() else a.to(torch.float64)
    lp = lp if lp.is_floating_point() else lp.to(torch.float64)
    in_mask = response_mask.bool()

    # a, lp come back float64 and zero outside ``valid``
    valid, a, lp, mean_a, mean_lp, num_valid, num_nonfinite = _deterministic_means(a, lp, in_mask, ratio, group, world_size)
    quota = kl_cov_quota(num_valid, ratio)
    if quota == 0:  # same decision on every rank: num_valid is global
        return KLCovSelection(
            mask=torch.zeros_like(in_mask), quota=0, num_selected=0, num_valid=0,
            num_nonfinite=num_nonfinite, threshold=math.nan,
            mean_advantage=float(mean_a), mean_log_prob=float(mean_lp),
        )

    neg_inf = torch.tensor(-math.inf, dtype=torch.float64, device=a.device)
    cov = a.sub_(mean_a).mul_(lp.sub_(mean_lp)).masked_fill_(~valid, neg_inf).reshape(-1)  # in place: own buffers

    # Each rank proposes its k largest values; the group's k-th largest is among them.
    local_k = min(quota, cov.numel())
    candidates = torch.full((quota,), -math.inf, dtype=torch.float64, device=a.device)
    if local_k:
        candidates[:local_k] = torch.topk(cov, local_k, largest=True, sorted=False).values
    all_candidates = _all_gather(candidates, group, world_size).reshape(-1)
    threshold = torch.topk(all_candidates, quota, largest=True, sorted=False).values.min()

    # Fewer than k tokens lie strictly above the k-th largest, so all of this rank's are
    # among its candidates; ties need one pass (threshold is finite, -inf padding never ties).
    at_least = cov >= threshold
    n_above = (candidates > threshold).sum()
    counts = _all_gather(torch.stack([n_above, at_least.sum() - n_above]).to(torch.int64), group, world_size)
    # Fill the remaining slots with tied tokens in (rank, row, position) order.
    remaining = quota - counts[:, 0].sum()
    ties_on_lower_ranks = counts[:rank, 1].sum()
    take_here = int((remaining - ties_on_lower_ranks).clamp(min=0, max=counts[rank, 1]))
    if take_here == int(counts[rank, 1]):  # all local ties (usually the one threshold token)
        selected = at_least
    else:
        tied = cov == threshold
        selected = (cov > threshold) | (tied & (torch.cumsum(tied.to(torch.int64), 0) <= take_here))
    num_selected = int(counts[:, 0].sum() + torch.minimum(remaining, counts[:, 1].sum()))
    return KLCovSelection(
        mask=selected.reshape(in_mask.shape),
        quota=quota,
        num_selected=num_selected,
        num_valid=num_valid,
        num_nonfinite=num_nonfinite,
        threshold=float(threshold),
        mean_advantage=float(mean_a),
        mean_log_prob=float(mean_lp),
    )
