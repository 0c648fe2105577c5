"""The catalogue of every verl patch the plugin applies (:data:`PATCHES`), and their install/uninstall.

As Liger's ``monkey_patch.py`` lists its patches, each :class:`Patch` names what it replaces, the seam that guards
it (:mod:`verl_klcov_global.seams`: checked once at import, before anything is patched; a moved seam raises
``VerlSeamError`` naming it), where it applies, the verl code it targets, and how it is installed:
:func:`install` applies exactly the catalogue's installable entries, in order, and checks each is in place after.

* ``train_batch_prepass`` (every process that trains): wraps ``BaseEngine.train_batch(self, data, loss_function)``,
  inherited by every engine, with :func:`.step.train_batch_with_prepass`;
* ``validate_config_driver_checks`` (the driver): wraps ``verl.utils.config.validate_config``, which ``main_ppo``
  (and ``main_ppo_v0``) calls before ``ray.init`` (verl 0.9; in 0.8 in the TaskRunner), so that
  :func:`verl_klcov_global.driver.prepare_trainer_config` checks the knobs on the raw config and adds the worker
  loader to the Ray runtime environment first;
* ``prepass_batched_logsumexp`` (during the prepass forward only, by :func:`.logprobs.batched_logsumexp`): swaps
  ``verl.utils.torch_functional.logprobs_from_logits_v2``;
* ``log_prob_pass_context`` (every process that imports verl's engine workers): wraps
  ``TrainingWorker.infer_batch(self, data)`` (what the actor's ``compute_log_prob`` calls) so that a pass of an actor
  whose loss is a global mode, with its LoRA adapter on (no ``no_lora_adapter``), opens
  :func:`.kept_pass.log_prob_pass` (held for the whole update with ``prepass_layout=old`` where the mode or the
  controller reads entropy, and for Lp-Reg's proxy); verl's dispatch attributes (``@register``) are kept. Skipped
  where verl's engine workers cannot be imported (their web-server dependencies missing), where no actor can run;
* ``log_prob_pass_keep`` (same processes as ``train_batch_prepass``): wraps ``BaseEngine.infer_batch``, inherited by
  the FSDP engine, to hand its outputs to :func:`.kept_pass.after_infer_batch`, which keeps them only inside such a
  pass (on every rank, Ulysses SP included);
* ``proxy_log_prob_in_pass`` (same processes): wraps ``FSDPEngineWithLMHead.prepare_model_outputs`` with
  :func:`.proxy.prepare_model_outputs_with_proxy`: where the micro-batch carries :data:`.proxy.PROXY_REQUEST_KEY`,
  Lp-Reg's proxy log-probs are computed from the logits and added to the model output, which
  ``log_prob_pass_keep`` keeps and removes;
* ``weight_restore_bumps_version``: wraps verl's sharded restore helpers ``fsdp{1,2}_sharded_load_from_cpu``, which
  ``separate_async`` / fully async training call around the log-prob pass (looked up at call time: a seam), so that
  a restore bumps the weights version of the engines holding the module (:func:`.weights.weights_restored`);
* ``seam_error_loss_registry``, ``seam_error_validate_config``: only in a process whose seam check failed, by
  :func:`verl_klcov_global.seams.make_seam_error_visible` (never by :func:`install`; this module is not imported
  then): the global mode names in verl's registry and ``validate_config`` raise the seam error.

The CPU platform that ``diagnose`` and the tests use patches verl and torch too; those patches are the lab's, never
applied by the plugin, and listed in :mod:`verl_klcov_global.lab.cpu`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

from tensordict import TensorDict
from verl.workers.engine.base import BaseEngine

from .. import driver, seams
from ..mode_config import OLD_POLICY_LAYOUT
from ..modes import global_mode_of
from ..seams import ORIGINAL_ATTR, RESTORE_HELPERS, replace_validate_config
from . import kept_pass, weights
from .proxy import PROXY_REQUEST_KEY, prepare_model_outputs_with_proxy
from .step import actor_config_of, train_batch_with_prepass

__all__ = ["ORIGINAL_ATTR", "PATCHES", "Patch", "PatchNotInstalledError", "install", "install_driver_checks",
           "install_hook", "install_proxy", "install_reuse", "is_hook_installed", "is_reuse_installed", "patch",
           "proxy_log_prob_pass", "uninstall_hook", "uninstall_reuse"]


class PatchNotInstalledError(RuntimeError):
    """An installable patch of the catalogue is not in place after its install ran."""


@dataclass(frozen=True)
class Patch:
    """One verl patch.

    ``name``; ``target``: what it replaces; ``seam``: the :data:`verl_klcov_global.seams.SEAMS` entry that guards it;
    ``scope``: where and when it applies; ``implementation``: the plugin's code it runs; ``verl``: the verl code it
    targets, by version (a verl upgrade checks these references); ``install`` / ``uninstall`` / ``installed``: how
    :func:`install` applies it, takes it off (tests) and sees it in place, or None for a patch applied elsewhere (its
    ``scope`` says where)."""

    name: str
    target: str
    seam: str
    scope: str
    implementation: str
    verl: str
    install: Optional[Callable[[], None]] = None
    uninstall: Optional[Callable[[], None]] = None
    installed: Optional[Callable[[], bool]] = None


def install() -> None:
    """Apply every installable patch of :data:`PATCHES`, in order (idempotent); raise
    :class:`PatchNotInstalledError` naming one that is not in place afterwards."""
    for entry in PATCHES:
        if entry.install is None:
            continue
        entry.install()
        if entry.installed is not None and not entry.installed():
            raise PatchNotInstalledError(f"PATCH {entry.name} ({entry.target}) is not in place after its install")


def patch(name: str) -> Patch:
    """The catalogue's entry ``name``."""
    for entry in PATCHES:
        if entry.name == name:
            return entry
    raise KeyError(f"no PATCH {name!r}; the catalogue has {[entry.name for entry in PATCHES]}")


