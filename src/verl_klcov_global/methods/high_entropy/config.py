"""The 80/20 rule (Wang et al. 2025, *Beyond the 80/20 Rule*, arXiv:2506.01939): its knobs, settings and config class.

``entropy_top_ratio`` (finite, in (0, 1], default 0.2, the name of the authors' fork) is the fraction of valid
tokens, by current-policy entropy, that keep the PPO-clip loss (0.2 = the 20% highest-entropy tokens; TRL's
``top_entropy_quantile`` means the same). ``actor.clip_ratio_low`` / ``clip_ratio_high`` / ``clip_ratio_c`` are verl
``vanilla``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ...knob_doc import knob
from ...mode_config import (
    RATIO_OF_MINIBATCH,
    ClippedModeSettings,
    GlobalModePolicyLossConfig,
    clipped_settings,
    knob_value,
    max_ratio_knob,
    min_ratio_knob,
    policy_loss_of,
)
from .selection import validate_entropy_top_ratio


#: The paper's rho (Wang et al. 2025, arXiv:2506.01939; their fork's ``entropy_top_ratio=0.2``).
DEFAULT_ENTROPY_TOP_RATIO = 0.2
DEFAULT_HIGH_ENTROPY_CONTROL_BOUNDS = (0.01, 1.0)


@dataclass(frozen=True, kw_only=True)
class HighEntropyGlobalSettings(ClippedModeSettings):
    """Validated knobs of one actor config for ``high_entropy_global``: the selection's ratio, verl
    ``vanilla``'s clip range and dual-clip bound (read as vanilla reads them), the prepass layout."""

    entropy_top_ratio: float
    clip_ratio_c: float


def read_high_entropy_settings(actor_config: Any) -> HighEntropyGlobalSettings:
    """Validated :class:`HighEntropyGlobalSettings` from an actor config (its ``policy_loss`` and PPO clip knobs).

    ``entropy_top_ratio`` defaults to :data:`DEFAULT_ENTROPY_TOP_RATIO` (0.2); the clip range as verl
    ``vanilla`` reads it (``clip_ratio_low`` / ``clip_ratio_high``, each falling back to ``clip_ratio``),
    ``clip_ratio_c`` defaulting to 3.0 as in ``vanilla``.
    """
    policy_loss = policy_loss_of(actor_config, "high_entropy_global")
    return HighEntropyGlobalSettings(
        entropy_top_ratio=validate_entropy_top_ratio(
            knob_value(policy_loss, "entropy_top_ratio", DEFAULT_ENTROPY_TOP_RATIO)),
        **clipped_settings(actor_config, policy_loss, DEFAULT_HIGH_ENTROPY_CONTROL_BOUNDS),
    )


@dataclass
class HighEntropyGlobalPolicyLossConfig(GlobalModePolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus ``entropy_top_ratio`` and the common knobs (:class:`GlobalModePolicyLossConfig`),
    validated on construction.

    Select it with ``actor_rollout_ref.actor.policy_loss._target_=verl_klcov_global.config.HighEntropyGlobalPolicyLossConfig``.
    ``entropy_top_ratio`` is a fraction in (0, 1] (0.2: the 20% highest-entropy tokens keep the PPO-clip loss).
    """

    CONTROL_BOUNDS: ClassVar[tuple[float, float]] = DEFAULT_HIGH_ENTROPY_CONTROL_BOUNDS

    loss_mode: str = "high_entropy_global"
    entropy_top_ratio: float = knob(
        DEFAULT_ENTROPY_TOP_RATIO, valid="finite, (0, 1]", default_note=" (the paper's, 14B and 32B)",
        help=f"ρ: fraction {RATIO_OF_MINIBATCH} that keep the PPO-clip loss, by current-policy entropy")
    entropy_control_min_ratio: float = min_ratio_knob(DEFAULT_HIGH_ENTROPY_CONTROL_BOUNDS)
    entropy_control_max_ratio: float = max_ratio_knob(DEFAULT_HIGH_ENTROPY_CONTROL_BOUNDS)

    def validate_knobs(self) -> None:
        validate_entropy_top_ratio(self.entropy_top_ratio)
