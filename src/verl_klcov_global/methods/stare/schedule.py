"""STARE's gate and weight schedule: what its reweighting does at a trainer step, from the batch's mean entropy.

Pure: floats in, floats out; nothing here knows verl. The rule is the authors' ``STAREController.update``
(hp-luo/STARE, ``verl/trainer/ppo/core_algos.py`` l.190-257 at bffb9e7; paper Sections 4.3 and 4.4), once per
trainer step, with ``H`` the mean old-policy entropy of the step's whole batch:

* the gate: ``gate_on = H < H_tgt``. While it is off every weight is 1 and STARE is the plain PPO surrogate;
* the schedule, only with ``adaptive`` and ``alpha != 0``: ``W <- clip(W + alpha * sgn(H_tgt - H), [1, w_max])``
  and ``M <- clip(M - alpha * sgn(H_tgt - H), [m_min, 1])``;
* a non-finite ``H`` changes nothing (the fork prints a warning and skips the update).

The state (:class:`StareState`) is a pure function of the steps before it, so a run resumed with it continues bit
for bit; the fork keeps it in the trainer object only, so a resumed fork run restarts ``W`` and ``M`` from the
configured values.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional

__all__ = ["StareSchedule", "StareState", "initial_state", "stare_update_rule", "update_stare_state"]


@dataclass(frozen=True)
class StareSchedule:
    """The rule's settings: ``target_entropy`` (nats per token), ``adaptive``, ``alpha`` (the step of ``W`` and
    ``M``), ``w_max`` and ``m_min`` (their bounds)."""

    target_entropy: float
    adaptive: bool = False
    alpha: float = 0.01
    w_max: float = 1.5
    m_min: float = 0.5


@dataclass(frozen=True)
class StareState:
    """The weights in use, the gate, the last entropy read (nan before the first) and the steps updated."""

    reweight_w: float
    reweight_m: float
    gate_on: bool
    entropy: float = math.nan
    steps: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StareState":
        return cls(reweight_w=float(data["reweight_w"]), reweight_m=float(data["reweight_m"]),
                   gate_on=bool(data["gate_on"]), entropy=float(data["entropy"]), steps=int(data["steps"]))


def initial_state(reweight_w: float, reweight_m: float) -> StareState:
    """The configured weights; the gate open, as the fork's controller starts (``gate_on = True``)."""
    return StareState(reweight_w=float(reweight_w), reweight_m=float(reweight_m), gate_on=True)


def _sign(x: float) -> float:
    return float((x > 0) - (x < 0))


def update_stare_state(state: StareState, entropy: float, schedule: StareSchedule) -> StareState:
    """One trainer step of the rule (module docstring) for the batch's mean entropy ``entropy``."""
    if not math.isfinite(entropy):
        return state
    gate_on = entropy < schedule.target_entropy
    w, m = state.reweight_w, state.reweight_m
    if schedule.adaptive and schedule.alpha != 0.0:
        sign = _sign(schedule.target_entropy - entropy)
        w = min(max(w + schedule.alpha * sign, 1.0), schedule.w_max)
        m = min(max(m - schedule.alpha * sign, schedule.m_min), 1.0)
    return replace(state, reweight_w=w, reweight_m=m, gate_on=gate_on, entropy=float(entropy), steps=state.steps + 1)


def schedule_of(settings: Any) -> StareSchedule:
    """The :class:`StareSchedule` of a :class:`verl_klcov_global.config.StareGlobalSettings`."""
    return StareSchedule(target_entropy=settings.target_entropy, adaptive=settings.adaptive, alpha=settings.alpha,
                         w_max=settings.w_max, m_min=settings.m_min)


def stare_update_rule(stored: Optional[dict[str, Any]], entropy: Optional[float],
                      settings: Any) -> tuple[dict[str, Any], Any, dict[str, float]]:
    """``stare_global``'s ``ModeSpec.update_rule``: the state kept in the optimizer (``stored``, None at first), the
    batch's old-policy entropy at the update's first optimizer step (None at the others: the state is read, not
    moved), the configured settings -> (the state to keep, the settings the step's loss applies, the figures).

    Without the schedule (``adaptive`` off) W and M are the configured ones at every step, also after a resume with
    other values; with it the kept W and M move, and a resumed run continues from them."""
    state = StareState.from_dict(stored) if stored is not None else initial_state(settings.reweight_w,
                                                                                   settings.reweight_m)
    if not settings.adaptive:
        state = replace(state, reweight_w=float(settings.reweight_w), reweight_m=float(settings.reweight_m))
    if entropy is not None:
        state = update_stare_state(state, entropy, schedule_of(settings))
    step_settings = replace(settings, reweight_w=state.reweight_w, reweight_m=state.reweight_m, gate_on=state.gate_on)
    figures = {"gate_on": float(state.gate_on), "reweight_w_in_use": state.reweight_w,
               "reweight_m_in_use": state.reweight_m, "target_entropy": float(settings.target_entropy)}
    if math.isfinite(state.entropy):
        figures["batch_entropy"] = state.entropy
    return state.to_dict(), step_settings, figures
