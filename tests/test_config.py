"""Validation of the plugin's knobs: every invalid value raises an error that says what to set."""

from __future__ import annotations

import math

import pytest
from verl.workers.config import ActorConfig, PolicyLossConfig

from verl_klcov_global.config import KLCovGlobalPolicyLossConfig, is_kl_cov_global, read_settings


def actor(**policy_loss):
    return ActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                       policy_loss=PolicyLossConfig(loss_mode="kl_cov_global", **policy_loss))


@pytest.mark.parametrize("ratio", [0, -1e-4, 1.0001, math.nan, math.inf, -math.inf])
def test_bad_kl_cov_ratio(ratio):
    with pytest.raises(ValueError, match=r"kl_cov_ratio must be finite and in \(0, 1\].*policy_loss.kl_cov_ratio"):
        read_settings(actor(kl_cov_ratio=ratio))


@pytest.mark.parametrize("coef", [-0.5, math.nan, math.inf, "x"])
def test_bad_ppo_kl_coef(coef):
    with pytest.raises(ValueError, match=r"ppo_kl_coef must be finite and >= 0.*policy_loss.ppo_kl_coef"):
        read_settings(actor(ppo_kl_coef=coef))


def test_valid_settings_and_defaults():
    settings = read_settings(actor(kl_cov_ratio=1.0, ppo_kl_coef=0.0))
    assert (settings.kl_cov_ratio, settings.ppo_kl_coef, settings.prepass_layout) == (1.0, 0.0, "infer")
    assert is_kl_cov_global(actor())
    assert not is_kl_cov_global(ActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1,
                                            rollout_n=1))


def test_plugin_config_dataclass_validates_on_construction():
    config = KLCovGlobalPolicyLossConfig(kl_cov_ratio=0.002, ppo_kl_coef=1.0, prepass_layout="train")
    assert read_settings(ActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1,
                                     rollout_n=1, policy_loss=config)).prepass_layout == "train"
    with pytest.raises(ValueError, match="prepass_layout must be one of"):
        KLCovGlobalPolicyLossConfig(prepass_layout="micro")
    with pytest.raises(ValueError, match="kl_cov_ratio"):
        KLCovGlobalPolicyLossConfig(kl_cov_ratio=2.0)
