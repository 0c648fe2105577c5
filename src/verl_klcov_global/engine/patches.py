"""The catalogue of every verl patch the plugin applies, and their install/uninstall.

Targets: verl 0.9.1 and 0.8.0 (line references are 0.9.1's). The signatures each patch rests on
are checked once, at import, by :mod:`verl_klcov_global.seams` (a moved seam raises
``VerlSeamError`` naming it before anything is patched); nothing here re-checks them.
:data:`PATCHES` lists them all, as Liger's ``monkey_patch.py`` lists its patches:

* ``train_batch_prepass`` (every process that trains): wraps
  ``verl.workers.engine.base.BaseEngine.train_batch(self, data, loss_function)``
  (``workers/engine/base.py`` ~113, inherited by every engine) with
  :func:`.step.train_batch_with_prepass`. Installed by :func:`install_hook`.
* ``validate_config_driver_checks`` (the driver): wraps
  ``verl.utils.config.validate_config(config, use_reference_policy, use_critic)``, which
  ``main_ppo`` (and ``main_ppo_v0``) calls before ``ray.init`` (verl 0.9; in 0.8 in the TaskRunner),
  so that :func:`verl_klcov_global.driver.prepare_trainer_config` checks the knobs on the raw
  config and adds the worker loader to the Ray runtime environment first. Installed by
  :func:`install_driver_checks`.
* ``prepass_batched_logsumexp`` (during the prepass only): swaps
  ``verl.utils.torch_functional.logprobs_from_logits_v2(logits, labels)`` inside
  :func:`.prepass.compute_prepass_log_probs`; see :mod:`.logprobs`.
* ``log_prob_pass_context`` (every process that imports verl's engine workers): wraps
  ``verl.workers.engine_workers.TrainingWorker.infer_batch(self, data)`` (~398, what the actor's
  ``compute_log_prob`` calls) so that a pass of an actor whose loss is a global mode with
  ``prepass_layout=infer`` and whose LoRA adapter stays on (no ``no_lora_adapter``) opens
  :func:`.kept_pass.log_prob_pass` (with ``prepass_layout=old``, where the mode or the controller reads
  entropy: held for the whole update, :mod:`.old_policy`); verl's dispatch attributes (``@register``) are kept. Installed by
  :func:`install_reuse`; skipped where verl's engine workers cannot be imported (their web-server
  dependencies missing), where no actor can run either.
* ``log_prob_pass_keep`` (same processes as ``train_batch_prepass``): wraps
  ``verl.workers.engine.base.BaseEngine.infer_batch(self, data, loss_function=None)`` (~134, inherited
  by the FSDP engine) to hand its outputs to :func:`.kept_pass.after_infer_batch`, which keeps them only
  inside such a pass (on every rank, Ulysses SP included). Installed by :func:`install_reuse`.
* ``proxy_log_prob_in_pass`` (same processes): wraps
  ``verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead.prepare_model_outputs(self, output, output_args,
  micro_batch, logits_processor_func)`` (~1332) with :func:`.proxy.prepare_model_outputs_with_proxy`: where the
  micro-batch carries :data:`.proxy.PROXY_REQUEST_KEY` (set by ``log_prob_pass_context`` for an ``lp_reg_global``
  actor's pass), Lp-Reg's proxy log-probs are computed from the logits and added to the model output, which
  ``log_prob_pass_keep`` keeps and removes. Installed by :func:`install_reuse`.
* ``weight_restore_bumps_version``: wraps ``verl.utils.fsdp_utils.fsdp2_sharded_load_from_cpu`` and,
  where verl has it (0.9.1 and later), ``fsdp1_sharded_load_from_cpu``: the restore of saved weights that
  ``separate_async`` / fully async training make around the log-prob pass
  (``experimental/separation/engine_workers.py`` ~140, imported at call time) bumps the weights version
  of the engines holding the module (:func:`.weights.weights_restored`). Installed by :func:`install_reuse`.

The CPU platform that ``diagnose`` and the tests use patches verl and torch too; those patches
are the lab's, never applied by the plugin, and listed in :mod:`verl_klcov_global.lab.cpu`.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable

from tensordict import TensorDict
from verl.workers.engine.base import BaseEngine

from .. import driver
from ..mode_config import OLD_POLICY_LAYOUT
from ..modes import global_mode_of
from ..seams import replace_validate_config
from . import kept_pass, weights
from .proxy import PROXY_REQUEST_KEY, prepare_model_outputs_with_proxy
from .step import actor_config_of, train_batch_with_prepass

__all__ = ["PATCHES", "Patch", "install", "install_driver_checks", "install_hook", "install_proxy", "install_reuse", "proxy_log_prob_pass",
           "is_hook_installed", "is_reuse_installed", "uninstall_hook", "uninstall_reuse"]

#: Attribute of a wrapper holding verl's original function (also how "already installed" is seen).
ORIGINAL_ATTR = "__verl_klcov_global_original__"


@dataclass(frozen=True)
class Patch:
    """One verl patch: its name, what it replaces, the seam that guards it, where it applies."""

    name: str
    target: str
    seam: str  # the :data:`verl_klcov_global.seams.SEAMS` entry that checks the target's signature
    scope: str
    implementation: str


PATCHES: tuple[Patch, ...] = (
    Patch("train_batch_prepass", "verl.workers.engine.base.BaseEngine.train_batch",
          "verl.workers.engine.base.BaseEngine.train_batch(self, data, loss_function)",
          "every process that imports the plugin (permanent)", "engine.step.train_batch_with_prepass"),
    Patch("validate_config_driver_checks", "verl.utils.config.validate_config (and main_ppo's imported copy)",
          "verl.utils.config.validate_config(config, use_reference_policy, use_critic)",
          "every process that imports the plugin; acts where main_ppo validates (permanent)",
          "driver.prepare_trainer_config"),
    Patch("prepass_batched_logsumexp", "verl.utils.torch_functional.logprobs_from_logits_v2",
          "verl.utils.torch_functional.logprobs_from_logits_v2(logits, labels)",
          "inside the no-grad prepass forward only, restored afterwards", "engine.logprobs.batched_logsumexp"),
    Patch("log_prob_pass_context", "verl.workers.engine_workers.TrainingWorker.infer_batch",
          "verl.workers.engine_workers.TrainingWorker.infer_batch(self, data)",
          "every process that imports the plugin and can import verl's engine workers (permanent)",
          "engine.patches.install_reuse -> engine.kept_pass.log_prob_pass"),
    Patch("log_prob_pass_keep", "verl.workers.engine.base.BaseEngine.infer_batch",
          "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead inherits BaseEngine.infer_batch",
          "every process that imports the plugin (permanent); keeps only inside log_prob_pass_context",
          "engine.kept_pass.after_infer_batch"),
    Patch("proxy_log_prob_in_pass", "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead.prepare_model_outputs",
          "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead.prepare_model_outputs(self, output, "
          "output_args, micro_batch, logits_processor_func)",
          "every process that imports the plugin (permanent); computes only where a micro-batch carries "
          "PROXY_REQUEST_KEY (the log-prob pass of a mode with ModeSpec.proxy_min_p)", "engine.proxy.prepare_model_outputs_with_proxy"),
    Patch("weight_restore_bumps_version",
          "verl.utils.fsdp_utils.fsdp2_sharded_load_from_cpu (and fsdp1_sharded_load_from_cpu where defined)",
          "verl.utils.fsdp_utils.fsdp2_sharded_load_from_cpu(model, cpu_sharded_state, target_spec) / "
          "fsdp1_sharded_load_from_cpu(model, cpu_sharded_state)",
          "every process that imports the plugin (permanent)", "engine.weights.weights_restored"),
)


def install() -> None:
    """Install the permanent patches (idempotent): ``train_batch_prepass``, ``validate_config_driver_checks`` and
    the three of verl's-log-prob-pass reuse (:func:`install_reuse`)."""
    install_hook()
    install_driver_checks()
    install_reuse()


