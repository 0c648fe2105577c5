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

from .knob_doc import knob_names
from .layout import MinibatchFields, read_fields
from .loss import Objective, SelectionMaskUnavailableError, global_policy_loss
from .mode_config import loss_mode_of

__all__ = ["MODES", "ModeSpec", "Selection", "global_mode_of", "register_mode"]


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
      anti-wind-up's upper edge): ``num_valid``, or Clip-Cov's candidates; ``floor_caveat``: what the evidence says
      against trusting the entropy floor with this mode (the driver warns with it, ``entropy-floor-unproven``;
      empty: nothing);
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
    * ``ratio_units_note``: how other frameworks' knobs for the same ratio are written, appended to the guardrails'
      unit warning (empty: nothing to add);
    * ``comparator``: the module of the authors' per-loss-call rule (``upstream``, when verl has no such loss): it
      defines ``COMPARATOR``, a :class:`verl_klcov_global.per_call.Comparator`. Only the lab imports it
      (by this name, in-process); the plugin never registers it. None: ``upstream`` is verl's own loss, or none.
    * ``knobs_without_diagnose_flag``: knobs of a built-in mode that ``diagnose`` takes through ``--set`` only (every
      other knob of a built-in mode gets a flag generated from its config-class field, ``--<knob>``, and a key of the
      report's options);
    * ``knobs_text(values) -> str``: the mode's knobs on ``diagnose``'s report line, from ``values`` (each of its
      knobs with a flag -> the value used); None: ``knob value`` for each, ``" | "`` between them;
    * ``reads_optimizer_step``: the mode's settings have a field ``optimizer_step``, which the engine sets at every
      optimizer step to its count of the actor's global-mode optimizer steps before it (:mod:`.engine.step_count`:
      the same on every rank and for any micro-batching, saved with the optimizer), e.g. so that a seeded draw is
      fresh at every step.
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
    floor_caveat: str = ""
    update_rule: Optional[UpdateRule] = None
    setting_warnings: Optional[SettingWarnings] = None
    ratio_of: str = "each optimizer minibatch's valid response tokens"
    ratio_may_be_zero: bool = False
    proxy_min_p: Optional[Callable[[Any], float]] = None
    loss_tallies: tuple[str, ...] = ()
    tally_figures: Optional[Callable[[dict[str, float], Any], dict[str, float]]] = None
    comparator: Optional[str] = None
    ratio_units_note: str = ""
    knobs_without_diagnose_flag: tuple[str, ...] = ()
    knobs_text: Optional[Callable[[dict[str, Any]], str]] = None
    reads_optimizer_step: bool = False

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
        unknown = [knob for knob in self.knobs_without_diagnose_flag if knob not in self.knobs]
        if unknown:
            raise ValueError(f"{self.name}: knobs_without_diagnose_flag names {', '.join(unknown)}, not among its knobs "
                             f"({', '.join(self.knobs)})")

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


def __getattr__(name: str) -> ModeSpec:
    """A row of the table by the constant it had here before it moved to its method's folder (``KL_COV`` is
    ``MODES["kl_cov_global"]``, ``HIGH_ENTROPY`` is ``MODES["high_entropy_global"]``)."""
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    for mode_name, mode in MODES.items():
        if mode_name.removesuffix("_global").upper() == name:
            return mode
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
