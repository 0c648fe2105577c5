"""Closed-loop entropy control: the law that moves a global mode's strength knob toward an entropy target.

Pure: tensors and floats in, floats out; nothing here knows verl. The engine (:mod:`.engine.control`) keeps
the state per engine, runs :func:`measure_entropy` and :func:`decide` before each optimizer step's
selection, hands the selection the ratio in use, and :func:`settle` after it.

The law, once per optimizer step (``r`` the controlled ratio: ``kl_cov_ratio``, ``clip_cov_ratio`` or
``entropy_top_ratio``; ``s`` the mode's sign: +1 where a larger ratio keeps entropy higher, -1 where it
lowers it; ``u`` the integral state, ``ln r``):

1. ``H`` = the token mean of the current-policy entropy over the minibatch's valid response tokens on every
   data-parallel rank (exact 64-bit fixed-point sum, :func:`.selection.collectives.agree_and_mean`): the
   same bits for any micro-batch or DP split of the same minibatch and parameters;
2. the error ``e = (H* - Ĥ) / max(H*, Ĥ)``, in [-1, 1]: the relative gap to the target ``H*``, bounded so
   that one step moves ``ln r`` by at most ``ki + kp``. ``Ĥ`` is ``H`` itself unless a horizon is set
   (``entropy_control_horizon`` ``h`` > 0 optimizer steps): then ``Ĥ = H + h * (H - H_{-k}) / k``, the entropy
   extrapolated ``h`` steps ahead along its mean change over the last ``k`` measured steps (``k`` =
   ``entropy_control_window``; ``Ĥ = H`` while fewer than ``k`` steps are measured), floored at 0. Why:
   these methods slow a fall of entropy far more than they reverse one, so a law that reads only ``H``
   keeps the method weak until the target is reached and then cannot stop the collapse already under way
   (docs/EVIDENCE.md, the miniature's attempts); the prediction strengthens the method while entropy is
   still above the target but falling towards it fast, and at rest (no change) it reads ``H``, so the
   target it holds is the same;
3. PI in log space (multiplicative in ``r``): ``u' = clamp(u + s * ki * e)``, and the ratio in use this
   step ``r = exp(clamp(u' + s * kp * e))``, both clamped to ``[ln min_ratio, ln max_ratio]``. The
   proportional term carries the loop: entropy integrates the knob's effect (the knob sets how fast
   entropy moves, not where it is), so ``kp`` sets how fast the entropy closes on the target (a
   first-order approach) and the integral only removes what is left;
4. after the selection, anti-wind-up by conditional integration (:func:`settle`): the step's integration
   is undone when the ratio in use already lay at or beyond an edge of the range where the ratio acts and
   the integration pushed further that way. The range: from ``max(1 / N, min_ratio)`` (``N`` the
   selection's valid tokens: below ``1 / N`` the quota ``max(1, int(N r))`` is 1 whatever ``r``) to
   ``min(reach / N, max_ratio)`` (``reach``: the most tokens the selection can take, ``N``, or Clip-Cov's
   candidates: beyond it a larger quota selects nothing more). With no valid token or nothing within
   reach the integral does not move.

The state (``u``, a step count and, with a horizon, the last ``k`` measured ``H``) is a pure function of the
steps before it, so a run resumed from a checkpoint that carries it continues bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from .selection.collectives import agree_and_mean
from .selection.knobs import POLICY_LOSS, finite_number, setting

__all__ = [
    "CONTROL_KNOBS", "DEFAULT_WINDOW", "ControlDecision", "ControllerState", "EntropyControlSettings", "clamp_start",
    "decide", "measure_entropy", "predict_entropy", "relative_error", "settle", "validate_entropy_control",
]

#: The controller's knobs under ``actor_rollout_ref.actor.policy_loss.`` (every mode's).
#: The trend's window when a horizon is set and no window is given (optimizer steps; see the config classes).
DEFAULT_WINDOW = 8

CONTROL_KNOBS = ("entropy_target", "entropy_control_ki", "entropy_control_kp", "entropy_control_min_ratio",
                 "entropy_control_max_ratio", "entropy_control_horizon", "entropy_control_window")


@dataclass(frozen=True)
class EntropyControlSettings:
    """Validated controller knobs (:func:`validate_entropy_control`).

    ``target``: ``H*``, nats per valid response token; ``ki``, ``kp``: the integral and proportional gains
    (change of ``ln r`` per optimizer step per unit of error); ``min_ratio`` < ``max_ratio``: the bounds of
    the controlled ratio, in (0, 1]; ``horizon``: optimizer steps ahead the error reads the entropy
    extrapolated to (0: the measured entropy itself); ``window``: measured steps its trend is taken over.
    """

    target: float
    ki: float
    kp: float
    min_ratio: float
    max_ratio: float
    horizon: float = 0.0
    window: int = DEFAULT_WINDOW

    def agreed(self) -> dict[str, float]:
        """The knobs every data-parallel rank must hold the same values of (their ``policy_loss`` names)."""
        return dict(zip(CONTROL_KNOBS, (self.target, self.ki, self.kp, self.min_ratio, self.max_ratio,
                                        self.horizon, float(self.window))))


@dataclass(frozen=True)
class ControllerState:
    """What the controller carries from one optimizer step to the next.

    ``knob``: the controlled ratio's name; ``log_ratio``: the integral state ``u = ln r``; ``steps``: optimizer
    steps controlled so far; ``recent``: with a horizon, the measured ``H`` of the last ``window`` steps that
    had valid tokens, oldest first (empty without one). A state saved without ``recent`` (0.5.0 to 0.6.0)
    loads with none: the trend starts again.
    """

    knob: str
    log_ratio: float
    steps: int = 0
    recent: tuple[float, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        state = {"knob": self.knob, "log_ratio": self.log_ratio, "steps": self.steps}
        if self.recent:
            state["recent"] = list(self.recent)
        return state

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> "ControllerState":
        return cls(knob=str(state["knob"]), log_ratio=float(state["log_ratio"]), steps=int(state["steps"]),
                   recent=tuple(float(h) for h in state.get("recent", ())))


@dataclass(frozen=True)
class ControlDecision:
    """One optimizer step's law (:func:`decide`), before the selection.

    ``entropy``: ``H`` (nan without valid tokens); ``num_valid``: the tokens ``H`` averages over the group;
    ``error``: ``e`` (0 without valid tokens); ``integral``: ``u'``; ``ratio_in_use``: the ratio the step's
    selection uses; ``predicted``: ``Ĥ`` with a horizon (None without one, or without valid tokens).
    """

    entropy: float
    num_valid: int
    error: float
    integral: float
    ratio_in_use: float
    predicted: Optional[float] = None

    def figures(self, knob: str, target: float) -> dict[str, float]:
        """The step's controller figures, for logging (names without a prefix); no NaN."""
        figures = {"entropy_target": target, f"{knob}_in_use": self.ratio_in_use}
        if self.num_valid:
            figures["entropy_measured"] = self.entropy
        if self.predicted is not None:
            figures["entropy_predicted"] = self.predicted
        return figures


