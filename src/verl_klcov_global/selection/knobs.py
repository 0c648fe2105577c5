"""Reading numeric knobs strictly: real numbers only; booleans and strings are rejected, never coerced.

``float(True)`` is 1.0 and ``float("0.1")`` is 0.1: a knob set to ``true`` or ``"0.1"`` would
silently become a number. Every selection validates its knobs through these two helpers.
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
