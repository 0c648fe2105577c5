"""The entropy target as a floor: the law that strengthens a global mode when the entropy is heading below a target.

Pure: tensors and floats in, floats out; nothing here knows verl. The engine (:mod:`.engine.control`) keeps
the state per engine, runs :func:`measure_entropy` and :func:`decide` before each optimizer step's
selection, hands the selection the ratio in use, and :func:`settle` after it.

These methods brake a fall of entropy; they do not raise it, and past some strength a method can lower it
(docs/EVIDENCE.md, KL-Cov on SmolLM2). So the target is a floor, as Skywork-OR1's and TRL's entropy targets are,
and the user's ratio ``r0`` (``kl_cov_ratio``, ``clip_cov_ratio`` or ``entropy_top_ratio``) is what they asked for:
the law only ever adds strength to it. ``s`` is the mode's sign (+1 where a larger ratio keeps entropy higher,
-1 where a smaller one does); the strength ``z = s ln(r / r0)`` is >= 0, 0 at the user's ratio. Once per
optimizer step:

1. ``H`` = the token mean of the current-policy entropy over the minibatch's valid response tokens on every
   data-parallel rank (exact 64-bit fixed-point sum, :func:`.selection.collectives.agree_and_mean`): the
   same bits for any micro-batch or DP split of the same minibatch and parameters;
2. the prediction ``Ĥ = H + h (H - H_{-k}) / k``: ``H`` extrapolated ``h`` optimizer steps ahead
   (``entropy_control_horizon``) along its mean change over the last ``k`` measured steps
   (``entropy_control_window``), floored at 0; ``Ĥ = H`` while fewer than ``k`` steps are measured or with
   ``h = 0``. A fall is braked before the target is crossed, not after;
3. the error, with hysteresis ``w`` (``entropy_control_hysteresis``): below the target, the deficit
   ``e = (H* - Ĥ) / H*`` in (0, 1]; above the band's top ``(1 + w) H*``, the surplus ``e = -(Ĥ - (1 + w) H*) / Ĥ``
   in (-1, 0); inside ``[H*, (1 + w) H*]``, 0 (the strength holds);
4. the step: ``z' = clamp(z + clamp(g e, -ln 2, ln 2), 0, z_max)`` with ``g = kp`` on a deficit (how fast it
   brakes harder) and ``g = ki`` on a surplus (how fast it eases back to the user's ratio); the ratio in use is
   ``r0 exp(s z')``. So it is never weaker than ``r0``, moves ``ln r`` by at most ln 2 per optimizer step, and
   reaches at most the bound on its entropy-raising side (``entropy_control_max_ratio`` for ``s = +1``,
   ``entropy_control_min_ratio`` for ``s = -1``): the authority range, where more strength means more entropy.
   ``r0`` must lie inside the bounds (:func:`check_ratio_within_bounds`);
5. after the selection, anti-wind-up (:func:`settle`): a strengthening step is undone when the ratio in use
   already lay at or beyond the edge of the range where the ratio acts: ``max(1 / N, min_ratio)`` (``N`` the
   selection's valid tokens: below ``1 / N`` the quota ``max(1, int(N r))`` is 1 whatever ``r``) or
   ``min(reach / N, max_ratio)`` (``reach``: the most tokens the selection can take, ``N``, or Clip-Cov's
   candidates). With no valid token or nothing within reach the state does not move.

The state (``ln r`` in use, a step count and, with a horizon, the last ``k`` measured ``H``) is a pure function of
the steps before it, so a run resumed from a checkpoint that carries it continues bit for bit.
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
    "CONTROL_KNOBS", "DEFAULT_HORIZON", "DEFAULT_HYSTERESIS", "DEFAULT_WINDOW", "MAX_STEP", "ControlDecision",
    "ControllerState", "EntropyControlSettings", "check_ratio_within_bounds", "decide", "floor_error",
    "measure_entropy", "predict_entropy", "settle", "validate_entropy_control",
]

#: The most one optimizer step moves ``ln r`` (ALF's bound on a step of its entropy coefficient).
MAX_STEP = math.log(2.0)
#: The prediction's defaults (optimizer steps): ``Ĥ`` reads the entropy 8 steps ahead along its trend over the last
#: 4 (fixed on the tiny-model miniature before the SmolLM2 runs; docs/EVIDENCE.md).
DEFAULT_HORIZON = 8.0
DEFAULT_WINDOW = 4
#: The band above the target where the strength holds, as a fraction of the target.
DEFAULT_HYSTERESIS = 0.1

#: The controller's knobs under ``actor_rollout_ref.actor.policy_loss.`` (every mode's).
CONTROL_KNOBS = ("entropy_target", "entropy_control_ki", "entropy_control_kp", "entropy_control_min_ratio",
                 "entropy_control_max_ratio", "entropy_control_horizon", "entropy_control_window",
                 "entropy_control_hysteresis")


@dataclass(frozen=True)
class EntropyControlSettings:
    """Validated controller knobs (:func:`validate_entropy_control`).

    ``target``: ``H*``, the floor, nats per valid response token; ``kp``: change of ``ln r`` per optimizer step per
    unit of relative deficit (braking harder), ``ki``: per unit of relative surplus above the band (easing back),
    each step at most :data:`MAX_STEP`; ``min_ratio`` < ``max_ratio``: the bounds of the controlled ratio in
    (0, 1], which must hold the user's ratio; ``horizon``: optimizer steps ahead the error reads the entropy
    extrapolated to (0: the measured entropy); ``window``: measured steps the trend is taken over; ``hysteresis``:
    the band ``[H*, (1 + hysteresis) H*]`` where the strength holds.
    """

    target: float
    ki: float
    kp: float
    min_ratio: float
    max_ratio: float
    horizon: float = DEFAULT_HORIZON
    window: int = DEFAULT_WINDOW
    hysteresis: float = DEFAULT_HYSTERESIS

    def agreed(self) -> dict[str, float]:
        """The knobs every data-parallel rank must hold the same values of (their ``policy_loss`` names)."""
        return dict(zip(CONTROL_KNOBS, (self.target, self.ki, self.kp, self.min_ratio, self.max_ratio,
                                        self.horizon, float(self.window), self.hysteresis)))


@dataclass(frozen=True)
class ControllerState:
    """What the controller carries from one optimizer step to the next.

    ``knob``: the controlled ratio's name; ``log_ratio``: ``ln r``, the ratio the last step used (the strength
    reached); ``steps``: optimizer steps controlled so far; ``recent``: with a horizon, the measured ``H`` of the
    last ``window`` steps that had valid tokens, oldest first (empty without one).
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
    ``error``: ``e`` (> 0 a deficit, < 0 a surplus above the band, 0 inside it or without valid tokens);
    ``log_ratio``: ``ln r`` of the ratio in use; ``ratio_in_use``: the ratio the step's selection uses;
    ``predicted``: ``Ĥ`` with a horizon (None without one, or without valid tokens).
    """

    entropy: float
    num_valid: int
    error: float
    log_ratio: float
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
                         + setting("entropy_control_window", str(DEFAULT_WINDOW)))
    return int(number)


def validate_entropy_control(target: Any, ki: Any, kp: Any, min_ratio: Any, max_ratio: Any,
                             horizon: Any = DEFAULT_HORIZON, window: Any = DEFAULT_WINDOW,
                             hysteresis: Any = DEFAULT_HYSTERESIS) -> Optional[EntropyControlSettings]:
    """The controller's settings, or None when ``target`` is None (the controller is off).

    Raises ``ValueError`` naming the ``policy_loss`` key to change: a target that is not a finite number > 0
    (booleans and strings are rejected), a negative or non-finite gain, ``kp`` 0 (the law would never brake),
    bounds outside (0, 1] or ``min_ratio >= max_ratio``. The gains and bounds are checked when the controller is
    off too, so a typo does not wait for the day it is switched on. ``horizon``, ``hysteresis``: finite, >= 0;
    ``window``: a whole number >= 1.
    """
    ki = _gain(ki, "entropy_control_ki", "1.0")
    kp = _gain(kp, "entropy_control_kp", "10")
    horizon = _gain(horizon, "entropy_control_horizon", "8")
    hysteresis = _gain(hysteresis, "entropy_control_hysteresis", "0.1")
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
    if kp == 0:
        raise ValueError("entropy_control_kp is 0: the controller would never strengthen the method below the "
                         f"target; {setting('entropy_control_kp', '10')}")
    return EntropyControlSettings(target=number, ki=ki, kp=kp, min_ratio=low, max_ratio=high, horizon=horizon,
                                  window=window, hysteresis=hysteresis)


def check_ratio_within_bounds(knob: str, ratio: float, settings: EntropyControlSettings) -> None:
    """ValueError naming the keys when the user's ratio ``knob`` = ``ratio`` lies outside the controller's bounds:
    the law never goes below what the user asked for, so a ratio beyond a bound has no floor it can keep."""
    if not settings.min_ratio <= ratio <= settings.max_ratio:
        raise ValueError(
            f"{knob}={ratio!r} lies outside the entropy controller's bounds [{settings.min_ratio!r}, "
            f"{settings.max_ratio!r}] (entropy_control_min_ratio / entropy_control_max_ratio): the controller only "
            f"ever strengthens the method from your {knob}, within the bounds. Set {POLICY_LOSS}{knob} inside them, "
            f"or set {POLICY_LOSS}entropy_control_min_ratio / entropy_control_max_ratio so that they hold it")


def measure_entropy(entropy: torch.Tensor, response_mask: torch.Tensor, settings: EntropyControlSettings,
                    group: Optional[dist.ProcessGroup]) -> tuple[float, int]:
    """``(H, N)``: the mean entropy over the valid response tokens of every rank of ``group``, and their count.

    ``entropy``, ``response_mask``: (batch, response_len) of this rank's shard. Valid: in the mask with a
    finite entropy. ``H`` is nan when ``N = 0``. Ranks holding other controller knobs all raise the same
    ``ValueError``. Exchange: one all-gather of 11 float64 per rank, one all-reduce of 1 int64.
    """
    values = entropy.detach()
    values = values if values.is_floating_point() else values.to(torch.float64)
    means = agree_and_mean((values,), response_mask.bool(), settings.agreed(), group)
    return (float(means.means[0]) if means.num_valid else math.nan), means.num_valid


def floor_error(settings: EntropyControlSettings, predicted: Optional[float]) -> float:
    """``e`` of step 3 (module docstring): the relative deficit below the target in (0, 1], minus the relative
    surplus above the band's top in (-1, 0), else 0 (inside the band, or nothing measured: ``predicted`` None)."""
    if predicted is None or math.isnan(predicted):
        return 0.0
    target, top = settings.target, settings.target * (1.0 + settings.hysteresis)
    if predicted < target:
        return (target - predicted) / target
    if predicted > top:
        return -(predicted - top) / predicted
    return 0.0


