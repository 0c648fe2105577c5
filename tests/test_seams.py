"""Seam checks (``seams.py``): the installed verl passes; a moved seam fails at import, by name.

Runs on every supported verl (0.9.1 main suite, 0.8.0 subset: ``scripts/test_verl_version.sh``).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import subprocess
import sys

import pytest
import verl.trainer.ppo.core_algos as core_algos
import verl.utils.torch_functional as verl_F
from verl.workers.config.actor import PolicyLossConfig
from verl.workers.engine.base import BaseEngine

import verl

from verl_klcov_global import seams
from verl_klcov_global.engine.patches import PATCHES
from verl_klcov_global.modes import MODES
from verl_klcov_global.seams import KNOWN_VERL_VERSIONS, VerlSeamError, check_seams

_KNOWN = r"Known to work: verl 0\.8\.0, 0\.9\.1"


def test_the_installed_verl_passes_every_seam():
    names = check_seams(force=True)
    assert names == [seam.name for seam in seams.SEAMS] and len(names) >= 20
    assert verl.__version__ in KNOWN_VERL_VERSIONS  # the suite runs on the versions the error message names


def test_every_patch_of_the_catalogue_is_guarded_by_a_seam():
    """A patch whose target moves must fail at import, by name: each one names a seam that is checked."""
    names = {seam.name for seam in seams.SEAMS}
    assert [patch.name for patch in PATCHES] == [
        "train_batch_prepass", "validate_config_driver_checks", "prepass_batched_logsumexp"]
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
    monkeypatch.undo()
    check_seams(force=True)  # control: the real one passes again


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
