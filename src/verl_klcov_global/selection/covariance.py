"""The covariance figures every selection logs: how much of the minibatch's covariance it acts on.

The paper's mechanism (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs"): under a
softmax policy the first-order change of entropy in one update is ``-eta * Cov(logp, A)``; KL-Cov
and Clip-Cov act on the few tokens with the largest covariance
``cov_i = (A_i - mean A) * (logp_i - mean logp)`` (means over the minibatch's ``N`` valid tokens).
Per selection (one optimizer step, the whole minibatch over the data-parallel group):

* ``cov_mean`` -- the minibatch-global mean covariance ``sum_valid cov_i / N`` (the ``Cov``
  of the formula, token-level);
* ``selected_cov_mean`` -- the mean covariance of the selected tokens (left out when none is
  selected);
* ``selected_cov_share`` -- the share of the total positive covariance held by the selected
  tokens, ``sum_selected max(cov_i, 0) / sum_valid max(cov_i, 0)`` in [0, 1] (left out when no
  token has a positive covariance).

Exact over the group: the four sums are 64-bit fixed-point sums
(:func:`.collectives.fixed_point_sums`) on a scale fixed by group-wide figures only, so every
figure is bit-identical however the minibatch is split over ranks or micro-batches. The sums
travel in one all-reduce the caller already makes or adds (see each selection's docstring).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .collectives import fixed_point_scale, fixed_point_sums

__all__ = ["CovarianceFigures", "CovarianceSelection", "covariance_bound", "local_covariance_sums", "covariance_figures", "NUM_SUMS"]

#: int64 numbers per rank: total, total positive, selected, selected positive covariance.
NUM_SUMS = 4


@dataclass(frozen=True)
class CovarianceFigures:
    """Group-wide covariance figures of one selection; ``nan`` where undefined (see module docstring)."""

    mean: float = math.nan
    selected_mean: float = math.nan
    selected_share: float = math.nan

    def figures(self) -> dict[str, float]:
        """The defined figures under their logged names (no NaN reaches a logger)."""
        named = {"cov_mean": self.mean, "selected_cov_mean": self.selected_mean,
                 "selected_cov_share": self.selected_share}
        return {name: value for name, value in named.items() if not math.isnan(value)}


@dataclass(frozen=True, kw_only=True)
class CovarianceSelection:
    """The fields both covariance selections report (KL-Cov's top-k, Clip-Cov's seeded draw), keyword-only.

    ``mask``: bool, the inputs' shape and device, True where this rank's token is selected. ``quota``: ``k`` over
    the group; ``num_selected``: tokens selected over the group. ``num_valid``: ``N``, finite tokens under
    ``response_mask`` over the group; ``num_nonfinite``: masked tokens with a non-finite input, never selected.
    ``mean_advantage`` / ``mean_log_prob``: the group-wide means the covariance uses. ``search_rounds``: histogram
    rounds the key search took. ``covariance``: the group-wide :class:`CovarianceFigures` of the selection.
    """

    mask: torch.Tensor
    quota: int
    num_selected: int
    num_valid: int
    num_nonfinite: int
    mean_advantage: float
    mean_log_prob: float
    search_rounds: int = 0
    covariance: CovarianceFigures = CovarianceFigures()


def covariance_bound(max_abs_advantage: torch.Tensor, max_abs_log_prob: torch.Tensor) -> torch.Tensor:
    """A bound on every ``|cov_i|`` from the group-wide maxima: ``|A - mean A| <= 2 max|A|``, likewise logp."""
    return 4.0 * max_abs_advantage.to(torch.float64) * max_abs_log_prob.to(torch.float64)


def local_covariance_sums(cov: torch.Tensor, valid: torch.Tensor, selected: torch.Tensor, bound: torch.Tensor,
                          num_valid: int, *, selected_part: bool = True) -> torch.Tensor:
    """This rank's fixed-point sums (int64): ``[total, positive]`` and, if ``selected_part``, ``[selected,
    selected positive]`` of ``cov`` (float64, any value outside ``valid``; ``selected`` a subset of ``valid``)."""
    kept = torch.where(valid, cov, cov.new_zeros(()))
    parts = [kept, kept.clamp_min(0.0)]
    if selected_part:
        chosen = torch.where(selected, kept, cov.new_zeros(()))
        parts += [chosen, chosen.clamp_min(0.0)]
    return fixed_point_sums(tuple(parts), bound, num_valid)


def covariance_figures(sums: torch.Tensor, bound: torch.Tensor, num_valid: int, num_selected: int) -> CovarianceFigures:
    """The figures from the all-reduced ``[total, positive, selected, selected positive]`` sums."""
    if num_valid <= 0:
        return CovarianceFigures()
    scale = fixed_point_scale(bound, num_valid)
    total, positive, chosen, chosen_positive = (int(x) for x in sums.tolist())
    return CovarianceFigures(
        mean=total * scale / num_valid,
        selected_mean=chosen * scale / num_selected if num_selected else math.nan,
        selected_share=chosen_positive / positive if positive > 0 else math.nan,
    )
