"""Loading routes that do not depend on verl's ``verl.plugins`` entry-point group (0.9.x only).

Each probe runs in a clean interpreter with the entry points switched off
(``VERL_USE_EXTERNAL_PLUGINS=none``; verl 0.8 has none anyway), so only the route under test can
import the plugin:

* ``VERL_USE_EXTERNAL_MODULES=verl_klcov_global``: ``import verl`` imports it;
* ``actor_rollout_ref.model.external_lib=verl_klcov_global``: building the model config imports it;
* ``policy_loss._target_=verl_klcov_global.config.KLCovGlobalPolicyLossConfig``: converting the
  policy-loss config (verl's ``omega_conf_to_dataclass``) imports it.

Each time the losses must be registered and the hook installed. Runs in the main suite (verl 0.9.1)
and in the verl 0.8.0 subset (``scripts/test_verl_version.sh``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_REPORT = """
import json, sys
from verl.workers.engine.base import BaseEngine
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
print("RESULT " + json.dumps({
    "plugin_imported": "verl_klcov_global.plugin" in sys.modules,
    "hooked": getattr(BaseEngine.train_batch, "__verl_klcov_global_original__", None) is not None,
    "registered": sorted(m for m in ("kl_cov_global", "clip_cov_global") if m in POLICY_LOSS_REGISTRY),
}))
"""
_LOADED = {"plugin_imported": True, "hooked": True, "registered": ["clip_cov_global", "kl_cov_global"]}
_ABSENT = {"plugin_imported": False, "hooked": False, "registered": []}


pytestmark = pytest.mark.slow  # each test starts fresh interpreters


def _probe(code: str, **env_overrides) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", "VERL_USE_EXTERNAL_PLUGINS")}
    # on 0.9 the entry point would load the plugin anyway: switch it off so only the route under test acts
    env.update(VERL_USE_EXTERNAL_PLUGINS="none", **env_overrides)
    proc = subprocess.run([sys.executable, "-c", "import verl\n" + code + _REPORT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_verl_use_external_modules_registers_the_losses_and_installs_the_hook():
    assert _probe("", VERL_USE_EXTERNAL_MODULES="verl_klcov_global") == _LOADED
    # control: without the variable (and without the entry point) nothing of the plugin is there
    assert _probe("") == _ABSENT


def test_external_lib_registers_the_losses_when_the_model_config_is_built(tiny_model_path):
    code = (f"from verl.workers.config import HFModelConfig\n"
            f"HFModelConfig(path={tiny_model_path!r}, external_lib='verl_klcov_global')\n")
    assert _probe(code) == _LOADED  # the control (nothing loads it otherwise) is the first test's


def test_config_class_target_registers_the_losses_when_the_policy_loss_config_is_converted():
    code = """
from omegaconf import OmegaConf
from verl.utils.config import omega_conf_to_dataclass
converted = omega_conf_to_dataclass(OmegaConf.create({
    "_target_": "verl_klcov_global.config.KLCovGlobalPolicyLossConfig", "loss_mode": "kl_cov_global",
    "kl_cov_ratio": 0.002, "ppo_kl_coef": 1.0}))
assert type(converted).__name__ == "KLCovGlobalPolicyLossConfig", type(converted)
"""
    assert _probe(code) == _LOADED
