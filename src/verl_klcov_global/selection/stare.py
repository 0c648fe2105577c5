"""Minibatch- and data-parallel-global STARE selection: the most surprising tokens of each advantage sign.

STARE (arXiv:2606.19236; the authors' ``compute_stare_token_weights`` in hp-luo/STARE,
``verl/trainer/ppo/core_algos.py`` l.1070-1198 at bffb9e7) reweights the PPO surrogate on the most surprising
tokens of each advantage sign. The fork takes its top-P% inside each loss call (its README: "batch-internal"),
so the micro-batch size changes which tokens get the weight. Here the same rule is applied once over the whole
optimizer minibatch and the data-parallel group:

* ``valid``: tokens under ``response_mask`` whose log-prob and advantage are finite (non-finite ones are never
  selected and are counted in :attr:`StareSelection.num_nonfinite`);
* the candidate sets ``T+`` (valid, ``A > 0``) and ``T-`` (valid, ``A < 0``); a token with ``A = 0`` is in
  neither (its surrogate is 0 whatever its weight);
* the surprisal ``s = -log pi_theta(y_t)``, the current policy's, detached (the prepass's log-probs);
* per set of ``n`` tokens over the group: ``k = min(n, max(1, int(n * P + 0.999999)))`` (the fork's rounding,
  l.1160, a ceiling that forgives float error), and ``k = 0`` when ``n = 0`` or ``P = 0`` (l.1156);
* ``L+``: the ``k+`` largest surprisals of ``T+``; ``L-``: the ``k-`` largest of ``T-``, taken only when
  ``with_negative`` (variant C2; variant O1 weights ``L+`` alone, and its ``L-`` is empty);
* ties at the k-th surprisal are broken by the order every mode uses, (rank in ``group``, row, position):
  exactly ``k`` tokens per set.

The mask is ``L+ | L-``: one bool per token. The sign of the advantage tells which set a selected token is in, so
the loss needs no second mask (:func:`stare_weights`).

Determinism across splits: the selection is exact (:func:`.collectives.select_largest_keys` on the surprisals'
order-preserving int64 keys) and the figures are 64-bit fixed-point sums on a scale fixed by group-wide figures
only, so the mask and every figure are bit-identical for any data-parallel or micro-batch split of the minibatch.

Communication per call (``W`` ranks): :func:`.collectives.agree_and_mean`'s all-gather of 6 float64 per rank and
all-reduce of 2 int64; one all-reduce of 2 int64 (the sets' sizes); one :func:`.collectives.select_largest_keys`
per set taken (at most 8 all-reduces of 256 bins and one collective of 8 bytes per rank each); one all-reduce of 2
int64 (the surprisal sums). At most 22 collectives and 16,496 bytes sent per rank, whatever ``k`` and ``N``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from .collectives import (
    agree_and_mean,
    all_reduce,
    fixed_point_scale,
    fixed_point_sums,
    float_order_keys,
    select_largest_keys,
)
from .knobs import finite_number, setting

__all__ = ["StareSelection", "select_stare_tokens", "stare_quota", "stare_weights", "validate_stare_top_ratio"]

TOP_RATIO_KEY = "stare_top_ratio"
TOP_RATIO_EXAMPLE = "0.1 (a fraction: 0.1 takes the 10% most surprising tokens of each sign, the paper's value)"


@dataclass(frozen=True)
class StareSelection:
    """Result of :func:`select_stare_tokens`.

    Attributes:
        mask: bool (batch, response_len), this rank's tokens in ``L+ | L-``.
        quota: ``k+ + k-``; ``num_selected`` equals it.
        positive_quota, negative_quota: ``k+`` and ``k-`` (``k-`` is 0 without ``with_negative``).
        positive_candidates, negative_candidates: ``|T+|`` and ``|T-|`` over the group.
        num_valid: valid tokens over the group (``A = 0`` included); ``num_nonfinite``: tokens under the mask
            whose log-prob or advantage is not finite.
        surprisal_mean: mean surprisal of the valid tokens; ``selected_surprisal_share``: the selected tokens'
            share of the valid tokens' summed surprisal (``nan`` when undefined).
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
    surprisal_mean: float = math.nan
    selected_surprisal_share: float = math.nan

    def figures(self) -> dict[str, float]:
        """The scalar figures, for logging (names without a prefix); undefined ones are left out (no NaN)."""
        figures = {
            "quota": float(self.quota), "selected": float(self.num_selected),
            "selected_positive": float(self.positive_quota), "selected_negative": float(self.negative_quota),
            "candidates_positive": float(self.positive_candidates),
            "candidates_negative": float(self.negative_candidates),
            "valid_tokens": float(self.num_valid), "nonfinite_tokens": float(self.num_nonfinite),
        }
        named = {"surprisal_mean": self.surprisal_mean, "selected_surprisal_share": self.selected_surprisal_share}
        figures.update({name: value for name, value in named.items() if not math.isnan(value)})
        return figures


