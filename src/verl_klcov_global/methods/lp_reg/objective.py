"""Lp-Reg's per-token objective on a given mask and proxy, its tallies, and its no-mask error."""

from __future__ import annotations

import torch

from ...loss import SelectionMaskUnavailableError, dual_clip_ppo_losses


class LpRegMaskUnavailableError(SelectionMaskUnavailableError):
    """The ``lp_reg_global`` loss was called without a precomputed selection mask."""


#: Metric prefix of ``lp_reg_global`` (the mode table's ``metric_prefix``).
LP_REG_PREFIX = "actor/lp_reg/"
#: The per-micro-batch tallies :func:`lp_reg_objective` reports (the mode table's ``loss_tallies``); the engine's
#: step sums them over the micro-batches and the DP group, and :func:`lp_reg_tally_figures` makes the step's figures.
LP_REG_TALLIES = ("regularised", "selected_in_support", "kl_sum", "per_call_switched_off")


def lp_reg_tally_figures(sums: dict[str, float], selection) -> dict[str, float]:
    """The step's figures from :data:`LP_REG_TALLIES` summed over its micro-batches and the DP group:
    ``regularised``, ``per_call_switched_off``, ``selected_in_support_share`` (of the selected tokens) and ``kl_mean``
    (over the regularised tokens), the last two where their denominator is not 0."""
    figures = {"regularised": sums["regularised"], "per_call_switched_off": sums["per_call_switched_off"]}
    if selection.num_selected:
        figures["selected_in_support_share"] = sums["selected_in_support"] / selection.num_selected
    if sums["regularised"]:
        figures["kl_mean"] = sums["kl_sum"] / sums["regularised"]
    return figures


def lp_reg_per_call_switched_off(advantages: torch.Tensor, response_mask: torch.Tensor, settings) -> int:
    """The tokens the authors' per-call rule would leave unregularised in this one loss call: for each advantage sign
    with a ratio > 0, its ``n`` tokens under ``response_mask`` when its quota ``max(1, int(n * rho))`` is not > 1
    (their ``if k > 1``), i.e. ``0 < n < 2 / rho``."""
    valid = response_mask.bool()
    switched = 0
    for tokens, ratio in ((valid & (advantages < 0), settings.neg_ratio), (valid & (advantages > 0), settings.pos_ratio)):
        n = int(tokens.sum())
        if ratio > 0 and n > 0 and max(1, int(n * ratio)) <= 1:
            switched += n
    return switched


def lp_reg_objective(old_log_prob, log_prob, advantages, response_mask, mask, settings, proxy_log_prob):
    """Lp-Reg's per-token loss (Lp-Reg-dev ``compute_policy_loss_lp_reg``, core_algos.py l.648-745 at 33b27e2) on
    ``mask`` (the prepass's quota), with ``proxy_log_prob`` = log pi_proxy of each token (pi_old's, min-p filtered).

    * A token of ``mask`` whose detached training log-prob is below the proxy's, ``log pi_theta < log pi_proxy``
      (the authors' support test, on the training forward), is *regularised*: ``-A * r + kl_coef *
      low_var_kl(log pi_theta, log pi_proxy)`` with ``r = exp(log pi_theta - log pi_old)`` unclipped and verl's
      ``kl_penalty(..., "low_var_kl")``, as the authors' code;
    * every other token keeps verl's ``vanilla`` dual-clip PPO surrogate
      (:func:`~verl_klcov_global.loss.dual_clip_ppo_losses`). The authors' code has no dual clip
      (``max(-A r, -A clip(r))``); the two agree wherever ``r <=
      clip_ratio_c`` (their scripts set ``clip_ratio_c`` 10 for verl's other losses).

    Unregularised tokens never reach the exponent or the proxy (``torch.where`` on safe stand-ins), so a proxy of
    ``-inf`` outside the min-p support or a large log-ratio elsewhere cannot make a NaN gradient.

    Metrics: ``vanilla``'s, plus the micro-batch's tallies :data:`LP_REG_TALLIES` (``<prefix><name>_in_micro_batch``):
    regularised tokens, selected tokens inside the proxy's support (finite proxy), the sum of the KL over the
    regularised tokens, and :func:`lp_reg_per_call_switched_off`.
    """
    from verl.trainer.ppo.core_algos import kl_penalty

    pg_losses, metrics = dual_clip_ppo_losses(old_log_prob, log_prob, advantages, response_mask, settings)
    detached = log_prob.detach()
    selected = mask & response_mask.bool()
    regularised = selected & (detached < proxy_log_prob)
    zero = log_prob.new_zeros(())
    target = torch.where(regularised, proxy_log_prob.to(log_prob.dtype), detached)
    kl = kl_penalty(log_prob, target, "low_var_kl")
    ratio = torch.exp(torch.where(regularised, log_prob - old_log_prob, zero))
    regularised_losses = -torch.where(regularised, advantages, zero) * ratio + settings.kl_coef * kl
    pg_losses = torch.where(regularised, regularised_losses, pg_losses)
    tallies = {
        "regularised": float(regularised.sum()),
        "selected_in_support": float((selected & torch.isfinite(proxy_log_prob)).sum()),
        "kl_sum": float(torch.where(regularised, kl.detach(), zero).sum(dtype=torch.float64)),
        "per_call_switched_off": float(lp_reg_per_call_switched_off(advantages, response_mask, settings)),
    }
    metrics.update({f"{LP_REG_PREFIX}{name}_in_micro_batch": value for name, value in tallies.items()})
    return pg_losses, metrics
