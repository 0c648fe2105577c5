"""The catalogue of every verl patch the plugin applies, and their install/uninstall.

Targets: verl 0.9.1 and 0.8.0 (line references are 0.9.1's). The signatures each patch rests on
are checked once, at import, by :mod:`verl_klcov_global.seams` (a moved seam raises
``VerlSeamError`` naming it before anything is patched); nothing here re-checks them.
:data:`PATCHES` lists them all, as Liger's ``monkey_patch.py`` lists its patches:

* ``train_batch_prepass`` (every process that trains): wraps
  ``verl.workers.engine.base.BaseEngine.train_batch(self, data, loss_function)``
  (``workers/engine/base.py`` ~113, inherited by every engine) with
  :func:`.step.train_batch_with_prepass`. Installed by :func:`install_hook`.
* ``validate_config_driver_checks`` (the driver): wraps
  ``verl.utils.config.validate_config(config, use_reference_policy, use_critic)``, which
  ``main_ppo`` (and ``main_ppo_v0``) calls before ``ray.init`` (verl 0.9; in 0.8 in the TaskRunner),
  so that :func:`verl_klcov_global.driver.prepare_trainer_config` checks the knobs on the raw
  config and adds the worker loader to the Ray runtime environment first. Installed by
  :func:`install_driver_checks`.
* ``prepass_batched_logsumexp`` (during the prepass only): swaps
  ``verl.utils.torch_functional.logprobs_from_logits_v2(logits, labels)`` inside
  :func:`.prepass.compute_prepass_log_probs`; see :mod:`.logprobs`.

The CPU platform that ``diagnose`` and the tests use patches verl and torch too; those patches
are the lab's, never applied by the plugin, and listed in :mod:`verl_klcov_global.lab.cpu`.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any, Callable

from tensordict import TensorDict
from verl.workers.engine.base import BaseEngine

from .. import driver
from .step import train_batch_with_prepass

__all__ = ["PATCHES", "Patch", "install", "install_driver_checks", "install_hook", "is_hook_installed",
           "uninstall_hook"]

#: Attribute of a wrapper holding verl's original function (also how "already installed" is seen).
ORIGINAL_ATTR = "__verl_klcov_global_original__"


@dataclass(frozen=True)
class Patch:
    """One verl patch: its name, what it replaces, the seam that guards it, where it applies."""

    name: str
    target: str
    seam: str  # the :data:`verl_klcov_global.seams.SEAMS` entry that checks the target's signature
    scope: str
    implementation: str


PATCHES: tuple[Patch, ...] = (
    Patch("train_batch_prepass", "verl.workers.engine.base.BaseEngine.train_batch",
          "verl.workers.engine.base.BaseEngine.train_batch(self, data, loss_function)",
          "every process that imports the plugin (permanent)", "engine.step.train_batch_with_prepass"),
    Patch("validate_config_driver_checks", "verl.utils.config.validate_config (and main_ppo's imported copy)",
          "verl.utils.config.validate_config(config, use_reference_policy, use_critic)",
          "every process that imports the plugin; acts where main_ppo validates (permanent)",
          "driver.prepare_trainer_config"),
    Patch("prepass_batched_logsumexp", "verl.utils.torch_functional.logprobs_from_logits_v2",
          "verl.utils.torch_functional.logprobs_from_logits_v2(logits, labels)",
          "inside the no-grad prepass forward only, restored afterwards", "engine.logprobs.batched_logsumexp"),
)


def install() -> None:
    """Install the permanent patches (idempotent): ``train_batch_prepass`` and ``validate_config_driver_checks``."""
    install_hook()
    install_driver_checks()


def install_hook() -> None:
    """Install PATCH ``train_batch_prepass`` (idempotent)."""
    current = BaseEngine.train_batch
    if getattr(current, ORIGINAL_ATTR, None) is not None:
        return

    @functools.wraps(current)
    def train_batch(self, data: TensorDict, loss_function: Callable) -> Any:
        return train_batch_with_prepass(current, self, data, loss_function)

    setattr(train_batch, ORIGINAL_ATTR, current)
    BaseEngine.train_batch = train_batch


def is_hook_installed() -> bool:
    """True when PATCH ``train_batch_prepass`` is active in this process."""
    return getattr(BaseEngine.train_batch, ORIGINAL_ATTR, None) is not None


def uninstall_hook() -> None:
    """Restore verl's own ``BaseEngine.train_batch`` (for tests)."""
    original = getattr(BaseEngine.train_batch, ORIGINAL_ATTR, None)
    if original is not None:
        BaseEngine.train_batch = original


def install_driver_checks() -> None:
    """Install PATCH ``validate_config_driver_checks`` (idempotent).

    The plugin is imported on ``import verl``, before ``main_ppo`` runs ``from verl.utils.config
    import validate_config``, so ``main_ppo`` gets the wrapper; a ``verl.trainer.main_ppo`` (or
    ``main_ppo_v0``, or ``__main__``) module imported earlier is updated too.
    """
    import verl.utils.config as verl_config

    current = verl_config.validate_config
    if getattr(current, ORIGINAL_ATTR, None) is not None:
        return

    @functools.wraps(current)
    def validate_config(config, *args, **kwargs):
        driver.prepare_trainer_config(config)
        return current(config, *args, **kwargs)

    setattr(validate_config, ORIGINAL_ATTR, current)
    verl_config.validate_config = validate_config
    for name in ("verl.trainer.main_ppo", "verl.trainer.main_ppo_v0", "__main__"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "validate_config", None) is current:
            module.validate_config = validate_config
