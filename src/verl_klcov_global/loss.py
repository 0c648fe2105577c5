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
apply the mode's objective (each method's ``objective.py``: its per-token formula on a given mask), weight and
aggregate as verl does. :func:`dual_clip_ppo_losses` is verl ``vanilla``'s per-token surrogate, which several
objectives build on. Outside a
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
    "aggregate_policy_loss",
    "dual_clip_ppo_losses",
    "global_policy_loss",
    "provide_selection_mask",
    "provided_selection",
    "verl_policy_loss",
]


class SelectionMaskUnavailableError(RuntimeError):
    """A global loss mode was called without a precomputed selection mask."""


@dataclass(frozen=True)
class _ProvidedMask:
    mask: torch.Tensor
    figures: dict[str, float] = field(default_factory=dict)
    settings: Any = None  # the settings the step's selection used (the engine always provides them), else None
    token_fields: dict[str, torch.Tensor] = field(default_factory=dict)  # per-token inputs of the objective


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
            config: the engine always passes those its selection used (STARE's gate, W and M; the entropy
            controller's ratio in use; the optimizer step), so mask and loss read one set of settings. None: the
            loss reads the actor config (a direct call).
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
    given and aggregates with ``agg_loss(..., loss_agg_mode, **config.global_batch_info)``. Where the channel carries
    settings (the engine's: those the step's selection used), the objective applies them, not the config's.

    Returns ``(pg_loss, metrics)``: the objective's metrics, ``<prefix>selected_in_micro_batch``
    (tokens of this micro-batch's mask) and the selection figures under ``mode.metric_prefix``.
    """

    def compute(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights):
        provided = _current_mask(response_mask, mode.name, mode.no_mask_error)
        # the settings the step's selection used (engine/step.py); the config's only for a direct call
        settings = provided.settings if provided.settings is not None else mode.read_settings(config)
        pg_losses, metrics = mode.objective(old_log_prob, log_prob, advantages, response_mask, provided.mask,
                                            settings, **provided.token_fields)
        pg_loss = aggregate_policy_loss(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights)
        prefix = mode.metric_prefix
        metrics[f"{prefix}selected_in_micro_batch"] = float(provided.mask.sum().item())
        metrics.update({f"{prefix}{name}": float(value) for name, value in provided.figures.items()})
        return pg_loss, metrics

    loss = verl_policy_loss(mode.name, compute)
    loss.__doc__ = f"verl policy loss ``{mode.name}``: see :func:`global_policy_loss`."
    return loss


def aggregate_policy_loss(pg_losses: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str, config: Any,
                          rollout_is_weights: Optional[torch.Tensor]) -> torch.Tensor:
    """A per-token loss (batch, response_len) times ``rollout_is_weights`` when given, aggregated as verl's losses do:
    ``agg_loss(..., loss_agg_mode, **config.global_batch_info)``."""
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                    **config.global_batch_info)


def verl_policy_loss(name: str, compute: Callable[..., tuple[torch.Tensor, dict[str, Any]]]) -> Callable:
    """``compute`` behind verl's policy-loss signature (``ppo_loss`` passes the arguments by keyword), named
    ``compute_policy_loss_<name>``. ``compute(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
    config, rollout_is_weights)`` returns ``(pg_loss, metrics)``."""

    def compute_policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        return compute(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)

    compute_policy_loss.__name__ = compute_policy_loss.__qualname__ = f"compute_policy_loss_{name}"
    compute_policy_loss.__doc__ = compute.__doc__
    return compute_policy_loss


def dual_clip_ppo_losses(old_log_prob, log_prob, advantages, response_mask, settings):
    """verl's ``vanilla`` dual-clip PPO per-token loss (``core_algos.compute_policy_loss_vanilla``), and its metrics.

    With ``r = exp(clamp(logp - old_logp, -20, 20))``: ``l1 = max(-A r, -A clamp(r, 1 - clip_ratio_low,
    1 + clip_ratio_high))``; where ``A < 0``, ``min(l1, -A clip_ratio_c)`` (dual clip), else ``l1``; the clip knobs
    are ``settings``' fields of those names. All tensors (batch, response_len). Metrics ``actor/pg_clipfrac``,
    ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``: ``vanilla``'s.
    """
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = verl_F.masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - settings.clip_ratio_low, 1 + settings.clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = verl_F.masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * settings.clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = verl_F.masked_mean(
        torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask
    )
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return pg_losses, {"actor/pg_clipfrac": pg_clipfrac.detach().item(), "actor/ppo_kl": ppo_kl.detach().item(),
                       "actor/pg_clipfrac_lower": pg_clipfrac_lower.detach().item()}

