"""The knobs of the global loss modes: their validated settings and the config classes that carry them.

The mode table (:mod:`verl_klcov_global.modes`) points each mode at its reader and class here.

Everything a user can set lives in ``actor_rollout_ref.actor.policy_loss``:

* ``loss_mode=kl_cov_global``, ``=clip_cov_global`` or ``=high_entropy_global`` selects this plugin;
* ``kl_cov_ratio`` (finite, in (0, 1]) and ``ppo_kl_coef`` (finite, >= 0) mean
  what they mean for verl's ``kl_cov``;
* ``clip_cov_ratio`` (finite, in (0, 1]), ``clip_cov_lb`` < ``clip_cov_ub`` (finite) mean
  what they mean for verl's ``clip_cov`` (defaults 0.0002, 1.0, 5.0, as verl's);
  ``actor.clip_ratio_low`` / ``clip_ratio_high`` are the PPO clip range, as for ``clip_cov``;
* ``clip_cov_seed`` (only with :class:`ClipCovGlobalPolicyLossConfig`; an integer in
  [0, 2**53), default :data:`DEFAULT_CLIP_COV_SEED` = 0): the seed of Clip-Cov's draw. The
  draw is a hash of (seed, sequence tokens, position), so every minibatch already gets its own
  draw; change the seed to get a different, equally valid one (e.g. per run of a sweep);
* ``entropy_top_ratio`` (``loss_mode=high_entropy_global``; finite, in (0, 1], default 0.2, the
  name of the authors' fork): the fraction of valid tokens, by current-policy entropy, that keep
  the PPO-clip loss (0.2 = the 20% highest-entropy tokens; TRL's ``top_entropy_quantile`` means the
  same). ``actor.clip_ratio_low`` / ``clip_ratio_high`` / ``clip_ratio_c`` are verl ``vanilla``'s;
* the entropy controller (only with the plugin's config classes; :mod:`.entropy_control`):
  ``entropy_target`` (nats per valid response token, finite, > 0; None, the default: off) holds the
  mean current-policy entropy of the optimizer minibatches on target by moving the mode's ratio knob
  (``kl_cov_ratio``, ``clip_cov_ratio`` or ``entropy_top_ratio``, the configured value being the start),
  with the gains ``entropy_control_ki`` / ``entropy_control_kp`` and within
  ``[entropy_control_min_ratio, entropy_control_max_ratio]`` (defaults per mode below);
* STARE (``loss_mode=stare_global``, only with :class:`StareGlobalPolicyLossConfig`): ``stare_top_ratio`` (P, in
  [0, 1], default 0.1), ``stare_variant`` (``O1``: W on the selected A > 0 tokens; ``C2``: also M on the selected
  A < 0 tokens), ``stare_reweight_w`` (>= 1, 1.1) and ``stare_reweight_m`` (in (0, 1], 0.9), the gate's
  ``stare_target_entropy`` (0.3 nats) and the schedule ``stare_adaptive`` / ``stare_alpha`` / ``stare_w_max`` /
  ``stare_m_min`` (off, 0.01, 1.5, 0.5); a per-token ``actor.loss_agg_mode`` (:data:`STARE_AGG_MODES`). It has
  no entropy controller (:func:`read_stare_settings` refuses its knobs);
* ``prepass_layout`` (only with the plugin's config classes,
  :class:`KLCovGlobalPolicyLossConfig` / :class:`ClipCovGlobalPolicyLossConfig` /
  :class:`HighEntropyGlobalPolicyLossConfig`): the
  micro-batch layout of the no-grad prepass, ``"infer"`` (default: the engine's log-prob
  inference settings, so the mask cannot depend on the training micro-batch size even in bf16)
  or ``"train"`` (the training micro-batch settings, as verl PR #7830 does).
  With dynamic batching the inference layout still depends on each rank's shard, so
  in bf16 (batch-shape-dependent log-probs) a different DP size can still move a
  near-tie; the training micro-batch size cannot. ``"old"`` (opt-in) runs no prepass at all:
  every optimizer step selects from the statistics of pi_old, the actor's weights at verl's
  log-prob pass (its ``old_log_probs`` and, where the mode or the controller reads it, that
  pass's entropy), not of the policy at the optimizer step (:mod:`.engine.old_policy`).

Numbers are read strictly: booleans and strings are rejected, never coerced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from verl.workers.config.actor import PolicyLossConfig

from .entropy_control import CONTROL_KNOBS, DEFAULT_WINDOW, EntropyControlSettings, validate_entropy_control
from .knob_doc import KnobDoc, knob
from .selection import (
    validate_clip_cov_ratio,
    validate_clip_cov_seed,
    validate_clip_cov_window,
    validate_clip_ratio,
    validate_entropy_top_ratio,
    validate_kl_cov_ratio,
    validate_lp_reg_ratio,
)
from .selection.knobs import POLICY_LOSS as POLICY_LOSS_PREFIX, finite_number, setting

#: Per-token field of the minibatch TensorDict that carries the selection mask (every global mode).
MASK_FIELD = "global_selection_mask"
PREPASS_LAYOUTS = ("infer", "train", "old")
#: The ``prepass_layout`` value that runs no prepass: every optimizer step selects from pi_old's statistics
#: (verl's ``old_log_probs``; the entropy of verl's log-prob pass), :mod:`.engine.old_policy`.
OLD_POLICY_LAYOUT = "old"
#: Actor strategies whose engine (verl's ``FSDPEngineWithLMHead``) the prepass hook covers.
SUPPORTED_STRATEGIES = ("fsdp", "fsdp2")
DEFAULT_CLIP_COV_SEED = 0


def unsupported_strategy_message(loss_mode: str, upstream: Optional[str], found: str) -> str:
    """The one wording of "the prepass does not cover this engine", for the driver and the engine alike.

    ``found`` says what was found (the config's strategy, or the engine's class and strategy);
    ``upstream`` is the per-micro-batch counterpart of ``loss_mode`` (None if it has none); it is
    suggested only when registered in verl's ``POLICY_LOSS_REGISTRY`` in this process (a lab-only
    comparator such as ``high_entropy_per_micro_batch`` is not a loss users can select).
    """
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    registered = upstream is not None and upstream in POLICY_LOSS_REGISTRY
    other = f"use loss_mode={upstream} (per-micro-batch selection)" if registered else "use another loss mode"
    return (f"loss_mode={loss_mode} supports verl's FSDP engine only (actor strategy {SUPPORTED_STRATEGIES}); "
            f"{found}. Set actor_rollout_ref.actor.strategy=fsdp2 (or fsdp), or {other}.")

# Upstream kl_cov's fallbacks when a field is None (verl 0.9.1 core_algos.py ~1884).
_DEFAULT_RATIO = 0.0002
_DEFAULT_COEF = 1.0
# Upstream clip_cov's fallbacks when a field is None (verl 0.9.1 core_algos.py ~1790).
_DEFAULT_CLIP_COV_RATIO = 0.0002
_DEFAULT_CLIP_COV_LB = 1.0
_DEFAULT_CLIP_COV_UB = 5.0
#: The paper's rho (Wang et al. 2025, arXiv:2506.01939; their fork's ``entropy_top_ratio=0.2``).
DEFAULT_ENTROPY_TOP_RATIO = 0.2
#: The entropy controller's gains (every mode): the proportional term carries the loop (a 10% entropy error
#: moves the ratio in use by e^1); the integral, ten times slower, removes the offset that is left
#: (HOW_IT_WORKS.md, "The law"; revised from 0.05 / 2.0 after the learning miniature, LEARNING.md).
DEFAULT_ENTROPY_CONTROL_KI = 0.1
DEFAULT_ENTROPY_CONTROL_KP = 10.0
#: 0: the error reads the measured entropy (0.5.0's law); > 0 optimizer steps: the entropy extrapolated that
#: far ahead along its trend over ``entropy_control_window`` steps (:mod:`.entropy_control`).
DEFAULT_ENTROPY_CONTROL_HORIZON = 0.0
DEFAULT_ENTROPY_CONTROL_WINDOW = DEFAULT_WINDOW
#: Bounds of the controlled ratio, per mode: KL-Cov's and Clip-Cov's around the papers' 2e-4 and 2e-3 (20x
#: below the smaller, 25x above the larger, at the ratio-units warning); the 80/20 rule's from 1% of the tokens
#: to all of them (1 = vanilla: the mode cannot lower entropy further).
DEFAULT_COV_CONTROL_BOUNDS = (1e-5, 0.05)
DEFAULT_HIGH_ENTROPY_CONTROL_BOUNDS = (0.01, 1.0)
# verl vanilla's fallback for the dual-clip bound when the actor config has none (core_algos.py ~1323).
_DEFAULT_CLIP_RATIO_C = 3.0


@dataclass(frozen=True)
class KLCovGlobalSettings:
    """Validated knobs of one actor config."""

    kl_cov_ratio: float
    ppo_kl_coef: float
    prepass_layout: str
    entropy_control: Optional[EntropyControlSettings] = None


@dataclass(frozen=True)
class ClipCovGlobalSettings:
    """Validated knobs of one actor config for ``clip_cov_global``."""

    clip_cov_ratio: float
    clip_cov_lb: float
    clip_cov_ub: float
    clip_cov_seed: int
    clip_ratio_low: float
    clip_ratio_high: float
    prepass_layout: str
    entropy_control: Optional[EntropyControlSettings] = None


@dataclass(frozen=True)
class HighEntropyGlobalSettings:
    """Validated knobs of one actor config for ``high_entropy_global``: the selection's ratio, verl
    ``vanilla``'s clip range and dual-clip bound (read as vanilla reads them), the prepass layout."""

    entropy_top_ratio: float
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    prepass_layout: str
    entropy_control: Optional[EntropyControlSettings] = None


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


