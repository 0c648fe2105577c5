"""Reading numeric knobs strictly: real numbers only; booleans and strings are rejected, never coerced.

``float(True)`` is 1.0 and ``float("0.1")`` is 0.1: a knob set to ``true`` or ``"0.1"`` would
silently become a number. Every selection validates its knobs through these helpers, and turns a
ratio knob into a token quota with :func:`ratio_quota`.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

POLICY_LOSS = "actor_rollout_ref.actor.policy_loss."
ACTOR = "actor_rollout_ref.actor."


def real_number(value: Any) -> Optional[float]:
    """``value`` as a float if it is a real number (int, float, numpy scalar...), else None; bool -> None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def finite_number(value: Any) -> Optional[float]:
    """:func:`real_number` restricted to finite values (None for NaN and +-inf)."""
    number = real_number(value)
    return number if number is not None and math.isfinite(number) else None


def setting(key: str, example: str, section: str = POLICY_LOSS) -> str:
    """``"set actor_rollout_ref.actor.policy_loss.<key>, e.g. =<example>"``: the fix an error message names."""
    return f"set {section}{key}, e.g. ={example}"


def validate_ratio(ratio: Any, key: str, example: str) -> float:
    """``ratio`` as float if it is a finite number in (0, 1] (not a bool or a string), else ValueError naming ``key``."""
    value = finite_number(ratio)
    if value is None or not (0.0 < value <= 1.0):
        raise ValueError(f"{key} must be finite and in (0, 1], got {ratio!r}; " + setting(key, example))
    return value


def validate_clip_ratio(value: Any, key: str) -> float:
    """A PPO clip ratio (``clip_ratio_low`` / ``clip_ratio_high``) as float if finite and >= 0, else ValueError."""
    number = finite_number(value)
    if number is None or number < 0:
        raise ValueError(f"{key} must be finite and >= 0, got {value!r}; {setting(key, '0.2', ACTOR)}")
    return number


def ratio_quota(num_valid: int, ratio: float) -> int:
    """Upstream kl_cov's and clip_cov's quota ``max(1, int(num_valid * ratio))``; 0 when there are no valid tokens."""
    if num_valid <= 0:
        return 0
    return max(1, int(num_valid * ratio))