def _positive_ratio_bound(value: Any, key: str, example: str) -> float:
    number = finite_number(value)
    if number is None or not (0.0 < number <= 1.0):
        raise ValueError(f"{key} must be finite and in (0, 1], got {value!r}; " + setting(key, example))
    return number


def _gain(value: Any, key: str, example: str) -> float:
    number = finite_number(value)
    if number is None or number < 0:
        raise ValueError(f"{key} must be finite and >= 0, got {value!r}; " + setting(key, example))
    return number


def _window(value: Any) -> int:
    number = finite_number(value)  # None for bools, strings, NaN and inf
    if number is None or not number.is_integer() or number < 1:
        raise ValueError(f"entropy_control_window must be a whole number of optimizer steps >= 1, got {value!r}; "
                         + setting("entropy_control_window", "8"))
    return int(number)


def validate_entropy_control(target: Any, ki: Any, kp: Any, min_ratio: Any, max_ratio: Any, horizon: Any = 0.0,
                             window: Any = DEFAULT_WINDOW) -> Optional[EntropyControlSettings]:
    """The controller's settings, or None when ``target`` is None (the controller is off).

    Raises ``ValueError`` naming the ``policy_loss`` key to change: a target that is not a finite number > 0
    (booleans and strings are rejected), a negative or non-finite gain, both gains 0 (the knob would never
    move), bounds outside (0, 1] or ``min_ratio >= max_ratio``. The gains and bounds are checked when the
    controller is off too, so a typo does not wait for the day it is switched on. ``horizon``: finite, >= 0
    (optimizer steps); ``window``: a whole number >= 1.
    """
    ki = _gain(ki, "entropy_control_ki", "0.1")
    kp = _gain(kp, "entropy_control_kp", "10")
    horizon = _gain(horizon, "entropy_control_horizon", "40")
    window = _window(window)
    low = _positive_ratio_bound(min_ratio, "entropy_control_min_ratio", "1e-05")
    high = _positive_ratio_bound(max_ratio, "entropy_control_max_ratio", "0.05")
    if low >= high:
        raise ValueError(f"entropy_control_min_ratio must be below entropy_control_max_ratio, got {min_ratio!r} >= "
                         f"{max_ratio!r}; set {POLICY_LOSS}entropy_control_min_ratio and ..._max_ratio")
    if target is None:
        return None
    number = finite_number(target)
    if number is None or number <= 0:
        raise ValueError(f"entropy_target must be a finite number of nats > 0 (or null: no controller), got "
                         f"{target!r}; " + setting("entropy_target", "1.5"))
    if ki == 0 and kp == 0:
        raise ValueError("entropy_control_ki and entropy_control_kp are both 0: the controller would never move "
                         f"the knob; {setting('entropy_control_ki', '0.1')}")
    return EntropyControlSettings(target=number, ki=ki, kp=kp, min_ratio=low, max_ratio=high, horizon=horizon,
                                  window=window)


