"""Minibatch- and data-parallel-global Clip-Cov token selection, with a reproducible sampler.

It answers one question for one optimizer minibatch, possibly sharded over a
data-parallel group: *which tokens get their gradient cut (``corr = 0``)?*

Semantics (upstream ``clip_cov``'s, ``core_algos.compute_policy_loss_clip_cov``, applied once over the
whole minibatch):

* ``N`` = valid tokens over all ranks: positions where ``response_mask`` is set and the
  advantage, the log-prob and the old log-prob are finite. Other masked tokens are never
  selected and are counted in :attr:`ClipCovSelection.num_nonfinite`.
* quota ``k = max(1, int(N * clip_cov_ratio))`` (upstream's rounding); 0 when ``N = 0``.
* tokens the PPO objective already clips are excluded (upstream's ``clip_by_origin``):
  ``r = exp(logp - old_logp)``, ``pg1 = -A r``, ``pg2 = -A clamp(r, 1 - clip_ratio_low,
  1 + clip_ratio_high)``, clipped where ``pg2 > pg1`` -- computed in the inputs' own dtype
  with upstream's expression, so the decision is the one the loss would make.
* covariance ``(A - mean A) * (logp - mean logp)`` with both means over the ``N`` valid
  tokens of the whole group, in float64, bit-identical for any split.
* candidates: valid, not PPO-clipped, ``clip_cov_lb < cov < clip_cov_ub``.
* ``min(k, #candidates over the group)`` candidates are chosen uniformly without
  replacement: those with the largest keys of :mod:`.keys`, a 64-bit hash of
  (``clip_cov_seed``, the optimizer step, the sequence's token ids, the response position).
  Upstream draws with an unseeded ``torch.randperm`` on every loss call; here the same
  minibatch at the same optimizer step gives the same tokens whatever the micro-batching,
  sample order or DP split, and every optimizer step (a later minibatch, a later PPO epoch,
  a later trainer step) draws afresh, as upstream does. When every candidate fits the
  quota, all are chosen -- exactly upstream's (then deterministic) result.

Communication per call (``W`` ranks), independent of ``k`` and ``N``: one all-gather of
12 float64 per rank (three maxima, two token counts, the six knobs and the optimizer step:
ranks that disagree on any of them all raise instead of hanging), one all-reduce of 3 int64 (sums), one all-reduce
of 6 int64 (candidate and PPO-clipped counts, and four exact covariance sums: total, positive,
over the candidates; :mod:`.covariance`); only when the candidates outnumber the quota,
:func:`.collectives.select_largest_keys` (at most 8 all-reduces of 1 KiB and one collective
of 8 bytes per rank) and one all-reduce of 2 int64 (the covariance sums over the chosen
tokens). Every rank takes part in every collective, also a rank without candidates or without
tokens.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ...selection.collectives import agree_and_mean, all_reduce, select_largest_keys
from ...selection.covariance import CovarianceSelection, covariance_bound, covariance_figures, local_covariance_sums
from ...selection.keys import MAX_SEED, sequence_hashes, token_keys
from ...selection.knobs import ACTOR, finite_number, ratio_quota, setting, validate_clip_ratio, validate_ratio

__all__ = [
    "ClipCovSelection",
    "clip_cov_quota",
    "select_clip_cov_tokens",
    "validate_clip_cov_ratio",
    "validate_clip_cov_window",
    "validate_clip_cov_seed",
    "validate_clip_ratio",
    "validate_optimizer_step",
]

#: How the draw's optimizer step is named where ranks disagree on it: the plugin's count, kept in the actor
#: optimizer's first parameter group (``engine/step_count.py``).
OPTIMIZER_STEP_NAME = "optimizer.param_groups[0].verl_klcov_global_optimizer_steps"


@dataclass(frozen=True, kw_only=True)
class ClipCovSelection(CovarianceSelection):
    """Result of :func:`select_clip_cov_tokens`: the fields of :class:`.covariance.CovarianceSelection` (there
    ``quota`` is the most tokens to select, ``num_selected`` = ``min(quota, num_candidates)``, a selected token's
    gradient is cut, ``search_rounds`` is 0 when no draw was needed) and:

    Attributes:
        num_candidates: candidates over the group (valid, not PPO-clipped, inside the window).
        num_ppo_clipped: valid tokens the PPO objective already clips, over the group.
    """

    num_candidates: int
    num_ppo_clipped: int

    def figures(self) -> dict[str, float]:
        """The scalar figures, for logging (names without a prefix); ``clipped`` = tokens selected. The
        covariance figures are left out where undefined (:meth:`.covariance.CovarianceFigures.figures`)."""
        return {
            "quota": float(self.quota),
            "candidates": float(self.num_candidates),
            "clipped": float(self.num_selected),
            "ppo_clipped": float(self.num_ppo_clipped),
            "valid_tokens": float(self.num_valid),
            "nonfinite_tokens": float(self.num_nonfinite),
            **self.covariance.figures(),
        }


def validate_clip_cov_ratio(ratio: Any) -> float:
    """``ratio`` as float if it is a finite number in (0, 1], else ValueError."""
    return validate_ratio(ratio, "clip_cov_ratio", "0.0002 (verl's default and the paper's Clip-Cov value)")


def validate_clip_cov_window(lb: Any, ub: Any) -> tuple[float, float]:
    """``(lb, ub)`` as floats if both are finite numbers with ``lb < ub``, else ValueError."""
    low, high = finite_number(lb), finite_number(ub)
    for key, given, value, example in (("clip_cov_lb", lb, low, "1.0"), ("clip_cov_ub", ub, high, "5.0")):
        if value is None:
            raise ValueError(f"{key} must be a finite number, got {given!r}; {setting(key, example)} "
                             "(verl's default)")
    if not low < high:
        raise ValueError(
            f"clip_cov_lb must be below clip_cov_ub, got clip_cov_lb={lb!r} >= clip_cov_ub={ub!r}; "
            f"{setting('clip_cov_lb', '1.0')} and {setting('clip_cov_ub', '5.0')} (verl's defaults)"
        )
    return low, high


def validate_clip_cov_seed(seed: Any) -> int:
    """``seed`` if it is an integer in [0, 2**53) (not a bool, float or string), else ValueError."""
    value = None if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) else int(seed)
    if value is None or not (0 <= value < MAX_SEED):
        raise ValueError(
            f"clip_cov_seed must be an integer in [0, 2**53), got {seed!r}; " + setting("clip_cov_seed", "0")
        )
    return value


def validate_optimizer_step(step: Any) -> int:
    """``step`` if it is an integer in [0, 2**53) (not a bool), else ValueError."""
    value = None if isinstance(step, bool) or not isinstance(step, numbers.Integral) else int(step)
    if value is None or not (0 <= value < MAX_SEED):
        raise ValueError(f"the draw's optimizer step must be an integer in [0, 2**53), got {step!r}")
    return value


#: Upstream clip_cov's quota ``max(int(ratio * num_valid), 1)`` (0 without valid tokens); the same rule as kl_cov's.
clip_cov_quota = ratio_quota


def _check_shapes(advantages, log_probs, old_log_probs, response_mask, token_ids, token_mask) -> None:
    """ValueError unless the per-token tensors are (batch, response_len) alike and ``token_ids`` (``token_mask``) are
    integer (batch, length); checked before any collective: a rank raising later, in the draw, would leave the
    others waiting."""
    shape = advantages.shape
    if not (shape == log_probs.shape == old_log_probs.shape == response_mask.shape) or advantages.dim() != 2:
        raise ValueError(
            "advantages, log_probs, old_log_probs and response_mask must be 2-D tensors of the same shape "
            f"(batch, response_len); got {tuple(advantages.shape)}, {tuple(log_probs.shape)}, "
            f"{tuple(old_log_probs.shape)}, {tuple(response_mask.shape)}"
        )
    if token_ids.dim() != 2 or token_ids.shape[0] != shape[0] or token_ids.is_floating_point():
        raise ValueError(f"token_ids must be integer (batch={shape[0]}, length), got {token_ids.dtype} "
                         f"{tuple(token_ids.shape)}")
    if token_mask is not None and token_mask.shape != token_ids.shape:
        raise ValueError(f"token_mask must have the shape of token_ids {tuple(token_ids.shape)}, "
                         f"got {tuple(token_mask.shape)}")


def _seeded_draw(candidates: torch.Tensor, k: int, num_candidates: int, seed: int, optimizer_step: int,
                 token_ids: torch.Tensor, token_mask: Optional[torch.Tensor], group) -> tuple[torch.Tensor, int]:
    """``k`` of the group's ``num_candidates`` candidates (this rank's: the bool (batch, response_len)
    ``candidates``), those with the largest keys hashed from (``seed``, ``optimizer_step``, the sequence's token ids,
    the position): this rank's mask of the chosen and the rounds the agreement took (collective)."""
    rows, columns = candidates.nonzero(as_tuple=True)  # row-major: ties keep (row, position) order
    hashed_rows, row_of = torch.unique(rows, return_inverse=True)
    # only the rows with candidates are hashed, on the inputs' device (token ids may live on the host)
    row_ids = token_ids[hashed_rows.to(token_ids.device)].to(rows.device)
    row_mask = None if token_mask is None else token_mask[hashed_rows.to(token_mask.device)].to(rows.device)
    high_half, low_half = sequence_hashes(row_ids, row_mask)
    keys = token_keys(seed, (high_half[row_of], low_half[row_of]), columns, optimizer_step)
    top = select_largest_keys(keys, torch.ones_like(keys, dtype=torch.bool), k, num_candidates, group)
    mask = torch.zeros_like(candidates)
    mask[rows[top.mask], columns[top.mask]] = True
    return mask, top.rounds


