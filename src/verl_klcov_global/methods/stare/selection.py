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

from ...selection.collectives import float_order_keys
from ...selection.knobs import finite_number, setting
from ...selection.signed import SignedSelection, group_sums, split_by_sign, take_largest

__all__ = ["StareSelection", "select_stare_tokens", "stare_quota", "stare_weights", "validate_stare_top_ratio"]

TOP_RATIO_KEY = "stare_top_ratio"
TOP_RATIO_EXAMPLE = "0.1 (a fraction: 0.1 takes the 10% most surprising tokens of each sign, the paper's value)"


@dataclass(frozen=True)
class StareSelection(SignedSelection):
    """Result of :func:`select_stare_tokens`: the fields of :class:`~verl_klcov_global.selection.signed.SignedSelection`
    (``L+ | L-``; ``k-`` is 0 without ``with_negative``), and ``surprisal_mean``, the mean surprisal of the valid
    tokens, and ``selected_surprisal_share``, the selected tokens' share of the valid tokens' summed surprisal
    (``nan`` when undefined)."""

    surprisal_mean: float = math.nan
    selected_surprisal_share: float = math.nan

    def statistics(self) -> dict[str, float]:
        return {"surprisal_mean": self.surprisal_mean, "selected_surprisal_share": self.selected_surprisal_share}


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
        log_probs, advantages, response_mask: (batch, response_len) current-policy log-probs, advantages and the
            real-response-token mask, as :func:`verl_klcov_global.selection.signed.split_by_sign` reads them.
        top_ratio: ``P``, a fraction in [0, 1].
        with_negative: also take ``L-`` (STARE's variant C2).
        group: the data-parallel group (rank r holds the r-th contiguous block of sequences), or None. Every rank
            must call this with the same ``top_ratio`` (ranks that disagree all raise) and ``with_negative``.
    """
    ratio = validate_stare_top_ratio(top_ratio)
    agreed = {TOP_RATIO_KEY: ratio, "stare_variant": float(bool(with_negative))}  # 0: O1, 1: C2
    sets = split_by_sign(log_probs, advantages, response_mask, agreed, group)
    surprisal = -sets.means.values[0]  # float64, exact negation; 0 outside ``valid``
    k_positive = stare_quota(sets.n_positive, ratio)
    k_negative = stare_quota(sets.n_negative, ratio) if with_negative else 0
    mask = take_largest(float_order_keys(surprisal), sets, k_positive, k_negative, group)
    total, chosen, scale = group_sums(surprisal, mask, sets, group)
    num_valid = sets.means.num_valid
    return StareSelection.of(
        mask, sets, k_positive, k_negative,
        surprisal_mean=total * scale / num_valid if num_valid else math.nan,
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