def clamp_start(ratio: float, settings: EntropyControlSettings) -> tuple[float, bool]:
    """The configured ratio clamped to the bounds (the start of a fresh controller), and whether it moved."""
    clamped = min(max(ratio, settings.min_ratio), settings.max_ratio)
    return clamped, clamped != ratio


def measure_entropy(entropy: torch.Tensor, response_mask: torch.Tensor, settings: EntropyControlSettings,
                    group: Optional[dist.ProcessGroup]) -> tuple[float, int]:
    """``(H, N)``: the mean entropy over the valid response tokens of every rank of ``group``, and their count.

    ``entropy``, ``response_mask``: (batch, response_len) of this rank's shard. Valid: in the mask with a
    finite entropy. ``H`` is nan when ``N = 0``. Ranks holding other controller knobs all raise the same
    ``ValueError``. Exchange: one all-gather of 10 float64 per rank, one all-reduce of 1 int64.
    """
    values = entropy.detach()
    values = values if values.is_floating_point() else values.to(torch.float64)
    means = agree_and_mean((values,), response_mask.bool(), settings.agreed(), group)
    return (float(means.means[0]) if means.num_valid else math.nan), means.num_valid


def relative_error(target: float, entropy: float) -> float:
    """``(H* - H) / max(H*, H)`` in [-1, 1]; 0 when ``H`` is nan (nothing measured)."""
    if math.isnan(entropy):
        return 0.0
    return (target - entropy) / max(target, entropy)


def _clamp_log(u: float, settings: EntropyControlSettings) -> float:
    return min(max(u, math.log(settings.min_ratio)), math.log(settings.max_ratio))


def predict_entropy(entropy: float, recent: tuple[float, ...], settings: EntropyControlSettings) -> float:
    """``Ĥ``: ``H`` extrapolated ``horizon`` optimizer steps ahead along its mean change per step over the last
    ``window`` measured steps (``recent``, oldest first), floored at 0; ``H`` itself without a horizon or while
    fewer than ``window`` steps are measured (a trend over fewer steps would carry ``horizon / k`` times the
    minibatch noise)."""
    if settings.horizon == 0 or len(recent) < settings.window:
        return entropy
    oldest = recent[-settings.window]
    return max(0.0, entropy + settings.horizon * (entropy - oldest) / settings.window)  # H >= 0: e stays in [-1, 1]


def decide(state: ControllerState, entropy: float, num_valid: int, settings: EntropyControlSettings,
           sign: int) -> ControlDecision:
    """Step 2-3 of the law: the integral ``u'`` and the ratio in use, from the measured ``H`` (module docstring)."""
    predicted = predict_entropy(entropy, state.recent, settings) if num_valid else None
    error = relative_error(settings.target, predicted) if predicted is not None else 0.0
    integral = _clamp_log(state.log_ratio + sign * settings.ki * error, settings)
    ratio_in_use = math.exp(_clamp_log(integral + sign * settings.kp * error, settings))
    return ControlDecision(entropy=entropy, num_valid=num_valid, error=error, integral=integral,
                           ratio_in_use=ratio_in_use, predicted=predicted if settings.horizon else None)


def settle(state: ControllerState, decision: ControlDecision, settings: EntropyControlSettings, num_valid: int,
           reach: int) -> ControllerState:
    """Step 4 of the law: the next state, with anti-wind-up from the step's selection.

    ``num_valid``: the selection's ``N``; ``reach``: the most tokens a larger ratio could select (``N``, or
    Clip-Cov's candidates). The integration ``decision.integral - state.log_ratio`` is kept unless the ratio in
    use lay at or beyond the edge of ``[max(1/N, min_ratio), min(reach/N, max_ratio)]`` it pushes towards.
    """
    previous, integral = state.log_ratio, decision.integral
    if num_valid <= 0 or reach <= 0:
        integral = previous  # the ratio acts on nothing this step: no integration
    else:
        low = max(math.log(1.0 / num_valid), math.log(settings.min_ratio))
        high = min(math.log(min(reach, num_valid) / num_valid), math.log(settings.max_ratio))
        in_use = math.log(decision.ratio_in_use)
        if (integral < previous and in_use <= low) or (integral > previous and in_use >= high):
            integral = previous
    if not settings.horizon:
        recent = ()  # no history without a horizon: a horizon set again later starts its trend afresh
    elif decision.num_valid:
        recent = (state.recent + (decision.entropy,))[-settings.window:]
    else:
        recent = state.recent
    return ControllerState(knob=state.knob, log_ratio=integral, steps=state.steps + 1, recent=recent)
