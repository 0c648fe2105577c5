"""Minibatch- and data-parallel-global KL-Cov token selection.

It answers one question for one optimizer minibatch, possibly sharded over a
data-parallel group: *which tokens are the top ``ratio`` fraction by covariance of
advantage and log-prob?*

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

Determinism across splits: the means are bit-identical however the minibatch is
split over ranks (:func:`.collectives.agree_and_mean`); every other quantity is per
token, and the k-th largest covariance is found exactly (:func:`.collectives.select_largest_keys`).
Hence the mask is a pure function of the concatenated minibatch. (Which sequences form
an optimizer minibatch is verl's business: with several minibatches per step, minibatch
i on W ranks is the union of each rank's i-th slice, so its contents depend on W.)

Communication per call (``group`` with ``W`` ranks), independent of ``k`` and ``N``:
one all-gather of 5 float64 per rank (two maxima, two token counts, the ratio -- ranks
that disagree on the ratio all raise instead of hanging), one all-reduce of 2 int64, then
:func:`.collectives.select_largest_keys`: at most 8 all-reduces of 1 KiB and one last
collective of 8 bytes per rank, then one all-reduce of 4 int64: the exact sums behind the
covariance figures (:mod:`.covariance`). Every rank takes part in every collective, also a
rank without valid tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ...selection.collectives import (
    agree_and_mean,
    all_reduce,
    float_order_keys,
    largest_selection_fields,
    select_largest_keys,
)
from ...selection.covariance import CovarianceSelection, covariance_bound, covariance_figures, local_covariance_sums
from ...selection.knobs import ratio_quota, validate_ratio

__all__ = ["KLCovSelection", "select_kl_cov_tokens", "kl_cov_quota", "validate_kl_cov_ratio"]


@dataclass(frozen=True, kw_only=True)
class KLCovSelection(CovarianceSelection):
    """Result of :func:`select_kl_cov_tokens`: the fields of :class:`.covariance.CovarianceSelection` (there
    ``num_selected`` equals ``quota``, and ``search_rounds`` is at most 8) and ``threshold``, the covariance of the
    last selected token (the k-th largest), ``nan`` when nothing is selected."""

    threshold: float

    def figures(self) -> dict[str, float]:
        """The scalar figures, for logging (names without a prefix).

        ``cov_threshold`` is left out when nothing is selected (it is undefined), so no NaN reaches a logger;
        so are the covariance figures that are undefined (:meth:`.covariance.CovarianceFigures.figures`).
        """
        figures = {
            "quota": float(self.quota),
            "selected": float(self.num_selected),
            "valid_tokens": float(self.num_valid),
            "nonfinite_tokens": float(self.num_nonfinite),
        }
        if self.num_selected:
            figures["cov_threshold"] = self.threshold
        figures.update(self.covariance.figures())
        return figures


def validate_kl_cov_ratio(ratio: Any) -> float:
    """Return ``ratio`` as float if it is a finite number in (0, 1] (not a bool or a string), else raise ValueError."""
    return validate_ratio(ratio, "kl_cov_ratio", "0.0002 (the paper's value for 32B) or =0.002 (7B)")


#: Upstream kl_cov's quota ``max(1, int(num_valid * ratio))`` (0 without valid tokens); the same rule as clip_cov's.
kl_cov_quota = ratio_quota


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
    a = advantages.detach()
    lp = log_probs.detach()
    a = a if a.is_floating_point() else a.to(torch.float64)
    lp = lp if lp.is_floating_point() else lp.to(torch.float64)
    in_mask = response_mask.bool()

    means = agree_and_mean((a, lp), in_mask, {"kl_cov_ratio": ratio}, group)
    (a, lp), (mean_a, mean_lp) = means.values, means.means  # float64, zero outside ``valid``
    quota = kl_cov_quota(means.num_valid, ratio)
    cov = a.sub_(mean_a).mul_(lp.sub_(mean_lp))  # in place: own buffers
    top = select_largest_keys(float_order_keys(cov), means.valid, quota, means.num_valid, group)
    bound = covariance_bound(*means.maxima)
    sums = all_reduce(local_covariance_sums(cov, means.valid, top.mask, bound, means.num_valid),
                      dist.ReduceOp.SUM, group)
    return KLCovSelection(
        **largest_selection_fields(top, quota, means),
        mean_advantage=float(mean_a),
        mean_log_prob=float(mean_lp),
        covariance=covariance_figures(sums, bound, means.num_valid, quota),
    )
