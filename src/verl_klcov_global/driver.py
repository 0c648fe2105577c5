"""The driver's part: check a trainer config before Ray starts, and make every Ray process load the plugin.

verl's ``main_ppo`` composes the Hydra config, calls ``verl.utils.config.validate_config`` in the
driver, and only then starts Ray (``run_ppo``: ``ray.init`` with ``ray_kwargs.ray_init``, then the
TaskRunner, the rollout and the workers). PATCH ``validate_config_driver_checks`` (in
:mod:`verl_klcov_global.engine.patches`, where every patch is listed) calls :func:`prepare_trainer_config`
first. When the config selects a mode of the table (:mod:`verl_klcov_global.modes`) it:

1. checks every knob of that mode (its ``ModeSpec.read_settings``) on the raw config values, before Hydra's conversion to verl's
   dataclasses can coerce them (``true`` -> 1.0, ``false`` -> 0.0): booleans, strings and
   non-finite numbers are rejected, and the error names the key and a good value. The same
   checks run on every route: verl's own ``PolicyLossConfig`` (a plain ``loss_mode=`` override),
   the plugin's configs (``verl_klcov_global/configs``), or ``policy_loss._target_`` set by hand. It also rejects an actor strategy
   the prepass does not cover (Megatron); then the whole-config findings of
   :mod:`verl_klcov_global.guardrails` (combinations that would void or misread the mode): its
   errors raise :class:`TrainerConfigError`, its warnings are
   :class:`~verl_klcov_global.guardrails.GuardrailWarning` (``warnings.warn``; the run goes on);
2. adds to the Ray runtime environment that ``run_ppo`` passes to ``ray.init`` (and so to the
   TaskRunner and every worker):

   * ``py_modules``: :data:`WORKER_LOADER_DIR`, a one-file module that Ray ships with the job,
     so it exists in every Ray process even where this package is not installed;
   * ``env_vars.VERL_USE_EXTERNAL_MODULES``: the modules already named there or in the driver's
     environment, plus :data:`WORKER_LOADER_MODULE`; ``import verl`` imports it in every Ray
     process (verl 0.8 and 0.9), and it imports this plugin, or raises an ``ImportError`` that
     says how to install it. That process, the TaskRunner first, fails to start: the run stops
     before a model, a rollout engine or a batch is loaded;
   * ``env_vars.VERL_KLCOV_GLOBAL_REQUIRED_BY``: which setting needs the plugin, and
     ``env_vars.VERL_KLCOV_GLOBAL_INSTALL_HINT``: :data:`~verl_klcov_global.install_hint.INSTALL_HINT`,
     for that message (the loader cannot import it from a process that lacks the plugin).

Set ``VERL_KLCOV_GLOBAL_AUTOLOAD=0`` in the driver's environment to skip step 2 (the knob checks
still run). Ray clusters started before the driver (``ray.init`` called by your own code) do not
take a runtime environment from verl's config: the driver warns, and the workers need the plugin
installed (entry point, verl 0.9) or ``VERL_USE_EXTERNAL_MODULES=verl_klcov_global`` in their
environment.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf, open_dict

from . import guardrails
from .entropy_control import check_ratio_within_bounds
from .mode_config import SUPPORTED_STRATEGIES, unsupported_strategy_message
from .modes import global_mode_of
from .install_hint import INSTALL_HINT

#: Module that :func:`prepare_trainer_config` ships to every Ray process and names in
#: ``VERL_USE_EXTERNAL_MODULES``.
WORKER_LOADER_MODULE = "verl_klcov_global_loader"
#: Its directory (a package), given to Ray as a ``py_modules`` entry.
WORKER_LOADER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_loader", WORKER_LOADER_MODULE)
EXTERNAL_MODULES_ENV = "VERL_USE_EXTERNAL_MODULES"
REQUIRED_BY_ENV = "VERL_KLCOV_GLOBAL_REQUIRED_BY"
INSTALL_HINT_ENV = "VERL_KLCOV_GLOBAL_INSTALL_HINT"
AUTOLOAD_ENV = "VERL_KLCOV_GLOBAL_AUTOLOAD"
MESSAGE_PREFIX = "verl-klcov-global"
#: The driver's messages: INFO (what was checked and shipped; ``main_ppo``'s Hydra logging shows INFO on the
#: console) and WARNING (visible even where logging is not configured).
logger = logging.getLogger(__name__)


class TrainerConfigError(ValueError):
    """A trainer config selects a plugin loss mode with a setting the plugin cannot run."""


def check_trainer_config(config: DictConfig, *, warn: bool = True) -> Optional[str]:
    """Check the plugin's knobs in a composed trainer config; return the plugin loss mode it selects, or None.

    ``config``: the root ``DictConfig`` ``main_ppo`` gets from Hydra (``actor_rollout_ref.actor`` is read).
    Raises :class:`TrainerConfigError` naming the key to change. ``warn=False``: the errors only (no
    :class:`~verl_klcov_global.guardrails.GuardrailWarning`).
    """
    actor = OmegaConf.select(config, "actor_rollout_ref.actor", default=None)
    mode = global_mode_of(actor) if actor is not None else None
    if mode is None:
        return None
    try:
        settings = mode.read_settings(actor)
        control = getattr(settings, "entropy_control", None)
        if control is not None:
            check_ratio_within_bounds(mode.ratio_knob, getattr(settings, mode.ratio_knob), control)
    except ValueError as error:
        raise TrainerConfigError(f"{MESSAGE_PREFIX}: loss_mode={mode.name}: {error}") from None
    strategy = actor.get("strategy", None)
    if strategy not in SUPPORTED_STRATEGIES:
        raise TrainerConfigError(f"{MESSAGE_PREFIX}: " + unsupported_strategy_message(
            mode.name, mode.upstream, f"actor_rollout_ref.actor.strategy is {strategy!r}"))
    # Whole-config findings (guardrails.py): errors raise here, warnings go to warnings.warn.
    found = guardrails.findings(config)
    guardrails.report(found if warn else [f for f in found if f.severity == guardrails.ERROR], TrainerConfigError)
    return mode.name


def check_in_trainer(config: Any) -> Optional[str]:
    """The error-level checks of :func:`check_trainer_config`, where verl's trainer is built (PATCH
    ``trainer_config_checks``: ``RayPPOTrainer`` and the v1 ``PPOTrainer``, in the TaskRunner).

    A recipe's or a user's own entry point that never calls ``validate_config`` builds one of these trainers,
    with the whole config, before any worker or forward: it gets the same errors as ``main_ppo``. The warnings
    come from the driver's check only (where both run, they are not said twice). A config that is not a
    ``DictConfig`` is left alone (returns None).
    """
    if not isinstance(config, DictConfig):
        return None
    return check_trainer_config(config, warn=False)


def _names(value: Any) -> list[str]:
    return [name.strip() for name in str(value or "").split(",") if name.strip()]


def add_worker_loading(config: DictConfig, mode: str) -> bool:
    """Add the worker loader to ``config.ray_kwargs.ray_init.runtime_env`` (idempotent). False when skipped."""
    if os.environ.get(AUTOLOAD_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        logger.warning(f"{MESSAGE_PREFIX}: Ray is already initialised (an existing cluster, or verl 0.8, whose "
                       f"main_ppo validates the config in the TaskRunner), so verl will not pass its runtime_env to "
                       f"ray.init: the workers load the plugin only if it is installed there (entry point, verl 0.9) "
                       f"or {EXTERNAL_MODULES_ENV}=verl_klcov_global is in their environment.")
    with open_dict(config):
        if OmegaConf.select(config, "ray_kwargs.ray_init.runtime_env", default=None) is None:
            OmegaConf.update(config, "ray_kwargs.ray_init.runtime_env", {}, force_add=True)
        runtime_env = config.ray_kwargs.ray_init.runtime_env
        with open_dict(runtime_env):
            if runtime_env.get("env_vars", None) is None:
                runtime_env.env_vars = {}
            if runtime_env.get("py_modules", None) is None:
                runtime_env.py_modules = []
            env_vars = runtime_env.env_vars
            with open_dict(env_vars):
                # A runtime_env variable replaces the inherited one in the workers: keep what was there.
                modules = _names(env_vars.get(EXTERNAL_MODULES_ENV, None) or os.environ.get(EXTERNAL_MODULES_ENV))
                if WORKER_LOADER_MODULE not in modules:
                    modules.append(WORKER_LOADER_MODULE)
                env_vars[EXTERNAL_MODULES_ENV] = ",".join(modules)
                from . import __version__

                env_vars[REQUIRED_BY_ENV] = (f"actor_rollout_ref.actor.policy_loss.loss_mode={mode} "
                                             f"(driver: verl-klcov-global {__version__})")
                env_vars[INSTALL_HINT_ENV] = INSTALL_HINT
            if WORKER_LOADER_DIR not in list(runtime_env.py_modules):
                runtime_env.py_modules.append(WORKER_LOADER_DIR)
    return True


def prepare_trainer_config(config: Any) -> Optional[str]:
    """:func:`check_trainer_config`, then :func:`add_worker_loading` when a plugin mode is selected.

    Any object that is not a ``DictConfig`` is left alone (returns None). Logs one INFO line saying
    what was checked and added (logger ``verl_klcov_global.driver``).
    """
    if not isinstance(config, DictConfig):
        return None
    mode = check_trainer_config(config)
    if mode is None:
        return None
    shipped = add_worker_loading(config, mode)
    logger.info(f"{MESSAGE_PREFIX}: loss_mode={mode}: knobs checked in the driver; "
                + (f"every Ray process will import {WORKER_LOADER_MODULE} ({EXTERNAL_MODULES_ENV}, runtime_env "
                   "py_modules), which loads the plugin or stops that process with the fix"
                   if shipped else f"worker loading skipped ({AUTOLOAD_ENV}=0)"))
    return mode
