"""Every example's Hydra overrides compose with verl's ppo_trainer config and pass verl's validation."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import verl
from verl_klcov_global.config import (
    ClipCovGlobalPolicyLossConfig,
    KLCovGlobalPolicyLossConfig,
    read_clip_cov_settings,
    read_kl_cov_settings,
)
from verl_klcov_global.configs import CONFIG_DIR

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.sh"))
VERL_CONFIG_DIR = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
CONFIGS_DIR = CONFIG_DIR  # the package's configs
#: examples per mode where it is not 2 (a 7B-style and a 32B one)
EXAMPLES_PER_MODE = {"stare_global": 1, "lp_reg_global": 1}  # Lp-Reg: Qwen3-14B (32B: one override)


def example_overrides(script: Path) -> list[str]:
    return _example_overrides_with(script)


def _example_overrides_with(script: Path, **env: str) -> list[str]:
    proc = subprocess.run(["bash", str(script)], env={**os.environ, **env, "PRINT_OVERRIDES": "1"},
                          capture_output=True, text=True, timeout=60, check=True)
    return [line for line in proc.stdout.splitlines() if line.strip()]


def test_every_example_selects_a_mode_of_the_table_and_every_mode_has_examples():
    """Guards the parametrized tests below against an empty glob, and the examples against a mode left out."""
    from verl_klcov_global.modes import MODES

    selected = {}
    for script in EXAMPLES:
        modes = [line.split("=", 1)[1] for line in example_overrides(script)
                 if line.startswith("actor_rollout_ref.actor.policy_loss.loss_mode=")]
        assert len(modes) == 1 and modes[0] in MODES, (script.name, modes)
        selected.setdefault(modes[0], []).append(script.name)
    assert sorted(selected) == sorted(MODES), selected
    # the 7B-style and the 32B example; STARE: the authors' one script (their other one is the GRPO baseline)
    assert {mode: len(names) for mode, names in selected.items()} == {
        mode: EXAMPLES_PER_MODE.get(mode, 2) for mode in MODES}, selected


def validated_actor(config):
    from verl.trainer.main_ppo import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    return omega_conf_to_dataclass(config.actor_rollout_ref.actor)


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_overrides_compose_and_validate(script):
    overrides = example_overrides(script)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=VERL_CONFIG_DIR, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    actor = validated_actor(config)
    if "high_entropy" in script.name:
        # the authors' Qwen3-14B DAPO script (the 32B variant changes the model only)
        from verl_klcov_global.config import HighEntropyGlobalPolicyLossConfig, read_high_entropy_settings

        assert isinstance(actor.policy_loss, HighEntropyGlobalPolicyLossConfig)
        settings = read_high_entropy_settings(actor)
        assert settings.entropy_top_ratio == 0.2 and settings.prepass_layout == "infer"
        assert (settings.clip_ratio_low, settings.clip_ratio_high, settings.clip_ratio_c) == (0.2, 0.28, 10.0)
        assert actor.ppo_max_token_len_per_gpu == 2048 + 20480 and actor.ulysses_sequence_parallel_size == 8
        assert config.data.train_batch_size == 512 and config.actor_rollout_ref.rollout.n == 16
        assert actor.optim.weight_decay == 0.1 and actor.grad_clip == 1.0
        assert ("14B" in config.actor_rollout_ref.model.path) != ("32b" in script.name)
    elif "stare" in script.name:
        # the authors' run_short_cot_qwen2.5_math_7b_STARE.sh: the paper's 7B defaults, on-policy
        from verl_klcov_global.config import StareGlobalPolicyLossConfig, read_stare_settings

        assert isinstance(actor.policy_loss, StareGlobalPolicyLossConfig)
        settings = read_stare_settings(actor)
        assert (settings.stare_top_ratio, settings.with_negative, settings.reweight_w, settings.reweight_m) == (
            0.1, False, 1.1, 0.9)
        assert (settings.target_entropy, settings.adaptive, settings.alpha, settings.w_max, settings.m_min) == (
            0.3, False, 0.01, 1.5, 0.5)
        assert settings.prepass_layout == "infer" and settings.gate_on
        assert (settings.clip_ratio_low, settings.clip_ratio_high, settings.clip_ratio_c) == (0.2, 0.28, 10.0)
        assert actor.ppo_max_token_len_per_gpu == (1024 + 3072) * 2
        assert config.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu == (1024 + 3072) * 3
        assert config.data.train_batch_size == actor.ppo_mini_batch_size == 64  # one optimizer step per step
        assert config.actor_rollout_ref.rollout.n == 8 and actor.optim.lr == 1e-6 and actor.grad_clip == 1.0
        assert "optimizer" in actor.checkpoint.save_contents  # STARE's state travels with the optimizer
        assert not config.algorithm.rollout_correction.bypass_mode  # the gate reads verl's log-prob pass
        variant = _example_overrides_with(script, STARE_VARIANT="C2")
        assert "+actor_rollout_ref.actor.policy_loss.stare_variant=C2" in variant
    elif "lp_reg" in script.name:
        # the authors' Qwen3_14b_lp_reg_onpolicy_64gpu.sh
        from verl_klcov_global.config import LpRegGlobalPolicyLossConfig, read_lp_reg_settings

        assert isinstance(actor.policy_loss, LpRegGlobalPolicyLossConfig)
        settings = read_lp_reg_settings(actor)
        assert (settings.neg_ratio, settings.pos_ratio, settings.min_p, settings.kl_coef) == (0.01, 0.0, 0.02, 1.0)
        assert (settings.clip_ratio_low, settings.clip_ratio_high, settings.clip_ratio_c) == (1.0, 9.0, 10.0)
        assert settings.prepass_layout == "infer"
        assert actor.ppo_max_token_len_per_gpu == 30720 and actor.ppo_mini_batch_size == 256
        assert config.data.train_batch_size == 256 and config.actor_rollout_ref.rollout.n == 8
        assert not config.algorithm.rollout_correction.bypass_mode  # the proxy needs verl's log-prob pass
    else:
        if "clip_cov" in script.name:
            assert isinstance(actor.policy_loss, ClipCovGlobalPolicyLossConfig)
            settings = read_clip_cov_settings(actor)
            assert (settings.clip_cov_ratio, settings.clip_cov_lb, settings.clip_cov_ub) == (0.0002, 1.0, 5.0)
            assert (settings.clip_ratio_low, settings.clip_ratio_high, settings.clip_cov_seed) == (1.0, 1.0, 0)
            assert actor.clip_ratio_c == 10.0
        else:
            assert isinstance(actor.policy_loss, KLCovGlobalPolicyLossConfig)
            settings = read_kl_cov_settings(actor)
            expected_ratio = 0.0002 if "32b" in script.name else 0.002
            assert settings.kl_cov_ratio == expected_ratio and settings.ppo_kl_coef == 1.0
        expected_tokens = 20480 if "32b" in script.name else 30720
        assert actor.ppo_max_token_len_per_gpu == expected_tokens
        assert config.data.train_batch_size == 256 and config.actor_rollout_ref.rollout.n == 8
    if "stare" not in script.name and "lp_reg" not in script.name:
        assert actor.ppo_mini_batch_size == 32
    assert actor.loss_agg_mode == "token-mean" and actor.entropy_coeff == 0 and not actor.use_kl_loss
    assert actor.use_dynamic_bsz


def compose_config_file(name, overrides=()):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIGS_DIR, version_base=None):
        return compose(config_name=name, overrides=["actor_rollout_ref.model.path=/m",
                                                     "actor_rollout_ref.actor.use_dynamic_bsz=True", "algorithm.adv_estimator=grpo",
                                                     *overrides])


def test_clip_cov_global_yaml_selects_the_plugin_config_and_takes_overrides_without_plus():
    actor = validated_actor(compose_config_file("clip_cov_global", [
        "actor_rollout_ref.actor.policy_loss.clip_cov_seed=17", "actor_rollout_ref.actor.policy_loss.clip_cov_lb=0.5",
        "actor_rollout_ref.actor.policy_loss.prepass_layout=train"]))
    assert type(actor.policy_loss) is ClipCovGlobalPolicyLossConfig
    settings = read_clip_cov_settings(actor)
    assert (settings.clip_cov_ratio, settings.clip_cov_lb, settings.clip_cov_ub) == (0.0002, 0.5, 5.0)
    assert (settings.clip_cov_seed, settings.prepass_layout) == (17, "train")


@pytest.mark.parametrize("override, message", [
    ("clip_cov_seed=-1", r"clip_cov_seed must be an integer in \[0, 2\*\*53\).*policy_loss.clip_cov_seed"),
    ("clip_cov_ub=0.5", r"clip_cov_lb must be below clip_cov_ub.*policy_loss.clip_cov_lb"),
    ("clip_cov_ratio=0", r"clip_cov_ratio must be finite and in \(0, 1\].*policy_loss.clip_cov_ratio"),
    ("loss_mode=kl_cov_global", r"loss_mode is 'kl_cov_global'.*policy_loss.loss_mode=clip_cov_global"),
])
def test_clip_cov_global_yaml_bad_values_fail_verls_validation(override, message):
    config = compose_config_file("clip_cov_global", [f"actor_rollout_ref.actor.policy_loss.{override}"])
    with pytest.raises(Exception, match=message):
        validated_actor(config)


def test_high_entropy_global_yaml_selects_the_plugin_config_and_takes_overrides_without_plus():
    from verl_klcov_global.config import HighEntropyGlobalPolicyLossConfig, read_high_entropy_settings

    actor = validated_actor(compose_config_file("high_entropy_global", [
        "actor_rollout_ref.actor.policy_loss.entropy_top_ratio=0.1",
        "actor_rollout_ref.actor.policy_loss.prepass_layout=train"]))
    assert type(actor.policy_loss) is HighEntropyGlobalPolicyLossConfig
    settings = read_high_entropy_settings(actor)
    assert (settings.entropy_top_ratio, settings.prepass_layout) == (0.1, "train")
    default = validated_actor(compose_config_file("high_entropy_global"))
    assert read_high_entropy_settings(default).entropy_top_ratio == 0.2  # the paper's rho


@pytest.mark.parametrize("override, message", [
    ("entropy_top_ratio=20", r"entropy_top_ratio.*policy_loss.entropy_top_ratio"),
    ("entropy_top_ratio=0", r"entropy_top_ratio must be finite and in \(0, 1\]"),
    ("loss_mode=kl_cov_global", r"loss_mode is 'kl_cov_global'.*policy_loss.loss_mode=high_entropy_global"),
])
def test_high_entropy_global_yaml_bad_values_fail_verls_validation(override, message):
    config = compose_config_file("high_entropy_global", [f"actor_rollout_ref.actor.policy_loss.{override}"])
    with pytest.raises(Exception, match=message):
        validated_actor(config)


def test_stare_global_yaml_selects_the_plugin_config_and_takes_overrides_without_plus():
    from verl_klcov_global.config import StareGlobalPolicyLossConfig, read_stare_settings

    actor = validated_actor(compose_config_file("stare_global", [
        f"actor_rollout_ref.actor.policy_loss.{override}" for override in (
            "stare_variant=C2", "stare_top_ratio=0.2", "stare_reweight_w=1.05", "stare_reweight_m=0.95",
            "stare_target_entropy=0.5", "stare_adaptive=true", "stare_alpha=0.02", "stare_w_max=1.2",
            "stare_m_min=0.8", "prepass_layout=old")]))
    assert type(actor.policy_loss) is StareGlobalPolicyLossConfig
    settings = read_stare_settings(actor)
    assert (settings.with_negative, settings.stare_top_ratio, settings.reweight_w, settings.reweight_m) == (
        True, 0.2, 1.05, 0.95)
    assert (settings.target_entropy, settings.adaptive, settings.alpha, settings.w_max, settings.m_min) == (
        0.5, True, 0.02, 1.2, 0.8)
    assert settings.prepass_layout == "old"
    default_config = compose_config_file("stare_global")
    default = read_stare_settings(validated_actor(default_config))
    assert (default.stare_top_ratio, default.with_negative, default.reweight_w, default.reweight_m,
            default.target_entropy, default.adaptive) == (0.1, False, 1.1, 0.9, 0.3, False)  # the paper's
    # every field the config class declares, and no entropy_* knob: the controller does not apply to STARE
    declared = set(default_config.actor_rollout_ref.actor.policy_loss)
    from dataclasses import fields

    plugin_fields = {f.name for f in fields(StareGlobalPolicyLossConfig)} - {
        f.name for f in fields(StareGlobalPolicyLossConfig.__mro__[1])}
    assert plugin_fields <= declared and not [key for key in declared if key.startswith("entropy_")]


@pytest.mark.parametrize("override, message", [
    ("stare_top_ratio=10", r"stare_top_ratio must be finite and in \[0, 1\].*policy_loss.stare_top_ratio"),
    ("stare_reweight_w=0.9", r"stare_reweight_w must be finite and >= 1.*policy_loss.stare_reweight_w"),
    ("stare_reweight_m=1.1", r"stare_reweight_m must be finite and in \(0, 1\].*policy_loss.stare_reweight_m"),
    ("stare_variant=O2", r"stare_variant must be one of.*policy_loss.stare_variant"),
    ("stare_adaptive=1", r"stare_adaptive must be true or false"),
    ("loss_mode=kl_cov_global", r"loss_mode is 'kl_cov_global'.*policy_loss.loss_mode=stare_global"),
])
def test_stare_global_yaml_bad_values_fail_verls_validation(override, message):
    config = compose_config_file("stare_global", [f"actor_rollout_ref.actor.policy_loss.{override}"])
    with pytest.raises(Exception, match=message):
        validated_actor(config)


def test_stare_global_yaml_refuses_a_summed_loss_agg_mode():
    """The gate compares verl's actor/entropy, aggregated with loss_agg_mode, with a per-token target: the driver's
    check (inside verl's validate_config) stops the sum modes, naming the key."""
    config = compose_config_file("stare_global", ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum"])
    with pytest.raises(Exception, match=r"loss_agg_mode='seq-mean-token-sum'.*actor.loss_agg_mode=token-mean"):
        validated_actor(config)


def test_lp_reg_global_yaml_selects_the_plugin_config_and_takes_overrides_without_plus():
    from dataclasses import fields

    from verl_klcov_global.config import LpRegGlobalPolicyLossConfig, read_lp_reg_settings

    actor = validated_actor(compose_config_file("lp_reg_global", [
        f"actor_rollout_ref.actor.policy_loss.{override}" for override in (
            "lp_reg_neg_ratio=0.005", "lp_reg_pos_ratio=0.001", "lp_reg_min_p=0.05", "lp_reg_kl_coef=0.5",
            "prepass_layout=old")]))
    assert type(actor.policy_loss) is LpRegGlobalPolicyLossConfig
    settings = read_lp_reg_settings(actor)
    assert (settings.neg_ratio, settings.pos_ratio, settings.min_p, settings.kl_coef, settings.prepass_layout) == (
        0.005, 0.001, 0.05, 0.5, "old")
    default_config = compose_config_file("lp_reg_global")
    default = read_lp_reg_settings(validated_actor(default_config))
    assert (default.neg_ratio, default.pos_ratio, default.min_p, default.kl_coef) == (0.01, 0.0, 0.02, 1.0)
    declared = set(default_config.actor_rollout_ref.actor.policy_loss)
    plugin_fields = {f.name for f in fields(LpRegGlobalPolicyLossConfig)} - {
        f.name for f in fields(LpRegGlobalPolicyLossConfig.__mro__[1])}
    assert plugin_fields <= declared and not [key for key in declared if key.startswith("entropy_")]


@pytest.mark.parametrize("override, message", [
    ("lp_reg_neg_ratio=2", r"lp_reg_neg_ratio must be finite and in \[0, 1\].*policy_loss.lp_reg_neg_ratio"),
    ("lp_reg_neg_ratio=0", r"both 0: lp_reg_global would regularise no token"),
    ("lp_reg_min_p=1", r"lp_reg_min_p must be finite and in \[0, 1\).*policy_loss.lp_reg_min_p"),
    ("lp_reg_kl_coef=-1", r"lp_reg_kl_coef must be finite and >= 0.*policy_loss.lp_reg_kl_coef"),
    ("ppo_kl_coef=1", r"ppo_kl_coef=1\S* is KL-Cov's coefficient, which lp_reg_global does not read.*lp_reg_kl_coef"),
    ("loss_mode=kl_cov_global", r"loss_mode is 'kl_cov_global'.*policy_loss.loss_mode=lp_reg_global"),
])
def test_lp_reg_global_yaml_bad_values_fail_verls_validation(override, message):
    config = compose_config_file("lp_reg_global", [f"actor_rollout_ref.actor.policy_loss.{override}"])
    with pytest.raises(Exception, match=message):
        validated_actor(config)


# -- DAPO's dynamic sampling and reward, as each authors' script sets them ------------------------------------

#: Per example: the authors' dynamic sampling (algorithm.filter_groups on, metric acc, max_num_gen_batches 10) and
#: their reward manager (`dapo` with its overlong buffer: on, and its length; None: not verl's, verl's default kept).
#: Sources: verl recipe/entropy/{7b,32b}_{kl,clip}_cov.sh at 246cac4; the 80/20 script
#: run_only_top20_high_entropy_tokens_dapo_qwen3_14b.sh; STARE's fork (its own `stare` reward manager);
#: Lp-Reg's Qwen3_14b_lp_reg_onpolicy_64gpu.sh (filter_groups off, overlong buffer off at 512).
AUTHORS_DAPO = {
    "dapo_kl_cov_global": dict(dynamic_sampling=True, reward="dapo", overlong=False, overlong_len=2048),
    "dapo_clip_cov_global": dict(dynamic_sampling=True, reward="dapo", overlong=False, overlong_len=2048),
    "dapo_high_entropy_global": dict(dynamic_sampling=True, reward="dapo", overlong=True, overlong_len=4096),
    "stare_global_qwen2.5_math_7b": dict(dynamic_sampling=True, reward=None),
    "lp_reg_global_qwen3_14b": dict(dynamic_sampling=False, reward="dapo", overlong=False, overlong_len=512),
}


def _authors_dapo(script: Path) -> dict:
    return AUTHORS_DAPO[script.stem.removesuffix("_32b")]


def test_every_example_has_its_authors_dapo_settings_written_down():
    assert sorted({script.stem.removesuffix("_32b") for script in EXAMPLES}) == sorted(AUTHORS_DAPO)


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_the_example_samples_and_rewards_as_its_authors_script(script):
    expected = _authors_dapo(script)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=VERL_CONFIG_DIR, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=example_overrides(script))
    groups = config.algorithm.filter_groups
    if expected["dynamic_sampling"]:
        assert config.trainer.use_v1 is True  # verl 0.9.1: the v1 trainer's replay buffer filters and refills
        assert (groups.enable, groups.metric, groups.max_num_gen_batches) == (True, "acc", 10)
    else:
        assert groups.enable is False
    if expected["reward"] is None:
        assert config.reward.reward_manager.name == "naive"  # verl's default (the authors' own is not in verl)
        assert "reward_kwargs" not in config.reward
        return
    assert config.reward.reward_manager.name == expected["reward"]
    kwargs = config.reward.reward_kwargs
    assert kwargs.max_resp_len == config.data.max_response_length
    buffer = kwargs.overlong_buffer_cfg
    assert (buffer.enable, buffer.len, buffer.penalty_factor) == (expected["overlong"], expected["overlong_len"], 1.0)
    from verl.experimental.reward_loop.reward_manager.dapo import DAPORewardManager

    manager = DAPORewardManager(config, tokenizer=None, compute_score=None)  # its own checks of the buffer pass
    assert manager.max_resp_len == config.data.max_response_length
    assert bool(manager.overlong_buffer_cfg.enable) is expected["overlong"]
