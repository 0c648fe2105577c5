"""STARE's per-token objective on a given mask (verl ``vanilla`` times its weights), and its no-mask error."""

from __future__ import annotations

from ...loss import SelectionMaskUnavailableError, dual_clip_ppo_losses
from .selection import stare_weights


class StareMaskUnavailableError(SelectionMaskUnavailableError):
    """The ``stare_global`` loss was called without a precomputed selection mask."""


def stare_objective(old_log_prob, log_prob, advantages, response_mask, mask, settings):
    """STARE's per-token loss (hp-luo/STARE ``compute_policy_loss_stare``, core_algos.py l.1201-1293 at bffb9e7):
    verl's ``vanilla`` dual-clip PPO surrogate on the full advantages, times ``omega``
    (:func:`.selection.stare_weights`: ``settings.reweight_w`` on selected tokens with ``A > 0``,
    ``settings.reweight_m`` on selected tokens with ``A < 0``, 1 elsewhere; all 1 while ``settings.gate_on`` is
    False). :func:`global_policy_loss` multiplies by ``rollout_is_weights`` and aggregates with verl's ``agg_loss``,
    as the fork does (its ``omega`` multiplies after the rollout weights: a product, the same). Metrics
    ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``: ``vanilla``'s."""
    pg_losses, metrics = dual_clip_ppo_losses(old_log_prob, log_prob, advantages, response_mask, settings)
    weights = stare_weights(mask, advantages, reweight_w=settings.reweight_w, reweight_m=settings.reweight_m,
                            gate_on=settings.gate_on)
    return pg_losses * weights, metrics
