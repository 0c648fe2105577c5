"""Every example's Hydra overrides compose with verl's ppo_trainer config and pass verl's validation."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import verl
from verl_klcov_global.config import KLCovGlobalPolicyLossConfig, read_settings

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.sh"))
VERL_CONFIG_DIR = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")


def example_overrides(script: Path) -> list[str]:
    proc = subprocess.run(["bash", str(script)], env={**os.environ, "PRINT_OVERRIDES": "1"},
                          capture_output=True, text=True, timeout=60, check=True)
    return [line for line in proc.stdout.splitlines() if line.strip()]


def test_examples_exist():
    assert {p.name for p in EXAMPLES} >= {"dapo_kl_cov_global.sh", "dapo_kl_cov_global_32b.sh"}


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_overrides_compose_and_validate(script):
    from verl.trainer.main_ppo import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    overrides = example_overrides(script)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=VERL_CONFIG_DIR, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    assert isinstance(actor.policy_loss, KLCovGlobalPolicyLossConfig)
    settings = read_settings(actor)
    expected_ratio = 0.0002 if "32b" in script.name else 0.002
    assert settings.kl_cov_ratio == expected_ratio and settings.ppo_kl_coef == 1.0
    assert actor.loss_agg_mode == "token-mean" and actor.entropy_coeff == 0 and not actor.use_kl_loss
    assert actor.use_dynamic_bsz and actor.ppo_mini_batch_size == 32
    assert config.data.train_batch_size == 256 and config.actor_rollout_ref.rollout.n == 8
