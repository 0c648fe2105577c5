"""Lp-Reg (Huang et al. 2025, arXiv:2510.03222): its knobs, settings and config class.

``lp_reg_neg_ratio`` / ``lp_reg_pos_ratio``: rho- / rho+ (the authors' 0.01 / 0); ``lp_reg_min_p``: kappa, the
proxy's min-p threshold (0.02); ``lp_reg_kl_coef``: beta (1.0), the KL's weight. No entropy controller.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from verl.workers.config.actor import PolicyLossConfig

from ...knob_doc import knob
from ...mode_config import ClippedModeSettings, PrepassPolicyLossConfig, clipped_settings, knob_value, policy_loss_of
from ...selection.knobs import POLICY_LOSS as POLICY_LOSS_PREFIX, finite_number, setting
from .selection import validate_lp_reg_ratio


DEFAULT_LP_REG_MIN_P = 0.02
DEFAULT_LP_REG_NEG_RATIO = 0.01
DEFAULT_LP_REG_POS_RATIO = 0.0
#: beta, the weight of the KL towards the proxy: the authors' scripts set ``ppo_kl_coef=1`` (Lp-Reg-dev@33b27e2,
#: recipe/lp_reg/*.sh:66). It is a knob of its own, ``lp_reg_kl_coef``, not verl's ``ppo_kl_coef``: verl's
#: ``actor.yaml`` writes ``ppo_kl_coef: 0.1`` into every ``policy_loss`` node it composes, so on the ``_target_``
#: route an unset beta would be verl's 0.1, not the authors' 1.
DEFAULT_LP_REG_KL_COEF = 1.0


@dataclass(frozen=True, kw_only=True)
class LpRegGlobalSettings(ClippedModeSettings):
    """Validated ``lp_reg_global`` settings (:func:`read_lp_reg_settings`).

    ``neg_ratio`` / ``pos_ratio``: rho- / rho+ (fractions of each advantage sign's valid tokens of the optimizer
    minibatch); ``min_p``: kappa, the proxy's min-p threshold; ``kl_coef``: beta (``lp_reg_kl_coef``), the KL's
    weight on the regularised tokens; the PPO clip knobs as verl ``vanilla`` reads them."""

    neg_ratio: float
    pos_ratio: float
    min_p: float
    kl_coef: float
    clip_ratio_c: float


def validate_lp_reg_min_p(value: Any) -> float:
    """kappa as float if it is a finite number in [0, 1) (0: no filter, the proxy is pi_old), else ValueError."""
    number = finite_number(value)
    if number is None or not (0.0 <= number < 1.0):
        raise ValueError(f"lp_reg_min_p must be finite and in [0, 1), got {value!r}: the proxy keeps the tokens of "
                         "probability >= lp_reg_min_p * max p; " + setting("lp_reg_min_p", "0.02 (the authors' value)"))
    return number


def validate_lp_reg_kl_coef(value: Any) -> float:
    """beta as float if it is a finite number >= 0, else ValueError."""
    number = finite_number(value)
    if number is None or number < 0:
        raise ValueError(f"lp_reg_kl_coef must be finite and >= 0, got {value!r}: beta, the weight of the KL towards "
                         "the proxy on the regularised tokens; " + setting("lp_reg_kl_coef", "1.0 (the authors' value)"))
    return number


def verl_ppo_kl_coef_default() -> float:
    """verl's own ``ppo_kl_coef`` default (``PolicyLossConfig``'s field; verl's ``actor.yaml`` writes the same 0.1)."""
    return next(f.default for f in dataclasses.fields(PolicyLossConfig) if f.name == "ppo_kl_coef")


def refuse_ppo_kl_coef_for_lp_reg(policy_loss: Any) -> None:
    """ValueError when a ``policy_loss`` of ``lp_reg_global`` carries a ``ppo_kl_coef`` other than verl's default:
    Lp-Reg does not read it (its beta is ``lp_reg_kl_coef``), so such a value is a beta the run would not get."""
    coef = knob_value(policy_loss, "ppo_kl_coef", None)
    default = verl_ppo_kl_coef_default()
    if coef is not None and finite_number(coef) != default:
        raise ValueError(
            f"ppo_kl_coef={coef!r} is KL-Cov's coefficient, which lp_reg_global does not read: Lp-Reg's beta is "
            f"lp_reg_kl_coef (default 1.0, the authors' value). Set {POLICY_LOSS_PREFIX}lp_reg_kl_coef={coef} "
            f"instead, and leave {POLICY_LOSS_PREFIX}ppo_kl_coef at verl's {default:g}")