@dataclass(frozen=True)
class StareGlobalSettings:
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
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    prepass_layout: str
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None
    gate_on: bool = True


DEFAULT_LP_REG_MIN_P = 0.02
DEFAULT_LP_REG_NEG_RATIO = 0.01
DEFAULT_LP_REG_POS_RATIO = 0.0
#: beta, the weight of the KL towards the proxy: the authors' scripts set ``ppo_kl_coef=1`` (Lp-Reg-dev@33b27e2,
#: recipe/lp_reg/*.sh:66). It is a knob of its own, ``lp_reg_kl_coef``, not verl's ``ppo_kl_coef``: verl's
#: ``actor.yaml`` writes ``ppo_kl_coef: 0.1`` into every ``policy_loss`` node it composes, so on the ``_target_``
#: route an unset beta would be verl's 0.1, not the authors' 1.
DEFAULT_LP_REG_KL_COEF = 1.0
#: Per-token field of the minibatch that carries, during one optimizer step, the proxy log-probs a mode reads from
#: verl's log-prob pass (``ModeSpec.proxy_min_p``; the objective's ``proxy_log_prob``), sliced like the mask.
PROXY_FIELD = "global_mode_proxy_log_probs"


@dataclass(frozen=True)
class LpRegGlobalSettings:
    """Validated ``lp_reg_global`` settings (:func:`read_lp_reg_settings`).

    ``neg_ratio`` / ``pos_ratio``: rho- / rho+ (fractions of each advantage sign's valid tokens of the optimizer
    minibatch); ``min_p``: kappa, the proxy's min-p threshold; ``kl_coef``: beta (``lp_reg_kl_coef``), the KL's
    weight on the regularised tokens; the PPO clip knobs as verl ``vanilla`` reads them."""

    neg_ratio: float
    pos_ratio: float
    min_p: float
    kl_coef: float
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    prepass_layout: str


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
    import dataclasses

    return next(f.default for f in dataclasses.fields(PolicyLossConfig) if f.name == "ppo_kl_coef")