def _wrapped(owner: Any, name: str) -> bool:
    return getattr(getattr(owner, name, None), ORIGINAL_ATTR, None) is not None


def _unwrap(owner: Any, name: str) -> None:
    original = getattr(getattr(owner, name, None), ORIGINAL_ATTR, None)
    if original is not None:
        setattr(owner, name, original)


# ---------------------------------------------------------------------------------------------
# train_batch_prepass


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
    return _wrapped(BaseEngine, "train_batch")


def uninstall_hook() -> None:
    """Restore verl's own ``BaseEngine.train_batch`` (for tests)."""
    _unwrap(BaseEngine, "train_batch")


# ---------------------------------------------------------------------------------------------
# validate_config_driver_checks


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


def _driver_checks_installed() -> bool:
    import verl.utils.config as verl_config

    return _wrapped(verl_config, "validate_config")


def _uninstall_driver_checks() -> None:
    import verl.utils.config as verl_config

    current = verl_config.validate_config
    original = getattr(current, ORIGINAL_ATTR, None)
    if original is not None:
        replace_validate_config(current, original)


# ---------------------------------------------------------------------------------------------
# trainer_config_checks


def _trainer_classes() -> list[type]:
    """verl's trainer classes that :data:`~verl_klcov_global.seams.TRAINER_CLASSES` names, where importable
    (verl 0.8.0 has no v1 trainer)."""
    found = []
    for module_name, name in seams.TRAINER_CLASSES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if getattr(module, name, None) is not None:
            found.append(getattr(module, name))
    return found


def _install_trainer_checks() -> None:
    """Install PATCH ``trainer_config_checks`` (idempotent): each trainer's ``__init__`` checks its config first."""
    for trainer_class in _trainer_classes():
        if _wrapped(trainer_class, "__init__"):
            continue
        original = trainer_class.__init__

        @functools.wraps(original)
        def __init__(self, *args, __original=original, **kwargs):
            driver.check_in_trainer(kwargs["config"] if "config" in kwargs else (args[0] if args else None))
            return __original(self, *args, **kwargs)

        setattr(__init__, ORIGINAL_ATTR, original)
        trainer_class.__init__ = __init__


def _uninstall_trainer_checks() -> None:
    for trainer_class in _trainer_classes():
        _unwrap(trainer_class, "__init__")


def _trainer_checks_installed() -> bool:
    return all(_wrapped(trainer_class, "__init__") for trainer_class in _trainer_classes())


# ---------------------------------------------------------------------------------------------
# log_prob_pass_context, log_prob_pass_keep, proxy_log_prob_in_pass, weight_restore_bumps_version


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

    # read before verl's infer_batch pops it (a seam: seams.NO_LORA_ADAPTER_KEY)
    if tu.get_non_tensor_data(data=data, key=seams.NO_LORA_ADAPTER_KEY, default=False):
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
        return kept_pass.log_prob_pass(engine, keep_entropy=True, hold=True, keep=keep,
                                       batch_entropy=reads_batch_entropy)
    if settings.prepass_layout != "infer":
        if not reads_batch_entropy:
            return contextlib.nullcontext()
        return kept_pass.log_prob_pass(engine, keep_entropy=False, keep=False, batch_entropy=True)
    return kept_pass.log_prob_pass(engine, keep_entropy=mode.reads_entropy(settings),
                                   batch_entropy=reads_batch_entropy)


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