def validate_stare_top_ratio(ratio: Any) -> float:
    """``ratio`` as float if it is a finite number in [0, 1] (0: STARE selects nothing), else ValueError naming the key."""
    value = finite_number(ratio)
    if value is None or not (0.0 <= value <= 1.0):
        raise ValueError(f"{TOP_RATIO_KEY} must be finite and in [0, 1], got {ratio!r}; "
                         + setting(TOP_RATIO_KEY, TOP_RATIO_EXAMPLE))
    return value


def stare_quota(num_candidates: int, ratio: float) -> int:
    """The fork's ``k = max(1, int(n * P + 0.999999))``, at most ``n``; 0 when ``n = 0`` or ``P = 0``."""
    if num_candidates <= 0 or ratio <= 0.0:
        return 0
    return min(num_candidates, max(1, int(num_candidates * ratio + 0.999999)))


def select_stare_tokens(
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    top_ratio: float,
    *,
    with_negative: bool = False,
    group: Optional[dist.ProcessGroup] = None,
) -> StareSelection:
    """Select ``L+`` (and, with ``with_negative``, ``L-``) over the whole group (module docstring).

    Args:
        log_probs: (batch, response_len) current-policy log-probs of the response tokens (any floating dtype).
        advantages: same shape, the advantage of each token (GRPO: the sequence's, broadcast).
        response_mask: same shape, nonzero at real response tokens.
        top_ratio: ``P``, a fraction in [0, 1].
        with_negative: also take ``L-`` (STARE's variant C2).
        group: the data-parallel group (rank r holds the r-th contiguous block of sequences), or None. Every rank
            must call this with the same ``top_ratio`` (ranks that disagree all raise) and ``with_negative``.
    """
    ratio = validate_stare_top_ratio(top_ratio)
    if not (log_probs.shape == advantages.shape == response_mask.shape) or log_probs.dim() != 2:
        raise ValueError("log_probs, advantages and response_mask must be 2-D tensors of one shape (batch, "
                         f"response_len); got {tuple(log_probs.shape)}, {tuple(advantages.shape)}, "
                         f"{tuple(response_mask.shape)}")
    lp = log_probs.detach()
    lp = lp if lp.is_floating_point() else lp.to(torch.float64)
    adv = advantages.detach()
    adv = adv if adv.is_floating_point() else adv.to(torch.float64)
    agreed = {TOP_RATIO_KEY: ratio, "stare_variant": float(bool(with_negative))}  # 0: O1, 1: C2
    means = agree_and_mean((lp, adv), response_mask.bool(), agreed, group)
    surprisal = -means.values[0]  # float64, exact negation; 0 outside ``valid``
    positive = means.valid & (means.values[1] > 0)
    negative = means.valid & (means.values[1] < 0)
    counts = all_reduce(torch.stack([positive.sum(), negative.sum()]).to(torch.int64), dist.ReduceOp.SUM, group)
    n_positive, n_negative = (int(x) for x in counts.tolist())
    k_positive = stare_quota(n_positive, ratio)
    k_negative = stare_quota(n_negative, ratio) if with_negative else 0
    keys = float_order_keys(surprisal)
    mask = torch.zeros_like(means.valid)
    if k_positive:
        mask |= select_largest_keys(keys, positive, k_positive, n_positive, group).mask
    if k_negative:
        mask |= select_largest_keys(keys, negative, k_negative, n_negative, group).mask
    bound = means.maxima[0]  # max |log pi| over the group's valid tokens
    zero = surprisal.new_zeros(())
    sums = all_reduce(fixed_point_sums((surprisal, torch.where(mask, surprisal, zero)), bound, means.num_valid),
                      dist.ReduceOp.SUM, group)
    total, chosen = (int(x) for x in sums.tolist())
    scale = fixed_point_scale(bound, means.num_valid)
    quota = k_positive + k_negative
    return StareSelection(
        mask=mask, quota=quota, num_selected=quota, positive_quota=k_positive, negative_quota=k_negative,
        positive_candidates=n_positive, negative_candidates=n_negative, num_valid=means.num_valid,
        num_nonfinite=means.num_nonfinite,
        surprisal_mean=total * scale / means.num_valid if means.num_valid else math.nan,
        selected_surprisal_share=chosen / total if total > 0 else math.nan,
    )


def stare_weights(mask: torch.Tensor, advantages: torch.Tensor, *, reweight_w: float, reweight_m: float,
                  gate_on: bool) -> torch.Tensor:
    """STARE's per-token weights ``omega`` (same shape as ``mask``, ``advantages``' dtype): ``W`` on selected tokens
    with ``A > 0``, ``M`` on selected tokens with ``A < 0``, 1 elsewhere; all 1 while the gate is off (the fork's
    l.1174-1182). With variant O1 the mask holds no ``A < 0`` token, so ``M`` never applies."""
    ones = torch.ones_like(advantages)
    if not gate_on:
        return ones
    weights = torch.where(mask & (advantages > 0), ones * reweight_w, ones)
    return torch.where(mask & (advantages < 0), ones * reweight_m, weights)
