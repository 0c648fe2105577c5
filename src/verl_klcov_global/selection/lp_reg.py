"""Minibatch- and data-parallel-global Lp-Reg selection: the lowest-probability tokens of each advantage sign.

Lp-Reg (arXiv:2510.03222; the authors' ``compute_policy_loss_lp_reg`` in CarlanLark/Lp-Reg-dev,
``verl/trainer/ppo/core_algos.py`` l.648-745 at 33b27e2) regularises the lowest-probability tokens of the
negative-advantage set towards a min-p-filtered proxy of the old policy. The fork takes its bottom-rho% inside
each loss call (one micro-batch on one rank), so the micro-batch and the DP size decide which tokens are
protected, and whether any are (its quota must exceed 1). Here the same rule is applied once over the whole
optimizer minibatch and the data-parallel group:

* ``valid``: tokens under ``response_mask`` whose log-prob and advantage are finite (non-finite ones are never
  selected and are counted in :attr:`LpRegSelection.num_nonfinite`);
* the candidate sets ``T-`` (valid, ``A < 0``) and ``T+`` (valid, ``A > 0``);
* per set of ``n`` tokens over the group at ratio ``rho``: ``k = max(1, int(n * rho))`` (the fork's rounding,
  l.728/737), ``0`` when ``n = 0`` or ``rho = 0`` (the fork's ``rho+ = 0``: off), at most ``n``;
* ``L-``: the ``k-`` tokens of ``T-`` with the lowest current log-prob ``log pi_theta(y_t)`` (detached, the
  prepass's); ``L+`` the same for ``T+`` with ``rho+``;
* ties at the k-th log-prob are broken by the order every mode uses, (rank in ``group``, row, position):
  exactly ``k`` tokens per set.

**The quota of 1.** The fork regularises a set only when ``k > 1`` (l.729/738): at ``rho- = 0.01`` a loss call
with fewer than 200 negative-advantage tokens regularises nothing, without a word. The method protects the
lowest-probability tokens of the batch; a quota of 1 is one such token. Here a set with ``k = 1`` is regularised
like any other, so with ``rho > 0`` and a non-empty set the mode always selects at least one token: a mode that
regularises nothing is impossible by construction. (Over a whole optimizer minibatch and the DP group ``n`` is
large and ``k = 1`` rare; the fork's ``k > 1`` is what switches whole micro-batches off.)

The mask is ``L- | L+``. Which selected tokens the loss regularises is decided in the loss, on the training
forward's detached log-prob, as the fork does: only where ``log pi_theta(y_t) < log pi_proxy(y_t)``
(:mod:`verl_klcov_global.loss`).

Determinism across splits: the selection is exact (:func:`.collectives.select_largest_keys` on the negated
log-probs' order-preserving int64 keys) and the figures are 64-bit fixed-point sums on a scale fixed by group-wide
figures only, so the mask and every figure are bit-identical for any data-parallel or micro-batch split.

Communication per call (``W`` ranks): :func:`.collectives.agree_and_mean`'s all-gather of 6 float64 per rank and
all-reduce of 2 int64; one all-reduce of 2 int64 (the sets' sizes); one :func:`.collectives.select_largest_keys`
per set taken (at most 8 all-reduces of 256 bins and one collective of 8 bytes per rank each); one all-reduce of
2 int64 (the log-prob sums). At most 22 collectives and 16,496 bytes sent per rank, whatever ``k`` and ``N``.
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

__all__ = ["LpRegSelection", "lp_reg_quota", "select_lp_reg_tokens", "validate_lp_reg_ratio"]

NEG_RATIO_KEY = "lp_reg_neg_ratio"
POS_RATIO_KEY = "lp_reg_pos_ratio"
_EXAMPLES = {
    NEG_RATIO_KEY: "0.01 (a fraction: the 1% lowest-probability negative-advantage tokens, the authors' value)",
    POS_RATIO_KEY: "0 (off, the authors' value)",
}


@dataclass(frozen=True)
class LpRegSelection:
    """Result of :func:`select_lp_reg_tokens`.

    Attributes:
        mask: bool (batch, response_len), this rank's tokens in ``L- | L+``.
        quota: ``k- + k+``; ``num_selected`` equals it.
        negative_quota, positive_quota: ``k-`` and ``k+``.
        negative_candidates, positive_candidates: ``|T-|`` and ``|T+|`` over the group.
        num_valid: valid tokens over the group (``A = 0`` included); ``num_nonfinite``: tokens under the mask
            whose log-prob or advantage is not finite.
        log_prob_mean: mean log-prob of the valid tokens; ``selected_log_prob_mean``: of the selected ones
            (``nan`` when undefined).
    """

    mask: torch.Tensor
    quota: int
    num_selected: int
    negative_quota: int
    positive_quota: int
    negative_candidates: int
    positive_candidates: int
    num_valid: int
    num_nonfinite: int
    log_prob_mean: float = math.nan
    selected_log_prob_mean: float = math.nan

    def figures(self) -> dict[str, float]:
        """The scalar figures, for logging (names without a prefix); undefined ones are left out (no NaN)."""
        figures = {
            "quota": float(self.quota), "selected": float(self.num_selected),
            "selected_negative": float(self.negative_quota), "selected_positive": float(self.positive_quota),
            "candidates_negative": float(self.negative_candidates),
            "candidates_positive": float(self.positive_candidates),
            "valid_tokens": float(self.num_valid), "nonfinite_tokens": float(self.num_nonfinite),
        }
        named = {"log_prob_mean": self.log_prob_mean, "selected_log_prob_mean": self.selected_log_prob_mean}
        figures.update({name: value for name, value in named.items() if not math.isnan(value)})
        return figures


def validate_lp_reg_ratio(ratio: Any, key: str = NEG_RATIO_KEY) -> float:
    """``ratio`` as float if it is a finite number in [0, 1] (0: the set is off), else ValueError naming ``key``."""
    value = finite_number(ratio)
    if value is None or not (0.0 <= value <= 1.0):
        raise ValueError(f"{key} must be finite and in [0, 1], got {ratio!r}; "
                         + setting(key, _EXAMPLES.get(key, "0.01")))
    return value


def lp_reg_quota(num_candidates: int, ratio: float) -> int:
    """The fork's ``k = max(1, int(n * rho))``, at most ``n``; 0 when ``n = 0`` or ``rho = 0``. Unlike the fork, a
    quota of 1 is taken (module docstring)."""
    if num_candidates <= 0 or ratio <= 0.0:
        return 0
    return min(num_candidates, max(1, int(num_candidates * ratio)))


def select_lp_reg_tokens(
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    neg_ratio: float,
    pos_ratio: float = 0.0,
    *,
    group: Optional[dist.ProcessGroup] = None,
) -> LpRegSelection:
    """Select ``L-`` (and, with ``pos_ratio > 0``, ``L+``) over the whole group (module docstring).

    Args:
        log_probs: (batch, response_len) current-policy log-probs of the response tokens (any floating dtype).
        advantages: same shape, the advantage of each token (GRPO: the sequence's, broadcast).
        response_mask: same shape, nonzero at real response tokens.
        neg_ratio: ``rho-``, a fraction in [0, 1]; ``pos_ratio``: ``rho+``, the same (0: off).
        group: the data-parallel group (rank r holds the r-th contiguous block of sequences), or None. Every rank
            must call this with the same ratios (ranks that disagree all raise).
    """
    rho_negative = validate_lp_reg_ratio(neg_ratio, NEG_RATIO_KEY)
    rho_positive = validate_lp_reg_ratio(pos_ratio, POS_RATIO_KEY)
    if not (log_probs.shape == advantages.shape == response_mask.shape) or log_probs.dim() != 2:
        raise ValueError("log_probs, advantages and response_mask must be 2-D tensors of one shape (batch, "
                         f"response_len); got {tuple(log_probs.shape)}, {tuple(advantages.shape)}, "
                         f"{tuple(response_mask.shape)}")
    lp = log_probs.detach()
    lp = lp if lp.is_floating_point() else lp.to(torch.float64)
    adv = advantages.detach()
    adv = adv if adv.is_floating_point() else adv.to(torch.float64)
    agreed = {NEG_RATIO_KEY: rho_negative, POS_RATIO_KEY: rho_positive}
    means = agree_and_mean((lp, adv), response_mask.bool(), agreed, group)
    log_prob = means.values[0]  # float64; 0 outside ``valid``
    negative = means.valid & (means.values[1] < 0)
    positive = means.valid & (means.values[1] > 0)
    counts = all_reduce(torch.stack([negative.sum(), positive.sum()]).to(torch.int64), dist.ReduceOp.SUM, group)
    n_negative, n_positive = (int(x) for x in counts.tolist())
    k_negative = lp_reg_quota(n_negative, rho_negative)
    k_positive = lp_reg_quota(n_positive, rho_positive)
    keys = float_order_keys(-log_prob)  # the lowest log-probs are the largest keys (negation is exact)
    mask = torch.zeros_like(means.valid)
    if k_negative:
        mask |= select_largest_keys(keys, negative, k_negative, n_negative, group).mask
    if k_positive:
        mask |= select_largest_keys(keys, positive, k_positive, n_positive, group).mask
    bound = means.maxima[0]  # max |log pi| over the group's valid tokens
    zero = log_prob.new_zeros(())
    sums = all_reduce(fixed_point_sums((log_prob, torch.where(mask, log_prob, zero)), bound, means.num_valid),
                      dist.ReduceOp.SUM, group)
    total, chosen = (int(x) for x in sums.tolist())
    scale = fixed_point_scale(bound, means.num_valid)
    quota = k_negative + k_positive
    return LpRegSelection(
        mask=mask, quota=quota, num_selected=quota, negative_quota=k_negative, positive_quota=k_positive,
        negative_candidates=n_negative, positive_candidates=n_positive, num_valid=means.num_valid,
        num_nonfinite=means.num_nonfinite,
        log_prob_mean=total * scale / means.num_valid if means.num_valid else math.nan,
        selected_log_prob_mean=chosen * scale / quota if quota else math.nan,
    )