def refuse_ppo_kl_coef_for_lp_reg(policy_loss: Any) -> None:
    """ValueError when a ``policy_loss`` of ``lp_reg_global`` carries a ``ppo_kl_coef`` other than verl's default:
    Lp-Reg does not read it (its beta is ``lp_reg_kl_coef``), so such a value is a beta the run would not get."""
    coef = _field(policy_loss, "ppo_kl_coef", None)
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
    neg = validate_lp_reg_ratio(_field(policy_loss, "lp_reg_neg_ratio", DEFAULT_LP_REG_NEG_RATIO), "lp_reg_neg_ratio")
    pos = validate_lp_reg_ratio(_field(policy_loss, "lp_reg_pos_ratio", DEFAULT_LP_REG_POS_RATIO), "lp_reg_pos_ratio")
    if neg == 0.0 and pos == 0.0:
        raise ValueError("lp_reg_neg_ratio and lp_reg_pos_ratio are both 0: lp_reg_global would regularise no token "
                         "(verl's vanilla plus a prepass); " + setting("lp_reg_neg_ratio", "0.01 (the authors' value)"))
    refuse_ppo_kl_coef_for_lp_reg(policy_loss)
    return {"neg_ratio": neg, "pos_ratio": pos,
            "min_p": validate_lp_reg_min_p(_field(policy_loss, "lp_reg_min_p", DEFAULT_LP_REG_MIN_P)),
            "kl_coef": validate_lp_reg_kl_coef(_field(policy_loss, "lp_reg_kl_coef", DEFAULT_LP_REG_KL_COEF))}


