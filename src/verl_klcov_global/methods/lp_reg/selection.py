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

from ...selection.collectives import float_order_keys
from ...selection.knobs import finite_number, setting
from ...selection.signed import SignedSelection, group_sums, split_by_sign, take_largest

__all__ = ["LpRegSelection", "lp_reg_quota", "select_lp_reg_tokens", "validate_lp_reg_ratio"]

NEG_RATIO_KEY = "lp_reg_neg_ratio"
POS_RATIO_KEY = "lp_reg_pos_ratio"
_EXAMPLES = {
    NEG_RATIO_KEY: "0.01 (a fraction: the 1% lowest-probability negative-advantage tokens, the authors' value)",
    POS_RATIO_KEY: "0 (off, the authors' value)",
}


@dataclass(frozen=True)
class LpRegSelection(SignedSelection):
    """Result of :func:`select_lp_reg_tokens`: the fields of :class:`~verl_klcov_global.selection.signed.SignedSelection`
    (``L- | L+``), and ``log_prob_mean``, the mean log-prob of the valid tokens, and ``selected_log_prob_mean``, of
    the selected ones (``nan`` when undefined)."""

    log_prob_mean: float = math.nan
    selected_log_prob_mean: float = math.nan

    def statistics(self) -> dict[str, float]:
        return {"log_prob_mean": self.log_prob_mean, "selected_log_prob_mean": self.selected_log_prob_mean}


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
        log_probs, advantages, response_mask: (batch, response_len) current-policy log-probs, advantages and the
            real-response-token mask, as :func:`verl_klcov_global.selection.signed.split_by_sign` reads them.
        neg_ratio: ``rho-``, a fraction in [0, 1]; ``pos_ratio``: ``rho+``, the same (0: off).
        group: the data-parallel group (rank r holds the r-th contiguous block of sequences), or None. Every rank
            must call this with the same ratios (ranks that disagree all raise).
    """
    rho_negative = validate_lp_reg_ratio(neg_ratio, NEG_RATIO_KEY)
    rho_positive = validate_lp_reg_ratio(pos_ratio, POS_RATIO_KEY)
    sets = split_by_sign(log_probs, advantages, response_mask,
                         {NEG_RATIO_KEY: rho_negative, POS_RATIO_KEY: rho_positive}, group)
    log_prob = sets.means.values[0]  # float64; 0 outside ``valid``
    k_negative = lp_reg_quota(sets.n_negative, rho_negative)
    k_positive = lp_reg_quota(sets.n_positive, rho_positive)
    # the lowest log-probs are the largest keys (negation is exact)
    mask = take_largest(float_order_keys(-log_prob), sets, k_positive, k_negative, group)
    total, chosen, scale = group_sums(log_prob, mask, sets, group)
    num_valid, quota = sets.means.num_valid, k_negative + k_positive
    return LpRegSelection.of(
        mask, sets, k_positive, k_negative,
        log_prob_mean=total * scale / num_valid if num_valid else math.nan,
        selected_log_prob_mean=chosen * scale / quota if quota else math.nan,
    )
