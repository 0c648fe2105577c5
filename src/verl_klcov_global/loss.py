"""The global policy losses verl calls, and the one channel that hands them each micro-batch's mask.

verl calls a policy loss with padded (batch, response_len) tensors only
(``verl/workers/utils/losses.py ppo_loss``); it never sees the micro-batch
TensorDict. The selection mask therefore reaches the loss through one explicit
channel: :func:`provide_selection_mask`, a context manager that sets a
:class:`contextvars.ContextVar` for the duration of one loss call. The engine's step
(:mod:`verl_klcov_global.engine.step`) wraps verl's loss function so that every
micro-batch's loss call runs inside ``provide_selection_mask(<that micro-batch's mask slice>)``.

:func:`global_policy_loss` turns one mode of the table (:mod:`verl_klcov_global.modes`)
into the function verl registers: read the mode's settings, take the mask from the channel,
apply the mode's objective (:func:`kl_cov_objective`, :func:`clip_cov_objective`,
:func:`high_entropy_objective`: verl's own per-token formulas on a given mask), weight and aggregate as verl does. Outside a
``provide_selection_mask`` block the loss raises the mode's
:class:`SelectionMaskUnavailableError`: there is never a silent fallback to per-micro-batch
selection.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import verl.utils.torch_functional as verl_F
from verl.trainer.ppo.core_algos import agg_loss

from .install_hint import INSTALL_HINT

__all__ = [
    "SelectionMaskUnavailableError",
    "KLCovMaskUnavailableError",
    "ClipCovMaskUnavailableError",
    "HighEntropyMaskUnavailableError",
    "StareMaskUnavailableError",
    "provide_selection_mask",
    "provided_selection",
    "global_policy_loss",
    "kl_cov_objective",
    "clip_cov_objective",
    "high_entropy_objective",
]


class SelectionMaskUnavailableError(RuntimeError):
    """A global loss mode was called without a precomputed selection mask."""


class KLCovMaskUnavailableError(SelectionMaskUnavailableError):
    """The ``kl_cov_global`` loss was called without a precomputed selection mask."""


class ClipCovMaskUnavailableError(SelectionMaskUnavailableError):
    """The ``clip_cov_global`` loss was called without a precomputed selection mask."""


@dataclass(frozen=True)
class _ProvidedMask:
    mask: torch.Tensor
    figures: dict[str, float] = field(default_factory=dict)
    settings: Any = None  # the step's settings where a rule moved them (ModeSpec.update_rule), else None
    token_fields: dict[str, torch.Tensor] = field(default_factory=dict)  # per-token inputs of the objective


class HighEntropyMaskUnavailableError(SelectionMaskUnavailableError):
    """The ``high_entropy_global`` loss was called without a precomputed selection mask."""


class StareMaskUnavailableError(SelectionMaskUnavailableError):
    """The ``stare_global`` loss was called without a precomputed selection mask."""


class LpRegMaskUnavailableError(SelectionMaskUnavailableError):
    """The ``lp_reg_global`` loss was called without a precomputed selection mask."""


_CURRENT_MASK: contextvars.ContextVar[Optional[_ProvidedMask]] = contextvars.ContextVar(
    "verl_klcov_global_mask", default=None
)

_NO_MASK_MESSAGE = (
    "loss_mode={mode} was called without a precomputed selection mask: the verl_klcov_global "
    "prepass hook is not active in this process, or the engine bypassed it. The hook wraps "
    "verl.workers.engine.base.BaseEngine.train_batch for verl's FSDP engines (strategy fsdp/fsdp2) and is "
    "installed when the plugin loads. Make sure the plugin is loaded in every worker process: install the "
    "package (its entry point, group verl.plugins, loads it on `import verl`; " + INSTALL_HINT + "), or set "
    "VERL_USE_EXTERNAL_MODULES=verl_klcov_global, or actor_rollout_ref.model.external_lib=verl_klcov_global. "
    "To call the loss directly, wrap the call in verl_klcov_global.provide_selection_mask(mask)."
)


_HOOK_INSTALL_ERROR: Optional[BaseException] = None


def record_hook_install_error(error: BaseException) -> None:
    """Remember why the prepass hook failed to install in this process (shown by the loss's error)."""
    global _HOOK_INSTALL_ERROR
    _HOOK_INSTALL_ERROR = error


@contextlib.contextmanager
def provide_selection_mask(mask: torch.Tensor, figures: Optional[dict[str, float]] = None,
                           settings: Any = None, token_fields: Optional[dict[str, torch.Tensor]] = None
                           ) -> Iterator[None]:
    """Make ``mask`` the selection seen by every global mode's loss call inside this block.

    Args:
        mask: bool (batch, response_len), aligned with the ``response_mask`` the
            loss will receive (the micro-batch's slice of the minibatch mask).
        figures: optional scalar figures of the selection (``Selection.figures()``), reported
            by the loss under its mode's metric prefix (e.g. ``actor/kl_cov/``).
        settings: optional, the settings this optimizer step's loss applies in place of those read from the actor
            config (a mode whose ``update_rule`` moves them once per trainer step: STARE's gate, W and M).
        token_fields: optional per-token tensors, each shaped like ``mask``, that the mode's objective takes as
            keyword arguments (``lp_reg_global``: ``proxy_log_prob``, Lp-Reg's proxy).
    """
    token = _CURRENT_MASK.set(_ProvidedMask(mask=mask, figures=dict(figures or {}), settings=settings,
                                            token_fields=dict(token_fields or {})))
    try:
        yield
    finally:
        _CURRENT_MASK.reset(token)


def provided_selection() -> Optional[_ProvidedMask]:
    """What the innermost :func:`provide_selection_mask` block provides (``.mask``, ``.figures``, ``.settings``), or
    None outside one: for comparators and tests that read the step's settings beside the loss."""
    return _CURRENT_MASK.get()


def _current_mask(response_mask: torch.Tensor, loss_mode: str,
                  no_mask_error: type[SelectionMaskUnavailableError]) -> _ProvidedMask:
    provided = _CURRENT_MASK.get()
    if provided is None:
        cause = "" if _HOOK_INSTALL_ERROR is None else f" The hook failed to install in this process: {_HOOK_INSTALL_ERROR!r}."
        raise no_mask_error(_NO_MASK_MESSAGE.format(mode=loss_mode) + cause)
    mask = provided.mask
    if mask.shape != response_mask.shape:
        raise ValueError(
            f"{loss_mode} mask has shape {tuple(mask.shape)} but the loss received response_mask of shape "
            f"{tuple(response_mask.shape)}: the mask slice does not belong to this micro-batch"
        )
    mask = mask.to(device=response_mask.device, dtype=torch.bool)
    if bool((mask & ~response_mask.bool()).any()):
        raise ValueError(f"{loss_mode} mask selects positions outside response_mask: it is misaligned")
    for name, values in provided.token_fields.items():
        if values.shape != response_mask.shape:
            raise ValueError(f"{loss_mode}'s per-token field {name} has shape {tuple(values.shape)} but the loss "
                             f"received response_mask of shape {tuple(response_mask.shape)}: it is misaligned")
    fields = {name: values.to(response_mask.device) for name, values in provided.token_fields.items()}
    return _ProvidedMask(mask=mask, figures=provided.figures, settings=provided.settings, token_fields=fields)


#: ``objective(old_log_prob, log_prob, advantages, response_mask, mask, settings) -> (per-token losses, metrics)``:
#: a mode's per-token loss on a given (batch, response_len) bool selection ``mask``, before
#: ``rollout_is_weights`` and aggregation; ``metrics`` are verl's own names (``actor/ppo_kl`` ...).
Objective = Callable[..., tuple[torch.Tensor, dict[str, float]]]


def global_policy_loss(mode: Any) -> Callable[..., tuple[torch.Tensor, dict[str, Any]]]:
    """The policy-loss function verl registers for ``mode`` (a :class:`verl_klcov_global.modes.ModeSpec`).

    Its arguments are those of every verl policy loss (``ppo_loss`` passes them by keyword); all
    tensors are (batch, response_len) for one micro-batch. It reads ``mode.read_settings(config)``,
    takes the micro-batch's mask from :func:`provide_selection_mask` (else raises
    ``mode.no_mask_error``), applies ``mode.objective``, multiplies by ``rollout_is_weights`` when
    given and aggregates with ``agg_loss(..., loss_agg_mode, **config.global_batch_info)``.

    Returns ``(pg_loss, metrics)``: the objective's metrics, ``<prefix>selected_in_micro_batch``
    (tokens of this micro-batch's mask) and the selection figures under ``mode.metric_prefix``.
    """

    def compute_policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        settings = mode.read_settings(config)
        provided = _current_mask(response_mask, mode.name, mode.no_mask_error)
        if provided.settings is not None:  # moved once per trainer step by the mode's update_rule (engine/schedule.py)
            settings = provided.settings
        pg_losses, metrics = mode.objective(old_log_prob, log_prob, advantages, response_mask, provided.mask,
                                            settings, **provided.token_fields)
        if rollout_is_weights is not None:
            pg_losses = pg_losses * rollout_is_weights
        pg_loss = agg_loss(
            loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **config.global_batch_info
        )
        prefix = mode.metric_prefix
        metrics[f"{prefix}selected_in_micro_batch"] = float(provided.mask.sum().item())
        metrics.update({f"{prefix}{name}": float(value) for name, value in provided.figures.items()})
        return pg_loss, metrics

    name = f"compute_policy_loss_{mode.name}"
    compute_policy_loss.__name__ = compute_policy_loss.__qualname__ = name
    compute_policy_loss.__doc__ = f"verl policy loss ``{mode.name}``: see :func:`global_policy_loss`."
    return compute_policy_loss


def kl_cov_objective(old_log_prob, log_prob, advantages, response_mask, mask, settings):
    """verl's ``kl_cov`` per-token loss (verl 0.9.1 core_algos.py ~1848) on ``mask``.

    ``-A * r`` with ``r = exp(logp - old_logp)``, plus ``settings.ppo_kl_coef * |logp - old_logp|``
    where ``mask`` is set. No PPO clipping, exactly like ``kl_cov``. Metric ``actor/ppo_kl``
    (masked mean |log-ratio|, as ``kl_cov`` reports it).
    """
    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    pg_losses = -advantages * ratio
    pg_losses_kl = pg_losses + settings.ppo_kl_coef * abs_kl
    pg_losses = torch.where(mask, pg_losses_kl, pg_losses)
    return pg_losses, {"actor/ppo_kl": verl_F.masked_mean(abs_kl, response_mask).detach().item()}


def clip_cov_objective(old_log_prob, log_prob, advantages, response_mask, mask, settings):
    """verl's ``clip_cov`` per-token loss (verl 0.9.1 core_algos.py ~1744) with its random selection replaced by ``mask``.

    With ``r = exp(logp - old_logp)``: ``max(-A r, -A clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high))``,
    times ``corr = 0`` where ``mask`` is set (1 elsewhere; those tokens still count in the
    aggregation's denominators). Metrics ``actor/pg_clipfrac`` (masked mean of ``corr == 0``) and
    ``actor/ppo_kl`` (masked mean of ``old_logp - logp``), as ``clip_cov`` reports them.
    """
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = verl_F.masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - settings.clip_ratio_low, 1 + settings.clip_ratio_high)
    corr = torch.ones_like(advantages)
    corr[mask] = 0
    pg_clipfrac = verl_F.masked_mean((corr == 0).float(), response_mask)
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr
    return pg_losses, {"actor/pg_clipfrac": pg_clipfrac.detach().item(), "actor/ppo_kl": ppo_kl.detach().item()}


