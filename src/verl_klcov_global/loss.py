"""The registered ``kl_cov_global`` policy loss and the channel that feeds it a mask.

verl calls a policy loss with padded (batch, response_len) tensors only
(``verl/workers/utils/losses.py ppo_loss``); it never sees the micro-batch
TensorDict. The selection mask therefore reaches the loss through one explicit
channel: :func:`provide_kl_cov_mask`, a context manager that sets a
:class:`contextvars.ContextVar` for the duration of one loss call. The engine
hook (``hook.py``) wraps verl's loss function so that every micro-batch's loss
call runs inside ``provide_kl_cov_mask(<that micro-batch's mask slice>)``.

Outside such a context the loss raises :class:`KLCovMaskUnavailableError`:
there is never a silent fallback to per-micro-batch selection.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import verl.utils.torch_functional as verl_F
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss

from .config import LOSS_MODE, METRIC_PREFIX, read_settings

__all__ = ["KLCovMaskUnavailableError", "provide_kl_cov_mask", "compute_policy_loss_kl_cov_global"]


class KLCovMaskUnavailableError(RuntimeError):
    """The ``kl_cov_global`` loss was called without a precomputed selection mask."""


@dataclass(frozen=True)
class _ProvidedMask:
    mask: torch.Tensor
    figures: dict[str, float] = field(default_factory=dict)


_CURRENT_MASK: contextvars.ContextVar[Optional[_ProvidedMask]] = contextvars.ContextVar(
    "verl_klcov_global_mask", default=None
)

_NO_MASK_MESSAGE = (
    "loss_mode=kl_cov_global was called without a precomputed selection mask: the verl_klcov_global "
    "prepass hook is not active in this process, or the engine bypassed it. The hook wraps "
    "verl.workers.engine.base.BaseEngine.train_batch for verl's FSDP engines (strategy fsdp/fsdp2) and is "
    "installed when the plugin loads. Make sure the plugin is loaded in every worker process: install the "
    "package (`pip install verl-klcov-global`, entry point group verl.plugins, loaded on `import verl`), or set "
    "VERL_USE_EXTERNAL_MODULES=verl_klcov_global, or actor_rollout_ref.model.external_lib=verl_klcov_global. "
    "To call the loss directly, wrap the call in verl_klcov_global.provide_kl_cov_mask(mask)."
)


_HOOK_INSTALL_ERROR: Optional[BaseException] = None


def record_hook_install_error(error: BaseException) -> None:
    """Remember why the prepass hook failed to install in this process (shown by the loss's error)."""
    global _HOOK_INSTALL_ERROR
    _HOOK_INSTALL_ERROR = error


@contextlib.contextmanager
def provide_kl_cov_mask(mask: torch.Tensor, figures: Optional[dict[str, float]] = None) -> Iterator[None]:
    """Make ``mask`` the selection seen by ``kl_cov_global`` loss calls inside this block.

    Args:
        mask: bool (batch, response_len), aligned with the ``response_mask`` the
            loss will receive (the micro-batch's slice of the minibatch mask).
        figures: optional scalar figures of the selection (see
            ``KLCovSelection.figures``), reported by the loss under ``actor/kl_cov/``.
    """
    token = _CURRENT_MASK.set(_ProvidedMask(mask=mask, figures=dict(figures or {})))
    try:
        yield
    finally:
        _CURRENT_MASK.reset(token)


def _current_mask(response_mask: torch.Tensor) -> _ProvidedMask:
    provided = _CURRENT_MASK.get()
    if provided is None:
        cause = "" if _HOOK_INSTALL_ERROR is None else f" The hook failed to install in this process: {_HOOK_INSTALL_ERROR!r}."
        raise KLCovMaskUnavailableError(_NO_MASK_MESSAGE + cause)
    mask = provided.mask
    if mask.shape != response_mask.shape:
        raise ValueError(
            f"kl_cov_global mask has shape {tuple(mask.shape)} but the loss received response_mask of shape "
            f"{tuple(response_mask.shape)}: the mask slice does not belong to this micro-batch"
        )
    mask = mask.to(device=response_mask.device, dtype=torch.bool)
    if bool((mask & ~response_mask.bool()).any()):
        raise ValueError("kl_cov_global mask selects positions outside response_mask: it is misaligned")
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