def install_hook() -> None:
    """Install PATCH ``train_batch_prepass`` (idempotent)."""
    current = BaseEngine.train_batch
    if getattr(current, ORIGINAL_ATTR, None) is not None:
        return

    @functools.wraps(current)
    def train_batch(self, data: TensorDict, loss_function: Callable) -> Any:
        return train_batch_with_prepass(current, self, data, loss_function)

    setattr(train_batch, ORIGINAL_ATTR, current)
    BaseEngine.train_batch = train_batch


def is_hook_installed() -> bool:
    """True when PATCH ``train_batch_prepass`` is active in this process."""
    return getattr(BaseEngine.train_batch, ORIGINAL_ATTR, None) is not None


def uninstall_hook() -> None:
    """Restore verl's own ``BaseEngine.train_batch`` (for tests)."""
    original = getattr(BaseEngine.train_batch, ORIGINAL_ATTR, None)
    if original is not None:
        BaseEngine.train_batch = original


def install_driver_checks() -> None:
    """Install PATCH ``validate_config_driver_checks`` (idempotent).

    The plugin is imported on ``import verl``, before ``main_ppo`` runs ``from verl.utils.config
    import validate_config``, so ``main_ppo`` gets the wrapper; a ``verl.trainer.main_ppo`` (or
    ``main_ppo_v0``, or ``__main__``) module imported earlier is updated too.
    """
    import verl.utils.config as verl_config

    current = verl_config.validate_config
    if getattr(current, ORIGINAL_ATTR, None) is not None:
        return

    @functools.wraps(current)
    def validate_config(config, *args, **kwargs):
        driver.prepare_trainer_config(config)
        return current(config, *args, **kwargs)

    setattr(validate_config, ORIGINAL_ATTR, current)
    replace_validate_config(current, validate_config)