def select_clip_cov_tokens(
    advantages: torch.Tensor,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    clip_cov_ratio: float,
    clip_cov_lb: float,
    clip_cov_ub: float,
    clip_ratio_low: float,
    clip_ratio_high: float,
    seed: int,
    optimizer_step: int = 0,
    token_mask: Optional[torch.Tensor] = None,
    group: Optional[dist.ProcessGroup] = None,
) -> ClipCovSelection:
    """Select Clip-Cov's tokens once over the whole minibatch and the data-parallel group.

    Args:
        advantages, log_probs, old_log_probs: (batch, response_len) floating-point tensors of
            this rank's shard; ``log_probs`` are the current policy's (the prepass's).
        response_mask: (batch, response_len), nonzero at real response tokens; column ``t``
            is response position ``t`` (right-padded responses).
        token_ids: (batch, length) integer ids identifying each sequence (verl's
            ``input_ids``: prompt + response), only hashed; ``token_mask`` (same shape, bool)
            marks the real tokens (None: all). They may live on another device (the host):
            only the rows holding candidates are moved, and only when a draw is needed.
        clip_cov_ratio, clip_cov_lb, clip_cov_ub: upstream's knobs (see module docstring).
        clip_ratio_low, clip_ratio_high: the PPO clip range.
        seed: ``clip_cov_seed``, an integer in [0, 2**53).
        optimizer_step: the optimizer step the draw is for, an integer in [0, 2**53), the same on every rank (the
            engine passes its count of the actor's optimizer steps: every optimizer step draws afresh); 0 gives the
            seed's own draw.
        group: data-parallel group (rank r holds a contiguous block of sequences, lower ranks
            first), or None. Every rank must pass the same knobs; batch sizes may differ,
            including 0 rows.

    Returns:
        :class:`ClipCovSelection` whose ``mask`` covers this rank's tokens.
    """
    ratio = validate_clip_cov_ratio(clip_cov_ratio)
    lb, ub = validate_clip_cov_window(clip_cov_lb, clip_cov_ub)
    low = validate_clip_ratio(clip_ratio_low, "clip_ratio_low")
    high = validate_clip_ratio(clip_ratio_high, "clip_ratio_high")
    seed = validate_clip_cov_seed(seed)
    optimizer_step = validate_optimizer_step(optimizer_step)
    _check_shapes(advantages, log_probs, old_log_probs, response_mask, token_ids, token_mask)

    a, lp, old = (x.detach() if x.is_floating_point() else x.detach().to(torch.float64)
                  for x in (advantages, log_probs, old_log_probs))
    in_mask = response_mask.bool()
    knobs = {"clip_cov_ratio": ratio, "clip_cov_lb": lb, "clip_cov_ub": ub, "clip_cov_seed": float(seed),
             f"{ACTOR}clip_ratio_low": low, f"{ACTOR}clip_ratio_high": high,
             OPTIMIZER_STEP_NAME: float(optimizer_step)}
    means = agree_and_mean((a, lp, old), in_mask, knobs, group)
    valid = means.valid

    # upstream's clip_by_origin, same expression and dtype (a NaN log-ratio is not valid anyway)
    ratio_to_old = torch.exp(lp - old)
    pg_losses1 = -a * ratio_to_old
    pg_losses2 = -a * torch.clamp(ratio_to_old, 1 - low, 1 + high)
    ppo_clipped = valid & (pg_losses2 > pg_losses1)

    (a64, lp64, _), (mean_a, mean_lp, _) = means.values, means.means  # float64, zero outside ``valid``
    cov = a64.sub_(mean_a).mul_(lp64.sub_(mean_lp))  # in place: own buffers
    candidates = valid & ~ppo_clipped & (cov > lb) & (cov < ub)
    bound = covariance_bound(means.maxima[0], means.maxima[1])
    # the covariance sums over all candidates travel with the counts: they are the chosen tokens' when all fit
    cov_sums = local_covariance_sums(cov, valid, candidates, bound, means.num_valid)
    counts = torch.cat([torch.stack([candidates.sum(), ppo_clipped.sum()]).to(torch.int64), cov_sums])
    reduced = all_reduce(counts, dist.ReduceOp.SUM, group)
    num_candidates, num_ppo_clipped = reduced[:2].tolist()
    cov_sums = reduced[2:]
    quota = clip_cov_quota(means.num_valid, ratio)
    k = min(quota, num_candidates)

    rounds = 0
    if k == num_candidates:  # every candidate fits: no draw (the same branch on every rank)
        mask = candidates
    else:
        mask, rounds = _seeded_draw(candidates, k, num_candidates, seed, optimizer_step, token_ids, token_mask, group)
        chosen_sums = local_covariance_sums(cov, valid, mask, bound, means.num_valid)[2:]
        cov_sums = torch.cat([cov_sums[:2], all_reduce(chosen_sums, dist.ReduceOp.SUM, group)])
    return ClipCovSelection(
        mask=mask,
        quota=quota,
        num_candidates=num_candidates,
        num_selected=k,
        num_ppo_clipped=num_ppo_clipped,
        num_valid=means.num_valid,
        num_nonfinite=means.num_nonfinite,
        mean_advantage=float(mean_a),
        mean_log_prob=float(mean_lp),
        search_rounds=rounds,
        covariance=covariance_figures(cov_sums, bound, means.num_valid, k),
    )
