"""The verl seams this plugin patches or reads, checked at import instead of verl's version string.

A verl release that keeps every seam below works; one that moves any of them makes
``import verl_klcov_global`` (and so the ``verl.plugins`` entry point,
``VERL_USE_EXTERNAL_MODULES`` and ``external_lib``) raise :class:`VerlSeamError`, naming each
moved seam and the verl versions known to work (:data:`KNOWN_VERL_VERSIONS`), before any
patch is applied or any loss is registered.

What is checked: names, signatures and dataclass fields, and (the ``behaviour`` seams) what verl's code does that
the plugin reads, run on stand-ins where that is cheap (a worker method's hand-over to its engine, a restore
helper's look-up) and read from the syntax tree where running it needs a whole worker (how ``loss_fn`` is built):

* what the reuse of verl's log-prob pass wraps (``engine/reuse.py``): ``TrainingWorker.infer_batch(self, data)``,
  ``BaseEngine.infer_batch`` inherited by the FSDP engine, verl's sharded weight-restore helpers, and
  ``FSDPEngineWithLMHead.prepare_model_outputs`` (Lp-Reg's proxy, ``engine/proxy.py``);
* the prepass hook's target and the engine calls it makes (``engine/``):
  ``BaseEngine.train_batch(self, data, loss_function)``, ``infer_batch``, ``optimizer_zero_grad``,
  ``get_data_parallel_group``, ``to(device, model, optimizer, grad)``; ``FSDPEngineWithLMHead``
  inherits ``train_batch`` from ``BaseEngine``; the engine config fields the prepass reads;
* how verl calls a policy loss (``loss.py``): ``ppo_loss(config, model_output, data, dp_group)``,
  ``POLICY_LOSS_REGISTRY``, ``register_policy_loss``, ``get_policy_loss_fn``, ``agg_loss`` and the
  argument names of upstream ``kl_cov`` / ``clip_cov`` (the plugin's losses take the same);
* the config fields the plugin reads (``config.py``): ``PolicyLossConfig`` and ``ActorConfig``;
* the helpers used on the minibatch (``engine/``, ``layout.py``): ``no_padding_2_padding``,
  ``tensordict_utils``, ``Metric`` / ``AggregationType``, ``logprobs_from_logits_v2`` (PATCH
  ``prepass_batched_logsumexp``), ``masked_mean``, ``get_device_name`` / ``get_device_id``;
* ``verl.utils.config.validate_config(config, use_reference_policy, use_critic)`` (patched in the driver);
* behaviour: ``ActorRolloutRefWorker.init_model`` builds ``loss_fn`` as ``partial(<loss>, config=...)`` (where the
  plugin finds the loss mode); ``TrainingWorker.train_batch`` / ``infer_batch`` hand their engine the micro-batch keys
  the plugin reads (:data:`WORKER_KEYS`) and the worker's ``loss_fn``, and ``infer_batch`` pops ``no_lora_adapter``;
  the FSDP engine's ``is_optimizer_offload_enabled`` property (the prepass's offload rule); ``DetachActorWorker``
  looks its restore helper up at call time (so PATCH ``weight_restore_bumps_version`` is the one it runs).

Known to work: :data:`KNOWN_VERL_VERSIONS` (the releases a user can pin; the test suite's verl sources are
listed in docs/DEVELOPING.md, "verl versions").

A moved seam must be seen, whatever route loads the plugin. verl's entry-point loader catches any
exception a plugin raises and logs it at DEBUG only, so :func:`make_seam_error_visible` (called by the
package on a failed check) also writes the message to stderr, once per process, and makes every later
lookup of a global mode in that process raise the same :class:`VerlSeamError` instead of verl's
"Unsupported loss mode": the loss names in verl's registry, and ``validate_config`` when the trainer
config selects the plugin. That code uses nothing the seams describe beyond what it checks on the spot.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["GLOBAL_MODE_NAMES", "KNOWN_VERL_VERSIONS", "SEAMS", "Seam", "VerlSeamError", "check_seams",
           "known_versions_text", "make_seam_error_visible", "seam_error_message"]

#: verl releases a user can install that the plugin is known to work on (the pin the seam error suggests
#: is the last one). Only installable releases: a development snapshot the suite also ran on is listed in
#: docs/DEVELOPING.md, not here.
KNOWN_VERL_VERSIONS = ("0.8.0", "0.9.1")
#: The loss modes the package registers (``modes.MODES``' built-in names; ``tests/test_seams.py`` keeps the two
#: equal). Named here so that a process whose seam check failed can still answer for them.
GLOBAL_MODE_NAMES = ("kl_cov_global", "clip_cov_global", "high_entropy_global", "stare_global", "lp_reg_global")


class VerlSeamError(ImportError):
    """The installed verl lacks a seam (signature, attribute, config field) the plugin relies on."""


class _Moved(Exception):
    """One seam's mismatch; the text says what was found instead."""


@dataclass(frozen=True)
class Seam:
    """One named seam: ``check()`` raises :class:`_Moved` with what it found when it does not hold."""

    name: str
    check: Callable[[], None]


