"""STARE (Luo et al. 2026, arXiv:2606.19236): its knobs, settings and config class.

``stare_top_ratio`` (P, in [0, 1], default 0.1), ``stare_variant`` (``O1``: W on the selected A > 0 tokens; ``C2``:
also M on the selected A < 0 tokens), ``stare_reweight_w`` (>= 1, 1.1) and ``stare_reweight_m`` (in (0, 1], 0.9),
the gate's ``stare_target_entropy`` (0.3 nats) and the schedule ``stare_adaptive`` / ``stare_alpha`` /
``stare_w_max`` / ``stare_m_min`` (off, 0.01, 1.5, 0.5); a per-token ``actor.loss_agg_mode``
(:data:`STARE_AGG_MODES`). It has no entropy controller (:func:`read_stare_settings` refuses its knobs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ...knob_doc import knob
from ...mode_config import ClippedModeSettings, PrepassPolicyLossConfig, clipped_settings, knob_value, policy_loss_of
from ...selection.knobs import POLICY_LOSS as POLICY_LOSS_PREFIX, finite_number, setting
from .selection import validate_stare_top_ratio


#: STARE's defaults (hp-luo/STARE's README and ``stare_*`` config; paper arXiv:2606.19236, Section 5): the 10%
#: most surprising tokens of each advantage sign, W 1.1 on L+, M 0.9 on L- (variant C2 only), gate target 0.3 nats,
#: the adaptive schedule off with step 0.01 within [1, 1.5] and [0.5, 1].
DEFAULT_STARE_TOP_RATIO = 0.1
DEFAULT_STARE_REWEIGHT_W = 1.1
DEFAULT_STARE_REWEIGHT_M = 0.9
DEFAULT_STARE_VARIANT = "O1"
STARE_VARIANTS = ("O1", "C2")
DEFAULT_STARE_TARGET_ENTROPY = 0.3
DEFAULT_STARE_ALPHA = 0.01
DEFAULT_STARE_W_MAX = 1.5
DEFAULT_STARE_M_MIN = 0.5
#: ``loss_agg_mode`` values whose driver-side ``actor/entropy`` is a per-token mean entropy, which STARE's gate
#: compares with a per-token target. ``token-sum`` and ``seq-mean-token-sum`` make it a sum (refused).
#: ``seq-mean-token-sum-norm`` is refused too: the authors' fork (hp-luo/STARE@bffb9e7, core_algos.py:889-893) gates
#: on the sum of the rows' entropy sums over the padded width, a figure that grows with the number of rows and is not
#: a per-token entropy, while verl's ``actor/entropy`` there is the mean row sum over ``loss_scale_factor``: no figure
#: the plugin could compute is both the authors' and a per-token entropy.
STARE_AGG_MODES = ("token-mean", "seq-mean-token-mean")


@dataclass(frozen=True, kw_only=True)
class StareGlobalSettings(ClippedModeSettings):
    """Validated knobs of one actor config for ``stare_global``: the selection (``stare_top_ratio``, the variant),
    the weights and their gate and schedule (:class:`verl_klcov_global.stare_control.StareSchedule`), verl
    ``vanilla``'s clip range and dual-clip bound, the prepass layout.

    ``reweight_w`` / ``reweight_m`` / ``gate_on`` are what the loss applies: the configured W and M with the gate
    open as read from the config; the engine replaces them, once per trainer step, with the schedule's state
    (:mod:`.engine.schedule`)."""

    stare_top_ratio: float
    with_negative: bool
    reweight_w: float
    reweight_m: float
    target_entropy: float
    adaptive: bool
    alpha: float
    w_max: float
    m_min: float
    clip_ratio_c: float
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None
    gate_on: bool = True


def _stare_number(value: Any, key: str, ok, rule: str, example: str) -> float:
    number = finite_number(value)
    if number is None or not ok(number):
        raise ValueError(f"{key} must be {rule}, got {value!r}; " + setting(key, example))
    return number


def validate_stare_variant(value: Any) -> str:
    """``O1`` (W on L+ only, the paper's default) or ``C2`` (also M on L-), else ValueError naming the key."""
    if value not in STARE_VARIANTS:
        raise ValueError(f"stare_variant must be one of {STARE_VARIANTS}, got {value!r}; "
                         + setting("stare_variant", "O1 (W on the surprising A > 0 tokens) or =C2 (also M on the "
                                   "surprising A < 0 tokens)"))
    return value


def validate_stare_knobs(policy_loss: Any) -> dict[str, Any]:
    """STARE's knobs of a ``policy_loss`` (defaults filled in), validated, each error naming its key:
    0 <= ``stare_top_ratio`` <= 1, ``stare_reweight_w`` >= 1, 0 < ``stare_reweight_m`` <= 1, ``stare_variant``,
    ``stare_target_entropy`` finite, ``stare_adaptive`` a bool, ``stare_alpha`` >= 0, and with the schedule on
    ``stare_m_min`` <= M <= 1 <= W <= ``stare_w_max``."""
    top_ratio = validate_stare_top_ratio(knob_value(policy_loss, "stare_top_ratio", DEFAULT_STARE_TOP_RATIO))
    w = _stare_number(knob_value(policy_loss, "stare_reweight_w", DEFAULT_STARE_REWEIGHT_W), "stare_reweight_w",
                      lambda x: x >= 1.0, "finite and >= 1 (the weight of the surprising A > 0 tokens)",
                      "1.1 (the paper's; 1.05 for 14B and 32B)")
    m = _stare_number(knob_value(policy_loss, "stare_reweight_m", DEFAULT_STARE_REWEIGHT_M), "stare_reweight_m",
                      lambda x: 0.0 < x <= 1.0, "finite and in (0, 1] (the weight of the surprising A < 0 tokens)",
                      "0.9 (the paper's; 0.95 for 14B and 32B)")
    variant = validate_stare_variant(knob_value(policy_loss, "stare_variant", DEFAULT_STARE_VARIANT))
    target = _stare_number(knob_value(policy_loss, "stare_target_entropy", DEFAULT_STARE_TARGET_ENTROPY),
                           "stare_target_entropy", lambda x: True,
                           "finite (nats per token: the weights apply while the batch's mean entropy is below it)",
                           "0.3 (the paper's)")
    adaptive = knob_value(policy_loss, "stare_adaptive", False)
    if not isinstance(adaptive, bool):
        raise ValueError(f"stare_adaptive must be true or false, got {adaptive!r}; "
                         + setting("stare_adaptive", "false (the paper's default: W and M fixed)"))
    alpha = _stare_number(knob_value(policy_loss, "stare_alpha", DEFAULT_STARE_ALPHA), "stare_alpha",
                          lambda x: x >= 0.0, "finite and >= 0 (the schedule's step of W and M per trainer step)",
                          "0.01 (the paper's)")
    w_max = _stare_number(knob_value(policy_loss, "stare_w_max", DEFAULT_STARE_W_MAX), "stare_w_max",
                          lambda x: x >= 1.0, "finite and >= 1 (the schedule's upper bound of W)", "1.5 (the paper's)")
    m_min = _stare_number(knob_value(policy_loss, "stare_m_min", DEFAULT_STARE_M_MIN), "stare_m_min",
                          lambda x: 0.0 < x <= 1.0, "finite and in (0, 1] (the schedule's lower bound of M)",
                          "0.5 (the paper's)")
    if adaptive and not (m_min <= m and w <= w_max):
        raise ValueError(
            f"with stare_adaptive=true the schedule moves W in [1, stare_w_max] and M in [stare_m_min, 1], and the "
            f"start lies outside: stare_reweight_w={w!r}, stare_w_max={w_max!r}, stare_reweight_m={m!r}, "
            f"stare_m_min={m_min!r}; set {POLICY_LOSS_PREFIX}stare_w_max >= stare_reweight_w and "
            f"{POLICY_LOSS_PREFIX}stare_m_min <= stare_reweight_m")
    return dict(stare_top_ratio=top_ratio, with_negative=variant == "C2", reweight_w=w, reweight_m=m,
                target_entropy=target, adaptive=adaptive, alpha=alpha, w_max=w_max, m_min=m_min)


def validate_stare_agg_mode(loss_agg_mode: Any, loss_scale_factor: Any) -> None:
    """STARE's gate compares the batch's mean entropy, verl's ``actor/entropy`` (aggregated with ``loss_agg_mode``),
    with a per-token target: refuse the modes where that figure is a sum (ValueError naming the key)."""
    key = "actor_rollout_ref.actor.loss_agg_mode"
    if loss_agg_mode == "seq-mean-token-sum-norm":
        raise ValueError(
            "stare_global's gate compares the batch's mean entropy with stare_target_entropy, nats per token; with "
            "loss_agg_mode='seq-mean-token-sum-norm' the authors' fork gates on the sum of the responses' entropy "
            "sums over the padded width (it grows with the number of responses) and verl's actor/entropy on their "
            "mean sum over loss_scale_factor: neither is a per-token entropy, so the paper's target would mean "
            f"something else. Set {key}=token-mean (the authors') or seq-mean-token-mean")
    if loss_agg_mode not in STARE_AGG_MODES:
        raise ValueError(
            f"stare_global's gate compares the batch's mean entropy (verl's actor/entropy, aggregated with "
            f"loss_agg_mode) with stare_target_entropy, nats per token; with loss_agg_mode={loss_agg_mode!r} that "
            f"figure is a sum (nats x tokens), the gate would never open and STARE would silently be vanilla. Set "
            f"{key}=token-mean (the authors') or seq-mean-token-mean")


def read_stare_settings(actor_config: Any) -> StareGlobalSettings:
    """Validated :class:`StareGlobalSettings` from an actor config (its ``policy_loss``, PPO clip knobs read as verl
    ``vanilla`` reads them, and ``loss_agg_mode`` / ``loss_scale_factor``, which the gate's entropy follows)."""
    policy_loss = policy_loss_of(actor_config, "stare_global", no_controller_because=(
        "STARE brings its own entropy feedback (its gate stare_target_entropy and the adaptive W/M), and a second "
        f"loop on the same entropy would fight it; set {POLICY_LOSS_PREFIX}stare_target_entropy (and stare_adaptive) "
        "instead"))
    loss_agg_mode = knob_value(actor_config, "loss_agg_mode", "token-mean")
    loss_scale_factor = knob_value(actor_config, "loss_scale_factor", None)
    validate_stare_agg_mode(loss_agg_mode, loss_scale_factor)
    return StareGlobalSettings(
        **validate_stare_knobs(policy_loss),
        **clipped_settings(actor_config, policy_loss),
        loss_agg_mode=loss_agg_mode,
        loss_scale_factor=None if loss_scale_factor is None else float(loss_scale_factor),
    )


@dataclass
class StareGlobalPolicyLossConfig(PrepassPolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus STARE's knobs and ``prepass_layout``, validated on construction.

    Select it with ``actor_rollout_ref.actor.policy_loss._target_=verl_klcov_global.config.StareGlobalPolicyLossConfig``.
    It has no ``entropy_*`` knobs: the plugin's entropy controller does not apply to STARE, which brings its own
    entropy feedback (the gate and the adaptive W/M, docs/STARE.md).
    """

    loss_mode: str = "stare_global"
    stare_top_ratio: float = knob(
        DEFAULT_STARE_TOP_RATIO, valid="finite, [0, 1]", default_note=" (the paper's)",
        help="P: fraction of the minibatch's valid A > 0 tokens (and A < 0 ones), all DP ranks, reweighted: the most "
             "surprising (−log π)")
    stare_reweight_w: float = knob(
        DEFAULT_STARE_REWEIGHT_W, row="weights", valid="W >= 1; M in (0, 1]; `O1`/`C2`",
        help="W: the selected A > 0 tokens' loss × W")
    stare_reweight_m: float = knob(DEFAULT_STARE_REWEIGHT_M, row="weights", valid="in (0, 1]",
                                   help="M: in `C2` also the selected A < 0 tokens' loss × M")
    stare_variant: str = knob(DEFAULT_STARE_VARIANT, row="weights", valid="`O1`/`C2`", choices=STARE_VARIANTS,
                              help="the variant, `O1` (W only) or `C2` (W and M)")
    stare_target_entropy: float = knob(
        DEFAULT_STARE_TARGET_ENTROPY, valid="finite",
        help="gate: W and M apply while the trainer step's batch entropy (verl's `actor/entropy`) is below it "
             "([STARE](docs/STARE.md#the-gates-statistic-verls-actorentropy-in-the-workers))")
    stare_adaptive: bool = knob(
        False, row="schedule", valid="bool; α >= 0; on: W <= w_max, M >= m_min",
        help="the schedule, per trainer step: W ± α within [1, w_max], M ∓ α within [m_min, 1]")
    stare_alpha: float = knob(DEFAULT_STARE_ALPHA, row="schedule", help="α, the schedule's step", valid=">= 0")
    stare_w_max: float = knob(DEFAULT_STARE_W_MAX, row="schedule", help="w_max, its bound on W", valid=">= 1")
    stare_m_min: float = knob(DEFAULT_STARE_M_MIN, row="schedule", help="m_min, its bound on M", valid="in (0, 1]")

    def validate_knobs(self) -> None:
        validate_stare_knobs(self)
