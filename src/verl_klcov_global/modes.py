"""The table of loss modes: one :class:`ModeSpec` per global loss mode; everything else asks it.

A mode is its name, verl's per-micro-batch counterpart, the metric prefix, the knobs and
their validating reader, the minibatch fields its selection reads, the selection, the
per-token objective, the config class, the error raised without a mask. Registration
(:mod:`.plugin`), the driver's checks (:mod:`.driver`), the engine's prepass and step
(:mod:`.engine`), the loss (:mod:`.loss`), ``diagnose`` and the CLI all read :data:`MODES`;
none names a mode itself. Adding a mode = one selection function + one :func:`register_mode`
call (``docs/ADDING_A_MODE.md``).

The prepass is the same for every mode: one no-grad forward of the optimizer minibatch (log-probs,
and the entropy too for a mode whose row sets ``prepass_reads_entropy`` or whose entropy controller is
on, :meth:`ModeSpec.reads_entropy`), then, with the controller on, one step of its law
(:mod:`.entropy_control`) sets the ratio knob ``ratio_knob`` in the settings, then
``mode.select(fields, settings, group)`` on the :class:`~.layout.MinibatchFields` that
:meth:`ModeSpec.read_minibatch` reads, then the mask travels to the micro-batches.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist
from tensordict import TensorDict

from .config import (
    DEFAULT_STARE_REWEIGHT_M,
    ClipCovGlobalPolicyLossConfig,
    HighEntropyGlobalPolicyLossConfig,
    KLCovGlobalPolicyLossConfig,
    LpRegGlobalPolicyLossConfig,
    StareGlobalPolicyLossConfig,
    loss_mode_of,
    read_clip_cov_settings,
    read_high_entropy_settings,
    read_kl_cov_settings,
    read_lp_reg_settings,
    read_stare_settings,
)
from .knob_doc import knob_names
from .layout import MinibatchFields, read_fields
from .loss import (
    ClipCovMaskUnavailableError,
    LP_REG_TALLIES,
    HighEntropyMaskUnavailableError,
    KLCovMaskUnavailableError,
    LpRegMaskUnavailableError,
    Objective,
    SelectionMaskUnavailableError,
    StareMaskUnavailableError,
    clip_cov_objective,
    global_policy_loss,
    high_entropy_objective,
    kl_cov_objective,
    lp_reg_objective,
    lp_reg_tally_figures,
    stare_objective,
)
from .selection import (
    kl_cov_quota,
    select_clip_cov_tokens,
    select_high_entropy_tokens,
    select_kl_cov_tokens,
    select_lp_reg_tokens,
    select_stare_tokens,
)
from .stare_control import stare_update_rule

__all__ = ["CLIP_COV", "HIGH_ENTROPY", "KL_COV", "LP_REG", "MODES", "STARE", "ModeSpec", "Selection", "global_mode_of", "register_mode"]


class Selection(Protocol):
    """What the engine needs of a selection result (``KLCovSelection``, ``ClipCovSelection``,
    ``HighEntropySelection``, ...)."""

    mask: torch.Tensor  # (batch, response_len) bool, this rank's minibatch in its original order
    quota: int
    num_selected: int
    num_valid: int

    def figures(self) -> dict[str, float]: ...


#: ``select(fields, settings, group) -> Selection``: one selection over this rank's minibatch and ``group``.
SelectFn = Callable[[MinibatchFields, Any, Optional[dist.ProcessGroup]], Selection]
#: ``update_rule(state, entropy, settings) -> (state, step settings, figures)``: a mode's once-per-trainer-step
#: rule (:mod:`.engine.schedule`). ``state``: the plain dict it kept in the optimizer (None at first); ``entropy``:
#: the old policy's mean entropy over the trainer step's batch (verl's ``actor/entropy``) at the update's first
#: optimizer step, None at the others; ``settings``: the configured ones. Returns the dict to keep, the settings
#: this optimizer step's loss applies, and figures logged under the mode's prefix.
UpdateRule = Callable[[Optional[dict], Optional[float], Any], tuple[dict, Any, dict[str, float]]]
#: ``setting_warnings(settings) -> [(name, key, what, fix), ...]``: settings the guardrails warn about
#: (:mod:`.guardrails`), e.g. ones that make the mode a no-op.
SettingWarnings = Callable[[Any], list[tuple[str, str, str, str]]]


@dataclass(frozen=True)
class ModeSpec:
    """One global loss mode.

    * ``name``: the ``policy_loss.loss_mode`` value; ``upstream``: its per-micro-batch counterpart
      (what ``diagnose`` compares with): verl's own loss (``kl_cov``), or a comparator the lab
      registers in-process (``high_entropy_per_micro_batch``: never by the plugin, so errors suggest
      it to users only when it is in verl's registry); None if there is none;
    * ``metric_prefix``: every metric of the mode is ``<metric_prefix><name>``;
    * ``knobs``: the ``policy_loss`` keys the mode reads (``plugin_knobs``: those only its
      ``config_class`` has, not verl's ``PolicyLossConfig``); left empty, both are derived from ``config_class``
      (:func:`.knob_doc.knob_names`: its ``VERL_KNOBS`` and its fields declared with
      :func:`.knob_doc.knob`, the entropy controller's apart); ``read_settings(actor_config)``
      validates them and returns the settings (with ``prepass_layout``), raising ``ValueError``
      that names the key to change;
    * ``response_fields`` / ``sequence_fields``: the minibatch fields ``select`` reads;
      ``prepass_reads_entropy``: the prepass also computes the current-policy entropy (verl's own
      ``infer_batch`` with ``calculate_entropy=True``, so ``entropy_from_logits_with_chunking`` /
      ``entropy_checkpointing`` apply) and hands it to ``select`` as ``fields.entropy``; the prepass
      of every other mode computes log-probs only;
    * ``select``: the selection; ``objective``: the per-token loss on its mask (:mod:`.loss`);
    * ``config_class``: the dataclass users select with ``policy_loss._target_`` (its
      ``loss_mode`` default is ``name``), or None;
    * ``no_mask_error``: raised by the loss when it gets no mask;
    * ``count_upstream_selected(num_valid, policy_loss, metrics)``: the tokens ``upstream``
      selected in one micro-batch of ``num_valid`` tokens, from its policy-loss config and
      ``ppo_loss``'s metrics (what ``diagnose`` reports for it), or None;
    * ``draws_at_random``: upstream draws its tokens at random (``diagnose`` repeats an update
      with the generators in another state to show it); ``diagnose_train_layout``: ``diagnose``
      also runs the mode with ``prepass_layout=train``;
    * ``ratio_knob``: the knob that is the fraction of tokens selected, with ``paper_ratios`` (model size ->
      the paper's value, a fraction), read by :mod:`.guardrails` (unit warning); ``penalises_log_ratio``:
      the mode's effect is a penalty on ``log pi - log pi_old``, which is 0 when every update is on-policy
      (:mod:`.guardrails` warns);
    * ``ratio_warning``: :mod:`.guardrails` warns that ``ratio_knob`` may be in the wrong units at or above
      this value (0.05: far above KL-Cov's and Clip-Cov's published values); None: no such warning (a mode
      whose published value is itself large, e.g. ``high_entropy_global``'s 0.2);
      ``ratio_one_is_vanilla``: ``ratio_knob = 1`` selects every valid token and the mode's objective is
      then verl's ``vanilla`` (:mod:`.guardrails` warns: the prepass buys nothing);
    * the entropy controller (:mod:`.entropy_control`, on when the settings carry ``entropy_control``)
      moves ``ratio_knob`` (the settings field of that name); ``entropy_sign``: +1 where a larger
      ``ratio_knob`` keeps entropy higher (KL-Cov, Clip-Cov: more tokens penalised or cut), -1 where it
      lowers entropy (the 80/20 rule: more low-entropy tokens train), 0: the mode has no controller;
      ``selection_reach(selection)``: the most tokens a larger ratio could select in that step (the
      anti-wind-up's upper edge): ``num_valid``, or Clip-Cov's candidates;
    * ``update_rule``: a once-per-trainer-step rule on the batch's old-policy entropy (:data:`UpdateRule`; STARE's
      gate and schedule), None for none. A mode with one reads verl's log-prob pass in every ``prepass_layout``
      (:attr:`reads_batch_entropy`; the driver refuses ``bypass_mode``, which runs no pass);
      ``setting_warnings``: the mode's own guardrail warnings (:data:`SettingWarnings`); ``ratio_of``: what
      ``ratio_knob`` is a fraction of, ``ratio_may_be_zero``: 0 is a valid value (the guardrails' wording);
    * ``proxy_min_p(settings) -> kappa``: the mode's objective reads Lp-Reg's proxy of the old policy
      (:mod:`.engine.proxy`), computed in verl's log-prob pass and held for the update in every ``prepass_layout``
      (the driver refuses ``bypass_mode``); the step hands it to the objective as ``proxy_log_prob``. None: no proxy;
    * ``loss_tallies``: per-micro-batch counts the objective reports as metrics ``<prefix><name>_in_micro_batch``;
      the step sums each over its micro-batches and the DP group (one all-reduce) and removes the raw entries;
      ``tally_figures(sums, selection)`` turns the sums into the step's figures (default: the sums themselves).
    """

    name: str
    upstream: Optional[str]
    metric_prefix: str
    read_settings: Callable[[Any], Any]
    response_fields: tuple[str, ...]
    select: SelectFn
    objective: Objective
    knobs: tuple[str, ...] = ()
    no_mask_error: type[SelectionMaskUnavailableError] = SelectionMaskUnavailableError
    sequence_fields: tuple[str, ...] = ()
    config_class: Optional[type] = None
    plugin_knobs: tuple[str, ...] = ()
    count_upstream_selected: Optional[Callable[[int, Any, dict], int]] = None
    draws_at_random: bool = False
    diagnose_train_layout: bool = False
    ratio_knob: Optional[str] = None
    paper_ratios: tuple[tuple[str, float], ...] = ()
    penalises_log_ratio: bool = False
    ratio_warning: Optional[float] = 0.05
    ratio_one_is_vanilla: bool = False
    prepass_reads_entropy: bool = False
    entropy_sign: int = 0
    selection_reach: Callable[[Any], int] = lambda selection: selection.num_valid
    update_rule: Optional[UpdateRule] = None
    setting_warnings: Optional[SettingWarnings] = None
    ratio_of: str = "each optimizer minibatch's valid response tokens"
    ratio_may_be_zero: bool = False
    proxy_min_p: Optional[Callable[[Any], float]] = None
    loss_tallies: tuple[str, ...] = ()
    tally_figures: Optional[Callable[[dict[str, float], Any], dict[str, float]]] = None

    def __repr__(self) -> str:
        return f"ModeSpec({self.name!r})"

    def __post_init__(self):
        if self.config_class is not None and not self.knobs:  # derived from the class: each knob written once there
            object.__setattr__(self, "knobs", knob_names(self.config_class))
            object.__setattr__(self, "plugin_knobs", self.plugin_knobs or tuple(
                name for name in self.knobs if name not in getattr(self.config_class, "VERL_KNOBS", {})))
        elif not self.plugin_knobs:
            object.__setattr__(self, "plugin_knobs", ("prepass_layout",))
        if self.config_class is not None and getattr(self.config_class, "loss_mode", None) != self.name:
            raise ValueError(f"{self.config_class.__name__}.loss_mode must default to {self.name!r}")
        if self.entropy_sign not in (-1, 0, 1) or (self.entropy_sign and self.ratio_knob is None):
            raise ValueError(f"{self.name}: entropy_sign must be -1, 0 or +1, and a controlled mode needs a ratio_knob")

    @property
    def reads_batch_entropy(self) -> bool:
        """The mode reads the old policy's entropy over the trainer step's batch from verl's log-prob pass."""
        return self.update_rule is not None

    @property
    def reads_log_prob_pass(self) -> bool:
        """The mode needs verl's log-prob pass in every ``prepass_layout`` (its batch entropy, or Lp-Reg's proxy)."""
        return self.reads_batch_entropy or self.proxy_min_p is not None

    def reads_entropy(self, settings: Any) -> bool:
        """Whether this step's prepass computes the entropy: the selection reads it (``prepass_reads_entropy``)
        or the entropy controller is on (``settings.entropy_control``)."""
        return self.prepass_reads_entropy or getattr(settings, "entropy_control", None) is not None

    @functools.cached_property
    def policy_loss(self) -> Callable:
        """The function registered in verl's ``POLICY_LOSS_REGISTRY`` under ``name`` (:func:`.loss.global_policy_loss`)."""
        return global_policy_loss(self)

    def read_minibatch(self, log_probs: torch.Tensor, data: TensorDict,
                       entropy: Optional[torch.Tensor] = None) -> MinibatchFields:
        """The fields this mode's selection reads from ``data``, dense, next to the (batch, width) ``log_probs``
        (and ``entropy`` when the prepass computed it; a mode with ``prepass_reads_entropy`` needs it)."""
        if self.prepass_reads_entropy and entropy is None:
            raise ValueError(f"{self.name} selects on the current-policy entropy (prepass_reads_entropy): pass the "
                             "prepass's (batch, width) entropy")
        return read_fields(log_probs, data, self.response_fields, self.sequence_fields, reader=self.name,
                           entropy=entropy)

    def select_minibatch(self, log_probs: torch.Tensor, data: TensorDict, settings: Any,
                         group: Optional[dist.ProcessGroup], entropy: Optional[torch.Tensor] = None) -> Selection:
        """:meth:`read_minibatch`, then :attr:`select`: the whole selection of one optimizer step."""
        return self.select(self.read_minibatch(log_probs, data, entropy), settings, group)


#: Every global loss mode, by name (insertion order: the order ``diagnose`` runs them).
MODES: dict[str, ModeSpec] = {}


def register_mode(mode: ModeSpec) -> ModeSpec:
    """Add ``mode`` to :data:`MODES` (a mode already there under its name is replaced); returns it.

    The plugin registers every mode of the table in verl's registry when it installs
    (:func:`verl_klcov_global.plugin.install`); call that again after adding a mode later.
    """
    MODES[mode.name] = mode
    return mode


def unregister_mode(name: str) -> None:
    """Remove a mode from :data:`MODES` (for tests that add one)."""
    MODES.pop(name, None)


def global_mode_of(actor_config: Any) -> Optional[ModeSpec]:
    """The :class:`ModeSpec` an actor config (verl ``ActorConfig`` or a mapping like it) selects, else None."""
    return MODES.get(loss_mode_of(actor_config))


# ---------------------------------------------------------------------------------------------
# The modes


def _select_kl_cov(fields: MinibatchFields, settings, group) -> Selection:
    return select_kl_cov_tokens(fields.response["advantages"], fields.log_probs, fields.response_mask,
                                settings.kl_cov_ratio, group=group)


def _select_clip_cov(fields: MinibatchFields, settings, group) -> Selection:
    token_ids, token_mask = fields.sequence["input_ids"]  # hashed for the reproducible draw
    return select_clip_cov_tokens(
        fields.response["advantages"], fields.log_probs, fields.response["old_log_probs"], fields.response_mask,
        token_ids, token_mask=token_mask,
        clip_cov_ratio=settings.clip_cov_ratio, clip_cov_lb=settings.clip_cov_lb, clip_cov_ub=settings.clip_cov_ub,
        clip_ratio_low=settings.clip_ratio_low, clip_ratio_high=settings.clip_ratio_high,
        seed=settings.clip_cov_seed, group=group,
    )


def _select_high_entropy(fields: MinibatchFields, settings, group) -> Selection:
    return select_high_entropy_tokens(fields.entropy, fields.response_mask, settings.entropy_top_ratio, group=group)


def _select_stare(fields: MinibatchFields, settings, group) -> Selection:
    return select_stare_tokens(fields.log_probs, fields.response["advantages"], fields.response_mask,
                               settings.stare_top_ratio, with_negative=settings.with_negative, group=group)


def _stare_setting_warnings(settings) -> list[tuple[str, str, str, str]]:
    """STARE settings that make the mode a no-op, or carry a knob it does not use."""
    found = []
    weights = [settings.reweight_w] + ([settings.reweight_m] if settings.with_negative else [])
    if all(w == 1.0 for w in weights) and not (settings.adaptive and settings.alpha > 0):
        found.append(("stare-weights-one", "stare_reweight_w",
                      "every STARE weight is 1 (stare_reweight_w=1" + (", stare_reweight_m=1" if settings.with_negative
                                                                       else "; variant O1 uses no M")
                      + ", no schedule): the loss is verl's vanilla plus a prepass",
                      "Set stare_reweight_w > 1 (the paper's 1.1), or use loss_mode=vanilla"))
    if settings.stare_top_ratio == 0.0:
        found.append(("stare-selects-nothing", "stare_top_ratio",
                      "stare_top_ratio=0 selects no token: the loss is verl's vanilla plus a prepass",
                      "Set stare_top_ratio to a fraction > 0 (the paper's 0.1), or use loss_mode=vanilla"))
    if settings.target_entropy <= 0.0:
        found.append(("stare-gate-never-opens", "stare_target_entropy",
                      f"stare_target_entropy={settings.target_entropy:g}: the batch's mean entropy is never below it, "
                      "so the gate never opens and the loss is verl's vanilla plus a prepass (the authors' GRPO "
                      "baseline script sets this)",
                      "Set stare_target_entropy > 0 (the paper's 0.3), or use loss_mode=vanilla"))
    # the default M (0.9, the paper's C2 value) ships with O1 too: warn only for an M someone chose for O1
    if not settings.with_negative and settings.reweight_m not in (1.0, DEFAULT_STARE_REWEIGHT_M):
        found.append(("stare-m-unused", "stare_reweight_m",
                      f"stare_reweight_m={settings.reweight_m:g} is not used by stare_variant=O1, which weights only "
                      "the surprising A > 0 tokens (W); M weights the surprising A < 0 tokens under variant C2",
                      "Set stare_variant=C2 to use M, or drop stare_reweight_m"))
    return found


def _count_kl_cov(num_valid: int, policy_loss, metrics: dict) -> int:
    return kl_cov_quota(num_valid, policy_loss.kl_cov_ratio)  # upstream selects exactly its quota


def _count_clip_cov(num_valid: int, policy_loss, metrics: dict) -> int:
    clipfrac = metrics["actor/pg_clipfrac"]  # masked mean of clip_cov's zeroed-gradient indicator
    clipfrac = clipfrac.values[0] if hasattr(clipfrac, "values") else clipfrac
    return round(float(clipfrac) * num_valid)


KL_COV = register_mode(ModeSpec(
    name="kl_cov_global", upstream="kl_cov", metric_prefix="actor/kl_cov/",
    read_settings=read_kl_cov_settings,
    response_fields=("advantages",), select=_select_kl_cov, objective=kl_cov_objective,
    no_mask_error=KLCovMaskUnavailableError, config_class=KLCovGlobalPolicyLossConfig,
    count_upstream_selected=_count_kl_cov, diagnose_train_layout=True,
    # Cui et al. 2025 (arXiv:2505.22617) and its recipe/entropy/{7b,32b}_kl_cov.sh
    ratio_knob="kl_cov_ratio", paper_ratios=(("7B", 0.002), ("32B", 0.0002)), penalises_log_ratio=True,
    entropy_sign=+1,  # more tokens with the |log-ratio| penalty hold entropy up (the paper's Fig. 9-10)
))
CLIP_COV = register_mode(ModeSpec(
    name="clip_cov_global", upstream="clip_cov", metric_prefix="actor/clip_cov/",
    read_settings=read_clip_cov_settings,
    response_fields=("advantages", "old_log_probs"), sequence_fields=("input_ids",), select=_select_clip_cov,
    objective=clip_cov_objective, no_mask_error=ClipCovMaskUnavailableError,
    config_class=ClipCovGlobalPolicyLossConfig, count_upstream_selected=_count_clip_cov, draws_at_random=True,
    ratio_knob="clip_cov_ratio", paper_ratios=(("7B", 0.0002), ("32B", 0.0002)),
    entropy_sign=+1, selection_reach=lambda selection: selection.num_candidates,  # at most every candidate is cut
))
HIGH_ENTROPY = register_mode(ModeSpec(
    name="high_entropy_global", upstream="high_entropy_per_micro_batch", metric_prefix="actor/high_entropy/",
    read_settings=read_high_entropy_settings, response_fields=(), select=_select_high_entropy,
    objective=high_entropy_objective, no_mask_error=HighEntropyMaskUnavailableError,
    config_class=HighEntropyGlobalPolicyLossConfig, prepass_reads_entropy=True,
    # Wang et al. 2025 (arXiv:2506.01939): rho = 0.2 for Qwen3-14B and -32B (their fork's entropy_top_ratio=0.2)
    ratio_knob="entropy_top_ratio", paper_ratios=(("14B", 0.2), ("32B", 0.2)),
    # 0.2 is the paper's value, so no units warning; rho = 1 keeps every token: vanilla plus a prepass
    ratio_warning=None, ratio_one_is_vanilla=True,
    entropy_sign=-1,  # a larger rho trains more low-entropy tokens: entropy falls faster (rho = 1 is vanilla)
))
STARE = register_mode(ModeSpec(
    name="stare_global", upstream="stare_per_micro_batch", metric_prefix="actor/stare/",
    read_settings=read_stare_settings, response_fields=("advantages",), select=_select_stare,
    objective=stare_objective, no_mask_error=StareMaskUnavailableError, config_class=StareGlobalPolicyLossConfig,
    # Luo et al. 2026 (arXiv:2606.19236): the 10% most surprising tokens of each advantage sign
    ratio_knob="stare_top_ratio", paper_ratios=(("7B", 0.1),), ratio_warning=None, ratio_may_be_zero=True,
    ratio_of="each advantage sign's valid response tokens of the optimizer minibatch",
    # no entropy controller (entropy_sign 0): STARE's gate and schedule are its own entropy feedback
    update_rule=stare_update_rule, setting_warnings=_stare_setting_warnings,
))



def _select_lp_reg(fields: MinibatchFields, settings, group) -> Selection:
    return select_lp_reg_tokens(fields.log_probs, fields.response["advantages"], fields.response_mask,
                                settings.neg_ratio, settings.pos_ratio, group=group)


LP_REG = register_mode(ModeSpec(
    name="lp_reg_global", upstream="lp_reg_per_micro_batch", metric_prefix="actor/lp_reg/",
    read_settings=read_lp_reg_settings, response_fields=("advantages",), select=_select_lp_reg,
    objective=lp_reg_objective, no_mask_error=LpRegMaskUnavailableError, config_class=LpRegGlobalPolicyLossConfig,
    # Huang et al. 2025 (arXiv:2510.03222), recipe/lp_reg/*.sh: rho- 0.01 (0.005 for Qwen2.5-32B)
    ratio_knob="lp_reg_neg_ratio", paper_ratios=(("7B", 0.01), ("32B", 0.005)), ratio_warning=None,
    ratio_of="each optimizer minibatch's negative-advantage valid response tokens",
    proxy_min_p=lambda settings: settings.min_p,  # no entropy controller (entropy_sign 0)
    loss_tallies=LP_REG_TALLIES, tally_figures=lp_reg_tally_figures,
))
