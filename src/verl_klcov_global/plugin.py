"""Entry point (group ``verl.plugins``): registers the losses and installs the engine hook.

verl 0.9.x imports this module on ``import verl`` in every process (driver,
TaskRunner, Ray workers). Importing or calling :func:`install` again is harmless.
"""

from __future__ import annotations

from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

from . import hook, loss, seams
from .config import CLIP_COV_LOSS_MODE, LOSS_MODE
from .loss import compute_policy_loss_clip_cov_global, compute_policy_loss_kl_cov_global


def install() -> None:
    """Register ``kl_cov_global`` and ``clip_cov_global`` in verl's policy-loss registry, install the hooks (idempotent).

    The hooks: PATCH ``train_batch_prepass`` (every process that trains) and PATCH
    ``validate_config_driver_checks`` (used by the driver: knob checks and worker loading before Ray starts).
    """
    seams.check_seams()  # raises VerlSeamError naming any verl seam that moved
    POLICY_LOSS_REGISTRY[LOSS_MODE] = compute_policy_loss_kl_cov_global
    POLICY_LOSS_REGISTRY[CLIP_COV_LOSS_MODE] = compute_policy_loss_clip_cov_global
    try:
        hook.install_hook()
        hook.install_driver_checks()
    except Exception as error:
        # verl logs entry-point failures at DEBUG only: keep the cause for the loss's error message.
        loss.record_hook_install_error(error)
        raise


install()