# ---------------------------------------------------------------------------------------------
# Reuse of verl's log-prob pass (engine/kept_pass.py, engine/reuse.py)

#: verl's sharded restore helpers PATCH ``weight_restore_bumps_version`` wraps (module verl.utils.fsdp_utils)
RESTORE_HELPERS = ("fsdp1_sharded_load_from_cpu", "fsdp2_sharded_load_from_cpu")


def _training_worker_class():
    """verl's ``TrainingWorker``, or None where its module cannot be imported (fastapi/uvicorn missing)."""
    try:
        from verl.workers.engine_workers import TrainingWorker
    except ImportError:
        return None
    return TrainingWorker


def _log_prob_pass_of(worker, data):
    """:func:`.kept_pass.log_prob_pass` for this ``TrainingWorker.infer_batch`` call, or a null context.

    A mode that reads Lp-Reg's proxy (``ModeSpec.proxy_min_p``) keeps and holds the pass in every layout, with
    :data:`.proxy.PROXY_REQUEST_KEY` set on the batch for the pass (PATCH ``proxy_log_prob_in_pass``)."""
    config = actor_config_of(getattr(worker, "loss_fn", None))  # None for a reference or value model
    mode = global_mode_of(config)
    engine = getattr(worker, "engine", None)
    if mode is None or engine is None or not isinstance(data, TensorDict):
        return contextlib.nullcontext()
    from verl.utils import tensordict_utils as tu

    if tu.get_non_tensor_data(data=data, key="no_lora_adapter", default=False):
        return contextlib.nullcontext()  # the LoRA reference pass: the adapter is off, not the actor's policy
    try:
        settings = mode.read_settings(config)
    except ValueError:  # a bad knob: the update raises it by name; nothing to keep
        return contextlib.nullcontext()
    reads_batch_entropy = mode.reads_batch_entropy  # a once-per-trainer-step rule: every layout (engine/schedule.py)
    if mode.proxy_min_p is not None:  # pi_old's proxy log-probs, held for every step of the update
        return proxy_log_prob_pass(engine, data, mode.proxy_min_p(settings), keep_entropy=mode.reads_entropy(settings),
                           batch_entropy=reads_batch_entropy)
    if settings.prepass_layout == OLD_POLICY_LAYOUT:  # pi_old's entropy, held for every step of the update
        keep = mode.reads_entropy(settings)
        if not keep and not reads_batch_entropy:
            return contextlib.nullcontext()  # old_log_probs travel with the batch: nothing to keep
        return kept_pass.log_prob_pass(engine, keep_entropy=True, hold=True, keep=keep, batch_entropy=reads_batch_entropy)
    if settings.prepass_layout != "infer":
        if not reads_batch_entropy:
            return contextlib.nullcontext()
        return kept_pass.log_prob_pass(engine, keep_entropy=False, keep=False, batch_entropy=True)
    return kept_pass.log_prob_pass(engine, keep_entropy=mode.reads_entropy(settings), batch_entropy=reads_batch_entropy)


