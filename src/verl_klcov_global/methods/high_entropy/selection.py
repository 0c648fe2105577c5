"""Minibatch- and data-parallel-global high-entropy token selection (the "80/20" method).

It answers one question for one optimizer minibatch, possibly sharded over a data-parallel
group: *which tokens are the top ``entropy_top_ratio`` fraction by current-policy entropy?*
(Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective RL for
LLM Reasoning", arXiv:2506.01939: the policy gradient is kept only on the tokens whose entropy
is at least the batch's (1 - rho)-quantile, rho = 0.2.)

Semantics, applied once over the whole minibatch and group:

* ``N`` = number of valid tokens over all ranks: positions where ``response_mask`` is set and
  the entropy is finite. Non-finite entropies are excluded from ``N`` and from the figures,
  never selected, and counted in :attr:`HighEntropySelection.num_nonfinite`. An entropy of
  exactly 0 (a deterministic token) is an ordinary value.
* quota ``k = max(1, int(N * rho))`` (:func:`.knobs.ratio_quota`, as KL-Cov's); ``k = 0`` when
  ``N = 0``.
* exactly the ``k`` largest entropies are selected. Ties at the k-th value are broken by the
  total order every mode uses: (rank in ``group``, row, position), i.e. sequence order in the
  minibatch seen as the concatenation of the ranks' shards, lower ranks first. So exactly ``k``
  tokens are selected, even when many share the k-th entropy (a per-micro-batch rule that keeps
  every token ``>=`` a quantile, as TRL's ``top_entropy_quantile``, can select more).

Determinism across splits: the selection is exact (:func:`.collectives.select_largest_keys` on
the entropies' order-preserving int64 keys), and the figures are 64-bit fixed-point sums on a
scale fixed by group-wide figures only (:func:`.collectives.fixed_point_sums`), so the mask and
every figure are pure functions of the concatenated minibatch: bit-identical for any
data-parallel or micro-batch split.

Communication per call (``group`` with ``W`` ranks), independent of ``k`` and ``N``: one
all-gather of 4 float64 per rank (max |entropy|, the valid and non-finite token counts, the ratio
-- ranks that disagree on the ratio all raise instead of hanging), one all-reduce of 1 int64 (the
entropy sum, unused here but part of :func:`.collectives.agree_and_mean`), then
:func:`.collectives.select_largest_keys`: at most 8 all-reduces of 256 bins (1 KiB each with
4-byte bins, i.e. while the group holds fewer than 2**31 valid tokens; 2 KiB with 8-byte bins
beyond) and one last collective of 8 bytes per rank, then one all-reduce of 2 int64 (the exact
sums of all and of the selected entropies). In all at most 12 collectives and
32 + 8 + 8 * 1,024 + 8 + 16 = 8,256 bytes sent per rank (16,448 with 8-byte bins). Every rank
takes part in every collective, also a rank without valid tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ...selection.collectives import (
    agree_and_mean,
    all_reduce,
    fixed_point_scale,
    fixed_point_sums,
    float_order_keys,
    largest_selection_fields,
    select_largest_keys,
)
from ...selection.knobs import ratio_quota, validate_ratio

__all__ = ["HighEntropySelection", "high_entropy_quota", "select_high_entropy_tokens",
           "validate_entropy_top_ratio"]

#: The knob's example in error messages: a fraction, not a percentage.
ENTROPY_TOP_RATIO_EXAMPLE = "0.2 (a fraction: 0.2 keeps the 20% highest-entropy tokens, the paper's value)"


@dataclass(frozen=True)
class HighEntropySelection:
    """Result of :func:`select_high_entropy_tokens`.

    Attributes:
        mask: bool tensor, same shape and device as the inputs; True where this rank's token keeps
            its policy-gradient loss.
        quota: ``k``, the number of tokens to select over the whole group.
        num_selected: tokens selected over the whole group (equals ``quota``).
        num_valid: ``N``, tokens under ``response_mask`` with a finite entropy, over the group.
        num_nonfinite: tokens under ``response_mask`` whose entropy is NaN/inf, over the group.
        threshold: the k-th largest entropy (the entropy of the last selected token), ``nan`` when
            nothing is selected.
        entropy_mean: mean entropy over the ``N`` valid tokens (``nan`` when ``N = 0``).
        selected_entropy_mean: mean entropy of the ``k`` selected tokens (``nan`` when ``k = 0``).
        selected_entropy_share: sum of the selected entropies / sum of all valid entropies (``nan``
            when that sum is not positive).
        search_rounds: histogram rounds the threshold search took (at most 8).
    """

    mask: torch.Tensor
    quota: int
    num_selected: int
    num_valid: int
    num_nonfinite: int
    threshold: float
    entropy_mean: float = math.nan
    selected_entropy_mean: float = math.nan
    selected_entropy_share: float = math.nan
    search_rounds: int = 0

    def figures(self) -> dict[str, float]:
        """The scalar figures, for logging (names without a prefix); undefined ones are left out (no NaN)."""
        figures = {
            "quota": float(self.quota),
            "selected": float(self.num_selected),
            "valid_tokens": float(self.num_valid),
            "nonfinite_tokens": float(self.num_nonfinite),
        }
        named = {
            "entropy_threshold": self.threshold,
            "entropy_mean": self.entropy_mean,
            "selected_entropy_mean": self.selected_entropy_mean,
            "selected_entropy_share": self.selected_entropy_share,
        }
        figures.update({name: value for name, value in named.items() if not math.isnan(value)})
        return figures


def validate_entropy_top_ratio(ratio: Any) -> float:
    """Return ``ratio`` as float if it is a finite number in (0, 1] (not a bool or a string), else raise ValueError.

    The message names ``actor_rollout_ref.actor.policy_loss.entropy_top_ratio`` and says it is a
    fraction (``20`` meant as 20% is refused).
    """
    return validate_ratio(ratio, "entropy_top_ratio", ENTROPY_TOP_RATIO_EXAMPLE)


#: The quota ``max(1, int(num_valid * entropy_top_ratio))`` (0 without valid tokens): KL-Cov's rule.
high_entropy_quota = ratio_quota


def select_high_entropy_tokens(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    entropy_top_ratio: float,
    *,
    group: Optional[dist.ProcessGroup] = None,
) -> HighEntropySelection:
    """Select the top ``entropy_top_ratio`` fraction of tokens by entropy, over the whole group.

    Args:
        entropy: (batch, response_len) current-policy entropy of each response token of this
            rank's shard (any floating dtype; compared exactly, in its own precision).
        response_mask: (batch, response_len), nonzero at real response tokens.
        entropy_top_ratio: the fraction of valid tokens to keep, finite, in (0, 1].
        group: data-parallel process group over which the minibatch is sharded (rank r holds a
            contiguous block of sequences, lower ranks first), or None for a single process.
            Every rank of ``group`` must call this with the same ratio; batch sizes may differ,
            including 0 rows.

    Returns:
        :class:`HighEntropySelection` whose ``mask`` covers this rank's tokens.

    See the module docstring for the exact semantics, the tie-breaking and the exchange.
    """
    ratio = validate_entropy_top_ratio(entropy_top_ratio)
    if entropy.shape != response_mask.shape or entropy.dim() != 2:
        raise ValueError(
            "entropy and response_mask must be 2-D tensors of the same shape (batch, response_len); "
            f"got {tuple(entropy.shape)}, {tuple(response_mask.shape)}"
        )
    values = entropy.detach()
    values = values if values.is_floating_point() else values.to(torch.float64)

    means = agree_and_mean((values,), response_mask.bool(), {"entropy_top_ratio": ratio}, group)
    (h,), (maximum,) = means.values, means.maxima  # float64, zero outside ``valid``
    quota = high_entropy_quota(means.num_valid, ratio)
    top = select_largest_keys(float_order_keys(h), means.valid, quota, means.num_valid, group)
    sums = all_reduce(fixed_point_sums((h, torch.where(top.mask, h, h.new_zeros(()))), maximum, means.num_valid),
                      dist.ReduceOp.SUM, group)
    total, chosen = (int(x) for x in sums.tolist())
    scale = fixed_point_scale(maximum, means.num_valid)
    return HighEntropySelection(
        **largest_selection_fields(top, quota, means),
        entropy_mean=total * scale / means.num_valid if means.num_valid else math.nan,
        selected_entropy_mean=chosen * scale / quota if quota else math.nan,
        selected_entropy_share=chosen / total if total > 0 else math.nan,
    )