def known_versions_text() -> str:
    return ", ".join(KNOWN_VERL_VERSIONS)


# ---------------------------------------------------------------------------------------------
# Building blocks


def _attr(module: str, qualname: str) -> Any:
    try:
        obj = importlib.import_module(module)
    except ImportError as error:
        raise _Moved(f"module {module} cannot be imported ({error})") from None
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise _Moved(f"{module}.{qualname} is missing")
        obj = getattr(obj, part)
    return obj


def _params(obj: Any) -> list[str]:
    return list(inspect.signature(obj).parameters)


def _signature(module: str, qualname: str, expected: list[str], *, prefix: bool = False,
               contains: bool = False) -> Callable[[], None]:
    """``module.qualname``'s parameter names equal ``expected`` (or start with it / include all of it)."""

    def check() -> None:
        found = _params(_attr(module, qualname))
        if prefix:
            ok = found[: len(expected)] == expected
        elif contains:
            ok = set(expected) <= set(found)
        else:
            ok = found == expected
        if not ok:
            raise _Moved(f"found parameters {found}")

    return check


def _exists(module: str, *qualnames: str) -> Callable[[], None]:
    def check() -> None:
        for qualname in qualnames:
            _attr(module, qualname)

    return check


def _fields(module: str, qualname: str, expected: tuple[str, ...]) -> Callable[[], None]:
    """``module.qualname`` is a dataclass with (at least) the fields ``expected``."""

    def check() -> None:
        cls = _attr(module, qualname)
        if not dataclasses.is_dataclass(cls):
            raise _Moved(f"{module}.{qualname} is no longer a dataclass")
        missing = [name for name in expected if name not in {f.name for f in dataclasses.fields(cls)}]
        if missing:
            raise _Moved(f"fields {missing} are missing")

    return check


def _registry() -> None:
    registry = _attr("verl.trainer.ppo.core_algos", "POLICY_LOSS_REGISTRY")
    if not isinstance(registry, dict):
        raise _Moved(f"POLICY_LOSS_REGISTRY is a {type(registry).__name__}, not a dict")


def _fsdp_engine_inherits(method: str, hook: str) -> Callable[[], None]:
    def check() -> None:
        engine = _attr("verl.workers.engine.fsdp.transformer_impl", "FSDPEngineWithLMHead")
        base = _attr("verl.workers.engine.base", "BaseEngine")
        owners = [cls.__qualname__ for cls in engine.__mro__ if method in vars(cls)]
        if owners[:1] != [base.__qualname__] or not issubclass(engine, base):
            raise _Moved(f"{method} is defined by {owners}: an override would bypass the {hook}")

    return check


_fsdp_engine_inherits_train_batch = _fsdp_engine_inherits("train_batch", "prepass hook")


def _training_worker_infer_batch() -> None:
    """``TrainingWorker.infer_batch(self, data)``, where verl's engine workers can be imported at all.

    They import web-server packages (fastapi, uvicorn) that verl does not require: where those are
    missing no actor can run in the process, and PATCH ``log_prob_pass_context`` is skipped.
    """
    if _engine_workers_importable():
        _signature("verl.workers.engine_workers", "TrainingWorker.infer_batch", ["self", "data"])()


def _restore_helpers() -> None:
    """verl's sharded restore helpers (``separate_async``): fsdp2's everywhere, fsdp1's where verl defines it
    (0.9.1 and later; verl 0.8.0 restores FSDP1 with the fsdp2 helper too)."""
    _signature("verl.utils.fsdp_utils", "fsdp2_sharded_load_from_cpu",
               ["model", "cpu_sharded_state", "target_spec"])()
    if hasattr(importlib.import_module("verl.utils.fsdp_utils"), "fsdp1_sharded_load_from_cpu"):
        _signature("verl.utils.fsdp_utils", "fsdp1_sharded_load_from_cpu", ["model", "cpu_sharded_state"])()


# ---------------------------------------------------------------------------------------------
# Behaviour: what verl's worker and engine do that the plugin reads (not only their signatures)

#: Attribute of a plugin wrapper holding verl's original function (also how "already installed" is seen); the
#: behavioural checks below call verl's original, so they run the same before and after the patches.
ORIGINAL_ATTR = "__verl_klcov_global_original__"

#: The non-tensor keys of a batch that verl's ``TrainingWorker`` sets before it calls its engine, and that the plugin
#: reads (the prepass's micro-batching and reuse's forward settings: ``engine/prepass.py``, ``engine/kept_pass.py``,
#: ``engine/proxy.py``): key -> the engine-config field it carries in ``train_batch`` / in ``infer_batch`` (None: the
#: model config's). The plugin reads them with a default; the seam makes sure the default never stands in for them.
WORKER_KEYS = {
    "use_remove_padding": (None, None),
    "use_dynamic_bsz": ("use_dynamic_bsz", "use_dynamic_bsz"),
    "max_token_len_per_gpu": ("max_token_len_per_gpu", "infer_max_token_len_per_gpu"),
    "micro_batch_size_per_gpu": ("micro_batch_size_per_gpu", "infer_micro_batch_size_per_gpu"),
    "use_fused_kernels": ("use_fused_kernels", "use_fused_kernels"),
}
#: The non-tensor key of the log-prob pass that PATCH ``log_prob_pass_context`` reads before verl's
#: ``TrainingWorker.infer_batch`` pops it (the LoRA reference pass: the adapter off).
NO_LORA_ADAPTER_KEY = "no_lora_adapter"


