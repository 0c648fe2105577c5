"""Selections next to the statistics they were made on, and the margin that keeps a selection across float noise.

Two forwards of one row in other micro-batch company (another micro-batch size, DP or Ulysses SP split, a plain
model) may give its fp32 log-probs and entropy other last bits on some CPUs (the AMD EPYC runners: ~5e-7; the
Intel Xeon: none): a mask made on them may then differ where a token's score sits within that noise of the
selection's boundary. What holds on every CPU, and what these helpers let a test check instead:

* a mask is exactly the mode's selection on the statistics its prepass used (:func:`recorded_selections` records
  them; :func:`reselect` recomputes the selection on them);
* two top-k masks made on scores ``a`` and ``b`` are equal when the gap between the k-th and the (k+1)-th largest
  score of ``a`` exceeds twice the largest difference ``max|a - b|`` (no score can cross the boundary): the
  margin :func:`top_k_margin` measures.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from verl_klcov_global.engine import prepass as engine_prepass, step as engine_step


@dataclass
class Recorded:
    """One prepass selection: its result, the minibatch and settings it was made for, and the statistics its prepass
    forward computed (None where it ran none: a reused step, ``prepass_layout=old``)."""

    result: Any
    data: Any
    settings: Any
    mode: Any
    group: Any
    log_probs: Optional[torch.Tensor]
    entropy: Optional[torch.Tensor]


@contextlib.contextmanager
def recorded_selections() -> Iterator[list[Recorded]]:
    """Every prepass selection made inside the block (``engine.step.run_prepass_and_select``), in order."""
    records: list[Recorded] = []
    stats: list[tuple] = []
    real_run = engine_step.run_prepass_and_select
    real_lp, real_both = engine_prepass.compute_prepass_log_probs, engine_prepass.compute_prepass_log_probs_and_entropy

    def log_probs_only(*args):
        stats.append((real_lp(*args), None))
        return stats[-1][0]

    def with_entropy(*args):
        stats.append(real_both(*args))
        return stats[-1]

    def run(engine, data, settings, mode):
        stats.clear()
        result = real_run(engine, data, settings, mode)
        log_probs, entropy = stats[0] if stats else (None, None)
        group = engine.get_data_parallel_group() if hasattr(engine, "get_data_parallel_group") else None
        records.append(Recorded(result, data, settings, mode, group, log_probs, entropy))
        return result

    engine_step.run_prepass_and_select = run
    engine_prepass.compute_prepass_log_probs, engine_prepass.compute_prepass_log_probs_and_entropy = (
        log_probs_only, with_entropy)
    try:
        yield records
    finally:
        engine_step.run_prepass_and_select = real_run
        engine_prepass.compute_prepass_log_probs, engine_prepass.compute_prepass_log_probs_and_entropy = (
            real_lp, real_both)


def reselect(record: Recorded, *, group=None):
    """The mode's selection on the statistics ``record``'s prepass used (collective over ``group``, as the original
    was over the DP group; None: this process alone)."""
    return record.mode.select_minibatch(record.log_probs, record.data, record.settings, group,
                                        entropy=record.entropy)


def kl_cov_scores(advantages: torch.Tensor, log_probs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """KL-Cov's covariance ``(A - mean A) * (log pi - mean log pi)`` per token, means over ``valid``, float64."""
    a, lp = advantages.double(), log_probs.double()
    return (a - a[valid].mean()) * (lp - lp[valid].mean())


def top_k_margin(scores: torch.Tensor, other: torch.Tensor, valid: torch.Tensor, k: int) -> tuple[float, float]:
    """(gap, drift): the k-th minus the (k+1)-th largest of ``scores`` over ``valid`` (inf when k selects every
    token), and ``max|scores - other|`` over ``valid``. ``drift == 0 or gap > 2 * drift``: the top-k of the two
    are the same tokens (ties broken alike)."""
    a, b = scores[valid].double(), other[valid].double()
    drift = float((a - b).abs().max()) if a.numel() else 0.0
    if k >= a.numel():
        return math.inf, drift
    top = torch.topk(a, k + 1).values
    return float(top[k - 1] - top[k]), drift


def selection_scores(record: Recorded, log_probs: torch.Tensor,
                     entropy: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, valid) of a top-k mode on ``record``'s minibatch with these statistics: KL-Cov's covariance, the
    80/20 rule's entropy (float64, (batch, width))."""
    fields = record.mode.read_minibatch(log_probs, record.data, entropy)
    valid = fields.response_mask.bool()
    if record.mode.name == "high_entropy_global":
        return fields.entropy.double(), valid & fields.entropy.isfinite()
    if record.mode.name == "kl_cov_global":
        advantages = fields.response["advantages"]
        valid = valid & advantages.isfinite() & fields.log_probs.isfinite()
        return kl_cov_scores(advantages, fields.log_probs, valid), valid
    raise ValueError(f"{record.mode.name} is not a top-k mode")


def selection_margin(record: Recorded, log_probs: torch.Tensor,
                     entropy: Optional[torch.Tensor] = None) -> tuple[float, float]:
    """:func:`top_k_margin` of ``record``'s top-k selection (its quota) between the statistics its prepass used and
    ``(log_probs, entropy)``, another forward of the same rows."""
    scores, valid = selection_scores(record, record.log_probs, record.entropy)
    other, _ = selection_scores(record, log_probs, entropy)
    return top_k_margin(scores, other, valid, record.result.selection.quota)
