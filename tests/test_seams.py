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
        "train_batch_prepass", "validate_config_driver_checks", "prepass_batched_logsumexp",
        "log_prob_pass_context", "log_prob_pass_keep", "proxy_log_prob_in_pass", "weight_restore_bumps_version"]
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


@pytest.mark.parametrize("owner, name, moved", [
    ("verl.workers.engine_workers.TrainingWorker", "infer_batch", lambda self, data, no_lora_adapter=False: None),
    ("verl.utils.fsdp_utils", "fsdp2_sharded_load_from_cpu", lambda model, state: None),
    ("verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead", "infer_batch",
     lambda self, data, loss_function=None: None),
])
def test_the_reuse_patches_targets_fail_loudly_when_they_move(monkeypatch, owner, name, moved):
    """PATCHES log_prob_pass_context / weight_restore_bumps_version / log_prob_pass_keep: a changed signature, or
    an override below BaseEngine that would bypass the keeping, is a seam error naming it (engine/reuse.py)."""
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
    assert name in message and "1 seam(s)" in message, message
    monkeypatch.undo()
    check_seams(force=True)