def _verl_original(function: Callable) -> Callable:
    while getattr(function, ORIGINAL_ATTR, None) is not None:
        function = getattr(function, ORIGINAL_ATTR)
    return function


class _Loose:
    """Stands in for whatever a probed verl method touches beyond what the probe sets: any attribute, call or
    context manager gives another stand-in; false; ``get(key, default)`` gives the default. The probe then checks
    only the behaviour the plugin relies on, not verl's other bookkeeping."""

    def __init__(self, **attributes: Any):
        self.__dict__.update(attributes)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Loose()

    def __call__(self, *args: Any, **kwargs: Any) -> "_Loose":
        return _Loose()

    def __enter__(self) -> "_Loose":
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False

    def __bool__(self) -> bool:
        return False

    def get(self, key: str, default: Any = None) -> Any:
        return self.__dict__.get(key, default)


class _ReachedEngine(Exception):
    """Raised by the probe's engine when verl's worker calls it: what the worker handed over."""

    def __init__(self, method: str, data: Any, loss_function: Any):
        super().__init__(method)
        self.method, self.data, self.loss_function = method, data, loss_function


class _ProbeEngine(_Loose):
    def train_batch(self, data, loss_function=None):
        raise _ReachedEngine("train_batch", data, loss_function)

    def infer_batch(self, data, loss_function=None):
        raise _ReachedEngine("infer_batch", data, loss_function)


#: Distinct values per engine-config field, so the probe sees which field a key carries.
_PROBE_ENGINE_CONFIG = dict(forward_only=False, use_dynamic_bsz=True, max_token_len_per_gpu=1031,
                            infer_max_token_len_per_gpu=2053, micro_batch_size_per_gpu=3,
                            infer_micro_batch_size_per_gpu=5, use_fused_kernels=False)


def _run_worker_method(method: str, data: Any, loss_fn: Callable) -> _ReachedEngine:
    """verl's own ``TrainingWorker.<method>(data)`` on a stand-in worker whose engine stops it where it is called."""
    worker_class = _attr("verl.workers.engine_workers", "TrainingWorker")
    probe = _Loose(loss_fn=loss_fn, engine=_ProbeEngine(), engine_config=_Loose(**_PROBE_ENGINE_CONFIG),
                   model_config={"use_remove_padding": True}, profiler=None)
    try:
        _verl_original(getattr(worker_class, method))(probe, data)
    except _ReachedEngine as reached:
        return reached
    except Exception as error:
        raise _Moved(f"TrainingWorker.{method} failed before it called its engine ({type(error).__name__}: "
                     f"{error})") from None
    raise _Moved(f"TrainingWorker.{method} returned without calling engine.{method}")


def _probe_batch(**non_tensor: Any):
    import torch
    from tensordict import TensorDict

    from verl.utils import tensordict_utils as tu

    data = TensorDict({"input_ids": torch.zeros(1, 2, dtype=torch.int64)}, batch_size=[1])
    tu.assign_non_tensor(data, global_token_num=[2], **non_tensor)
    return data


def _worker_sets_the_micro_batch_keys() -> None:
    """verl's ``TrainingWorker.train_batch`` / ``infer_batch`` hand their engine every key of :data:`WORKER_KEYS`,
    from the engine-config field of the training / the inference micro-batching, with the worker's loss function;
    ``infer_batch`` pops :data:`NO_LORA_ADAPTER_KEY` before its engine sees the batch (so PATCH
    ``log_prob_pass_context`` must read it first, as it does). Run on a stand-in worker (verl's own code)."""
    if not _engine_workers_importable():
        return
    from verl.utils import tensordict_utils as tu

    def loss_fn(*args, **kwargs):  # the worker's loss function, by identity
        raise AssertionError("the probe never computes a loss")

    for index, method in enumerate(("train_batch", "infer_batch")):
        reached = _run_worker_method(method, _probe_batch(**{NO_LORA_ADAPTER_KEY: False}), loss_fn)
        if reached.method != method:
            raise _Moved(f"TrainingWorker.{method} called engine.{reached.method}, not engine.{method}")
        if method == "train_batch" and reached.loss_function is not loss_fn:
            raise _Moved("TrainingWorker.train_batch did not hand its engine the worker's own loss_fn")
        found = {key: tu.get_non_tensor_data(data=reached.data, key=key, default=_Loose) for key in WORKER_KEYS}
        expected = {key: True if fields[index] is None else _PROBE_ENGINE_CONFIG[fields[index]]
                    for key, fields in WORKER_KEYS.items()}
        if found != expected:
            wrong = {key: ("not set" if found[key] is _Loose else found[key]) for key in WORKER_KEYS
                     if found[key] != expected[key]}
            raise _Moved(f"TrainingWorker.{method} handed its engine {wrong} for the keys {sorted(wrong)} (expected "
                         f"{ {key: expected[key] for key in wrong} }: the engine config's "
                         f"{'training' if index == 0 else 'inference'} micro-batching)")
        if method == "infer_batch" and NO_LORA_ADAPTER_KEY in reached.data.keys():
            raise _Moved(f"TrainingWorker.infer_batch no longer pops {NO_LORA_ADAPTER_KEY!r} before its engine runs")