def predict_entropy(entropy: float, recent: tuple[float, ...], settings: EntropyControlSettings) -> float:
    """``Ĥ``: ``H`` extrapolated ``horizon`` optimizer steps ahead along its mean change per step over the last
    ``window`` measured steps (``recent``, oldest first), floored at 0; ``H`` itself without a horizon or while
    fewer than ``window`` steps are measured (a trend over fewer steps would carry ``horizon / k`` times the
    minibatch noise)."""
    if settings.horizon == 0 or len(recent) < settings.window:
        return entropy
    oldest = recent[-settings.window]
    return max(0.0, entropy + settings.horizon * (entropy - oldest) / settings.window)


def _strength_limit(user_ratio: float, settings: EntropyControlSettings, sign: int) -> float:
    """``z_max``: the strength at the bound on the entropy-raising side."""
    bound = settings.max_ratio if sign > 0 else settings.min_ratio
    return max(0.0, sign * (math.log(bound) - math.log(user_ratio)))


def decide(state: ControllerState, entropy: float, num_valid: int, settings: EntropyControlSettings, sign: int,
           user_ratio: float) -> ControlDecision:
    """Steps 2-4 of the law (module docstring): this step's ratio in use from the measured ``H``, the state and the
    user's ratio ``r0``. ``sign``: the mode's entropy sign (+1 or -1)."""
    predicted = predict_entropy(entropy, state.recent, settings) if num_valid else None
    error = floor_error(settings, predicted)
    gain = settings.kp if error > 0 else settings.ki
    step = max(-MAX_STEP, min(MAX_STEP, gain * error))
    strength = sign * (state.log_ratio - math.log(user_ratio))
    strength = min(max(strength + step, 0.0), _strength_limit(user_ratio, settings, sign))
    log_ratio = math.log(user_ratio) + sign * strength
    return ControlDecision(entropy=entropy, num_valid=num_valid, error=error, log_ratio=log_ratio,
                           ratio_in_use=math.exp(log_ratio), predicted=predicted if settings.horizon else None)