def read_lp_reg_settings(actor_config: Any) -> LpRegGlobalSettings:
    """Validated :class:`LpRegGlobalSettings` from an actor config (its ``policy_loss``; the PPO clip knobs read as
    verl ``vanilla`` reads them). The plugin's entropy controller does not apply (its keys are refused)."""
    policy_loss = _policy_loss_of(actor_config, "lp_reg_global")
    controller = controller_knobs_set(policy_loss)
    if controller:
        raise ValueError(
            f"{controller[0]} is a knob of the plugin's entropy controller, which lp_reg_global does not have (it has "
            f"no ratio whose size moves entropy one way): remove {POLICY_LOSS_PREFIX}{controller[0]}")
    clip_ratio = getattr(actor_config, "clip_ratio", None)
    low, high = (_field(actor_config, key, clip_ratio) for key in ("clip_ratio_low", "clip_ratio_high"))
    return LpRegGlobalSettings(
        **validate_lp_reg_knobs(policy_loss),
        clip_ratio_low=validate_clip_ratio(low, "clip_ratio_low"),
        clip_ratio_high=validate_clip_ratio(high, "clip_ratio_high"),
        clip_ratio_c=validate_clip_ratio_c(_field(actor_config, "clip_ratio_c", _DEFAULT_CLIP_RATIO_C)),
        prepass_layout=validate_prepass_layout(_field(policy_loss, "prepass_layout", "infer")),
    )


def validate_clip_ratio_c(value: Any) -> float:
    """The dual-clip bound ``clip_ratio_c`` as float if finite and > 1 (verl ``vanilla`` asserts it), else ValueError."""
    number = finite_number(value)
    if number is None or number <= 1.0:
        raise ValueError(f"clip_ratio_c must be finite and > 1 (the dual-clip lower bound of the ratio), got {value!r}; "
                         + setting("clip_ratio_c", "3.0 (verl's default)", "actor_rollout_ref.actor."))
    return number


def validate_ppo_kl_coef(coef: Any) -> float:
    """Return ``coef`` as float if it is a finite number >= 0 (not a bool or a string), else raise ValueError."""
    value = finite_number(coef)
    if value is None or value < 0:
        raise ValueError(
            f"ppo_kl_coef must be finite and >= 0, got {coef!r}; " + setting("ppo_kl_coef", "1.0 (the paper's value)")
        )
    return value


def validate_prepass_layout(layout: Any) -> str:
    if layout not in PREPASS_LAYOUTS:
        raise ValueError(
            f"prepass_layout must be one of {PREPASS_LAYOUTS}, got {layout!r}; "
            "set actor_rollout_ref.actor.policy_loss.prepass_layout=infer (default), =train or =old (no prepass: "
            "select from the old policy's statistics, docs/PREPASS.md)"
        )
    return layout


def controller_knobs_set(policy_loss: Any) -> list[str]:
    """The entropy controller's keys (:data:`.entropy_control.CONTROL_KNOBS`) that ``policy_loss`` sets: refused by a
    mode without a controller."""
    return [key for key in CONTROL_KNOBS if _field(policy_loss, key, None) is not None]


def _field(policy_loss: Any, name: str, default: Any) -> Any:
    value = policy_loss.get(name, None) if hasattr(policy_loss, "get") else getattr(policy_loss, name, None)
    return default if value is None else value


def read_entropy_control(policy_loss: Any, bounds: tuple[float, float]) -> Optional[EntropyControlSettings]:
    """The controller's validated settings from a ``policy_loss`` (None: ``entropy_target`` unset, off).

    ``bounds``: the mode's default ``(min, max)`` of the controlled ratio. verl's own ``PolicyLossConfig`` has
    none of these keys: the controller needs the plugin's config class (``policy_loss._target_``).
    """
    return validate_entropy_control(
        _field(policy_loss, "entropy_target", None),
        _field(policy_loss, "entropy_control_ki", DEFAULT_ENTROPY_CONTROL_KI),
        _field(policy_loss, "entropy_control_kp", DEFAULT_ENTROPY_CONTROL_KP),
        _field(policy_loss, "entropy_control_min_ratio", bounds[0]),
        _field(policy_loss, "entropy_control_max_ratio", bounds[1]),
        _field(policy_loss, "entropy_control_horizon", DEFAULT_ENTROPY_CONTROL_HORIZON),
        _field(policy_loss, "entropy_control_window", DEFAULT_ENTROPY_CONTROL_WINDOW),
    )


def loss_mode_of(actor_config: Any) -> Optional[str]:
    """The ``policy_loss.loss_mode`` of an actor config (verl ``ActorConfig`` or a mapping like it).

    ``"vanilla"`` (verl's default) when the field is None; None when there is no config or no ``policy_loss``.
    Which loss modes are the plugin's is the mode table's business (:func:`verl_klcov_global.modes.global_mode_of`).
    """
    policy_loss = getattr(actor_config, "policy_loss", None)
    if policy_loss is None and hasattr(actor_config, "get"):
        policy_loss = actor_config.get("policy_loss", None)
    if policy_loss is None:
        return None
    return _field(policy_loss, "loss_mode", "vanilla")


