"""Configuration of the ``kl_cov_global`` loss mode: names, knobs and their validation.

Everything a user can set lives in ``actor_rollout_ref.actor.policy_loss``:

* ``loss_mode=kl_cov_global`` selects this plugin;
* ``kl_cov_ratio`` (finite, in (0, 1]) and ``ppo_kl_coef`` (finite, >= 0) mean
  what they mean for verl's ``kl_cov``;
* ``prepass_layout`` (only with ``policy_loss._target_`` set to
  :class:`KLCovGlobalPolicyLossConfig`): the micro-batch layout of the no-grad
  prepass, ``"infer"`` (default: the engine's log-prob inference settings, so
  the mask cannot depend on the training micro-batch size even in bf16) or
  ``"train"`` (the training micro-batch settings, as verl PR #7830 does).
  With dynamic batching the inference layout still depends on each rank's shard, so
  in bf16 (batch-shape-dependent log-probs) a different DP size can still move a
  near-tie; the training micro-batch size cannot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from verl.workers.config.actor import PolicyLossConfig

from .selection import validate_kl_cov_ratio

LOSS_MODE = "kl_cov_global"
#: Per-token field of the minibatch TensorDict that carries the selection mask.
MASK_KEY = "kl_cov_global_mask"
#: Prefix of every metric this plugin adds to verl's metrics dict.
METRIC_PREFIX = "actor/kl_cov/"
PREPASS_LAYOUTS = ("infer", "train")

# Upstream kl_cov's fallbacks when a field is None (verl 0.9.1 core_algos.py ~1884).
_DEFAULT_RATIO = 0.0002
_DEFAULT_COEF = 1.0


@dataclass(frozen=True)
class KLCovGlobalSettings:
    """Validated knobs of one actor config."""

    kl_cov_ratio: float
    ppo_kl_coef: float
    prepass_layout: str


def validate_ppo_kl_coef(coef: Any) -> float:
    """Return ``coef`` as float if finite and >= 0, else raise ValueError."""
    try:
        value = float(coef)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"ppo_kl_coef must be finite and >= 0, got {coef!r}; "
            "set actor_rollout_ref.actor.policy_loss.ppo_kl_coef, e.g. =1.0 (the paper's value)"
        )
    return value


def validate_prepass_layout(layout: Any) -> str:
    if layout not in PREPASS_LAYOUTS:
        raise ValueError(
            f"prepass_layout must be one of {PREPASS_LAYOUTS}, got {layout!r}; "
            "set actor_rollout_ref.actor.policy_loss.prepass_layout=infer (default) or =train"
        )
    return layout


def _field(policy_loss: Any, name: str, default: Any) -> Any:
    value = policy_loss.get(name, None) if hasattr(policy_loss, "get") else getattr(policy_loss, name, None)
    return default if value is None else value


def is_kl_cov_global(actor_config: Any) -> bool:
    """True when an actor config (verl ``ActorConfig`` or a mapping like it) selects ``kl_cov_global``."""
    policy_loss = getattr(actor_config, "policy_loss", None)
    if policy_loss is None and hasattr(actor_config, "get"):
        policy_loss = actor_config.get("policy_loss", None)
    if policy_loss is None:
        return False
    return _field(policy_loss, "loss_mode", "vanilla") == LOSS_MODE


def read_settings(actor_config: Any) -> KLCovGlobalSettings:
    """Validated :class:`KLCovGlobalSettings` from an actor config's ``policy_loss``."""
    if actor_config is None or getattr(actor_config, "policy_loss", None) is None:
        raise ValueError("kl_cov_global needs the actor config (with policy_loss) passed as `config`")
    policy_loss = actor_config.policy_loss
    return KLCovGlobalSettings(
        kl_cov_ratio=validate_kl_cov_ratio(_field(policy_loss, "kl_cov_ratio", _DEFAULT_RATIO)),
        ppo_kl_coef=validate_ppo_kl_coef(_field(policy_loss, "ppo_kl_coef", _DEFAULT_COEF)),
        prepass_layout=validate_prepass_layout(_field(policy_loss, "prepass_layout", "infer")),
    )


@dataclass
class KLCovGlobalPolicyLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus this plugin's knob, validated on construction.

    Select it with ``actor_rollout_ref.actor.policy_loss._target_=verl_klcov_global.config.KLCovGlobalPolicyLossConfig``.
    """

    loss_mode: str = LOSS_MODE
    prepass_layout: str = "infer"

    def __post_init__(self):
        parent_post_init = getattr(super(), "__post_init__", None)
        if parent_post_init is not None:
            parent_post_init()
        if self.loss_mode != LOSS_MODE:
            # verl's ppo_trainer.yaml sets loss_mode "vanilla": selecting this class through
            # `policy_loss._target_` alone would silently train without kl_cov_global.
            raise ValueError(
                f"{type(self).__name__} carries the knobs of loss_mode={LOSS_MODE}, but loss_mode is "
                f"{self.loss_mode!r}: set actor_rollout_ref.actor.policy_loss.loss_mode={LOSS_MODE}, or drop "
                "actor_rollout_ref.actor.policy_loss._target_ (verl's PolicyLossConfig) for other loss modes"
            )
        validate_kl_cov_ratio(self.kl_cov_ratio)
        validate_ppo_kl_coef(self.ppo_kl_coef)
        validate_prepass_layout(self.prepass_layout)
