"""The entropy controller in verl's engine: one step of its law per optimizer step, its state kept per engine.

:func:`steer` runs inside the prepass (:mod:`.prepass`), after the forward and before the selection, when the
mode's settings carry ``entropy_control``; the law itself is :mod:`verl_klcov_global.entropy_control`.

Where the state lives: in the engine's optimizer, as the entry :data:`STATE_KEY` of its first parameter
group (a plain dict: the controlled knob's name, ``ln r`` of the ratio in use, the steps controlled and, with a
prediction horizon, the last measured entropies). So:

* one state per engine: ``diagnose`` and a fused actor/ref worker hold several engines in one process, and
  each trains with its own optimizer (a reference engine has none and never trains);
* it is saved and loaded with the optimizer, by verl's own checkpoint manager: torch's
  ``Optimizer.state_dict()`` keeps every key of a parameter group and ``load_state_dict`` restores it, and
  verl's FSDP checkpoint manager saves ``optimizer.state_dict()`` per rank (``checkpoint.save_contents``
  with ``optimizer``, verl's default). A run resumed from such a checkpoint continues bit for bit.
  Without the optimizer in ``checkpoint.save_contents`` / ``load_contents`` (then Adam's moments restart
  too), a resumed run starts the controller again from the configured ratio: the driver warns
  (:mod:`verl_klcov_global.guardrails`, ``entropy-control-not-checkpointed``);
* every data-parallel rank holds the same state: the law reads only group-wide figures.

A state saved for another knob (a checkpoint of another mode) is not used: the controller starts again from
the configured ratio, with a warning.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist
from verl.workers.engine.base import BaseEngine

from ..entropy_control import (
    ControlDecision, ControllerState, check_ratio_within_bounds, decide, measure_entropy, settle,
)
from ..guardrails import GuardrailWarning
from ..layout import MinibatchFields
from ..modes import ModeSpec, Selection

__all__ = ["STATE_KEY", "Steering", "check_target_below_max_entropy", "controller_state", "first_param_group",
           "settle_after_selection",
           "steer", "store_controller_state"]

#: The optimizer parameter-group entry that carries the controller's state.
STATE_KEY = "verl_klcov_global_entropy_control"


def first_param_group(engine: BaseEngine) -> dict:
    """The engine's optimizer's first parameter group, where the plugin keeps per-engine state that verl's
    checkpoints must carry (the controller's, :data:`STATE_KEY`; a mode's update rule's, :mod:`.schedule`; the
    optimizer step count of a per-step draw, :mod:`.step_count`)."""
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None or not optimizer.param_groups:
        raise RuntimeError("the entropy controller, a mode's once-per-trainer-step rule and a per-step draw keep their "
                           "state in the actor's optimizer, and this engine has "
                           f"none ({type(engine).__name__}): it trains no parameters")
    return optimizer.param_groups[0]


def controller_state(engine: BaseEngine, mode: ModeSpec, settings: Any) -> ControllerState:
    """The engine's controller state; a fresh one (the user's ratio) if it has none. The user's ratio must lie
    within the bounds (ValueError naming the keys, as the driver's check)."""
    control = settings.entropy_control
    configured = getattr(settings, mode.ratio_knob)
    check_ratio_within_bounds(mode.ratio_knob, configured, control)
    stored = first_param_group(engine).get(STATE_KEY)
    if stored is not None and stored.get("knob") == mode.ratio_knob:
        return ControllerState.from_dict(stored)  # the law keeps it within the user's ratio and the bound
    if stored is not None:
        warnings.warn(GuardrailWarning(
            f"verl-klcov-global: the optimizer carries an entropy-controller state for {stored.get('knob')!r} "
            f"(another mode's checkpoint?), not {mode.ratio_knob!r}: {mode.name}'s controller starts again from "
            f"the configured {mode.ratio_knob}"), stacklevel=2)
    return ControllerState(knob=mode.ratio_knob, log_ratio=math.log(configured))


def store_controller_state(engine: BaseEngine, state: ControllerState) -> None:
    """Write ``state`` into the engine's optimizer (saved with it by verl's checkpoint manager)."""
    first_param_group(engine)[STATE_KEY] = state.to_dict()


def check_target_below_max_entropy(engine: BaseEngine, target: float) -> None:
    """Raise ``ValueError`` when ``target`` >= ln(vocabulary size) of the engine's model: no policy reaches it.

    The driver checks this before Ray when ``actor_rollout_ref.model.path`` is a local directory; this is the
    check for every other path (and the lab), at every controlled step, so at the first one. Models whose
    config has no ``vocab_size`` are not checked.
    """
    hf_config = getattr(getattr(engine, "model_config", None), "hf_config", None)
    vocab_size = getattr(hf_config, "vocab_size", None)
    if isinstance(vocab_size, int) and vocab_size > 1 and target >= math.log(vocab_size):
        raise ValueError(
            f"entropy_target={target!r} nats is not below ln(vocabulary size) = ln({vocab_size}) = "
            f"{math.log(vocab_size):.4g}, the entropy of a uniform policy: no policy reaches it. Set "
            "actor_rollout_ref.actor.policy_loss.entropy_target below that (e.g. the entropy your runs start at)")


@dataclass(frozen=True)
class Steering:
    """One controlled optimizer step: the settings its selection uses (``ratio_knob`` = the ratio in use),
    the law's decision, and the state before it."""

    settings: Any
    decision: ControlDecision
    state: ControllerState

    def figures(self, mode: ModeSpec) -> dict[str, float]:
        return self.decision.figures(mode.ratio_knob, self.settings.entropy_control.target)


def steer(engine: BaseEngine, mode: ModeSpec, settings: Any, fields: MinibatchFields,
          group: Optional[dist.ProcessGroup]) -> Steering:
    """Before the selection: measure ``H`` over the minibatch and the group, decide this step's ratio."""
    control = settings.entropy_control
    check_target_below_max_entropy(engine, control.target)
    state = controller_state(engine, mode, settings)
    entropy, num_valid = measure_entropy(fields.entropy, fields.response_mask, control, group)
    decision = decide(state, entropy, num_valid, control, mode.entropy_sign, getattr(settings, mode.ratio_knob))
    return Steering(settings=dataclasses.replace(settings, **{mode.ratio_knob: decision.ratio_in_use}),
                    decision=decision, state=state)


def settle_after_selection(engine: BaseEngine, mode: ModeSpec, steering: Steering, selection: Selection) -> None:
    """After the selection: the next state (anti-wind-up from the selection's ``N`` and reach), stored."""
    store_controller_state(engine, settle(steering.state, steering.decision, steering.settings.entropy_control,
                                          selection.num_valid, mode.selection_reach(selection), mode.entropy_sign))