def _install_log_prob_pass_context() -> None:
    """Install PATCH ``log_prob_pass_context`` (idempotent; nothing where verl's engine workers cannot be imported)."""
    worker_class = _training_worker_class()
    if worker_class is None or _wrapped(worker_class, "infer_batch"):
        return
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


def _log_prob_pass_context_installed() -> bool:
    worker_class = _training_worker_class()
    return worker_class is None or _wrapped(worker_class, "infer_batch")


def _uninstall_log_prob_pass_context() -> None:
    worker_class = _training_worker_class()
    if worker_class is not None:
        _unwrap(worker_class, "infer_batch")


def _install_log_prob_pass_keep() -> None:
    """Install PATCH ``log_prob_pass_keep`` (idempotent)."""
    if _wrapped(BaseEngine, "infer_batch"):
        return
    current_infer = BaseEngine.infer_batch

    @functools.wraps(current_infer)
    def infer_batch(self, data: TensorDict, loss_function: Callable = None, *args, **kwargs) -> Any:
        outputs = current_infer(self, data, loss_function, *args, **kwargs)
        kept_pass.after_infer_batch(self, data, outputs)
        return outputs

    setattr(infer_batch, ORIGINAL_ATTR, current_infer)
    BaseEngine.infer_batch = infer_batch


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


def _fsdp_utils():
    import verl.utils.fsdp_utils as fsdp_utils

    return fsdp_utils


def _install_weight_restore_bumps_version() -> None:
    """Install PATCH ``weight_restore_bumps_version`` on each of verl's restore helpers it defines (idempotent)."""
    fsdp_utils = _fsdp_utils()
    for name in RESTORE_HELPERS.values():
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


def _weight_restore_installed() -> bool:
    fsdp_utils = _fsdp_utils()
    return all(_wrapped(fsdp_utils, name) for name in RESTORE_HELPERS.values() if hasattr(fsdp_utils, name))


def _uninstall_weight_restore() -> None:
    fsdp_utils = _fsdp_utils()
    for name in RESTORE_HELPERS.values():
        _unwrap(fsdp_utils, name)


def install_reuse() -> None:
    """Install the catalogue's patches of verl's log-prob pass: ``log_prob_pass_context``, ``proxy_log_prob_in_pass``,
    ``log_prob_pass_keep`` and ``weight_restore_bumps_version`` (idempotent)."""
    for name in REUSE_PATCHES:
        patch(name).install()


def is_reuse_installed() -> bool:
    """True when PATCH ``log_prob_pass_keep`` is active in this process."""
    return _wrapped(BaseEngine, "infer_batch")


def uninstall_reuse() -> None:
    """Restore verl's own functions of the reuse patches (for tests)."""
    for name in REUSE_PATCHES:
        patch(name).uninstall()


# ---------------------------------------------------------------------------------------------
# The catalogue

#: The patches of verl's log-prob pass (:func:`install_reuse`).
REUSE_PATCHES = ("log_prob_pass_context", "proxy_log_prob_in_pass", "log_prob_pass_keep",
                 "weight_restore_bumps_version")
_FSDP = "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead"