def _engine_workers_importable() -> bool:
    """verl's engine workers can be imported, or only a third-party package of theirs is missing (fastapi, uvicorn:
    then no actor runs in this process and there is nothing to check); a missing verl module is a moved seam."""
    try:
        importlib.import_module("verl.workers.engine_workers")
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] != "verl":
            return False
        raise _Moved(f"module verl.workers.engine_workers cannot be imported ({error})") from None
    except ImportError as error:
        raise _Moved(f"module verl.workers.engine_workers cannot be imported ({error})") from None
    return True


def _loss_fn_is_a_partial_with_the_actor_config() -> None:
    """Every ``self.loss_fn = ...`` of verl's ``ActorRolloutRefWorker.init_model`` is ``partial(<loss>, config=...)``:
    the plugin finds the actor config (and so the loss mode) in the partial's ``keywords["config"]``
    (``engine.step.actor_config_of``). Read from the method's syntax tree: running it needs a whole worker."""
    if not _engine_workers_importable():
        return
    import ast
    import textwrap

    init_model = _verl_original(_attr("verl.workers.engine_workers", "ActorRolloutRefWorker.init_model"))
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(init_model)))
    except (OSError, TypeError, SyntaxError) as error:
        raise _Moved(f"the source of ActorRolloutRefWorker.init_model cannot be read ({error})") from None
    built = [node.value for node in ast.walk(tree) if isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Attribute) and t.attr == "loss_fn" and isinstance(t.value, ast.Name) and t.value.id == "self"
        for t in node.targets)]
    if not built:
        raise _Moved("ActorRolloutRefWorker.init_model no longer assigns self.loss_fn")
    for value in built:
        call = value if isinstance(value, ast.Call) else None
        name = None if call is None else (call.func.attr if isinstance(call.func, ast.Attribute) else
                                          getattr(call.func, "id", None))
        if name != "partial" or not any(keyword.arg == "config" for keyword in call.keywords):
            raise _Moved(f"ActorRolloutRefWorker.init_model sets self.loss_fn = {ast.unparse(value)}, not "
                         "partial(<loss>, config=<actor config>, ...)")


def _fsdp_engine_reports_optimizer_offload() -> None:
    """``FSDPEngineWithLMHead.is_optimizer_offload_enabled`` is a property verl's FSDP engine defines (``BaseEngine``'s
    is abstract): the prepass reads it to keep an offloaded optimizer's states off the device
    (``engine/prepass.py``)."""
    engine = _attr("verl.workers.engine.fsdp.transformer_impl", "FSDPEngineWithLMHead")
    owner = next((cls for cls in engine.__mro__ if "is_optimizer_offload_enabled" in vars(cls)), None)
    if owner is None:
        raise _Moved("FSDPEngineWithLMHead has no is_optimizer_offload_enabled")
    found = vars(owner)["is_optimizer_offload_enabled"]
    if not isinstance(found, property) or getattr(found.fget, "__isabstractmethod__", False):
        raise _Moved(f"is_optimizer_offload_enabled is {'abstract' if isinstance(found, property) else type(found).__name__} "
                     f"on {owner.__qualname__}, not a property of the FSDP engine")


#: verl's sharded restore helpers (module ``verl.utils.fsdp_utils``) and the strategies that use them.
RESTORE_HELPERS = {"fsdp": "fsdp1_sharded_load_from_cpu", "fsdp2": "fsdp2_sharded_load_from_cpu"}


