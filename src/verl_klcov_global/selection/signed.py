"""What the selections by advantage sign share (STARE's ``L+``/``L-``, Lp-Reg's ``L-``/``L+``): the inputs' checks,
the split of the group's valid tokens by advantage sign, the k largest keys taken in each sign's set, the exact
group-wide sums of a per-token statistic, and the result's common fields.

Collectives, in order: :func:`~.collectives.agree_and_mean` (the knobs' agreement and the exact means), one
all-reduce of 2 int64 (the two sets' sizes), :func:`~.collectives.select_largest_keys` per set taken (positive
first), one all-reduce of 2 int64 (:func:`group_sums`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .collectives import (
    GroupMeans,
    agree_and_mean,
    all_reduce,
    fixed_point_scale,
    fixed_point_sums,
    select_largest_keys,
)


@dataclass(frozen=True)
class SignedSelection:
    """The fields every selection by advantage sign reports.

    ``mask``: bool (batch, response_len), this rank's selected tokens; ``quota``: ``k+ + k-``, ``num_selected``
    equals it; ``positive_quota`` / ``negative_quota``: ``k+`` / ``k-``; ``positive_candidates`` /
    ``negative_candidates``: ``|T+|`` / ``|T-|`` over the group; ``num_valid``: valid tokens over the group (``A = 0``
    included); ``num_nonfinite``: tokens under the mask whose log-prob or advantage is not finite.
    """

    mask: torch.Tensor
    quota: int
    num_selected: int
    positive_quota: int
    negative_quota: int
    positive_candidates: int
    negative_candidates: int
    num_valid: int
    num_nonfinite: int

    @classmethod
    def of(cls, mask: torch.Tensor, sets: "SignedSets", k_positive: int, k_negative: int, **statistics: float):
        """The result of taking ``k_positive`` / ``k_negative`` tokens of ``sets`` into ``mask``; ``statistics`` are the
        subclass's own fields."""
        quota = k_positive + k_negative
        return cls(mask=mask, quota=quota, num_selected=quota, positive_quota=k_positive, negative_quota=k_negative,
                   positive_candidates=sets.n_positive, negative_candidates=sets.n_negative,
                   num_valid=sets.means.num_valid, num_nonfinite=sets.means.num_nonfinite, **statistics)

    def statistics(self) -> dict[str, float]:
        """The method's own figures (NaN where undefined); each method's selection says which."""
        return {}

    def figures(self) -> dict[str, float]:
        """The scalar figures, for logging (names without a prefix): the common ones and :meth:`statistics`,
        undefined ones left out (no NaN)."""
        figures = {
            "quota": float(self.quota), "selected": float(self.num_selected),
            "selected_positive": float(self.positive_quota), "selected_negative": float(self.negative_quota),
            "candidates_positive": float(self.positive_candidates),
            "candidates_negative": float(self.negative_candidates),
            "valid_tokens": float(self.num_valid), "nonfinite_tokens": float(self.num_nonfinite),
        }
        figures.update({name: value for name, value in self.statistics().items() if not math.isnan(value)})
        return figures


@dataclass(frozen=True)
class SignedSets:
    """The group's valid tokens split by advantage sign: ``means`` (``values[0]`` the log-probs, ``values[1]`` the
    advantages, float64, 0 outside ``valid``), this rank's ``positive`` / ``negative`` masks and the group's sizes."""

    means: GroupMeans
    positive: torch.Tensor
    negative: torch.Tensor
    n_positive: int
    n_negative: int


def split_by_sign(log_probs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
                  agreed: dict[str, float], group: Optional[dist.ProcessGroup]) -> SignedSets:
    """Check the (batch, response_len) inputs, agree on the knobs ``agreed`` over ``group`` and split its valid
    tokens (finite log-prob and advantage) into ``A > 0`` and ``A < 0`` (``A = 0`` in neither). ValueError on
    inputs that are not 2-D of one shape."""
    if not (log_probs.shape == advantages.shape == response_mask.shape) or log_probs.dim() != 2:
        raise ValueError("log_probs, advantages and response_mask must be 2-D tensors of one shape (batch, "
                         f"response_len); got {tuple(log_probs.shape)}, {tuple(advantages.shape)}, "
                         f"{tuple(response_mask.shape)}")
    inputs = []
    for tensor in (log_probs, advantages):
        tensor = tensor.detach()
        inputs.append(tensor if tensor.is_floating_point() else tensor.to(torch.float64))
    means = agree_and_mean(tuple(inputs), response_mask.bool(), agreed, group)
    positive = means.valid & (means.values[1] > 0)
    negative = means.valid & (means.values[1] < 0)
    counts = all_reduce(torch.stack([positive.sum(), negative.sum()]).to(torch.int64), dist.ReduceOp.SUM, group)
    n_positive, n_negative = (int(x) for x in counts.tolist())
    return SignedSets(means, positive, negative, n_positive, n_negative)


def take_largest(keys: torch.Tensor, sets: SignedSets, k_positive: int, k_negative: int,
                 group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """This rank's mask of the ``k_positive`` largest ``keys`` of the positive set and the ``k_negative`` largest of
    the negative set, over ``group`` (a set with quota 0 is not taken)."""
    mask = torch.zeros_like(sets.means.valid)
    if k_positive:
        mask |= select_largest_keys(keys, sets.positive, k_positive, sets.n_positive, group).mask
    if k_negative:
        mask |= select_largest_keys(keys, sets.negative, k_negative, sets.n_negative, group).mask
    return mask


def group_sums(values: torch.Tensor, mask: torch.Tensor, sets: SignedSets,
               group: Optional[dist.ProcessGroup]) -> tuple[int, int, float]:
    """Exact group-wide sums of ``values`` (a float64 statistic bounded by the largest ``|log pi|``, 0 outside the
    valid tokens) over the valid tokens and over ``mask``, as fixed-point integers, and the scale that turns them
    into floats: ``(total, chosen, scale)``."""
    means = sets.means
    bound = means.maxima[0]  # max |log pi| over the group's valid tokens
    zero = values.new_zeros(())
    sums = all_reduce(fixed_point_sums((values, torch.where(mask, values, zero)), bound, means.num_valid),
                      dist.ReduceOp.SUM, group)
    total, chosen = (int(x) for x in sums.tolist())
    return total, chosen, fixed_point_scale(bound, means.num_valid)