@contextlib.contextmanager
def proxy_log_prob_pass(engine, data: TensorDict, min_p: float, *, keep_entropy: bool, batch_entropy: bool):
    """The log-prob pass with Lp-Reg's proxy requested on ``data`` (removed again after the pass)."""
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor(data, **{PROXY_REQUEST_KEY: float(min_p)})
    try:
        with kept_pass.log_prob_pass(engine, keep_entropy=keep_entropy, keep_proxy=True, batch_entropy=batch_entropy):
            yield
    finally:
        if PROXY_REQUEST_KEY in data.keys():
            del data[PROXY_REQUEST_KEY]


def install_reuse() -> None:
    """Install PATCHES ``log_prob_pass_context``, ``log_prob_pass_keep``, ``proxy_log_prob_in_pass`` and
    ``weight_restore_bumps_version`` (idempotent)."""
    import verl.utils.fsdp_utils as fsdp_utils

    worker_class = _training_worker_class()
    if worker_class is not None and getattr(worker_class.infer_batch, ORIGINAL_ATTR, None) is None:
        current_worker_infer = worker_class.infer_batch

        @functools.wraps(current_worker_infer)  # keeps verl's @register dispatch attributes
        def worker_infer_batch(self, data, *args, **kwargs):
            try:
                context = _log_prob_pass_of(self, data)
            except Exception:  # never verl's pass's failure: nothing is kept, the update runs the prepass
                context = contextlib.nullcontext()
            with context:
                return current_worker_infer(self, data, *args, **kwargs)

        setattr(worker_infer_batch, ORIGINAL_ATTR, current_worker_infer)
        worker_class.infer_batch = worker_infer_batch

    install_proxy()

    if getattr(BaseEngine.infer_batch, ORIGINAL_ATTR, None) is None:
        current_infer = BaseEngine.infer_batch

        @functools.wraps(current_infer)
        def infer_batch(self, data: TensorDict, loss_function: Callable = None, *args, **kwargs) -> Any:
            outputs = current_infer(self, data, loss_function, *args, **kwargs)
            kept_pass.after_infer_batch(self, data, outputs)
            return outputs

        setattr(infer_batch, ORIGINAL_ATTR, current_infer)
        BaseEngine.infer_batch = infer_batch

    for name in RESTORE_HELPERS:
        current_restore = getattr(fsdp_utils, name, None)
        if current_restore is None or getattr(current_restore, ORIGINAL_ATTR, None) is not None:
            continue
        setattr(fsdp_utils, name, _restore_wrapper(current_restore))


def _restore_wrapper(current: Callable) -> Callable:
    @functools.wraps(current)
    def restore(model, *args, **kwargs):
        try:
            return current(model, *args, **kwargs)
        finally:  # even a restore that failed halfway has written some parameters
            weights.weights_restored(model)

    setattr(restore, ORIGINAL_ATTR, current)
    return restore


def _lm_head_engine_class():
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    return FSDPEngineWithLMHead


def install_proxy() -> None:
    """Install PATCH ``proxy_log_prob_in_pass`` (idempotent)."""
    engine_class = _lm_head_engine_class()
    current = engine_class.prepare_model_outputs
    if getattr(current, ORIGINAL_ATTR, None) is not None:
        return

    @functools.wraps(current)
    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        return prepare_model_outputs_with_proxy(current, self, output, output_args, micro_batch,
                                                logits_processor_func)

    setattr(prepare_model_outputs, ORIGINAL_ATTR, current)
    engine_class.prepare_model_outputs = prepare_model_outputs


def is_reuse_installed() -> bool:
    """True when PATCH ``log_prob_pass_keep`` is active in this process."""
    return getattr(BaseEngine.infer_batch, ORIGINAL_ATTR, None) is not None


def uninstall_reuse() -> None:
    """Restore verl's own functions of the three reuse patches (for tests)."""
    import verl.utils.fsdp_utils as fsdp_utils

    worker_class = _training_worker_class()
    targets = [(BaseEngine, "infer_batch"), (_lm_head_engine_class(), "prepare_model_outputs")] + [
        (fsdp_utils, name) for name in RESTORE_HELPERS]
    if worker_class is not None:
        targets.append((worker_class, "infer_batch"))
    for owner, name in targets:
        original = getattr(getattr(owner, name, None), ORIGINAL_ATTR, None)
        if original is not None:
            setattr(owner, name, original)