def _policy_loss_of(actor_config: Any, mode: str) -> Any:
    if actor_config is None or getattr(actor_config, "policy_loss", None) is None:
        raise ValueError(f"{mode} needs the actor config (with policy_loss) passed as `config`")
    return actor_config.policy_loss


def read_kl_cov_settings(actor_config: Any) -> KLCovGlobalSettings:
    """Validated :class:`KLCovGlobalSettings` from an actor config's ``policy_loss``."""
    policy_loss = _policy_loss_of(actor_config, "kl_cov_global")
    return KLCovGlobalSettings(
        kl_cov_ratio=validate_kl_cov_ratio(_field(policy_loss, "kl_cov_ratio", _DEFAULT_RATIO)),
        ppo_kl_coef=validate_ppo_kl_coef(_field(policy_loss, "ppo_kl_coef", _DEFAULT_COEF)),
        prepass_layout=validate_prepass_layout(_field(policy_loss, "prepass_layout", "infer")),
        entropy_control=read_entropy_control(policy_loss, DEFAULT_COV_CONTROL_BOUNDS),
    )


def read_clip_cov_settings(actor_config: Any) -> ClipCovGlobalSettings:
    """Validated :class:`ClipCovGlobalSettings` from an actor config (its ``policy_loss`` and clip ratios).

    The PPO clip range follows upstream ``clip_cov``: ``clip_ratio_low`` / ``clip_ratio_high``,
    each falling back to ``clip_ratio`` when None.
    """
    policy_loss = _policy_loss_of(actor_config, "clip_cov_global")
    lb, ub = validate_clip_cov_window(_field(policy_loss, "clip_cov_lb", _DEFAULT_CLIP_COV_LB),
                                      _field(policy_loss, "clip_cov_ub", _DEFAULT_CLIP_COV_UB))
    clip_ratio = getattr(actor_config, "clip_ratio", None)
    low, high = (_field(actor_config, key, clip_ratio) for key in ("clip_ratio_low", "clip_ratio_high"))
    return ClipCovGlobalSettings(
        clip_cov_ratio=validate_clip_cov_ratio(_field(policy_loss, "clip_cov_ratio", _DEFAULT_CLIP_COV_RATIO)),
        clip_cov_lb=lb,
        clip_cov_ub=ub,
        clip_cov_seed=validate_clip_cov_seed(_field(policy_loss, "clip_cov_seed", DEFAULT_CLIP_COV_SEED)),
        clip_ratio_low=validate_clip_ratio(low, "clip_ratio_low"),
        clip_ratio_high=validate_clip_ratio(high, "clip_ratio_high"),
        prepass_layout=validate_prepass_layout(_field(policy_loss, "prepass_layout", "infer")),
        entropy_control=read_entropy_control(policy_loss, DEFAULT_COV_CONTROL_BOUNDS),
    )


