"""Whole-config findings: settings that make a global loss mode do something other than what was asked.

The knob checks (:mod:`.config`) look at one knob at a time. The checks here look at how the
trainer config combines them with the rest of verl's config (verl 0.9.1 read for each):

* ``bypass-ignores-rollout-correction`` (error): ``algorithm.rollout_correction.bypass_mode=True``
  with rollout IS (``rollout_is``), rejection sampling (``rollout_rs``) or ``loss_type=reinforce``.
  In bypass mode verl copies ``rollout_log_probs`` into ``old_log_probs`` and skips the driver's
  IS/RS computation on both trainers (``trainer/ppo/ray_trainer.py`` ~1650,
  ``trainer/ppo/v1/trainer_base.py`` ~1767): IS, RS and ``loss_type`` are left to verl's
  ``bypass_mode`` loss, which a global loss mode replaces. Nothing of them is applied.
  (The legacy trainer's ``apply_bypass_mode`` also writes ``loss_mode="bypass_mode"``, but only
  into the driver's copy of the config; the workers keep the loss mode they were built with:
  ``tests/test_guardrails_trainer.py`` runs it.)
* ``kl-cov-on-policy`` (warning): a mode whose effect is a log-ratio penalty
  (``ModeSpec.penalises_log_ratio``: ``kl_cov_global``) where every optimizer update is the first
  one after the old log-probs were computed (one minibatch per old-log-prob pass and
  ``ppo_epochs=1``, old log-probs recomputed by the actor, not the rollout's): the penalty
  ``ppo_kl_coef * |log pi - log pi_old|`` is 0 up to float noise.
* ``ratio-units`` (warning): the mode's ``ModeSpec.ratio_knob`` (``kl_cov_ratio`` / ``clip_cov_ratio``)
  >= the mode's ``ModeSpec.ratio_warning`` (:data:`RATIO_WARNING` = 0.05 for KL-Cov and Clip-Cov; none for
  ``high_entropy_global``, whose paper value is 0.2), with the mode's ``paper_ratios``.
* ``ratio-is-percentage`` (error): ``ratio_knob`` > 1, e.g. ``entropy_top_ratio=20`` meant as 20%. The knob
  readers (:mod:`.config`) refuse it too; this finding says what the number means.
* ``ratio-keeps-all`` (warning): ``ratio_knob`` = 1 for a mode with ``ModeSpec.ratio_one_is_vanilla``
  (``high_entropy_global``): every valid token keeps the loss, so the update is verl's ``vanilla`` plus a
  prepass.

* ``entropy-target-unreachable`` (error): ``entropy_target`` >= ln(vocabulary size), the entropy of a uniform
  policy, read from ``config.json`` at ``actor_rollout_ref.model.path`` when that is a local directory (else
  the worker checks at the first controlled step, :mod:`.engine.control`).
* ``entropy-floor-unproven`` (warning): the controller is on for a mode whose row carries a ``floor_caveat``: on a
  real model more strength did not reliably hold more entropy (KL-Cov on SmolLM2, docs/EVIDENCE.md).
* ``entropy-control-not-checkpointed`` (warning): the controller is on but ``optimizer`` is not in the actor's
  ``checkpoint.save_contents`` or ``load_contents``: its state travels with the optimizer, so a resumed run
  starts it again from the configured ratio.

* ``old-policy-without-log-prob-pass`` (error): ``prepass_layout=old`` with ``bypass_mode=True``: there is no
  actor log-prob pass, so no pi_old statistics (the old log-probs are the rollout engine's).
* ``old-policy-entropy-not-kept`` (error): ``prepass_layout=old`` where the mode or the controller reads
  entropy (``ModeSpec.reads_entropy``) on a trainer whose log-prob pass the plugin does not keep
  (:data:`OLD_POLICY_ENTROPY_TRAINERS`: the legacy and v1 sync trainers are).

* ``batch-entropy-without-log-prob-pass`` (error): a mode with a once-per-trainer-step rule
  (``ModeSpec.update_rule``: ``stare_global``'s gate) with ``bypass_mode=True``: no actor log-prob pass runs,
  so there is no batch entropy (verl's ``actor/entropy`` is not computed either).
* ``batch-entropy-not-kept`` (error): such a mode on a trainer whose log-prob pass the plugin does not see
  (:data:`OLD_POLICY_ENTROPY_TRAINERS`).
* ``update-rule-not-checkpointed`` (warning): such a mode's state (STARE's gate, W and M) travels with the
  optimizer, and ``optimizer`` is not in ``checkpoint.save_contents`` / ``load_contents``.
* ``update-rule-during-critic-warmup`` (warning): ``trainer.critic_warmup > 0`` with a rule that moves state
  (STARE's adaptive W/M): verl runs log-prob passes without actor updates during the warm-up; the rule steps
  once per actor update (the fork's controller also steps at the warm-up's steps).
* the mode's own warnings (``ModeSpec.setting_warnings``; ``stare_global``: ``stare-weights-one``,
  ``stare-selects-nothing``, ``stare-gate-never-opens``, ``stare-m-unused``).

Which mode gets which finding is read from the table of modes (:mod:`.modes`), never from a mode's name.

:func:`findings` is pure: raw (unresolved-or-resolved) ``DictConfig`` in, :class:`Finding` list
out. :func:`report` raises the errors and emits the warnings (:class:`GuardrailWarning`).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Optional

from omegaconf import OmegaConf

from .mode_config import OLD_POLICY_LAYOUT
from .modes import ModeSpec, global_mode_of
from .selection.knobs import finite_number

PREFIX = "verl-klcov-global"
ACTOR = "actor_rollout_ref.actor"
POLICY_LOSS = f"{ACTOR}.policy_loss"
ROLLOUT_CORRECTION = "algorithm.rollout_correction"
#: For KL-Cov and Clip-Cov (``ModeSpec.ratio_warning``'s default), a ratio at or above this is far more than
#: any published value: most likely a percentage or another framework's unit carried over.
RATIO_WARNING = 0.05
_DEFAULT_RATIO = 0.0002  # verl's kl_cov / clip_cov fallback for an unset ratio

ERROR, WARNING = "error", "warning"


class GuardrailWarning(UserWarning):
    """A trainer config a global loss mode runs with, but not as its user most likely meant.

    Filter them with ``warnings.filterwarnings("ignore", category=GuardrailWarning)`` or
    ``PYTHONWARNINGS=ignore::verl_klcov_global.guardrails.GuardrailWarning``.
    """


@dataclass(frozen=True)
class Finding:
    """One whole-config finding: ``severity`` (``error`` / ``warning``), a stable ``code``, the config
    ``key`` it is about, what happens (``message``) and what to change (``fix``)."""

    severity: str
    code: str
    key: str
    message: str
    fix: str

    def text(self) -> str:
        return f"{PREFIX}: {self.key}: {self.message}. {self.fix}"

    def to_json(self) -> dict:
        return asdict(self)


def _get(config: Any, key: str, default: Any = None) -> Any:
    value = OmegaConf.select(config, key, default=default, throw_on_resolution_failure=False)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _positive_int(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def trainer_kind(config: Any) -> str:
    """``legacy`` (``trainer.use_v1=False``, or a verl without the key) or the v1 trainer mode
    (``trainer.v1.trainer_mode``: ``sync`` by default, ``colocate_async``, ``separate_async``)."""
    if not bool(_get(config, "trainer.use_v1", False)):
        return "legacy"
    return str(_get(config, "trainer.v1.trainer_mode", "sync") or "sync")


def updates_per_old_log_prob_pass(config: Any) -> Optional[int]:
    """Optimizer updates that share one pass of old log-probs, or None when the config does not say.

    verl 0.9.1: the actor update cuts each trainer batch into minibatches of ``ppo_mini_batch_size``
    prompts (``x rollout.n`` sequences, also with dynamic batch sizes) and runs ``ppo_epochs`` epochs
    (``workers/engine_workers.py`` ``train_mini_batch``). The v1 trainers run ``parameter_sync_step``
    local steps of ``train_batch_size / parameter_sync_step`` prompts each (``trainer_base.step``);
    the sync and colocated ones recompute old log-probs with the current weights every local step,
    ``separate_async`` with the weights of the cycle's start (``_compute_old_log_prob``), so its
    ``parameter_sync_step`` local steps share one anchor.
    """
    batch = _positive_int(_get(config, "data.train_batch_size"))
    mini = _positive_int(_get(config, f"{ACTOR}.ppo_mini_batch_size"))
    epochs = _positive_int(_get(config, f"{ACTOR}.ppo_epochs", 1))
    if batch is None or mini is None or epochs is None:
        return None
    kind = trainer_kind(config)
    sync_steps = 1
    if kind != "legacy":
        sync_steps = _positive_int(_get(config, f"trainer.v1.{kind}.parameter_sync_step", 1)) or 1
    if kind == "separate_async":
        return sync_steps * epochs  # verl asserts train_batch_size == parameter_sync_step * ppo_mini_batch_size
    return max(1, (batch // sync_steps) // mini) * epochs


def _bypass(config: Any) -> bool:
    return bool(_get(config, f"{ROLLOUT_CORRECTION}.bypass_mode", False))


def _bypass_findings(config: Any, spec: ModeSpec) -> list[Finding]:
    mode = spec.name
    if not _bypass(config):
        return []
    unused = []
    for key in ("rollout_is", "rollout_rs"):
        value = _get(config, f"{ROLLOUT_CORRECTION}.{key}")
        if value not in (None, "", "null", "None"):
            unused.append(f"{key}={value}")
    loss_type = _get(config, f"{ROLLOUT_CORRECTION}.loss_type", "ppo_clip")
    if loss_type not in (None, "ppo_clip"):
        unused.append(f"loss_type={loss_type}")
    if not unused:
        return []
    return [Finding(
        ERROR, "bypass-ignores-rollout-correction", f"{ROLLOUT_CORRECTION}.bypass_mode",
        f"bypass_mode=True with loss_mode={mode} would silently drop {', '.join(unused)}: in bypass mode verl "
        f"takes the rollout's log-probs as old log-probs and leaves IS, rejection sampling and loss_type to its "
        f"own 'bypass_mode' loss, which {mode} replaces, so no IS weight or rejection reaches the loss "
        f"({trainer_kind(config)} trainer; verl's legacy trainer also rewrites loss_mode to 'bypass_mode' in the "
        f"driver's copy of the config, not in the workers')",
        f"Set {ROLLOUT_CORRECTION}.bypass_mode=False (decoupled mode: verl computes the IS weights and rejections "
        f"in the driver and {mode} applies them), or drop {' and '.join(u.split('=')[0] for u in unused)} "
        f"(set {ROLLOUT_CORRECTION}.rollout_is=null rollout_rs=null loss_type=ppo_clip) to keep bypass mode")]


def _on_policy_findings(config: Any, spec: ModeSpec) -> list[Finding]:
    mode = spec.name
    if not spec.penalises_log_ratio or _bypass(config):
        return []
    coef = finite_number(_get(config, f"{POLICY_LOSS}.ppo_kl_coef", 1.0))
    if coef == 0.0:
        return []
    updates = updates_per_old_log_prob_pass(config)
    if updates != 1:
        return []
    kind = trainer_kind(config)
    batch, mini = _get(config, "data.train_batch_size"), _get(config, f"{ACTOR}.ppo_mini_batch_size")
    shape = (f"trainer.v1.separate_async.parameter_sync_step=1, ppo_epochs=1" if kind == "separate_async" else
             f"data.train_batch_size={batch} and {ACTOR}.ppo_mini_batch_size={mini}: one minibatch per step, "
             f"{ACTOR}.ppo_epochs=1")
    more = ("trainer.v1.separate_async.parameter_sync_step >= 2 or " if kind == "separate_async" else
            f"a smaller {ACTOR}.ppo_mini_batch_size (e.g. ={max(1, int(batch) // 4)}: 4 minibatches per step) or ")
    return [Finding(
        WARNING, "kl-cov-on-policy", f"{ACTOR}.ppo_mini_batch_size",
        f"loss_mode={mode} with {shape} ({kind} trainer): every optimizer update is on-policy (the actor's "
        f"old log-probs are its current ones), so the penalty ppo_kl_coef * |log pi - log pi_old| is 0 up to float "
        f"noise and has no effect (what is left of its gradient is coef * sign(noise) * grad log pi on the selected "
        f"tokens)",
        f"Give it an effect with {more}{ACTOR}.ppo_epochs >= 2; it also acts with "
        f"{ROLLOUT_CORRECTION}.bypass_mode=True (old log-probs from the rollout). The run goes on")]


def _ratio_value(config: Any, spec: ModeSpec) -> Optional[float]:
    if spec.ratio_knob is None:
        return None
    return finite_number(_get(config, f"{POLICY_LOSS}.{spec.ratio_knob}", _DEFAULT_RATIO))


def _paper_text(spec: ModeSpec) -> str:
    by_ratio: dict[float, list[str]] = {}
    for size, ratio in spec.paper_ratios:
        by_ratio.setdefault(ratio, []).append(size)
    return ", ".join(f"{ratio:g} ({ratio:.2%}) at {' and '.join(sizes)}" for ratio, sizes in by_ratio.items())


def _percentage_findings(config: Any, spec: ModeSpec) -> list[Finding]:
    knob, value = spec.ratio_knob, _ratio_value(config, spec)
    if value is None or value <= 1.0:
        return []
    paper = f"; the paper uses {_paper_text(spec)}" if spec.paper_ratios else ""
    return [Finding(
        ERROR, "ratio-is-percentage", f"{POLICY_LOSS}.{knob}",
        f"{knob}={value:g} is more than 1, but {knob} is a fraction of {spec.ratio_of} in "
        f"{'[0, 1]' if spec.ratio_may_be_zero else '(0, 1]'} (0.2 selects 20% of them), not a percentage{paper}",
        f"If you meant {value:g}% set {POLICY_LOSS}.{knob}={value / 100:g}")]


def _keeps_all_findings(config: Any, spec: ModeSpec) -> list[Finding]:
    knob, value = spec.ratio_knob, _ratio_value(config, spec)
    if not spec.ratio_one_is_vanilla or value != 1.0:
        return []
    return [Finding(
        WARNING, "ratio-keeps-all", f"{POLICY_LOSS}.{knob}",
        f"{knob}=1 selects every valid token: loss_mode={spec.name} then updates exactly as verl's vanilla loss, "
        f"plus a prepass per optimizer step that changes nothing",
        f"Set {POLICY_LOSS}.{knob} below 1"
        + (f" (the paper's value is {spec.paper_ratios[0][1]:g})" if spec.paper_ratios else "")
        + ", or use loss_mode=vanilla. The run goes on")]


def _ratio_findings(config: Any, spec: ModeSpec) -> list[Finding]:
    knob = spec.ratio_knob
    if knob is None or not spec.paper_ratios or spec.ratio_warning is None:
        return []
    value = _ratio_value(config, spec)
    if value is None or value < spec.ratio_warning or value > 1.0:
        return []
    paper_text = _paper_text(spec)
    first_size, first_ratio = spec.paper_ratios[0]
    times = value / first_ratio
    return [Finding(
        WARNING, "ratio-units", f"{POLICY_LOSS}.{knob}",
        f"{knob}={value:g} is a fraction, not a percentage: it selects {value:.2%} of each optimizer minibatch's "
        f"valid response tokens, {times:.0f}x the paper's {first_size} value; the paper uses {paper_text}"
        + (f". {spec.ratio_units_note}" if spec.ratio_units_note else ""),
        f"If you meant {value:g}% set {POLICY_LOSS}.{knob}={value / 100:g} (the paper's {first_size} value is "
        f"{first_ratio:g}). The run goes on")]


def local_vocab_size(config: Any) -> Optional[int]:
    """``vocab_size`` of ``config.json`` at ``actor_rollout_ref.model.path`` when that is a local directory, else None."""
    path = _get(config, "actor_rollout_ref.model.path")
    config_file = os.path.join(os.path.expanduser(str(path)), "config.json") if path else None
    if config_file is None or not os.path.isfile(config_file):
        return None
    try:
        with open(config_file) as f:
            model_config = json.load(f)
    except (OSError, ValueError):
        return None
    vocab_size = model_config.get("vocab_size") or (model_config.get("text_config") or {}).get("vocab_size")
    return vocab_size if isinstance(vocab_size, int) and vocab_size > 1 else None


def _controller_findings(config: Any, spec: ModeSpec) -> list[Finding]:
    try:
        settings = spec.read_settings(OmegaConf.select(config, ACTOR))
    except ValueError:
        return []  # a bad knob: the knob check (driver.check_trainer_config) names it
    control = getattr(settings, "entropy_control", None)
    if control is None or not spec.entropy_sign:
        return []
    found = []
    vocab_size = local_vocab_size(config)
    if vocab_size is not None and control.target >= math.log(vocab_size):
        found.append(Finding(
            ERROR, "entropy-target-unreachable", f"{POLICY_LOSS}.entropy_target",
            f"entropy_target={control.target:g} nats is not below ln(vocabulary size) = ln({vocab_size}) = "
            f"{math.log(vocab_size):.4g} (the model's config.json), the entropy of a uniform policy: no policy "
            "reaches it",
            f"Set {POLICY_LOSS}.entropy_target below {math.log(vocab_size):.4g} (e.g. the entropy your runs start at, "
            "verl's actor/entropy)"))
    knob, value = spec.ratio_knob, getattr(settings, spec.ratio_knob)
    if spec.floor_caveat:
        found.append(Finding(
            WARNING, "entropy-floor-unproven", f"{POLICY_LOSS}.entropy_target", spec.floor_caveat,
            f"Watch {spec.metric_prefix}entropy_measured and {spec.metric_prefix}{knob}_in_use against your fixed-"
            f"{knob} runs, or set {POLICY_LOSS}.entropy_control_max_ratio to your {knob} to keep the method as you set "
            "it. The run goes on"))
    contents = [_get(config, f"{ACTOR}.checkpoint.{key}", ["model", "optimizer", "extra"])
                for key in ("save_contents", "load_contents")]
    if any(isinstance(c, (list, tuple)) and "optimizer" not in c for c in contents):
        found.append(Finding(
            WARNING, "entropy-control-not-checkpointed", f"{ACTOR}.checkpoint.save_contents",
            "the entropy controller keeps its state (the ratio it has reached, and with a horizon the entropy's "
            "recent trend) in the actor's optimizer, and "
            f"'optimizer' is not in {ACTOR}.checkpoint.save_contents / load_contents: a resumed run starts the "
            f"controller again from {knob}={value:g}, as it starts the optimizer's moments again",
            f"Keep 'optimizer' in {ACTOR}.checkpoint.save_contents and load_contents (verl's default) for an exact "
            "resume. The run goes on"))
    return found


#: Trainers whose actor log-prob pass the plugin keeps for ``prepass_layout=old`` (tested: the legacy trainer's
#: ``RayPPOTrainer`` and the v1 sync trainer, both through verl's engine ``TrainingWorker``).
OLD_POLICY_ENTROPY_TRAINERS = ("legacy", "sync")


def _old_policy_findings(config: Any, spec: ModeSpec) -> list[Finding]:
    try:
        settings = spec.read_settings(OmegaConf.select(config, ACTOR))
    except ValueError:
        return []  # a bad knob: the knob check (driver.check_trainer_config) names it
    if settings.prepass_layout != OLD_POLICY_LAYOUT:
        return []
    mode, key = spec.name, f"{POLICY_LOSS}.prepass_layout"
    fix_layout = f"Set {key}=infer (the current policy's statistics, exact)"
    if _bypass(config):
        return [Finding(
            ERROR, "old-policy-without-log-prob-pass", key,
            f"prepass_layout={OLD_POLICY_LAYOUT} selects from pi_old, the actor's weights at verl's log-prob pass, but "
            f"{ROLLOUT_CORRECTION}.bypass_mode=True runs no actor log-prob pass: the old log-probs are the rollout "
            f"engine's, not the actor's, and there is no pass entropy",
            f"{fix_layout}, or set {ROLLOUT_CORRECTION}.bypass_mode=False")]
    kind = trainer_kind(config)
    if spec.reads_entropy(settings) and kind not in OLD_POLICY_ENTROPY_TRAINERS:
        reader = "its selection" if spec.prepass_reads_entropy else "the entropy controller (entropy_target)"
        return [Finding(
            ERROR, "old-policy-entropy-not-kept", key,
            f"loss_mode={mode} with prepass_layout={OLD_POLICY_LAYOUT} reads pi_old's entropy ({reader}), which verl "
            f"does not hand the update; the plugin keeps it from the actor's log-prob pass on the legacy and the v1 "
            f"sync trainers only, and this is the v1 {kind} trainer",
            f"{fix_layout}, or use trainer.use_v1=False or trainer.v1.trainer_mode=sync")]
    return []


def _log_prob_pass_findings(config: Any, reads: str, no_pass: str, not_kept: str, verb: str) -> list[Finding]:
    """The errors of a mode that reads something from the actor's log-prob pass (``reads`` says what): ``no_pass``
    when ``bypass_mode`` runs no such pass, ``not_kept`` on a trainer whose pass the plugin does not ``verb``."""
    if _bypass(config):
        return [Finding(
            ERROR, no_pass, f"{ROLLOUT_CORRECTION}.bypass_mode",
            f"{reads}, and {ROLLOUT_CORRECTION}.bypass_mode=True runs no such pass (the old log-probs are the "
            "rollout's)", f"Set {ROLLOUT_CORRECTION}.bypass_mode=False")]
    kind = trainer_kind(config)
    if kind not in OLD_POLICY_ENTROPY_TRAINERS:
        return [Finding(
            ERROR, not_kept, "trainer.v1.trainer_mode",
            f"{reads}, which the plugin {verb} on the legacy and the v1 sync trainers only, and this is the v1 "
            f"{kind} trainer", "Use trainer.use_v1=False or trainer.v1.trainer_mode=sync")]
    return []


def _proxy_findings(config: Any, spec: ModeSpec) -> list[Finding]:
    """A mode that reads Lp-Reg's proxy (``ModeSpec.proxy_min_p``) needs the actor's log-prob pass, kept by the
    plugin, and the logits (no fused kernels)."""
    if spec.proxy_min_p is None:
        return []
    mode = spec.name
    reads = (f"loss_mode={mode} computes its proxy pi_proxy (the old policy, min-p filtered) in the actor's log-prob "
             "pass")
    missing = _log_prob_pass_findings(config, reads, "proxy-without-log-prob-pass", "proxy-not-kept", "keeps")
    if missing:
        return missing
    if _get(config, "actor_rollout_ref.model.use_fused_kernels", False) is True:
        return [Finding(
            ERROR, "proxy-without-logits", "actor_rollout_ref.model.use_fused_kernels",
            f"{reads} from its logits, and use_fused_kernels=True does not materialise them",
            "Set actor_rollout_ref.model.use_fused_kernels=False")]
    return []


def _update_rule_findings(config: Any, spec: ModeSpec) -> list[Finding]:
    if not spec.reads_batch_entropy:
        return []
    try:
        settings = spec.read_settings(OmegaConf.select(config, ACTOR))
    except ValueError:
        return []  # a bad knob: the knob check (driver.check_trainer_config) names it
    mode = spec.name
    reads = (f"loss_mode={mode} reads, once per trainer step, the old policy's mean entropy over the step's batch "
             "(verl's actor/entropy) from the actor's log-prob pass")
    missing = _log_prob_pass_findings(config, reads, "batch-entropy-without-log-prob-pass", "batch-entropy-not-kept",
                                      "sees")
    if missing:
        return missing
    found = [Finding(WARNING, name, f"{POLICY_LOSS}.{key}", what, fix + ". The run goes on")
             for name, key, what, fix in (spec.setting_warnings(settings) if spec.setting_warnings else [])]
    contents = [_get(config, f"{ACTOR}.checkpoint.{key}", ["model", "optimizer", "extra"])
                for key in ("save_contents", "load_contents")]
    if any(isinstance(c, (list, tuple)) and "optimizer" not in c for c in contents):
        found.append(Finding(
            WARNING, "update-rule-not-checkpointed", f"{ACTOR}.checkpoint.save_contents",
            f"loss_mode={mode} keeps the state of its once-per-trainer-step rule in the actor's "
            f"optimizer, and 'optimizer' is not in {ACTOR}.checkpoint.save_contents / load_contents: a resumed run "
            "starts it again from the configured values",
            f"Keep 'optimizer' in {ACTOR}.checkpoint.save_contents and load_contents (verl's default) for an exact "
            "resume. The run goes on"))
    warmup = _get(config, "trainer.critic_warmup", 0)
    if getattr(settings, "adaptive", False) and isinstance(warmup, int) and warmup > 0:
        found.append(Finding(
            WARNING, "update-rule-during-critic-warmup", "trainer.critic_warmup",
            f"trainer.critic_warmup={warmup}: verl runs the actor's log-prob pass but no actor update for the first "
            f"{warmup} steps, and {mode}'s schedule steps once per actor update, so W and M start moving after the "
            "warm-up (the authors' controller also steps during it)",
            "Set trainer.critic_warmup=0 (GRPO needs no critic), or expect the schedule to start later. The run goes "
            "on"))
    return found


def findings(config: Any) -> list[Finding]:
    """Every whole-config finding for a composed trainer config (``DictConfig``); [] unless it selects a
    global loss mode. Errors first. Reads ``actor_rollout_ref.actor``, ``data``, ``trainer`` and
    ``algorithm.rollout_correction``; the knobs themselves are checked by :mod:`.config`."""
    actor = OmegaConf.select(config, ACTOR, default=None)
    mode = global_mode_of(actor) if actor is not None else None
    if mode is None:
        return []
    found = (_bypass_findings(config, mode) + _on_policy_findings(config, mode) + _percentage_findings(config, mode)
             + _ratio_findings(config, mode) + _keeps_all_findings(config, mode) + _controller_findings(config, mode)
             + _old_policy_findings(config, mode) + _update_rule_findings(config, mode) + _proxy_findings(config, mode))
    return sorted(found, key=lambda f: f.severity != ERROR)


def report(found: list[Finding], error_cls: type = ValueError) -> None:
    """Raise ``error_cls`` with every error's text (one per line), else emit each warning as a
    :class:`GuardrailWarning`."""
    errors = [f.text() for f in found if f.severity == ERROR]
    if errors:
        raise error_cls("\n".join(errors))
    for finding in found:
        warnings.warn(finding.text(), GuardrailWarning, stacklevel=3)
