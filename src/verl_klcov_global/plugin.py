"""Entry point (group ``verl.plugins``): registers every mode of the table as a verl loss, installs the patches.

verl 0.9.x imports this module on ``import verl`` in every process (driver, TaskRunner, Ray
workers); ``VERL_USE_EXTERNAL_MODULES`` and ``external_lib`` import the package, which imports
this module. Importing or calling :func:`install` again is harmless.
"""

from __future__ import annotations

from verl.trainer.ppo.core_algos import register_policy_loss

from . import loss, seams
from .engine import patches
from .methods import register_built_in_modes
from .modes import MODES


def register_losses() -> None:
    """Register ``mode.policy_loss`` under ``mode.name`` in verl's policy-loss registry, for every mode of the table.

    The one registration route: verl's own ``register_policy_loss`` decorator. The built-in methods' rows join the
    table first (:func:`verl_klcov_global.methods.register_built_in_modes`): verl may load this entry point while the
    package itself is still importing.
    """
    register_built_in_modes()
    for mode in MODES.values():
        register_policy_loss(mode.name)(mode.policy_loss)


def install() -> None:
    """Register the losses and install the patches of :data:`verl_klcov_global.engine.patches.PATCHES` (idempotent)."""
    seams.check_seams()  # cached after the package's import-time check; raises VerlSeamError naming a moved seam
    register_losses()
    try:
        patches.install()
    except Exception as error:
        # verl logs entry-point failures at DEBUG only: keep the cause for the loss's error message.
        loss.record_hook_install_error(error)
        raise


install()