def settle(state: ControllerState, decision: ControlDecision, settings: EntropyControlSettings, num_valid: int,
           reach: int, sign: int) -> ControllerState:
    """Step 5 of the law: the next state, with anti-wind-up from the step's selection.

    ``num_valid``: the selection's ``N``; ``reach``: the most tokens a larger ratio could select (``N``, or
    Clip-Cov's candidates). The step's ``ln r`` is kept unless it strengthened the method while the ratio in use
    lay at or beyond the edge of ``[max(1/N, min_ratio), min(reach/N, max_ratio)]`` on the strengthening side.
    """
    log_ratio = decision.log_ratio
    strengthened = sign * (log_ratio - state.log_ratio) > 0
    if num_valid <= 0 or reach <= 0:
        log_ratio = state.log_ratio  # the ratio acts on nothing this step: the state does not move
    elif strengthened:
        low = max(math.log(1.0 / num_valid), math.log(settings.min_ratio))
        high = min(math.log(min(reach, num_valid) / num_valid), math.log(settings.max_ratio))
        if (sign > 0 and log_ratio >= high) or (sign < 0 and log_ratio <= low):
            log_ratio = state.log_ratio
    if not settings.horizon:
        recent = ()  # no history without a horizon: a horizon set again later starts its trend afresh
    elif decision.num_valid:
        recent = (state.recent + (decision.entropy,))[-settings.window:]
    else:
        recent = state.recent
    return ControllerState(knob=state.knob, log_ratio=log_ratio, steps=state.steps + 1, recent=recent)