def validate_lp_reg_knobs(policy_loss: Any) -> dict[str, float]:
    """``lp_reg_neg_ratio``, ``lp_reg_pos_ratio``, ``lp_reg_min_p``, ``lp_reg_kl_coef`` of a ``policy_loss``, validated
    (ValueError naming the key); a set with both ratios 0 selects nothing and is refused, and so is a ``ppo_kl_coef``
    other than verl's (:func:`refuse_ppo_kl_coef_for_lp_reg`)."""
    neg = validate_lp_reg_ratio(knob_value(policy_loss, "lp_reg_neg_ratio", DEFAULT_LP_REG_NEG_RATIO), "lp_reg_neg_ratio")
    pos = validate_lp_reg_ratio(knob_value(policy_loss, "lp_reg_pos_ratio", DEFAULT_LP_REG_POS_RATIO), "lp_reg_pos_ratio")
    if neg == 0.0 and pos == 0.0:
        raise ValueError("lp_reg_neg_ratio and lp_reg_pos_ratio are both 0: lp_reg_global would regularise no token "
                         "(verl's vanilla plus a prepass); " + setting("lp_reg_neg_ratio", "0.01 (the authors' value)"))
    refuse_ppo_kl_coef_for_lp_reg(policy_loss)
    return {"neg_ratio": neg, "pos_ratio": pos,
            "min_p": validate_lp_reg_min_p(knob_value(policy_loss, "lp_reg_min_p", DEFAULT_LP_REG_MIN_P)),
            "kl_coef": validate_lp_reg_kl_coef(knob_value(policy_loss, "lp_reg_kl_coef", DEFAULT_LP_REG_KL_COEF))}


def read_lp_reg_settings(actor_config: Any) -> LpRegGlobalSettings:
    """Validated :class:`LpRegGlobalSettings` from an actor config (its ``policy_loss``; the PPO clip knobs read as
    verl ``vanilla`` reads them). The plugin's entropy controller does not apply (its keys are refused)."""
    policy_loss = policy_loss_of(actor_config, "lp_reg_global",
                                 no_controller_because="it has no ratio whose size moves entropy one way")
    return LpRegGlobalSettings(
        **validate_lp_reg_knobs(policy_loss),
        **clipped_settings(actor_config, policy_loss),
    )


@dataclass
class LpRegGlobalPolicyLossConfig(PrepassPolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus Lp-Reg's knobs and ``prepass_layout``, validated on construction.

    Select it with ``actor_rollout_ref.actor.policy_loss._target_=verl_klcov_global.config.LpRegGlobalPolicyLossConfig``.
    ``lp_reg_neg_ratio`` / ``lp_reg_pos_ratio``: rho- / rho+ (the authors' 0.01 / 0); ``lp_reg_min_p``: kappa, the
    proxy's min-p threshold (0.02); ``lp_reg_kl_coef``: beta (1.0), the KL's weight (not verl's ``ppo_kl_coef``, which
    verl's YAML sets to 0.1 on every route; a ``ppo_kl_coef`` other than that is refused). No ``entropy_*`` knobs:
    the plugin's entropy controller does not apply (docs/LP_REG.md).
    """

    loss_mode: str = "lp_reg_global"
    lp_reg_neg_ratio: float = knob(
        DEFAULT_LP_REG_NEG_RATIO, row="ratios", valid="finite, [0, 1], not both 0", default_note=" (the authors')",
        help="ρ−: fraction of the minibatch's valid A < 0 tokens, all DP ranks, with the lowest log π: regularised "
             "where log π < log π_proxy")
    lp_reg_pos_ratio: float = knob(DEFAULT_LP_REG_POS_RATIO, row="ratios", valid="finite, [0, 1]",
                                   help="ρ+: the same for the A > 0 tokens")
    lp_reg_min_p: float = knob(
        DEFAULT_LP_REG_MIN_P, row="proxy", valid="κ in [0, 1); β >= 0", default_note=" (the authors')",
        help="κ: the proxy keeps π_old's tokens with p >= κ·max p ([LP_REG](docs/LP_REG.md#the-method-as-implemented))")
    lp_reg_kl_coef: float = knob(DEFAULT_LP_REG_KL_COEF, row="proxy", valid="finite, >= 0",
                                 help="β: weight of the KL to the proxy (not verl's `ppo_kl_coef`, which must stay 0.1)")

    def validate_knobs(self) -> None:
        validate_lp_reg_knobs(self)