def high_entropy_objective(old_log_prob, log_prob, advantages, response_mask, mask, settings):
    """verl's ``vanilla`` PPO-clip per-token loss (verl 0.9.1 core_algos.py ~1286) on ``where(mask, A, 0)``.

    The paper's objective (Wang et al. 2025, arXiv:2506.01939, J_HighEnt): the clipped surrogate
    of every token times the indicator ``H_t >= tau`` (here: ``mask``, the top ``entropy_top_ratio``
    over the minibatch), normalised by all tokens. Per token, with ``r = exp(clamp(logp - old_logp, -20, 20))``
    and ``A' = A`` where ``mask`` is set, else ``0``:
    ``l1 = max(-A' r, -A' clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high))``; where ``A' < 0``,
    ``min(l1, -A' clip_ratio_c)`` (dual clip), else ``l1``. An unselected token has ``A' = 0``, so its
    loss and its gradient are exactly 0 (also when its advantage is not finite), while it still counts
    in the aggregation's denominators: :func:`global_policy_loss` multiplies by ``rollout_is_weights``
    and aggregates with verl's ``agg_loss`` over the whole ``response_mask``, as ``vanilla`` does; for
    ``token-mean`` that is the paper's ``1 / sum_i |o_i|``. Metrics ``actor/pg_clipfrac``,
    ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``: ``vanilla``'s, on ``A'``.
    """
    masked_advantages = torch.where(mask, advantages, advantages.new_zeros(()))
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = verl_F.masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -masked_advantages * ratio
    pg_losses2 = -masked_advantages * torch.clamp(ratio, 1 - settings.clip_ratio_low, 1 + settings.clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = verl_F.masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -masked_advantages * settings.clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = verl_F.masked_mean(
        torch.gt(clip_pg_losses1, pg_losses3) * (masked_advantages < 0).float(), response_mask
    )
    pg_losses = torch.where(masked_advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return pg_losses, {"actor/pg_clipfrac": pg_clipfrac.detach().item(), "actor/ppo_kl": ppo_kl.detach().item(),
                       "actor/pg_clipfrac_lower": pg_clipfrac_lower.detach().item()}


def stare_objective(old_log_prob, log_prob, advantages, response_mask, mask, settings):
    """STARE's per-token loss (hp-luo/STARE ``compute_policy_loss_stare``, core_algos.py l.1201-1293 at bffb9e7):
    verl's ``vanilla`` dual-clip PPO surrogate on the full advantages, times ``omega``
    (:func:`.selection.stare.stare_weights`: ``settings.reweight_w`` on selected tokens with ``A > 0``,
    ``settings.reweight_m`` on selected tokens with ``A < 0``, 1 elsewhere; all 1 while ``settings.gate_on`` is
    False). :func:`global_policy_loss` multiplies by ``rollout_is_weights`` and aggregates with verl's ``agg_loss``,
    as the fork does (its ``omega`` multiplies after the rollout weights: a product, the same). Metrics
    ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``: ``vanilla``'s."""
    from .selection.stare import stare_weights

    pg_losses, metrics = high_entropy_objective(old_log_prob, log_prob, advantages, response_mask,
                                                torch.ones_like(mask, dtype=torch.bool), settings)
    weights = stare_weights(mask, advantages, reweight_w=settings.reweight_w, reweight_m=settings.reweight_m,
                            gate_on=settings.gate_on)
    return pg_losses * weights, metrics


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
    * every other token keeps verl's ``vanilla`` dual-clip PPO surrogate (:func:`high_entropy_objective` with every
      token kept). The authors' code has no dual clip (``max(-A r, -A clip(r))``); the two agree wherever ``r <=
      clip_ratio_c`` (their scripts set ``clip_ratio_c`` 10 for verl's other losses).

    Unregularised tokens never reach the exponent or the proxy (``torch.where`` on safe stand-ins), so a proxy of
    ``-inf`` outside the min-p support or a large log-ratio elsewhere cannot make a NaN gradient.

    Metrics: ``vanilla``'s, plus the micro-batch's tallies :data:`LP_REG_TALLIES` (``<prefix><name>_in_micro_batch``):
    regularised tokens, selected tokens inside the proxy's support (finite proxy), the sum of the KL over the
    regularised tokens, and :func:`lp_reg_per_call_switched_off`.
    """
    from verl.trainer.ppo.core_algos import kl_penalty

    pg_losses, metrics = high_entropy_objective(old_log_prob, log_prob, advantages, response_mask,
                                                torch.ones_like(mask, dtype=torch.bool), settings)
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