PATCHES: tuple[Patch, ...] = (
    Patch("train_batch_prepass", "verl.workers.engine.base.BaseEngine.train_batch",
          "verl.workers.engine.base.BaseEngine.train_batch(self, data, loss_function)",
          "every process that imports the plugin (permanent)", "engine.step.train_batch_with_prepass",
          "workers/engine/base.py BaseEngine.train_batch: 0.9.1 ~113, 0.8.0 and main 1dda039b the same method",
          install=install_hook, uninstall=uninstall_hook, installed=is_hook_installed),
    Patch("validate_config_driver_checks", "verl.utils.config.validate_config (and main_ppo's imported copy)",
          "verl.utils.config.validate_config(config, use_reference_policy, use_critic)",
          "every process that imports the plugin; acts where main_ppo validates (permanent)",
          "driver.prepare_trainer_config",
          "utils/config.py validate_config; called by trainer/main_ppo.py before ray.init (0.9.1, main 1dda039b), in "
          "the TaskRunner (0.8.0)",
          install=install_driver_checks, uninstall=_uninstall_driver_checks, installed=_driver_checks_installed),
    Patch("trainer_config_checks", "verl.trainer.ppo.ray_trainer.RayPPOTrainer.__init__ and "
          "verl.trainer.ppo.v1.trainer_base.PPOTrainer.__init__ (where verl has it)",
          seams.TRAINERS_TAKE_CONFIG,
          "every process that imports the plugin; acts where a trainer is built, the TaskRunner (permanent)",
          "driver.check_in_trainer",
          "trainer/ppo/ray_trainer.py RayPPOTrainer.__init__ (0.8.0, 0.9.1, main 1dda039b); trainer/ppo/v1/"
          "trainer_base.py PPOTrainer.__init__ (0.9.1, main 1dda039b), whose subclasses (sync, colocate_async, "
          "separate_async) call it",
          install=_install_trainer_checks, uninstall=_uninstall_trainer_checks, installed=_trainer_checks_installed),
    Patch("prepass_batched_logsumexp", "verl.utils.torch_functional.logprobs_from_logits_v2",
          "verl.utils.torch_functional.logprobs_from_logits_v2(logits, labels)",
          "inside the no-grad prepass forward only (engine.logprobs.batched_logsumexp), restored afterwards",
          "engine.logprobs.log_probs_in_place",
          "utils/torch_functional.py logprobs_from_logits_v2: 0.9.1 ~173, the path logprobs_from_logits takes without "
          "flash-attn's cross-entropy kernel (or with VERL_DISABLE_FLASH_ATTN_CE=1) and without NPU kernels. Off "
          "where the step reads entropy: 0.9.1 computes the entropy before the log-probs (transformer_impl.py "
          "~1397-1431), 0.8.0's packed path after them, from the logits the patch overwrites (the entropy then moved "
          "by up to 1e-2 on the tiny model, CPU)"),
    Patch("log_prob_pass_context", "verl.workers.engine_workers.TrainingWorker.infer_batch",
          "verl.workers.engine_workers.TrainingWorker.infer_batch(self, data)",
          "every process that imports the plugin and can import verl's engine workers (permanent)",
          "engine.patches._log_prob_pass_of -> engine.kept_pass.log_prob_pass",
          "workers/engine_workers.py TrainingWorker.infer_batch: 0.9.1 ~398 (pops no_lora_adapter ~402), "
          "0.8.0 ~380, main 1dda039b ~400",
          install=_install_log_prob_pass_context, uninstall=_uninstall_log_prob_pass_context,
          installed=_log_prob_pass_context_installed),
    Patch("proxy_log_prob_in_pass", f"{_FSDP}.prepare_model_outputs",
          f"{_FSDP}.prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func)",
          "every process that imports the plugin (permanent); computes only where a micro-batch carries "
          "PROXY_REQUEST_KEY (the log-prob pass of a mode with ModeSpec.proxy_min_p)",
          "engine.proxy.prepare_model_outputs_with_proxy",
          "workers/engine/fsdp/transformer_impl.py prepare_model_outputs: 0.9.1 ~1332, 0.8.0 ~1067, main 1dda039b "
          "~1308 (the logits exist there in the packed and the padded branch; verl's top-k distillation passes the "
          "loss function there as logits_processor_func, 0.9.1 ~1413, which engine.step passes through)",
          install=install_proxy, uninstall=lambda: _unwrap(_lm_head_engine_class(), "prepare_model_outputs"),
          installed=lambda: _wrapped(_lm_head_engine_class(), "prepare_model_outputs")),
    Patch("log_prob_pass_keep", "verl.workers.engine.base.BaseEngine.infer_batch",
          f"{_FSDP} inherits BaseEngine.infer_batch",
          "every process that imports the plugin (permanent); keeps only inside log_prob_pass_context",
          "engine.kept_pass.after_infer_batch",
          "workers/engine/base.py BaseEngine.infer_batch: 0.9.1 ~134, inherited by the FSDP engine",
          install=_install_log_prob_pass_keep, uninstall=lambda: _unwrap(BaseEngine, "infer_batch"),
          installed=is_reuse_installed),
    Patch("weight_restore_bumps_version",
          "verl.utils.fsdp_utils.fsdp2_sharded_load_from_cpu (and fsdp1_sharded_load_from_cpu where defined)",
          "verl.utils.fsdp_utils.fsdp2_sharded_load_from_cpu(model, cpu_sharded_state, target_spec) / "
          "fsdp1_sharded_load_from_cpu(model, cpu_sharded_state)",
          "every process that imports the plugin (permanent)", "engine.weights.weights_restored",
          "utils/fsdp_utils.py (fsdp1's helper from 0.9.1 on); called by experimental/separation/engine_workers.py "
          "DetachActorWorker.restore_model_from_cpu, which imports the helper at call time (a seam)",
          install=_install_weight_restore_bumps_version, uninstall=_uninstall_weight_restore,
          installed=_weight_restore_installed),
    *(Patch(guard.name, guard.target, guard.seam,
            "only in a process whose seam check failed, applied by seams.make_seam_error_visible (never by install())",
            f"seams.{guard.apply.__name__}", guard.verl) for guard in seams.SEAM_ERROR_GUARDS),
)
