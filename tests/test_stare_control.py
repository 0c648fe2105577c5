"""stare_control.py against the authors' STAREController.update (hp-luo/STARE core_algos.py l.237-257 at bffb9e7),
transcribed here as the oracle, over entropy sequences that cross the target, sit on it and hold non-finite values."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from verl_klcov_global.methods.stare.schedule import StareSchedule, StareState, initial_state, update_stare_state


class ForkController:
    """The fork's controller, line for line (its print replaced by nothing)."""

    def __init__(self, target_entropy, reweight_w, reweight_m, adaptive=False, alpha=0.0, w_max=1.5, m_min=0.5):
        self.target_entropy, self.adaptive, self.alpha = float(target_entropy), bool(adaptive), float(alpha)
        self.w_max, self.m_min = float(w_max), float(m_min)
        self.reweight_w, self.reweight_m, self.gate_on, self.current_ent = float(reweight_w), float(reweight_m), True, \
            float("nan")

    def update(self, current_ent):
        if not np.isfinite(current_ent):
            return
        self.current_ent = float(current_ent)
        self.gate_on = bool(current_ent < self.target_entropy)
        if not self.adaptive or self.alpha == 0.0:
            return
        sign = float(np.sign(self.target_entropy - current_ent))
        self.reweight_w = float(np.clip(self.reweight_w + self.alpha * sign, 1.0, self.w_max))
        self.reweight_m = float(np.clip(self.reweight_m - self.alpha * sign, self.m_min, 1.0))


@pytest.mark.parametrize("adaptive,alpha", [(False, 0.01), (True, 0.0), (True, 0.01), (True, 0.2)])
def test_every_step_is_the_forks(adaptive, alpha):
    rng = random.Random(7)
    target = 0.3
    entropies = [rng.uniform(0.0, 0.6) for _ in range(200)] + [target, math.nan, math.inf, 0.1, -math.inf, 0.5]
    fork = ForkController(target, 1.1, 0.9, adaptive=adaptive, alpha=alpha)
    schedule = StareSchedule(target_entropy=target, adaptive=adaptive, alpha=alpha)
    state = initial_state(1.1, 0.9)
    assert state.gate_on and fork.gate_on  # both start open
    for entropy in entropies:
        fork.update(entropy)
        state = update_stare_state(state, entropy, schedule)
        assert (state.reweight_w, state.reweight_m, state.gate_on) == (fork.reweight_w, fork.reweight_m, fork.gate_on)
        if math.isfinite(entropy):
            assert state.entropy == fork.current_ent
    if adaptive and alpha:
        assert state.reweight_w in (1.0, 1.5) or 1.0 < state.reweight_w < 1.5
    assert state.steps == sum(math.isfinite(e) for e in entropies)


def test_the_gate_is_strict_and_a_state_round_trips():
    schedule = StareSchedule(target_entropy=0.3)
    state = update_stare_state(initial_state(1.1, 0.9), 0.3, schedule)
    assert not state.gate_on  # H = H_tgt: closed (the fork's '<')
    assert StareState.from_dict(state.to_dict()) == state
    unchanged = update_stare_state(state, math.nan, schedule)
    assert unchanged == state


# ---------------------------------------------------------------------------------------------
# The mode's update rule (ModeSpec.update_rule): what the engine calls at every optimizer step


def _settings(**overrides):
    from verl_klcov_global.config import StareGlobalPolicyLossConfig, read_stare_settings
    from verl_klcov_global.lab.tiny import make_actor_config

    return read_stare_settings(make_actor_config(policy_loss=StareGlobalPolicyLossConfig(**overrides)))


def test_the_rule_moves_the_state_only_at_an_updates_first_step():
    from verl_klcov_global.methods.stare.schedule import stare_update_rule

    settings = _settings(stare_adaptive=True, stare_target_entropy=0.3)
    state, step, figures = stare_update_rule(None, 0.2, settings)  # first step: H below the target
    assert step.gate_on and step.reweight_w == pytest.approx(1.11) and step.reweight_m == pytest.approx(0.89)
    assert figures == {"gate_on": 1.0, "reweight_w_in_use": step.reweight_w, "reweight_m_in_use": step.reweight_m,
                       "target_entropy": 0.3, "batch_entropy": 0.2}
    again, step_again, _ = stare_update_rule(state, None, settings)  # a later step of the same update: read only
    assert again == state and step_again == step
    closed, step_closed, _ = stare_update_rule(state, 0.5, settings)
    assert not step_closed.gate_on and closed["steps"] == 2 and step_closed.reweight_w == pytest.approx(1.10)


def test_without_the_schedule_the_configured_weights_apply_also_after_a_resume():
    from verl_klcov_global.methods.stare.schedule import stare_update_rule

    kept = {"reweight_w": 1.4, "reweight_m": 0.6, "gate_on": False, "entropy": 0.5, "steps": 7}
    state, step, _ = stare_update_rule(kept, None, _settings(stare_reweight_w=1.2))
    assert (step.reweight_w, step.reweight_m, step.gate_on) == (1.2, 0.9, False)  # the gate is the kept one
    assert state["steps"] == 7


def test_a_nonfinite_batch_entropy_leaves_the_state_as_the_fork_does():
    from verl_klcov_global.methods.stare.schedule import stare_update_rule

    state, _, _ = stare_update_rule(None, 0.2, _settings())
    assert stare_update_rule(state, math.nan, _settings())[0] == state
