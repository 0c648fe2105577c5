"""Seam checks (``seams.py``): the installed verl passes; a moved seam fails at import, by name.

Runs on every verl the suite is run with (docs/DEVELOPING.md, "verl versions"). Nothing here compares
the running verl's version string: the seams are the gate. What a user sees of a moved seam (the
``main_ppo`` driver, Ray workers, the entry-point route) is ``tests/test_seam_error_user_level.py``'s.
"""

from __future__ import annotations

import dataclasses
import inspect
import glob
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import verl.trainer.ppo.core_algos as core_algos
import verl.utils.config as verl_config
import verl.utils.torch_functional as verl_F
from verl.workers.config.actor import PolicyLossConfig
from verl.workers.engine.base import BaseEngine

import verl

from packaging.version import Version

from verl_klcov_global import modes, seams
from verl_klcov_global.engine.patches import PATCHES
from verl_klcov_global.install_hint import INSTALL_HINT
from verl_klcov_global.modes import MODES
from verl_klcov_global.seams import KNOWN_VERL_VERSIONS, VerlSeamError, check_seams

from .trainer_support.env import REPO_ROOT

_KNOWN = r"Known to work: verl 0\.8\.0, 0\.9\.1"


def test_the_installed_verl_passes_every_seam():
    names = check_seams(force=True)
    assert names == [seam.name for seam in seams.SEAMS] and len(names) >= 20


def test_the_versions_the_seam_error_names_are_installable_releases_that_ci_pins():
    """``KNOWN_VERL_VERSIONS`` feeds the pin the seam error suggests: each must be a release a user can install
    (no dev snapshot, no pre-release), and each one a CI job pins and runs the suite on (``constraints*.txt``);
    the suggested pin is the newest."""
    versions = [Version(v) for v in KNOWN_VERL_VERSIONS]
    assert all(not (v.is_prerelease or v.is_devrelease or v.local) for v in versions), KNOWN_VERL_VERSIONS
    assert versions == sorted(versions) and len(set(versions)) == len(versions), KNOWN_VERL_VERSIONS
    pinned = set()
    for path in glob.glob(os.path.join(REPO_ROOT, "constraints*.txt")):
        with open(path) as f:
            pinned |= {line.split("==", 1)[1].strip() for line in f if line.startswith("verl==")}
    assert pinned == set(KNOWN_VERL_VERSIONS), (pinned, KNOWN_VERL_VERSIONS)


def test_every_patch_of_the_catalogue_is_guarded_by_a_seam():
    """A patch whose target moves must fail at import, by name: each one names a seam that is checked."""
    names = {seam.name for seam in seams.SEAMS}
    assert [patch.name for patch in PATCHES] == [
        "train_batch_prepass", "validate_config_driver_checks", "trainer_config_checks", "prepass_batched_logsumexp",
        "log_prob_pass_context", "proxy_log_prob_in_pass", "log_prob_pass_keep", "weight_restore_bumps_version",
        "seam_error_loss_registry", "seam_error_validate_config"]
    for patch in PATCHES:
        assert patch.seam in names, patch


def test_the_plugins_losses_take_the_arguments_the_seam_checks():
    for fn in (mode.policy_loss for mode in MODES.values()):
        assert list(inspect.signature(fn).parameters) == seams.POLICY_LOSS_ARGUMENTS


def test_a_changed_train_batch_signature_fails_naming_the_seam_and_the_known_versions(monkeypatch):
    def train_batch(self, batch, loss_fn, extra=None):  # a hypothetical future signature
        raise AssertionError("must not be called")

    monkeypatch.setattr(BaseEngine, "train_batch", train_batch)
    with pytest.raises(VerlSeamError) as raised:
        check_seams(force=True)
    message = str(raised.value)
    assert "BaseEngine.train_batch(self, data, loss_function)" in message
    assert "['self', 'batch', 'loss_fn', 'extra']" in message
    assert "1 seam(s)" in message
    assert re.search(_KNOWN, message)
    _assert_says_what_to_do(message)
    monkeypatch.undo()
    check_seams(force=True)  # control: the real one passes again


