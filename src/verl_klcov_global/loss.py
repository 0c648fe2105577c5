"""The registered ``kl_cov_global`` and ``clip_cov_global`` policy losses and the channel that feeds them a mask.

verl calls a policy loss with padded (batch, response_len) tensors only
(``verl/workers/utils/losses.py ppo_loss``); it never sees the micro-batch
TensorDict. The selection mask therefore reaches the loss through one explicit
channel: :func:`provide_selection_mask` (old name :func:`provide_kl_cov_mask`), a
context manager that sets a :class:`contextvars.ContextVar` for the duration of one
loss call. The engine hook (``hook.py``) wraps verl's loss function so that every
micro-batch's loss call runs inside ``provide_selection_mask(<that micro-batch's mask slice>)``.

Outside such a context the losses raise :class:`SelectionMaskUnavailableError`
(:class:`KLCovMaskUnavailableError` / :class:`ClipCovMaskUnavailableError`): there is
never a silent fallback to per-micro-batch selection.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import verl.utils.torch_functional as verl_F
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss

from .config import (
    CLIP_COV_LOSS_MODE,
    CLIP_COV_METRIC_PREFIX,
    LOSS_MODE,
    METRIC_PREFIX,
    read_clip_cov_settings,
    read_settings,
)
from .install_hint import INSTALL_HINT

__all__ = [
    "SelectionMaskUnavailableError",
    "KLCovMaskUnavailableError",
    "ClipCovMaskUnavailableError",
    "provide_selection_mask",
    "provide_kl_cov_mask",
    "compute_policy_loss_kl_cov_global",
    "compute_policy_loss_clip_cov_global",
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
_NO_MASK_ERRORS = {LOSS_MODE: KLCovMaskUnavailableError, CLIP_COV_LOSS_MODE: ClipCovMaskUnavailableError}


_HOOK_INSTALL_ERROR: Optional[BaseException] = None


def record_hook_install_error(error: BaseException) -> None:
    """Remember why the prepass hook failed to install in this process (shown by the loss's error)."""
    global _HOOK_INSTALL_ERROR
    _HOOK_INSTALL_ERROR = error


@contextlib.contextmanager
def provide_selection_mask(mask: torch.Tensor, figures: Optional[dict[str, float]] = None) -> Iterator[None]:
    """Make ``mask`` the selection seen by ``kl_cov_global`` / ``clip_cov_global`` loss calls inside this block.

    Args:
        mask: bool (batch, response_len), aligned with the ``response_mask`` the
            loss will receive (the micro-batch's slice of the minibatch mask).
        figures: optional scalar figures of the selection (``KLCovSelection.figures`` /
            ``ClipCovSelection.figures``), reported by the loss under its metric prefix
            (``actor/kl_cov/`` / ``actor/clip_cov/``).
    """
    token = _CURRENT_MASK.set(_ProvidedMask(mask=mask, figures=dict(figures or {})))
    try:
        yield
    finally:
        _CURRENT_MASK.reset(token)


#: The channel's first name, kept for callers written for kl_cov_global alone.
provide_kl_cov_mask = provide_selection_mask


def _current_mask(response_mask: torch.Tensor, loss_mode: str = LOSS_MODE) -> _ProvidedMask:
    provided = _CURRENT_MASK.get()
    if provided is None:
        cause = "" if _HOOK_INSTALL_ERROR is None else f" The hook failed to install in this process: {_HOOK_INSTALL_ERROR!r}."
        raise _NO_MASK_ERRORS[loss_mode](_NO_MASK_MESSAGE.format(mode=loss_mode) + cause)
    mask = provided.mask
    if mask.shape != response_mask.shape:
        raise ValueError(
            f"{loss_mode} mask has shape {tuple(mask.shape)} but the loss received response_mask of shape "
            f"{tuple(response_mask.shape)}: the mask slice does not belong to this micro-batch"
        )
    mask = mask.to(device=response_mask.device, dtype=torch.bool)
    if bool((mask & ~response_mask.bool()).any()):
        raise ValueError(f"{loss_mode} mask selects positions outside response_mask: it is misaligned")
    return _ProvidedMask(mask=mask, figures=provided.figures)


@register_policy_loss(LOSS_MODE)
def compute_policy_loss_kl_cov_global(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's ``kl_cov`` objective on a mask selected over the whole minibatch.

    All tensors are (batch, response_len) for one micro-batch. Per token:
    ``-A * r`` with ``r = exp(logp - old_logp)``, plus ``ppo_kl_coef * |logp - old_logp|``
    where the provided mask is set; times ``rollout_is_weights`` when given;
    aggregated with ``agg_loss(..., loss_agg_mode, **config.global_batch_info)``.
    No PPO clipping, exactly like ``kl_cov`` (verl 0.9.1 core_algos.py ~1848).

    Returns ``(pg_loss, metrics)`` with ``actor/ppo_kl`` (masked mean |log-ratio|,
    as ``kl_cov`` reports it), ``actor/kl_cov/selected_in_micro_batch`` and the
    selection figures under ``actor/kl_cov/``.
    """
    settings = read_settings(config)
    provided = _current_mask(response_mask)
    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    pg_losses = -advantages * ratio
    pg_losses_kl = pg_losses + settings.ppo_kl_coef * abs_kl
    pg_losses = torch.where(provided.mask, pg_losses_kl, pg_losses)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights

    pg_loss = agg_loss(
        loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **config.global_batch_info
    )
    metrics = {
        "actor/ppo_kl": verl_F.masked_mean(abs_kl, response_mask).detach().item(),
        f"{METRIC_PREFIX}selected_in_micro_batch": float(provided.mask.sum().item()),
    }
    metrics.update({f"{METRIC_PREFIX}{name}": float(value) for name, value in provided.figures.items()})
    return pg_loss, metrics


@register_policy_loss(CLIP_COV_LOSS_MODE)
def compute_policy_loss_clip_cov_global(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's ``clip_cov`` objective on a mask selected over the whole minibatch.

    All tensors are (batch, response_len) for one micro-batch. Per token, with
    ``r = exp(logp - old_logp)``: ``max(-A r, -A clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high))``,
    times ``corr = 0`` where the provided mask is set (1 elsewhere; those tokens still count
    in the aggregation's denominators); times ``rollout_is_weights`` when given; aggregated
    with ``agg_loss(..., loss_agg_mode, **config.global_batch_info)``. Exactly ``clip_cov``
    (verl 0.9.1 core_algos.py ~1744) with its per-micro-batch random selection replaced.

    Returns ``(pg_loss, metrics)`` with ``actor/pg_clipfrac`` (masked mean of ``corr == 0``)
    and ``actor/ppo_kl`` (masked mean of ``old_logp - logp``) as ``clip_cov`` reports them,
    ``actor/clip_cov/selected_in_micro_batch`` and the selection figures under ``actor/clip_cov/``.
    """
    settings = read_clip_cov_settings(config)
    provided = _current_mask(response_mask, CLIP_COV_LOSS_MODE)
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = verl_F.masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - settings.clip_ratio_low, 1 + settings.clip_ratio_high)
    corr = torch.ones_like(advantages)
    corr[provided.mask] = 0
    pg_clipfrac = verl_F.masked_mean((corr == 0).float(), response_mask)
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights

    pg_loss = agg_loss(
        loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **config.global_batch_info
    )
    metrics = {
        "actor/pg_clipfrac": pg_clipfrac.detach().item(),
        "actor/ppo_kl": ppo_kl.detach().item(),
        f"{CLIP_COV_METRIC_PREFIX}selected_in_micro_batch": float(provided.mask.sum().item()),
    }
    metrics.update({f"{CLIP_COV_METRIC_PREFIX}{name}": float(value) for name, value in provided.figures.items()})
    return pg_loss, metrics