def read_high_entropy_settings(actor_config: Any) -> HighEntropyGlobalSettings:
    """Validated :class:`HighEntropyGlobalSettings` from an actor config (its ``policy_loss`` and PPO clip knobs).

    ``entropy_top_ratio`` defaults to :data:`DEFAULT_ENTROPY_TOP_RATIO` (0.2); the clip range as verl
    ``vanilla`` reads it (``clip_ratio_low`` / ``clip_ratio_high``, each falling back to ``clip_ratio``),
    ``clip_ratio_c`` defaulting to 3.0 as in ``vanilla``.
    """
    policy_loss = _policy_loss_of(actor_config, "high_entropy_global")
    clip_ratio = getattr(actor_config, "clip_ratio", None)
    low, high = (_field(actor_config, key, clip_ratio) for key in ("clip_ratio_low", "clip_ratio_high"))
    return HighEntropyGlobalSettings(
        entropy_top_ratio=validate_entropy_top_ratio(
            _field(policy_loss, "entropy_top_ratio", DEFAULT_ENTROPY_TOP_RATIO)),
        clip_ratio_low=validate_clip_ratio(low, "clip_ratio_low"),
        clip_ratio_high=validate_clip_ratio(high, "clip_ratio_high"),
        clip_ratio_c=validate_clip_ratio_c(_field(actor_config, "clip_ratio_c", _DEFAULT_CLIP_RATIO_C)),
        prepass_layout=validate_prepass_layout(_field(policy_loss, "prepass_layout", "infer")),
        entropy_control=read_entropy_control(policy_loss, DEFAULT_HIGH_ENTROPY_CONTROL_BOUNDS),
    )


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
    from .selection.stare import validate_stare_top_ratio

    top_ratio = validate_stare_top_ratio(_field(policy_loss, "stare_top_ratio", DEFAULT_STARE_TOP_RATIO))
    w = _stare_number(_field(policy_loss, "stare_reweight_w", DEFAULT_STARE_REWEIGHT_W), "stare_reweight_w",
                      lambda x: x >= 1.0, "finite and >= 1 (the weight of the surprising A > 0 tokens)",
                      "1.1 (the paper's; 1.05 for 14B and 32B)")
    m = _stare_number(_field(policy_loss, "stare_reweight_m", DEFAULT_STARE_REWEIGHT_M), "stare_reweight_m",
                      lambda x: 0.0 < x <= 1.0, "finite and in (0, 1] (the weight of the surprising A < 0 tokens)",
                      "0.9 (the paper's; 0.95 for 14B and 32B)")
    variant = validate_stare_variant(_field(policy_loss, "stare_variant", DEFAULT_STARE_VARIANT))
    target = _stare_number(_field(policy_loss, "stare_target_entropy", DEFAULT_STARE_TARGET_ENTROPY),
                           "stare_target_entropy", lambda x: True,
                           "finite (nats per token: the weights apply while the batch's mean entropy is below it)",
                           "0.3 (the paper's)")
    adaptive = _field(policy_loss, "stare_adaptive", False)
    if not isinstance(adaptive, bool):
        raise ValueError(f"stare_adaptive must be true or false, got {adaptive!r}; "
                         + setting("stare_adaptive", "false (the paper's default: W and M fixed)"))
    alpha = _stare_number(_field(policy_loss, "stare_alpha", DEFAULT_STARE_ALPHA), "stare_alpha",
                          lambda x: x >= 0.0, "finite and >= 0 (the schedule's step of W and M per trainer step)",
                          "0.01 (the paper's)")
    w_max = _stare_number(_field(policy_loss, "stare_w_max", DEFAULT_STARE_W_MAX), "stare_w_max",
                          lambda x: x >= 1.0, "finite and >= 1 (the schedule's upper bound of W)", "1.5 (the paper's)")
    m_min = _stare_number(_field(policy_loss, "stare_m_min", DEFAULT_STARE_M_MIN), "stare_m_min",
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
    policy_loss = _policy_loss_of(actor_config, "stare_global")
    controller = controller_knobs_set(policy_loss)
    if controller:
        raise ValueError(
            f"{controller[0]} is a knob of the plugin's entropy controller, which stare_global does not have: STARE "
            "brings its own entropy feedback (its gate stare_target_entropy and the adaptive W/M), and a second loop "
            f"on the same entropy would fight it. Remove {POLICY_LOSS_PREFIX}{controller[0]}; set "
            f"{POLICY_LOSS_PREFIX}stare_target_entropy (and stare_adaptive) instead")
    loss_agg_mode = _field(actor_config, "loss_agg_mode", "token-mean")
    loss_scale_factor = _field(actor_config, "loss_scale_factor", None)
    validate_stare_agg_mode(loss_agg_mode, loss_scale_factor)
    clip_ratio = getattr(actor_config, "clip_ratio", None)
    low, high = (_field(actor_config, key, clip_ratio) for key in ("clip_ratio_low", "clip_ratio_high"))
    return StareGlobalSettings(
        **validate_stare_knobs(policy_loss),
        clip_ratio_low=validate_clip_ratio(low, "clip_ratio_low"),
        clip_ratio_high=validate_clip_ratio(high, "clip_ratio_high"),
        clip_ratio_c=validate_clip_ratio_c(_field(actor_config, "clip_ratio_c", _DEFAULT_CLIP_RATIO_C)),
        prepass_layout=validate_prepass_layout(_field(policy_loss, "prepass_layout", "infer")),
        loss_agg_mode=loss_agg_mode,
        loss_scale_factor=None if loss_scale_factor is None else float(loss_scale_factor),
    )


def _require_loss_mode(config: PolicyLossConfig) -> None:
    """``config.loss_mode`` must be its class's own default: a class is judged by its own ``loss_mode``, so a user's
    subclass of a plugin class (its ``loss_mode`` defaulting to the user's mode) is not refused for the parent's."""
    expected = type(config).loss_mode
    if config.loss_mode != expected:
        # verl's ppo_trainer.yaml sets loss_mode "vanilla": selecting a class through
        # `policy_loss._target_` alone would silently train without the plugin's loss.
        raise ValueError(
            f"{type(config).__name__} carries the knobs of loss_mode={expected}, but loss_mode is "
            f"{config.loss_mode!r}: set actor_rollout_ref.actor.policy_loss.loss_mode={expected}, or drop "
            "actor_rollout_ref.actor.policy_loss._target_ (verl's PolicyLossConfig) for other loss modes"
        )


def _parent_post_init(config: PolicyLossConfig, cls: type) -> None:
    parent_post_init = getattr(super(cls, config), "__post_init__", None)
    if parent_post_init is not None:
        parent_post_init()


_RATIO_OF_MINIBATCH = "of the minibatch's valid response tokens (all DP ranks)"


@dataclass
class PrepassPolicyLossConfig(PolicyLossConfig):
    """The knob every global mode carries, defined once: ``prepass_layout``. Not selected itself (its ``loss_mode``
    is verl's): each mode's class derives from it, or from :class:`GlobalModePolicyLossConfig`."""

    prepass_layout: str = knob(
        "infer", valid="`infer`, `train`, `old`",
        help="prepass micro-batching: `infer` (the log-prob inference settings) or `train` (the training ones); "
             "`old` (opt-in): no prepass, every step selects from π_old's statistics, not the current policy's "
             "([PREPASS](docs/PREPASS.md#prepass_layoutold-the-old-policys-statistics-no-prepass))")


@dataclass
class GlobalModePolicyLossConfig(PrepassPolicyLossConfig):
    """The knobs every mode with an entropy controller carries, defined once: ``prepass_layout`` and the
    controller's seven.

    Not selected itself (its ``loss_mode`` is verl's): each mode's class derives from it, sets its own ``loss_mode``
    and, where the controlled ratio's bounds differ from KL-Cov's and Clip-Cov's, the two bound defaults and
    :attr:`CONTROL_BOUNDS` together. :meth:`validate_common_knobs` checks what is defined here.
    """

    #: the default (min, max) of the controlled ratio, as the two fields below default (read by the controller's
    #: validation; a subclass that changes one changes both)
    CONTROL_BOUNDS: ClassVar[tuple[float, float]] = DEFAULT_COV_CONTROL_BOUNDS

    entropy_target: Optional[float] = knob(
        None, controller=True, valid="finite, > 0, < ln(vocab)", default_note=" (off)",
        help="entropy controller: holds the minibatches' mean entropy here by moving the mode's ratio knob "
             "([HOW_IT_WORKS](docs/HOW_IT_WORKS.md#entropy-on-target-the-controller))")
    entropy_control_ki: float = knob(
        DEFAULT_ENTROPY_CONTROL_KI, controller=True, row="gains", valid="finite, >= 0, not both 0",
        help="the controller's integral gain (per optimizer step, in ln(ratio))")
    entropy_control_kp: float = knob(DEFAULT_ENTROPY_CONTROL_KP, controller=True, row="gains", valid="finite, >= 0",
                                     help="the controller's proportional gain")
    entropy_control_min_ratio: float = knob(
        DEFAULT_COV_CONTROL_BOUNDS[0], controller=True, row="bounds", valid="0 < min < max <= 1",
        help="lower bound of the controlled ratio")
    entropy_control_max_ratio: float = knob(DEFAULT_COV_CONTROL_BOUNDS[1], controller=True, row="bounds",
                                            help="upper bound of the controlled ratio", valid="<= 1")
    entropy_control_horizon: float = knob(
        DEFAULT_ENTROPY_CONTROL_HORIZON, controller=True, row="horizon", valid="finite >= 0; whole >= 1",
        help="the controller's error reads the entropy extrapolated this many optimizer steps ahead along its "
             "trend (0: the measured entropy)")
    entropy_control_window: int = knob(DEFAULT_ENTROPY_CONTROL_WINDOW, controller=True, row="horizon",
                                       help="the trend's window, in optimizer steps", valid="whole >= 1")

    def validate_common_knobs(self) -> None:
        """``prepass_layout`` and the controller's knobs (ValueError naming the key, as the driver's check)."""
        validate_prepass_layout(self.prepass_layout)
        read_entropy_control(self, self.CONTROL_BOUNDS)


@dataclass
class KLCovGlobalPolicyLossConfig(GlobalModePolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus this plugin's knobs (:class:`GlobalModePolicyLossConfig`), validated on
    construction.

    Select it with ``actor_rollout_ref.actor.policy_loss._target_=verl_klcov_global.config.KLCovGlobalPolicyLossConfig``.
    """

    VERL_KNOBS: ClassVar[dict[str, KnobDoc]] = {
        "kl_cov_ratio": KnobDoc(f"fraction {_RATIO_OF_MINIBATCH} that get the penalty", "finite, (0, 1]"),
        "ppo_kl_coef": KnobDoc("coefficient of `\\|log π − log π_old\\|` on the selected tokens", "finite, >= 0",
                               default_note="; 1.0 in `kl_cov_global.yaml` (the paper's)"),
    }
    loss_mode: str = "kl_cov_global"

    def __post_init__(self):
        _parent_post_init(self, KLCovGlobalPolicyLossConfig)
        _require_loss_mode(self)
        validate_kl_cov_ratio(self.kl_cov_ratio)
        validate_ppo_kl_coef(self.ppo_kl_coef)
        self.validate_common_knobs()


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

    def __post_init__(self):
        _parent_post_init(self, ClipCovGlobalPolicyLossConfig)
        _require_loss_mode(self)
        validate_clip_cov_ratio(self.clip_cov_ratio)
        validate_clip_cov_window(self.clip_cov_lb, self.clip_cov_ub)
        validate_clip_cov_seed(self.clip_cov_seed)
        self.validate_common_knobs()


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
        help=f"ρ: fraction {_RATIO_OF_MINIBATCH} that keep the PPO-clip loss, by current-policy entropy")
    entropy_control_min_ratio: float = knob(DEFAULT_HIGH_ENTROPY_CONTROL_BOUNDS[0], controller=True, row="bounds",
                                            help="lower bound of the controlled ratio", valid="0 < min < max <= 1")
    entropy_control_max_ratio: float = knob(DEFAULT_HIGH_ENTROPY_CONTROL_BOUNDS[1], controller=True, row="bounds",
                                            help="upper bound of the controlled ratio", valid="<= 1")

    def __post_init__(self):
        _parent_post_init(self, HighEntropyGlobalPolicyLossConfig)
        _require_loss_mode(self)
        validate_entropy_top_ratio(self.entropy_top_ratio)
        self.validate_common_knobs()


@dataclass
class StareGlobalPolicyLossConfig(PrepassPolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus STARE's knobs and ``prepass_layout``, validated on construction.

    Select it with ``actor_rollout_ref.actor.policy_loss._target_=verl_klcov_global.config.StareGlobalPolicyLossConfig``.
    It has no ``entropy_*`` knobs: the plugin's entropy controller does not apply to STARE, which brings its own
    entropy feedback (the gate and the adaptive W/M, docs/HOW_IT_WORKS.md "STARE").
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
             "([HOW_IT_WORKS](docs/HOW_IT_WORKS.md#stare-stare_global))")
    stare_adaptive: bool = knob(
        False, row="schedule", valid="bool; α >= 0; on: W <= w_max, M >= m_min",
        help="the schedule, per trainer step: W ± α within [1, w_max], M ∓ α within [m_min, 1]")
    stare_alpha: float = knob(DEFAULT_STARE_ALPHA, row="schedule", help="α, the schedule's step", valid=">= 0")
    stare_w_max: float = knob(DEFAULT_STARE_W_MAX, row="schedule", help="w_max, its bound on W", valid=">= 1")
    stare_m_min: float = knob(DEFAULT_STARE_M_MIN, row="schedule", help="m_min, its bound on M", valid="in (0, 1]")

    def __post_init__(self):
        _parent_post_init(self, StareGlobalPolicyLossConfig)
        _require_loss_mode(self)
        validate_stare_knobs(self)
        validate_prepass_layout(self.prepass_layout)


@dataclass
class LpRegGlobalPolicyLossConfig(PrepassPolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus Lp-Reg's knobs and ``prepass_layout``, validated on construction.

    Select it with ``actor_rollout_ref.actor.policy_loss._target_=verl_klcov_global.config.LpRegGlobalPolicyLossConfig``.
    ``lp_reg_neg_ratio`` / ``lp_reg_pos_ratio``: rho- / rho+ (the authors' 0.01 / 0); ``lp_reg_min_p``: kappa, the
    proxy's min-p threshold (0.02); ``lp_reg_kl_coef``: beta (1.0), the KL's weight (not verl's ``ppo_kl_coef``, which
    verl's YAML sets to 0.1 on every route; a ``ppo_kl_coef`` other than that is refused). No ``entropy_*`` knobs:
    the plugin's entropy controller does not apply (docs/HOW_IT_WORKS.md, "Lp-Reg").
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
        help="κ: the proxy keeps π_old's tokens with p >= κ·max p ([HOW_IT_WORKS](docs/HOW_IT_WORKS.md#lp-reg-lp_reg_global))")
    lp_reg_kl_coef: float = knob(DEFAULT_LP_REG_KL_COEF, row="proxy", valid="finite, >= 0",
                                 help="β: weight of the KL to the proxy (not verl's `ppo_kl_coef`, which must stay 0.1)")

    def __post_init__(self):
        _parent_post_init(self, LpRegGlobalPolicyLossConfig)
        _require_loss_mode(self)
        validate_lp_reg_knobs(self)
        validate_prepass_layout(self.prepass_layout)