def _assert_says_what_to_do(message: str) -> None:
    """The seam error names the verl found and the fix (pin a known verl, or upgrade the plugin), never an install hint."""
    where = os.path.dirname(os.path.abspath(verl.__file__))
    assert f"cannot run on the verl it found (verl {verl.__version__} at {where})" in message, message
    assert f'pin a verl known to work (pip install "verl=={KNOWN_VERL_VERSIONS[-1]}")' in message, message
    assert "or upgrade verl-klcov-global to a release that supports this verl." in message, message
    assert f"loss modes ({', '.join(MODES)}) are not available" in message, message
    assert INSTALL_HINT not in message and "not on any package index" not in message


def test_the_seam_message_text():
    message = seams.seam_error_message(["  - some.seam(a, b): found parameters ['a']", "  - other.seam: missing"])
    lines = message.splitlines()
    assert lines[0].startswith("verl-klcov-global ") and lines[0].endswith("2 seam(s) it patches or reads moved:")
    assert lines[1:3] == ["  - some.seam(a, b): found parameters ['a']", "  - other.seam: missing"]
    assert len(lines) == 4 and re.search(_KNOWN, lines[3])
    _assert_says_what_to_do(message)


def test_the_seam_error_names_the_built_in_modes():
    """A process whose check failed answers for these names; a new built-in mode must be added there too."""
    assert seams.GLOBAL_MODE_NAMES == (modes.KL_COV.name, modes.CLIP_COV.name, modes.HIGH_ENTROPY.name,
                                       modes.STARE.name, modes.LP_REG.name) == tuple(MODES)


@pytest.fixture
def seam_failure(monkeypatch, capsys):
    """A failed check made visible in this process, on copies of what it touches (restored afterwards)."""
    registry = {"vanilla": core_algos.POLICY_LOSS_REGISTRY["vanilla"]}
    monkeypatch.setattr(core_algos, "POLICY_LOSS_REGISTRY", registry)
    calls = []
    monkeypatch.setattr(verl_config, "validate_config", lambda *args, **kwargs: calls.append((args, kwargs)) or "ok")
    monkeypatch.setattr(seams, "_SEAM_ERROR_MESSAGE", None)
    message = seams.seam_error_message(["  - a.seam: moved"])
    seams.make_seam_error_visible(VerlSeamError(message))
    seams.make_seam_error_visible(VerlSeamError(message))  # a second load attempt in the same process
    return message, registry, calls, capsys.readouterr().err


def test_a_failed_check_is_written_to_stderr_once_per_process(seam_failure):
    message, _, _, err = seam_failure
    assert err == f"verl_klcov_global.seams.VerlSeamError: {message}\n"


def test_after_a_failed_check_the_loss_lookup_raises_the_seam_error(seam_failure):
    message, registry, _, _ = seam_failure
    assert registry["vanilla"] is not None and sorted(registry) == sorted([*MODES, "vanilla"])
    for mode in seams.GLOBAL_MODE_NAMES:
        with pytest.raises(VerlSeamError) as raised:  # what verl's ppo_loss does, instead of "Unsupported loss mode"
            core_algos.get_policy_loss_fn(mode)(old_log_prob=None, log_prob=None, advantages=None, response_mask=None)
        assert str(raised.value) == message


@pytest.mark.parametrize("key,value", [("actor.policy_loss.loss_mode", "kl_cov_global"),
                                       ("actor.policy_loss.loss_mode", "clip_cov_global"),
                                       ("actor.policy_loss._target_", "verl_klcov_global.config.KLCovGlobalPolicyLossConfig"),
                                       ("model.external_lib", "verl_klcov_global")])