def _restore_helpers_are_looked_up_at_call_time() -> None:
    """verl's ``DetachActorWorker`` (``separate_async``) takes its restore helper from ``verl.utils.fsdp_utils`` when it
    is called, so PATCH ``weight_restore_bumps_version``, which rebinds the module's attribute, is the helper it runs.
    Run on a stand-in worker for each strategy with the module's helpers briefly replaced: the handler it returns must
    be the replacement. Skipped where verl has no ``DetachActorWorker`` or its module cannot be imported (that route cannot
    run here)."""
    try:
        module = importlib.import_module("verl.experimental.separation.engine_workers")
    except ImportError:
        return
    worker_class = getattr(module, "DetachActorWorker", None)
    get_handlers = getattr(worker_class, "_get_strategy_handlers", None)
    if get_handlers is None:
        return
    fsdp_utils = importlib.import_module("verl.utils.fsdp_utils")
    present = {name: getattr(fsdp_utils, name) for name in RESTORE_HELPERS.values() if hasattr(fsdp_utils, name)}

    def replacement(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the probe never restores")

    # verl 0.8.0 has no fsdp1 helper and restores strategy fsdp with the fsdp2 one: any module helper will do, so
    # long as it is read from the module when the handler is asked for.
    for name in present:
        setattr(fsdp_utils, name, replacement)
    try:
        for strategy in RESTORE_HELPERS:
            try:
                handlers = get_handlers(_Loose(_strategy_handlers=None, config=_Loose(actor=_Loose(strategy=strategy))))
            except Exception as error:
                raise _Moved(f"DetachActorWorker._get_strategy_handlers failed for strategy {strategy} "
                             f"({type(error).__name__}: {error})") from None
            if not (isinstance(handlers, tuple) and len(handlers) == 2 and handlers[1] is replacement):
                raise _Moved(f"DetachActorWorker's restore handler for {strategy} is not looked up in "
                             f"verl.utils.fsdp_utils ({' or '.join(present)}) at call time (a module-level import "
                             "would bypass the plugin's wrapper)")
    finally:
        for name, helper in present.items():
            setattr(fsdp_utils, name, helper)


#: verl's trainer classes (module, class) whose ``__init__`` PATCH ``trainer_config_checks`` wraps; the v1 one is
#: absent from verl 0.8.0.
TRAINER_CLASSES = (("verl.trainer.ppo.ray_trainer", "RayPPOTrainer"), ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer"))


def _trainers_take_the_config_first() -> None:
    """Each trainer of :data:`TRAINER_CLASSES` (the first always, the v1 one where its module imports) takes
    ``config`` as its first parameter, whose ``__init__`` is its own or a base's that is not ``object``'s."""
    for index, (module_name, name) in enumerate(TRAINER_CLASSES):
        if index > 0 and importlib.util.find_spec(module_name.rpartition(".")[0]) is None:
            continue
        trainer_class = _attr(module_name, name)
        found = _params(trainer_class.__init__)
        if found[:2] != ["self", "config"]:
            raise _Moved(f"{name}.__init__ takes {found}, not (self, config, ...)")


#: The keywords verl's ``ppo_loss`` passes to a registered policy loss; the plugin's losses take these.
POLICY_LOSS_ARGUMENTS = ["old_log_prob", "log_prob", "advantages", "response_mask", "loss_agg_mode", "config",
                         "rollout_is_weights"]


def _loss_arguments_match_upstream() -> None:
    for name in ("compute_policy_loss_kl_cov", "compute_policy_loss_clip_cov"):
        found = _params(_attr("verl.trainer.ppo.core_algos", name))
        if found != POLICY_LOSS_ARGUMENTS:
            raise _Moved(f"{name} takes {found}; the plugin's losses take {POLICY_LOSS_ARGUMENTS}")


#: The behavioural seams' names (their checks are above).
BEHAVIOUR_LOSS_FN = ("verl.workers.engine_workers.ActorRolloutRefWorker.init_model builds loss_fn as "
                     "partial(<loss>, config=<actor config>)")
BEHAVIOUR_WORKER_KEYS = ("verl.workers.engine_workers.TrainingWorker.train_batch / infer_batch hand their engine the "
                         "micro-batch keys (use_remove_padding, use_dynamic_bsz, max_token_len_per_gpu, "
                         "micro_batch_size_per_gpu, use_fused_kernels) and the worker's loss_fn; infer_batch pops "
                         "no_lora_adapter")
BEHAVIOUR_OFFLOAD = ("verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead.is_optimizer_offload_enabled "
                     "(a property of the FSDP engine)")
TRAINERS_TAKE_CONFIG = ("verl.trainer.ppo.ray_trainer.RayPPOTrainer(config, ...) / "
                        "verl.trainer.ppo.v1.trainer_base.PPOTrainer(config)")
BEHAVIOUR_RESTORE = ("verl.experimental.separation.engine_workers.DetachActorWorker looks its restore helper up in "
                     "verl.utils.fsdp_utils at call time")

_CORE = "verl.trainer.ppo.core_algos"
_BASE = "verl.workers.engine.base"

#: Every seam, in the order the plugin meets them.
SEAMS: tuple[Seam, ...] = (
    # engine/: PATCH train_batch_prepass and the engine calls around it
    Seam("verl.workers.engine.base.BaseEngine.train_batch(self, data, loss_function)",
         _signature(_BASE, "BaseEngine.train_batch", ["self", "data", "loss_function"])),
    Seam("verl.workers.engine.base.BaseEngine.infer_batch(self, data, loss_function, ...)",
         _signature(_BASE, "BaseEngine.infer_batch", ["self", "data", "loss_function"], prefix=True)),
    Seam("verl.workers.engine.base.BaseEngine.to(self, device, model, optimizer, grad)",
         _signature(_BASE, "BaseEngine.to", ["self", "device", "model", "optimizer", "grad"])),
    Seam("verl.workers.engine.base.BaseEngine.optimizer_zero_grad / get_data_parallel_group",
         _exists(_BASE, "BaseEngine.optimizer_zero_grad", "BaseEngine.get_data_parallel_group")),
    Seam("verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead inherits BaseEngine.train_batch",
         _fsdp_engine_inherits_train_batch),
    # engine/reuse.py: verl's log-prob pass kept (PATCHES log_prob_pass_context / _keep), weight restores seen
    Seam("verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead inherits BaseEngine.infer_batch",
         _fsdp_engine_inherits("infer_batch", "keeping of verl's log-prob pass")),
    Seam("verl.workers.engine_workers.TrainingWorker.infer_batch(self, data)", _training_worker_infer_batch),
    # engine/proxy.py: PATCH proxy_log_prob_in_pass (Lp-Reg's proxy from the log-prob pass's logits)
    Seam("verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead.prepare_model_outputs(self, output, "
         "output_args, micro_batch, logits_processor_func)",
         _signature("verl.workers.engine.fsdp.transformer_impl", "FSDPEngineWithLMHead.prepare_model_outputs",
                    ["self", "output", "output_args", "micro_batch", "logits_processor_func"])),
    Seam("verl.utils.fsdp_utils.fsdp2_sharded_load_from_cpu(model, cpu_sharded_state, target_spec) / "
         "fsdp1_sharded_load_from_cpu(model, cpu_sharded_state)", _restore_helpers),
    # behaviour: what verl's worker and engine do that the plugin reads
    Seam(BEHAVIOUR_LOSS_FN, _loss_fn_is_a_partial_with_the_actor_config),
    Seam(BEHAVIOUR_WORKER_KEYS, _worker_sets_the_micro_batch_keys),
    Seam(BEHAVIOUR_OFFLOAD, _fsdp_engine_reports_optimizer_offload),
    Seam(BEHAVIOUR_RESTORE, _restore_helpers_are_looked_up_at_call_time),
    Seam("verl.workers.config.FSDPEngineConfig fields strategy, infer_micro_batch_size_per_gpu, "
         "infer_max_token_len_per_gpu",
         _fields("verl.workers.config", "FSDPEngineConfig",
                 ("strategy", "infer_micro_batch_size_per_gpu", "infer_max_token_len_per_gpu"))),
    Seam("verl.workers.utils.padding.no_padding_2_padding(tensor, data)",
         _signature("verl.workers.utils.padding", "no_padding_2_padding", ["tensor", "data"])),
    Seam("verl.utils.tensordict_utils.get_non_tensor_data(data, key, default)",
         _signature("verl.utils.tensordict_utils", "get_non_tensor_data", ["data", "key", "default"])),
    Seam("verl.utils.tensordict_utils.assign_non_tensor(tensor_dict, **kwargs)",
         _signature("verl.utils.tensordict_utils", "assign_non_tensor", ["tensor_dict", "kwargs"])),
    Seam("verl.utils.tensordict_utils.index_select_tensor_dict(batch, indices)",
         _signature("verl.utils.tensordict_utils", "index_select_tensor_dict", ["batch", "indices"])),
    Seam("verl.utils.metric.Metric / AggregationType.MEAN", _exists("verl.utils.metric", "Metric", "AggregationType.MEAN")),
    Seam("verl.utils.torch_functional.logprobs_from_logits_v2(logits, labels)",
         _signature("verl.utils.torch_functional", "logprobs_from_logits_v2", ["logits", "labels"])),
    Seam("verl.utils.torch_functional.logprobs_from_logits / masked_mean",
         _exists("verl.utils.torch_functional", "logprobs_from_logits", "masked_mean")),
    Seam("verl.utils.device.get_device_name / get_device_id",
         _exists("verl.utils.device", "get_device_name", "get_device_id")),
    # loss.py: how verl finds and calls a policy loss
    Seam("verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY (a dict)", _registry),
    Seam("verl.trainer.ppo.core_algos.register_policy_loss(name) / get_policy_loss_fn(name)",
         lambda: (_signature(_CORE, "register_policy_loss", ["name"])(),
                  _signature(_CORE, "get_policy_loss_fn", ["name"])())),
    Seam("verl.trainer.ppo.core_algos.agg_loss(loss_mat, loss_mask, loss_agg_mode, **global_batch_info)",
         _signature(_CORE, "agg_loss", ["loss_mat", "loss_mask", "loss_agg_mode", "dp_size", "batch_num_tokens",
                                        "global_batch_size", "loss_scale_factor"], contains=True)),
    Seam("verl.trainer.ppo.core_algos policy-loss arguments (old_log_prob, log_prob, advantages, response_mask, "
         "loss_agg_mode, config, rollout_is_weights)", _loss_arguments_match_upstream),
    Seam("verl.workers.utils.losses.ppo_loss(config, model_output, data, dp_group)",
         _signature("verl.workers.utils.losses", "ppo_loss", ["config", "model_output", "data", "dp_group"])),
    # config.py: the knobs read from the actor config
    Seam("verl.workers.config.actor.PolicyLossConfig fields loss_mode, kl_cov_ratio, ppo_kl_coef, clip_cov_ratio, "
         "clip_cov_lb, clip_cov_ub",
         _fields("verl.workers.config.actor", "PolicyLossConfig",
                 ("loss_mode", "kl_cov_ratio", "ppo_kl_coef", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"))),
    Seam("verl.workers.config.actor.ActorConfig fields policy_loss, loss_agg_mode, clip_ratio, clip_ratio_low, "
         "clip_ratio_high, global_batch_info",
         _fields("verl.workers.config.actor", "ActorConfig",
                 ("policy_loss", "loss_agg_mode", "clip_ratio", "clip_ratio_low", "clip_ratio_high",
                  "global_batch_info"))),
    # driver-side validation, and the same errors where verl's trainer is built
    Seam("verl.utils.config.validate_config(config, use_reference_policy, use_critic)",
         _signature("verl.utils.config", "validate_config", ["config", "use_reference_policy", "use_critic"])),
    Seam(TRAINERS_TAKE_CONFIG, _trainers_take_the_config_first),
)

_CHECKED = False


def check_seams(seams: Optional[tuple[Seam, ...]] = None, *, force: bool = False) -> list[str]:
    """Check every seam; raise one :class:`VerlSeamError` listing each that moved. Returns the names checked.

    The result of a full check is cached per process (``force=True`` checks again).
    """
    global _CHECKED
    if seams is None and _CHECKED and not force:
        return [seam.name for seam in SEAMS]
    seams = SEAMS if seams is None else seams
    moved = []
    for seam in seams:
        try:
            seam.check()
        except _Moved as mismatch:
            moved.append(f"  - {seam.name}: {mismatch}")
    if moved:
        raise VerlSeamError(seam_error_message(moved))
    if seams is SEAMS:
        _CHECKED = True
    return [seam.name for seam in seams]


def seam_error_message(moved: list[str]) -> str:
    """The one text of the seam error (driver, every Ray worker, stderr and exception alike).

    ``moved``: one line per moved seam (``"  - <seam>: <what was found>"``). Names the verl found (version and
    path), the versions known to work and what to do.
    """
    return (
        f"verl-klcov-global {_plugin_version()} cannot run on the verl it found ({_verl_found()}): "
        f"{len(moved)} seam(s) it patches or reads moved:\n" + "\n".join(moved) + "\n"
        f"Its loss modes ({', '.join(GLOBAL_MODE_NAMES)}) are not available in this process. "
        f"Known to work: verl {known_versions_text()}. To fix: pin a verl known to work "
        f"(pip install \"verl=={KNOWN_VERL_VERSIONS[-1]}\") where the driver and the Ray workers run, "
        f"or upgrade verl-klcov-global to a release that supports this verl."
    )


def _plugin_version() -> str:
    try:
        from importlib import metadata

        return metadata.version("verl-klcov-global")
    except Exception:  # a source tree that was never installed
        return "(version unknown)"


def _verl_found() -> str:
    """For the message only: nothing depends on the version string."""
    verl = sys.modules.get("verl")
    if verl is None:
        try:
            import verl
        except Exception:  # pragma: no cover - the plugin imports verl first
            return "verl not importable"
    where = os.path.dirname(os.path.abspath(getattr(verl, "__file__", None) or "?"))
    return f"verl {getattr(verl, '__version__', 'of unknown version')} at {where}"


# ---------------------------------------------------------------------------------------------
# Making a failed check visible on every route

#: The failed check's message in this process (None while no check failed).
_SEAM_ERROR_MESSAGE: Optional[str] = None
#: Marks what :func:`make_seam_error_visible` put in place (a registry entry, the ``validate_config`` guard).
SEAM_ERROR_ATTR = "__verl_klcov_global_seam_error__"
_ERROR_NAME = f"{__name__}.{VerlSeamError.__qualname__}"


def make_seam_error_visible(error: VerlSeamError) -> None:
    """Make a failed seam check seen in this process even where verl swallows the exception.

    Called by ``verl_klcov_global/__init__.py`` before it re-raises ``error``. It

    1. writes ``verl_klcov_global.seams.VerlSeamError: <message>`` to stderr, once per process (verl's
       entry-point loader logs the exception at DEBUG only);
    2. registers, in verl's ``POLICY_LOSS_REGISTRY`` (if it is still a dict), each name of
       :data:`GLOBAL_MODE_NAMES` not registered yet with a function that raises the same error, so a worker's
       first loss call says why instead of verl's ``Unsupported loss mode``;
    3. wraps ``verl.utils.config.validate_config`` (whatever its signature; ``main_ppo`` calls it in the driver
       before Ray starts) to raise the same error when the config selects the plugin
       (``policy_loss.loss_mode`` a global mode, ``policy_loss._target_`` or ``model.external_lib`` in this
       package) before Hydra looks the config class up.

    Steps 2 and 3 are :data:`SEAM_ERROR_GUARDS`, the catalogue's ``seam_error_*`` patches
    (:data:`verl_klcov_global.engine.patches.PATCHES`). Each step is best effort and idempotent: a seam that moved
    may make one impossible, never the others.
    """
    global _SEAM_ERROR_MESSAGE
    first = _SEAM_ERROR_MESSAGE is None
    _SEAM_ERROR_MESSAGE = str(error)
    if first:
        try:
            sys.stderr.write(f"{_ERROR_NAME}: {_SEAM_ERROR_MESSAGE}\n")
            sys.stderr.flush()
        except Exception:  # pragma: no cover - a closed stderr
            pass
    for guard in SEAM_ERROR_GUARDS:
        try:
            guard.apply()
        except Exception:  # best effort: the message is already on stderr and the import still fails
            pass


def seam_error() -> Optional[VerlSeamError]:
    """A new :class:`VerlSeamError` with this process's failed check's message; None if no check failed."""
    return None if _SEAM_ERROR_MESSAGE is None else VerlSeamError(_SEAM_ERROR_MESSAGE)


def _raise_seam_error(*args: Any, **kwargs: Any) -> Any:
    raise VerlSeamError(_SEAM_ERROR_MESSAGE)


setattr(_raise_seam_error, SEAM_ERROR_ATTR, True)


def _guard_loss_registry() -> None:
    registry = getattr(importlib.import_module("verl.trainer.ppo.core_algos"), "POLICY_LOSS_REGISTRY", None)
    if isinstance(registry, dict):
        for name in GLOBAL_MODE_NAMES:
            registry.setdefault(name, _raise_seam_error)


def _plugin_setting(config: Any) -> Optional[str]:
    """The setting of a trainer config that needs the plugin, or None (any shape that does not fit: None)."""

    def get(node: Any, key: str) -> Any:
        try:
            return node.get(key, None)
        except Exception:
            return None

    actor_rollout_ref = get(config, "actor_rollout_ref")
    policy_loss = get(get(actor_rollout_ref, "actor"), "policy_loss")
    loss_mode, target = get(policy_loss, "loss_mode"), get(policy_loss, "_target_")
    external_lib = get(get(actor_rollout_ref, "model"), "external_lib")
    if isinstance(loss_mode, str) and loss_mode in GLOBAL_MODE_NAMES:
        return f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}"
    if isinstance(target, str) and target.startswith("verl_klcov_global."):
        return f"actor_rollout_ref.actor.policy_loss._target_={target}"
    if isinstance(external_lib, str) and external_lib.split(".")[0] == "verl_klcov_global":
        return f"actor_rollout_ref.model.external_lib={external_lib}"
    return None


def _guard_validate_config() -> None:
    verl_config = importlib.import_module("verl.utils.config")
    current = getattr(verl_config, "validate_config", None)
    if not callable(current) or getattr(current, SEAM_ERROR_ATTR, False):
        return

    @functools.wraps(current)
    def validate_config(*args: Any, **kwargs: Any) -> Any:
        config = kwargs.get("config", args[0] if args else None)
        if _plugin_setting(config) is not None:
            raise VerlSeamError(_SEAM_ERROR_MESSAGE)
        return current(*args, **kwargs)

    setattr(validate_config, SEAM_ERROR_ATTR, True)
    replace_validate_config(current, validate_config)


def replace_validate_config(current: Callable, replacement: Callable) -> None:
    """Make ``replacement`` verl's ``verl.utils.config.validate_config`` in place of ``current``, also where a trainer
    module (``verl.trainer.main_ppo``, ``main_ppo_v0`` or ``__main__``) imported ``current`` by name before."""
    importlib.import_module("verl.utils.config").validate_config = replacement
    for name in ("verl.trainer.main_ppo", "verl.trainer.main_ppo_v0", "__main__"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "validate_config", None) is current:
            module.validate_config = replacement


@dataclass(frozen=True)
class SeamErrorGuard:
    """A patch of verl applied only in a process whose seam check failed (an entry of the patch catalogue)."""

    name: str
    target: str
    seam: str
    verl: str
    apply: Callable[[], None]


#: What :func:`make_seam_error_visible` applies, in order; listed in the patch catalogue too.
SEAM_ERROR_GUARDS: tuple[SeamErrorGuard, ...] = (
    SeamErrorGuard("seam_error_loss_registry",
                   "verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY (the names of GLOBAL_MODE_NAMES not registered)",
                   "verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY (a dict)",
                   "trainer/ppo/core_algos.py POLICY_LOSS_REGISTRY (0.8.0, 0.9.1, main 1dda039b)", _guard_loss_registry),
    SeamErrorGuard("seam_error_validate_config", "verl.utils.config.validate_config (and main_ppo's imported copy)",
                   "verl.utils.config.validate_config(config, use_reference_policy, use_critic)",
                   "utils/config.py validate_config, whatever its signature", _guard_validate_config),
)
