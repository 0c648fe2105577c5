"""What every global mode's configuration shares: the fields of the minibatch, the prepass layouts, the knob
readers and validators, and the config-class bases each method's class derives from.

A method's own knobs, settings and config class live in its folder (``methods/<name>/config.py``);
:mod:`verl_klcov_global.config` re-exports the classes users name in ``policy_loss._target_``.

Every knob a user sets lives in ``actor_rollout_ref.actor.policy_loss`` (the README's knob table, made from the
config classes). Shared here: ``prepass_layout`` (:class:`PrepassPolicyLossConfig`): the micro-batch layout of
the no-grad prepass, ``"infer"`` (default: the engine's log-prob inference settings, so the mask cannot depend on
the training micro-batch size even in bf16) or ``"train"`` (the training micro-batch settings, as verl PR #7830
does). With dynamic batching the inference layout still depends on each rank's shard, so in bf16
(batch-shape-dependent log-probs) a different DP size can still move a near-tie; the training micro-batch size
cannot. ``"old"`` (opt-in) runs no prepass at all: every optimizer step selects from the statistics of pi_old, the
actor's weights at verl's log-prob pass, not of the policy at the optimizer step (:mod:`.engine.old_policy`).
The entropy controller's seven knobs (:class:`GlobalModePolicyLossConfig`, :mod:`.entropy_control`) move a mode's
ratio knob to hold the minibatches' mean entropy on ``entropy_target``.

Numbers are read strictly: booleans and strings are rejected, never coerced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from verl.workers.config.actor import PolicyLossConfig

from .entropy_control import (
    CONTROL_KNOBS, DEFAULT_HORIZON, DEFAULT_HYSTERESIS, DEFAULT_WINDOW, EntropyControlSettings,
    validate_entropy_control,
)
from .knob_doc import knob
from .selection.knobs import POLICY_LOSS as POLICY_LOSS_PREFIX, finite_number, setting, validate_clip_ratio

__all__ = [
    "DEFAULT_CLIP_RATIO_C", "DEFAULT_COV_CONTROL_BOUNDS", "DEFAULT_ENTROPY_CONTROL_HORIZON", "DEFAULT_ENTROPY_CONTROL_KI",
    "DEFAULT_ENTROPY_CONTROL_KP", "DEFAULT_ENTROPY_CONTROL_WINDOW", "MASK_FIELD", "OLD_POLICY_LAYOUT", "PREPASS_LAYOUTS",
    "PROXY_FIELD", "RATIO_OF_MINIBATCH", "ModeSettings", "ClippedModeSettings", "clipped_settings", "common_settings", "refuse_controller_knobs", "SUPPORTED_STRATEGIES", "GlobalModePolicyLossConfig", "PrepassPolicyLossConfig",
    "controller_knobs_set", "knob_value", "loss_mode_of", "max_ratio_knob", "min_ratio_knob", "parent_post_init", "policy_loss_of", "ppo_clip_settings",
    "read_entropy_control", "require_loss_mode", "unsupported_strategy_message", "validate_clip_ratio_c",
    "validate_prepass_layout",
]

#: Per-token field of the minibatch TensorDict that carries the selection mask (every global mode).
MASK_FIELD = "global_selection_mask"
PREPASS_LAYOUTS = ("infer", "train", "old")
#: The ``prepass_layout`` value that runs no prepass: every optimizer step selects from pi_old's statistics
#: (verl's ``old_log_probs``; the entropy of verl's log-prob pass), :mod:`.engine.old_policy`.
OLD_POLICY_LAYOUT = "old"
#: Actor strategies whose engine (verl's ``FSDPEngineWithLMHead``) the prepass hook covers.
SUPPORTED_STRATEGIES = ("fsdp", "fsdp2")


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

#: The floor law's gains (every mode; :mod:`.entropy_control`): ``kp`` brakes harder below the target (a
#: predicted deficit of 7% or more doubles the ratio in one optimizer step, the most a step moves it); ``ki``
#: eases back towards the user's ratio above the hysteresis band (a 10% surplus: ln r moves by 0.1 a step).
DEFAULT_ENTROPY_CONTROL_KI = 1.0
DEFAULT_ENTROPY_CONTROL_KP = 10.0
#: The prediction: the entropy 8 optimizer steps ahead along its trend over the last 4 (0: the measured entropy).
DEFAULT_ENTROPY_CONTROL_HORIZON = DEFAULT_HORIZON
DEFAULT_ENTROPY_CONTROL_WINDOW = DEFAULT_WINDOW
DEFAULT_ENTROPY_CONTROL_HYSTERESIS = DEFAULT_HYSTERESIS
#: Bounds of the controlled ratio, per mode: KL-Cov's and Clip-Cov's around the papers' 2e-4 and 2e-3 (20x
#: below the smaller, 25x above the larger, at the ratio-units warning); the 80/20 rule's from 1% of the tokens
#: to all of them (1 = vanilla: the mode cannot lower entropy further).
DEFAULT_COV_CONTROL_BOUNDS = (1e-5, 0.05)
# verl vanilla's fallback for the dual-clip bound when the actor config has none (compute_policy_loss_vanilla).
DEFAULT_CLIP_RATIO_C = 3.0


#: Per-token field of the minibatch that carries, during one optimizer step, the proxy log-probs a mode reads from
#: verl's log-prob pass (``ModeSpec.proxy_min_p``; the objective's ``proxy_log_prob``), sliced like the mask.
PROXY_FIELD = "global_mode_proxy_log_probs"


def validate_clip_ratio_c(value: Any) -> float:
    """The dual-clip bound ``clip_ratio_c`` as float if finite and > 1 (verl ``vanilla`` asserts it), else ValueError."""
    number = finite_number(value)
    if number is None or number <= 1.0:
        raise ValueError(f"clip_ratio_c must be finite and > 1 (the dual-clip lower bound of the ratio), got {value!r}; "
                         + setting("clip_ratio_c", "3.0 (verl's default)", "actor_rollout_ref.actor."))
    return number


def ppo_clip_settings(actor_config: Any, dual_clip: bool = True) -> dict[str, float]:
    """The PPO clip knobs of an actor config as verl's losses read them, validated (ValueError naming the key):
    ``clip_ratio_low`` / ``clip_ratio_high``, each falling back to ``clip_ratio`` when None, and with ``dual_clip``
    the dual-clip bound ``clip_ratio_c`` (verl ``vanilla``'s 3.0 when None)."""
    clip_ratio = getattr(actor_config, "clip_ratio", None)
    low, high = (knob_value(actor_config, key, clip_ratio) for key in ("clip_ratio_low", "clip_ratio_high"))
    settings = {"clip_ratio_low": validate_clip_ratio(low, "clip_ratio_low"),
                "clip_ratio_high": validate_clip_ratio(high, "clip_ratio_high")}
    if dual_clip:
        settings["clip_ratio_c"] = validate_clip_ratio_c(knob_value(actor_config, "clip_ratio_c", DEFAULT_CLIP_RATIO_C))
    return settings


@dataclass(frozen=True, kw_only=True)
class ModeSettings:
    """The base of every mode's validated settings (keyword-only fields): what :func:`common_settings` reads,
    ``prepass_layout`` and ``entropy_control`` (None: the controller is off, or the mode has none)."""

    prepass_layout: str
    entropy_control: Optional[EntropyControlSettings] = None


@dataclass(frozen=True, kw_only=True)
class ClippedModeSettings(ModeSettings):
    """:class:`ModeSettings` of a mode with verl ``vanilla``'s PPO clip range (:func:`ppo_clip_settings`)."""

    clip_ratio_low: float
    clip_ratio_high: float


def common_settings(policy_loss: Any, control_bounds: Optional[tuple[float, float]] = None) -> dict[str, Any]:
    """The settings every mode shares, validated (ValueError naming the key): ``prepass_layout``, and with
    ``control_bounds`` (the mode's default bounds of its controlled ratio) the entropy controller's
    ``entropy_control`` (:func:`read_entropy_control`)."""
    settings = {"prepass_layout": validate_prepass_layout(knob_value(policy_loss, "prepass_layout", "infer"))}
    if control_bounds is not None:
        settings["entropy_control"] = read_entropy_control(policy_loss, control_bounds)
    return settings


def clipped_settings(actor_config: Any, policy_loss: Any, control_bounds: Optional[tuple[float, float]] = None, *,
                     dual_clip: bool = True) -> dict[str, Any]:
    """The fields of :class:`ClippedModeSettings` (plus ``clip_ratio_c`` with ``dual_clip``), validated:
    :func:`ppo_clip_settings` of ``actor_config`` and :func:`common_settings` of ``policy_loss``."""
    return {**ppo_clip_settings(actor_config, dual_clip=dual_clip), **common_settings(policy_loss, control_bounds)}


def refuse_controller_knobs(policy_loss: Any, mode: str, why: str) -> None:
    """ValueError when ``policy_loss`` sets a knob of the entropy controller, which ``mode`` does not have: the
    message names the first such key, says ``why`` (the mode's reason and what to set instead) and to remove it."""
    controller = controller_knobs_set(policy_loss)
    if controller:
        raise ValueError(f"{controller[0]} is a knob of the plugin's entropy controller, which {mode} does not have: "
                         f"{why}. Remove {POLICY_LOSS_PREFIX}{controller[0]}")


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
    return [key for key in CONTROL_KNOBS if knob_value(policy_loss, key, None) is not None]


def knob_value(policy_loss: Any, name: str, default: Any) -> Any:
    value = policy_loss.get(name, None) if hasattr(policy_loss, "get") else getattr(policy_loss, name, None)
    return default if value is None else value


def read_entropy_control(policy_loss: Any, bounds: tuple[float, float]) -> Optional[EntropyControlSettings]:
    """The controller's validated settings from a ``policy_loss`` (None: ``entropy_target`` unset, off).

    ``bounds``: the mode's default ``(min, max)`` of the controlled ratio. verl's own ``PolicyLossConfig`` has
    none of these keys: the controller needs the plugin's config class (``policy_loss._target_``).
    """
    return validate_entropy_control(
        knob_value(policy_loss, "entropy_target", None),
        knob_value(policy_loss, "entropy_control_ki", DEFAULT_ENTROPY_CONTROL_KI),
        knob_value(policy_loss, "entropy_control_kp", DEFAULT_ENTROPY_CONTROL_KP),
        knob_value(policy_loss, "entropy_control_min_ratio", bounds[0]),
        knob_value(policy_loss, "entropy_control_max_ratio", bounds[1]),
        knob_value(policy_loss, "entropy_control_horizon", DEFAULT_ENTROPY_CONTROL_HORIZON),
        knob_value(policy_loss, "entropy_control_window", DEFAULT_ENTROPY_CONTROL_WINDOW),
        knob_value(policy_loss, "entropy_control_hysteresis", DEFAULT_ENTROPY_CONTROL_HYSTERESIS),
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
    return knob_value(policy_loss, "loss_mode", "vanilla")


def policy_loss_of(actor_config: Any, mode: str, *, no_controller_because: Optional[str] = None) -> Any:
    """``actor_config.policy_loss`` (ValueError when there is none). For a mode without the entropy controller,
    ``no_controller_because`` says why (its reason and what to set instead): a controller knob set there is refused
    (:func:`refuse_controller_knobs`)."""
    if actor_config is None or getattr(actor_config, "policy_loss", None) is None:
        raise ValueError(f"{mode} needs the actor config (with policy_loss) passed as `config`")
    if no_controller_because is not None:
        refuse_controller_knobs(actor_config.policy_loss, mode, no_controller_because)
    return actor_config.policy_loss


def require_loss_mode(config: PolicyLossConfig) -> None:
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


def parent_post_init(config: PolicyLossConfig, cls: type) -> None:
    parent_post_init = getattr(super(cls, config), "__post_init__", None)
    if parent_post_init is not None:
        parent_post_init()


RATIO_OF_MINIBATCH = "of the minibatch's valid response tokens (all DP ranks)"


@dataclass
class PrepassPolicyLossConfig(PolicyLossConfig):
    """The knob every global mode carries, defined once: ``prepass_layout``. Not selected itself (its ``loss_mode``
    is verl's): each mode's class derives from it, or from :class:`GlobalModePolicyLossConfig`."""

    prepass_layout: str = knob(
        "infer", valid="`infer`, `train`, `old`",
        help="prepass micro-batching: `infer` (the log-prob inference settings) or `train` (the training ones); "
             "`old` (opt-in): no prepass, every step selects from π_old's statistics, not the current policy's "
             "([PREPASS](docs/PREPASS.md#prepass_layoutold-the-old-policys-statistics-no-prepass))")

    def __post_init__(self):
        parent_post_init(self, PrepassPolicyLossConfig)
        require_loss_mode(self)
        self.validate_knobs()
        self.validate_common_knobs()

    def validate_knobs(self) -> None:
        """The method's own knobs, validated on construction (ValueError naming the key): each method's class says
        which; a user's subclass extends it (``super().validate_knobs()``)."""

    def validate_common_knobs(self) -> None:
        """``prepass_layout`` (ValueError naming the key, as the driver's check)."""
        validate_prepass_layout(self.prepass_layout)


def min_ratio_knob(bounds: tuple[float, float]) -> Any:
    """The field ``entropy_control_min_ratio`` with default ``bounds[0]``: a mode's class whose bounds differ from
    :data:`DEFAULT_COV_CONTROL_BOUNDS` redeclares both bound fields with these, and sets ``CONTROL_BOUNDS``."""
    return knob(bounds[0], controller=True, row="bounds", valid="0 < min <= ratio <= max <= 1",
                help="lower bound of the controlled ratio (must hold your ratio)")


def max_ratio_knob(bounds: tuple[float, float]) -> Any:
    """The field ``entropy_control_max_ratio`` with default ``bounds[1]`` (see :func:`min_ratio_knob`)."""
    return knob(bounds[1], controller=True, row="bounds", valid="<= 1", help="upper bound of the controlled ratio")


@dataclass
class GlobalModePolicyLossConfig(PrepassPolicyLossConfig):
    """The knobs every mode with an entropy controller carries, defined once: ``prepass_layout`` and the
    controller's eight.

    Not selected itself (its ``loss_mode`` is verl's): each mode's class derives from it, sets its own ``loss_mode``
    and, where the controlled ratio's bounds differ from KL-Cov's and Clip-Cov's, the two bound defaults and
    :attr:`CONTROL_BOUNDS` together. :meth:`validate_common_knobs` checks what is defined here.
    """

    #: the default (min, max) of the controlled ratio, as the two fields below default (read by the controller's
    #: validation; a subclass that changes one changes both)
    CONTROL_BOUNDS: ClassVar[tuple[float, float]] = DEFAULT_COV_CONTROL_BOUNDS

    entropy_target: Optional[float] = knob(
        None, controller=True, valid="finite, > 0, < ln(vocab)", default_note=" (off)",
        help="entropy floor: below it (predicted) the controller strengthens the mode beyond its ratio knob, never "
             "weakens it ([HOW_IT_WORKS](docs/HOW_IT_WORKS.md#entropy-floor-the-controller))")
    entropy_control_ki: float = knob(
        DEFAULT_ENTROPY_CONTROL_KI, controller=True, row="gains", valid="finite, >= 0",
        help="how fast it eases back to your ratio above the band (ln(ratio) per step per relative surplus)")
    entropy_control_kp: float = knob(DEFAULT_ENTROPY_CONTROL_KP, controller=True, row="gains", valid="finite, > 0",
                                     help="how fast it brakes harder below the target (per relative deficit); "
                                          "a step moves ln(ratio) by at most ln 2")
    entropy_control_min_ratio: float = min_ratio_knob(DEFAULT_COV_CONTROL_BOUNDS)
    entropy_control_max_ratio: float = max_ratio_knob(DEFAULT_COV_CONTROL_BOUNDS)
    entropy_control_horizon: float = knob(
        DEFAULT_ENTROPY_CONTROL_HORIZON, controller=True, row="horizon", valid="finite >= 0; whole >= 1",
        help="the controller's error reads the entropy extrapolated this many optimizer steps ahead along its "
             "trend (0: the measured entropy)")
    entropy_control_window: int = knob(DEFAULT_ENTROPY_CONTROL_WINDOW, controller=True, row="horizon",
                                       help="the trend's window, in optimizer steps", valid="whole >= 1")
    entropy_control_hysteresis: float = knob(
        DEFAULT_ENTROPY_CONTROL_HYSTERESIS, controller=True, row="horizon", valid="finite >= 0",
        help="the band [target, (1 + this) x target] where the strength holds; above it the controller eases back")

    def validate_common_knobs(self) -> None:
        """``prepass_layout`` and the controller's knobs (ValueError naming the key, as the driver's check)."""
        validate_prepass_layout(self.prepass_layout)
        read_entropy_control(self, self.CONTROL_BOUNDS)