def test_after_a_failed_check_validate_config_raises_it_for_a_config_that_needs_the_plugin(seam_failure, key, value):
    from omegaconf import OmegaConf

    message, _, calls, _ = seam_failure
    config = OmegaConf.create({"actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "vanilla"}}, "model": {}}})
    assert verl_config.validate_config(config=config, use_reference_policy=False, use_critic=False) == "ok"
    assert len(calls) == 1  # control: a config that does not need the plugin goes on to verl's check
    OmegaConf.update(config, f"actor_rollout_ref.{key}", value, force_add=True)
    with pytest.raises(VerlSeamError) as raised:
        verl_config.validate_config(config, use_reference_policy=False, use_critic=False)
    assert str(raised.value) == message and len(calls) == 1


def test_a_moved_registry_does_not_stop_the_other_guards(monkeypatch, capsys):
    monkeypatch.setattr(core_algos, "POLICY_LOSS_REGISTRY", ["vanilla"])  # the registry seam itself moved
    monkeypatch.setattr(verl_config, "validate_config", lambda *args, **kwargs: "ok")
    monkeypatch.setattr(seams, "_SEAM_ERROR_MESSAGE", None)
    seams.make_seam_error_visible(VerlSeamError("moved"))
    assert core_algos.POLICY_LOSS_REGISTRY == ["vanilla"]
    assert capsys.readouterr().err == "verl_klcov_global.seams.VerlSeamError: moved\n"
    with pytest.raises(VerlSeamError, match="^moved$"):
        verl_config.validate_config({"actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "kl_cov_global"}}}})


def test_every_moved_seam_is_listed_at_once(monkeypatch):
    fields = {k: v for k, v in PolicyLossConfig.__dataclass_fields__.items() if k not in ("kl_cov_ratio", "clip_cov_ub")}
    monkeypatch.setattr(PolicyLossConfig, "__dataclass_fields__", fields)
    monkeypatch.delattr(verl_F, "logprobs_from_logits_v2")
    monkeypatch.setattr(core_algos, "POLICY_LOSS_REGISTRY", list(core_algos.POLICY_LOSS_REGISTRY))
    monkeypatch.setitem(sys.modules, "verl.utils.config", None)  # a module that moved away: import fails
    with pytest.raises(VerlSeamError, match=_KNOWN) as raised:
        check_seams(force=True)
    message = str(raised.value)
    assert "4 seam(s)" in message
    assert "PolicyLossConfig fields loss_mode" in message and "fields ['kl_cov_ratio', 'clip_cov_ub'] are missing" in message
    assert "logprobs_from_logits_v2 is missing" in message
    assert "POLICY_LOSS_REGISTRY is a list, not a dict" in message
    assert "validate_config(config, use_reference_policy, use_critic): module verl.utils.config cannot be imported" \
        in message


def test_a_dataclass_that_stops_being_one_is_named(monkeypatch):
    seam = next(s for s in seams.SEAMS if s.name.startswith("verl.workers.config.actor.ActorConfig"))
    import verl.workers.config.actor as actor

    monkeypatch.setattr(actor, "ActorConfig", type("ActorConfig", (), {}))
    with pytest.raises(VerlSeamError, match="ActorConfig is no longer a dataclass"):
        check_seams((seam,))
    assert dataclasses.is_dataclass(PolicyLossConfig)


_IMPORT_WITH_MOVED_SEAM = """
import verl.workers.engine.base as base
def train_batch(self, data):  # one argument fewer than the plugin patches
    pass
base.BaseEngine.train_batch = train_batch
import verl_klcov_global
"""


@pytest.mark.slow  # a fresh interpreter
def test_importing_the_plugin_over_a_moved_seam_fails_before_patching_anything():
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "none"}  # 0.9: the entry point must not import it first
    env.pop("VERL_USE_EXTERNAL_MODULES", None)
    proc = subprocess.run([sys.executable, "-c", _IMPORT_WITH_MOVED_SEAM], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert "VerlSeamError" in proc.stderr
    assert "BaseEngine.train_batch(self, data, loss_function): found parameters ['self', 'data']" in proc.stderr
    assert "Known to work: verl 0.8.0, 0.9.1" in proc.stderr


@pytest.mark.parametrize("owner, name, moved, seams_moved", [
    # a worker method that no longer hands its engine the batch also breaks the behaviour seam of the worker's keys
    ("verl.workers.engine_workers.TrainingWorker", "infer_batch", lambda self, data, no_lora_adapter=False: None, 2),
    ("verl.utils.fsdp_utils", "fsdp2_sharded_load_from_cpu", lambda model, state: None, 1),
    ("verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead", "infer_batch",
     lambda self, data, loss_function=None: None, 1),
])
def test_the_reuse_patches_targets_fail_loudly_when_they_move(monkeypatch, owner, name, moved, seams_moved):
    """PATCHES log_prob_pass_context / weight_restore_bumps_version / log_prob_pass_keep: a changed signature, or
    an override below BaseEngine that would bypass the keeping, is a seam error naming it (engine/kept_pass.py)."""
    import importlib

    try:
        target = importlib.import_module(owner)  # a module
    except ModuleNotFoundError:  # a class: module.Class
        module_name, _, class_name = owner.rpartition(".")
        target = getattr(importlib.import_module(module_name), class_name)
    monkeypatch.setattr(target, name, moved)
    with pytest.raises(VerlSeamError) as raised:
        check_seams(force=True)
    message = str(raised.value)
    assert name in message and f"{seams_moved} seam(s)" in message, message
    monkeypatch.undo()
    check_seams(force=True)


# ---------------------------------------------------------------------------------------------
# Behavioural seams: a verl that keeps every signature but changes what the plugin reads fails loudly, by name


def _seam_error_with(monkeypatch, owner, name, replacement) -> str:
    """The seam error's text with ``owner.name`` replaced (restored afterwards, and every seam holds again)."""
    monkeypatch.setattr(owner, name, replacement)
    with pytest.raises(VerlSeamError) as raised:
        check_seams(force=True)
    monkeypatch.undo()
    check_seams(force=True)
    return str(raised.value)


def test_a_loss_fn_not_built_as_a_partial_with_the_actor_config_fails_naming_the_seam(monkeypatch):
    """``engine.step.actor_config_of`` finds the loss mode in ``loss_fn.keywords["config"]``: a verl that binds the
    config another way would make every global mode look like no mode at all (verl's own step, no mask)."""
    from verl.workers.engine_workers import ActorRolloutRefWorker
    from verl.workers.utils.losses import ppo_loss

    def init_model(self):  # a hypothetical verl that closes over the config
        actor_config = self.config.actor
        self.loss_fn = lambda **kwargs: ppo_loss(config=actor_config, **kwargs)

    message = _seam_error_with(monkeypatch, ActorRolloutRefWorker, "init_model", init_model)
    assert f"{seams.BEHAVIOUR_LOSS_FN}: ActorRolloutRefWorker.init_model sets self.loss_fn = lambda" in message
    assert "1 seam(s)" in message


def _train_batch_without_keys(self, data):  # a hypothetical verl that leaves the micro-batching to the engine
    return self.engine.train_batch(data, loss_function=self.loss_fn)


def _infer_batch_with_the_training_budget(self, data):  # a hypothetical verl that forgot the inference settings
    from verl.utils import tensordict_utils as tu

    tu.pop(data, key="no_lora_adapter", default=False)
    tu.assign_non_tensor(data, use_remove_padding=self.model_config.get("use_remove_padding", False),
                         use_dynamic_bsz=self.engine_config.use_dynamic_bsz,
                         max_token_len_per_gpu=self.engine_config.max_token_len_per_gpu,
                         micro_batch_size_per_gpu=self.engine_config.micro_batch_size_per_gpu,
                         use_fused_kernels=self.engine_config.use_fused_kernels)
    return self.engine.infer_batch(data, loss_function=self.loss_fn)


def _infer_batch_keeping_no_lora_adapter(self, data):  # pops nothing: the engine would see the LoRA key
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor(data, use_remove_padding=self.model_config.get("use_remove_padding", False),
                         use_dynamic_bsz=self.engine_config.use_dynamic_bsz,
                         max_token_len_per_gpu=self.engine_config.infer_max_token_len_per_gpu,
                         micro_batch_size_per_gpu=self.engine_config.infer_micro_batch_size_per_gpu,
                         use_fused_kernels=self.engine_config.use_fused_kernels)
    return self.engine.infer_batch(data, loss_function=self.loss_fn)


@pytest.mark.parametrize("name, replacement, found", [
    ("train_batch", _train_batch_without_keys, "TrainingWorker.train_batch handed its engine {'use_remove_padding': "
                                               "'not set'"),
    ("infer_batch", _infer_batch_with_the_training_budget, "TrainingWorker.infer_batch handed its engine "
                                                           "{'max_token_len_per_gpu': 1031, 'micro_batch_size_per_gpu': 3}"),
    ("infer_batch", _infer_batch_keeping_no_lora_adapter, "TrainingWorker.infer_batch no longer pops 'no_lora_adapter'"),
])
def test_a_worker_that_hands_its_engine_other_micro_batch_keys_fails_naming_the_seam(monkeypatch, name, replacement,
                                                                                     found):
    """The prepass and reuse read these keys with defaults: a verl that stopped setting them (or set the training
    budget in the log-prob pass) would change the prepass's micro-batching or reuse's decision silently."""
    from verl.workers.engine_workers import TrainingWorker

    message = _seam_error_with(monkeypatch, TrainingWorker, name, replacement)
    assert f"{seams.BEHAVIOUR_WORKER_KEYS}: {found}" in message, message
    assert "1 seam(s)" in message


def test_the_keys_the_plugin_reads_from_verls_batches_are_the_checked_ones():
    """Every string key the plugin's engine code reads from a batch with verl's ``get_non_tensor_data`` is one the
    worker seam checks, or one with a stated other source."""
    import ast

    other_sources = {
        "pad_mode": "set by verl's SFT trainers only; verl's engine reads it with the plugin's default, NO_PADDING",
    }
    read = set()
    for path in (Path(REPO_ROOT) / "src" / "verl_klcov_global" / "engine").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                    "non_tensor", "_non_tensor", "get_non_tensor_data"):
                keys = [node.args[1]] if len(node.args) > 1 else [k.value for k in node.keywords if k.arg == "key"]
                for key in keys:
                    literals = [key] if not isinstance(key, ast.IfExp) else [key.body, key.orelse]
                    read |= {lit.value for lit in literals if isinstance(lit, ast.Constant)}
    assert read and read <= set(seams.WORKER_KEYS) | set(other_sources), read - set(seams.WORKER_KEYS)
    assert {"use_dynamic_bsz", "max_token_len_per_gpu", "micro_batch_size_per_gpu"} <= read  # the scan sees them


def test_an_fsdp_engine_without_its_optimizer_offload_property_fails_naming_the_seam(monkeypatch):
    """The prepass keeps an offloaded optimizer's states off the device by this property: renamed, the states would
    stay on the device during the prepass."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    owner = next(cls for cls in FSDPEngineWithLMHead.__mro__ if "is_optimizer_offload_enabled" in vars(cls))
    monkeypatch.delattr(owner, "is_optimizer_offload_enabled")  # BaseEngine's abstract one is what is left
    with pytest.raises(VerlSeamError) as raised:
        check_seams(force=True)
    message = str(raised.value)
    monkeypatch.undo()
    check_seams(force=True)
    assert f"{seams.BEHAVIOUR_OFFLOAD}: is_optimizer_offload_enabled is abstract on BaseEngine" in message
    assert "1 seam(s)" in message


def test_a_restore_helper_bound_at_import_fails_naming_the_seam(monkeypatch):
    """PATCH weight_restore_bumps_version rebinds verl.utils.fsdp_utils' helpers; a DetachActorWorker that took them
    at import would restore weights without bumping the version, and a stale pass could be reused."""
    from verl.experimental.separation.engine_workers import DetachActorWorker
    from verl.utils.fsdp_utils import fsdp2_sharded_load_from_cpu, fsdp2_sharded_save_to_cpu

    def _get_strategy_handlers(self):  # the helpers as they were when this module was imported
        return fsdp2_sharded_save_to_cpu, fsdp2_sharded_load_from_cpu

    message = _seam_error_with(monkeypatch, DetachActorWorker, "_get_strategy_handlers", _get_strategy_handlers)
    assert f"{seams.BEHAVIOUR_RESTORE}: DetachActorWorker's restore handler for fsdp is not looked up" in message
    assert "1 seam(s)" in message


def test_a_trainer_that_takes_its_config_elsewhere_fails_naming_the_seam(monkeypatch):
    """PATCH trainer_config_checks reads the whole config as the trainer's first argument: a verl trainer built
    another way would skip the plugin's checks for an entry point that never calls validate_config."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    def __init__(self, tokenizer, config=None):
        raise AssertionError("never built")

    message = _seam_error_with(monkeypatch, RayPPOTrainer, "__init__", __init__)
    assert f"{seams.TRAINERS_TAKE_CONFIG}: RayPPOTrainer.__init__ takes ['self', 'tokenizer', 'config']" in message
    assert "1 seam(s)" in message


# ---------------------------------------------------------------------------------------------
# The patch catalogue is what install() applies


def test_install_applies_the_catalogues_installable_patches_in_order_and_puts_each_back(monkeypatch):
    from verl_klcov_global.engine import patches

    applied_elsewhere = {entry.name for entry in PATCHES if entry.install is None}
    assert applied_elsewhere == {"prepass_batched_logsumexp", *(guard.name for guard in seams.SEAM_ERROR_GUARDS)}
    installable = [entry for entry in PATCHES if entry.install is not None]
    assert all(entry.uninstall is not None and entry.installed is not None for entry in installable)
    calls = []
    recording = tuple(dataclasses.replace(entry, install=lambda entry=entry: calls.append(entry.name) or entry.install())
                      if entry.install is not None else entry for entry in PATCHES)
    monkeypatch.setattr(patches, "PATCHES", recording)
    patches.install()
    assert calls == [entry.name for entry in installable]
    monkeypatch.undo()
    try:
        for entry in installable:
            entry.uninstall()
            assert not entry.installed(), entry.name
    finally:
        patches.install()
    assert all(entry.installed() for entry in installable)


def test_install_names_a_patch_whose_install_left_it_out(monkeypatch):
    from verl_klcov_global.engine import patches

    broken = tuple(dataclasses.replace(entry, install=lambda: None, installed=lambda: False)
                   if entry.name == "log_prob_pass_keep" else entry for entry in PATCHES)
    monkeypatch.setattr(patches, "PATCHES", broken)
    with pytest.raises(patches.PatchNotInstalledError, match="PATCH log_prob_pass_keep .* is not in place"):
        patches.install()


def test_the_seam_errors_guards_are_the_catalogues_seam_error_patches():
    """What make_seam_error_visible applies is listed in the catalogue, each entry guarded by a checked seam."""
    entries = {entry.name: entry for entry in PATCHES}
    names = {seam.name for seam in seams.SEAMS}
    for guard in seams.SEAM_ERROR_GUARDS:
        entry = entries[guard.name]
        assert entry.install is None and guard.seam == entry.seam in names
        assert entry.implementation == f"seams.{guard.apply.__name__}"
