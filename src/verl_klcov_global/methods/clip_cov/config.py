"""Clip-Cov (Cui et al. 2025, arXiv:2505.22617; verl's ``clip_cov``): its knobs, settings and config class.

``clip_cov_ratio`` (finite, in (0, 1]), ``clip_cov_lb`` < ``clip_cov_ub`` (finite) are verl's own fields and mean
what they mean for verl's ``clip_cov`` (defaults 0.0002, 1.0, 5.0, as verl's); ``actor.clip_ratio_low`` /
``clip_ratio_high`` are the PPO clip range, as for ``clip_cov``. ``clip_cov_seed`` (only with
:class:`ClipCovGlobalPolicyLossConfig`; an integer in [0, 2**53), default 0) seeds the reproducible draw: a hash of
(seed, optimizer step, sequence tokens, position), so every minibatch and every optimizer step (a later PPO epoch
included) gets its own draw; change the seed to get a different, equally valid sequence of draws (e.g. per run of a
sweep).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ...knob_doc import KnobDoc, knob
from ...mode_config import (
    DEFAULT_COV_CONTROL_BOUNDS,
    ClippedModeSettings,
    GlobalModePolicyLossConfig,
    clipped_settings,
    knob_value,
    policy_loss_of,
)
from .selection import validate_clip_cov_ratio, validate_clip_cov_seed, validate_clip_cov_window


#: Upstream clip_cov's fallbacks when a field is None (``core_algos.compute_policy_loss_clip_cov``).
UPSTREAM_FALLBACKS = {"clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0}
DEFAULT_CLIP_COV_SEED = 0


@dataclass(frozen=True, kw_only=True)
class ClipCovGlobalSettings(ClippedModeSettings):
    """Validated knobs of one actor config for ``clip_cov_global``."""

    clip_cov_ratio: float
    clip_cov_lb: float
    clip_cov_ub: float
    clip_cov_seed: int
    optimizer_step: int = 0  # not a knob: the engine sets its count of optimizer steps (ModeSpec.reads_optimizer_step)


def _upstream_knob(policy_loss: Any, key: str) -> Any:
    return knob_value(policy_loss, key, UPSTREAM_FALLBACKS[key])


def read_clip_cov_settings(actor_config: Any) -> ClipCovGlobalSettings:
    """Validated :class:`ClipCovGlobalSettings` from an actor config (its ``policy_loss`` and clip ratios).

    The PPO clip range follows upstream ``clip_cov``: ``clip_ratio_low`` / ``clip_ratio_high``,
    each falling back to ``clip_ratio`` when None.
    """
    policy_loss = policy_loss_of(actor_config, "clip_cov_global")
    lb, ub = validate_clip_cov_window(_upstream_knob(policy_loss, "clip_cov_lb"),
                                      _upstream_knob(policy_loss, "clip_cov_ub"))
    return ClipCovGlobalSettings(
        clip_cov_ratio=validate_clip_cov_ratio(_upstream_knob(policy_loss, "clip_cov_ratio")),
        clip_cov_lb=lb,
        clip_cov_ub=ub,
        clip_cov_seed=validate_clip_cov_seed(knob_value(policy_loss, "clip_cov_seed", DEFAULT_CLIP_COV_SEED)),
        **clipped_settings(actor_config, policy_loss, DEFAULT_COV_CONTROL_BOUNDS, dual_clip=False),
    )


@dataclass
class ClipCovGlobalPolicyLossConfig(GlobalModePolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus ``clip_cov_seed`` and the common knobs (:class:`GlobalModePolicyLossConfig`),
    validated on construction.

    Select it with ``actor_rollout_ref.actor.policy_loss._target_=verl_klcov_global.config.ClipCovGlobalPolicyLossConfig``.
    ``clip_cov_ratio``, ``clip_cov_lb``, ``clip_cov_ub`` are verl's own fields (defaults 0.0002, 1.0, 5.0).
    """

    VERL_KNOBS: ClassVar[dict[str, KnobDoc]] = {
        "clip_cov_ratio": KnobDoc("at most this fraction of valid tokens get their gradient cut", "finite, (0, 1]"),
        "clip_cov_lb": KnobDoc("lb: the candidates are the tokens with lb < cov < ub", "finite, lb < ub", row="window"),
        "clip_cov_ub": KnobDoc("ub, the window's upper bound", "finite, > lb", row="window"),
    }
    loss_mode: str = "clip_cov_global"
    clip_cov_seed: int = knob(DEFAULT_CLIP_COV_SEED, valid="integer in [0, 2^53)",
                              help="seed of the reproducible draw among the candidates")

    def validate_knobs(self) -> None:
        validate_clip_cov_ratio(self.clip_cov_ratio)
        validate_clip_cov_window(self.clip_cov_lb, self.clip_cov_ub)
        validate_clip_cov_seed(self.clip_cov_seed)
