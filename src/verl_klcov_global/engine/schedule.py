"""Per-trainer-step rules in verl's engine: a mode's state moved once per update, from the batch's old-policy entropy.

A mode whose row has an ``update_rule`` (``stare_global``: STARE's gate and adaptive W/M) reads, once per trainer
step, the old policy's entropy over the step's whole batch (:mod:`.batch_entropy`: verl's ``actor/entropy``,
agreed over the data-parallel group). :func:`settings_for_step` runs at every optimizer step, before the prepass:

* at the update's first optimizer step (a new log-prob pass on every rank) the rule moves the state with that
  entropy;
* at the others (further minibatches, PPO epochs) it reads the state unchanged,

and returns the settings the step's loss applies (handed to every micro-batch's loss with its mask slice,
:func:`verl_klcov_global.loss.provide_selection_mask`) and the figures to log.

Where the state lives: the entry :data:`RULE_STATE_KEY` of the engine's optimizer's first parameter group, as the
entropy controller's (:mod:`.control`): saved and loaded with the optimizer by verl's checkpoint manager, so a
resumed run continues exactly; the same on every rank (every rank computes it from the same agreed integers). A
state kept for another mode is not used (the rule starts again from the configured values).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from verl.workers.engine.base import BaseEngine

from ..modes import ModeSpec
from . import batch_entropy
from .control import first_param_group

__all__ = ["RULE_STATE_KEY", "settings_for_step"]

#: The optimizer parameter-group entry that carries a mode's per-trainer-step state.
RULE_STATE_KEY = "verl_klcov_global_update_rule"


def settings_for_step(engine: BaseEngine, mode: ModeSpec, settings: Any) -> tuple[Any, dict[str, float]]:
    """This optimizer step's settings and figures under ``mode.update_rule`` (module docstring). Collective over the
    data-parallel group (:func:`.batch_entropy.agree`): call it on every rank at every optimizer step."""
    group = engine.get_data_parallel_group() if dist.is_available() and dist.is_initialized() else None
    update = batch_entropy.agree(engine, group, mode.name)
    entropy = None
    if update.first:
        entropy = batch_entropy.mean_entropy(update.sums, settings.loss_agg_mode, settings.loss_scale_factor)
    param_group = first_param_group(engine)
    stored = param_group.get(RULE_STATE_KEY)
    state = stored.get("state") if isinstance(stored, dict) and stored.get("mode") == mode.name else None
    new_state, step_settings, figures = mode.update_rule(state, entropy, settings)
    param_group[RULE_STATE_KEY] = {"mode": mode.name, "state": new_state}
    return step_settings, figures
