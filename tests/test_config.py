"""Validation of the plugin's knobs: every invalid value raises an error that says what to set."""

from __future__ import annotations

import math

import pytest
from verl.workers.config import ActorConfig, PolicyLossConfig

from verl_klcov_global.config import (
    DEFAULT_CLIP_COV_SEED,
    ClipCovGlobalPolicyLossConfig,
    KLCovGlobalPolicyLossConfig,
    loss_mode_of,
    read_clip_cov_settings,
    read_kl_cov_settings,
)
from verl_klcov_global.modes import global_mode_of
from verl_klcov_global.methods.clip_cov.row import CLIP_COV
from verl_klcov_global.methods.kl_cov.row import KL_COV


def actor(**policy_loss):
    return ActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                       policy_loss=PolicyLossConfig(loss_mode="kl_cov_global", **policy_loss))


@pytest.mark.parametrize("ratio", [0, -1e-4, 1.0001, math.nan, math.inf, -math.inf])
def test_bad_kl_cov_ratio(ratio):
    with pytest.raises(ValueError, match=r"kl_cov_ratio must be finite and in \(0, 1\].*policy_loss.kl_cov_ratio"):
        read_kl_cov_settings(actor(kl_cov_ratio=ratio))


@pytest.mark.parametrize("coef", [-0.5, math.nan, math.inf, "x"])
def test_bad_ppo_kl_coef(coef):
    with pytest.raises(ValueError, match=r"ppo_kl_coef must be finite and >= 0.*policy_loss.ppo_kl_coef"):
        read_kl_cov_settings(actor(ppo_kl_coef=coef))


def test_valid_settings_and_defaults():
    settings = read_kl_cov_settings(actor(kl_cov_ratio=1.0, ppo_kl_coef=0.0))
    assert (settings.kl_cov_ratio, settings.ppo_kl_coef, settings.prepass_layout) == (1.0, 0.0, "infer")
    assert global_mode_of(actor()) is KL_COV
    assert global_mode_of(ActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1,
                                      rollout_n=1)) is None


def test_plugin_config_dataclass_validates_on_construction():
    config = KLCovGlobalPolicyLossConfig(kl_cov_ratio=0.002, ppo_kl_coef=1.0, prepass_layout="train")
    assert read_kl_cov_settings(ActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1,
                                     rollout_n=1, policy_loss=config)).prepass_layout == "train"
    with pytest.raises(ValueError, match="prepass_layout must be one of"):
        KLCovGlobalPolicyLossConfig(prepass_layout="micro")
    with pytest.raises(ValueError, match="kl_cov_ratio"):
        KLCovGlobalPolicyLossConfig(kl_cov_ratio=2.0)


@pytest.mark.parametrize("key,value", [("kl_cov_ratio", True), ("kl_cov_ratio", "0.002"), ("ppo_kl_coef", False),
                                       ("ppo_kl_coef", "1.0")])
def test_kl_cov_knobs_reject_booleans_and_strings(key, value):
    with pytest.raises(ValueError, match=f"{key} must be finite.*policy_loss.{key}"):
        read_kl_cov_settings(actor(**{key: value}))


# ---------------------------------------------------------------------------------------------
# clip_cov_global


def clip_actor(policy_loss=None, **actor_kwargs):
    policy_loss = policy_loss if policy_loss is not None else PolicyLossConfig(loss_mode="clip_cov_global")
    return ActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                       policy_loss=policy_loss, **actor_kwargs)


def test_clip_cov_defaults_are_verls_and_the_seed_is_0():
    settings = read_clip_cov_settings(clip_actor(clip_ratio_low=0.2, clip_ratio_high=0.28))
    assert (settings.clip_cov_ratio, settings.clip_cov_lb, settings.clip_cov_ub) == (0.0002, 1.0, 5.0)
    assert (settings.clip_cov_seed, settings.prepass_layout) == (DEFAULT_CLIP_COV_SEED, "infer") == (0, "infer")
    assert (settings.clip_ratio_low, settings.clip_ratio_high) == (0.2, 0.28)
    assert loss_mode_of(clip_actor()) == "clip_cov_global" and global_mode_of(clip_actor()) is CLIP_COV
    assert loss_mode_of(actor()) == "kl_cov_global"


def test_clip_ratios_fall_back_to_clip_ratio_like_upstream():
    settings = read_clip_cov_settings(clip_actor(clip_ratio=0.3, clip_ratio_low=None, clip_ratio_high=None))
    assert (settings.clip_ratio_low, settings.clip_ratio_high) == (0.3, 0.3)


@pytest.mark.parametrize("fields,match", [
    (dict(clip_cov_ratio=0), r"clip_cov_ratio must be finite and in \(0, 1\].*policy_loss.clip_cov_ratio, e.g. =0.0002"),
    (dict(clip_cov_ratio=1.5), r"clip_cov_ratio must be finite and in \(0, 1\]"),
    (dict(clip_cov_ratio=math.nan), r"clip_cov_ratio must be finite"),
    (dict(clip_cov_ratio=True), r"clip_cov_ratio must be finite"),
    (dict(clip_cov_ratio="0.1"), r"clip_cov_ratio must be finite"),
    (dict(clip_cov_lb=5.0, clip_cov_ub=1.0), r"clip_cov_lb must be below clip_cov_ub.*policy_loss.clip_cov_lb, e.g. =1.0"),
    (dict(clip_cov_lb=math.inf), r"clip_cov_lb must be a finite number.*policy_loss.clip_cov_lb, e.g. =1.0"),
    (dict(clip_cov_ub=math.nan), r"clip_cov_ub must be a finite number.*policy_loss.clip_cov_ub, e.g. =5.0"),
    (dict(clip_cov_ub=True), r"clip_cov_ub must be a finite number"),
])
def test_bad_clip_cov_knobs(fields, match):
    with pytest.raises(ValueError, match=match):
        read_clip_cov_settings(clip_actor(PolicyLossConfig(loss_mode="clip_cov_global", **fields)))
    with pytest.raises(ValueError, match=match):
        ClipCovGlobalPolicyLossConfig(**fields)


@pytest.mark.parametrize("seed", [-1, 2**53, 0.5, True, "1"])
def test_bad_clip_cov_seed(seed):
    with pytest.raises(ValueError, match=r"clip_cov_seed must be an integer in \[0, 2\*\*53\).*policy_loss.clip_cov_seed"):
        ClipCovGlobalPolicyLossConfig(clip_cov_seed=seed)


def test_bad_clip_ratio_for_clip_cov_global():
    with pytest.raises(ValueError, match=r"clip_ratio_high must be finite and >= 0.*actor_rollout_ref.actor.clip_ratio_high"):
        read_clip_cov_settings(clip_actor(clip_ratio_high=-0.1))


def test_clip_cov_config_dataclass():
    config = ClipCovGlobalPolicyLossConfig(clip_cov_ratio=0.001, clip_cov_lb=0.5, clip_cov_ub=2.0, clip_cov_seed=7,
                                           prepass_layout="train")
    settings = read_clip_cov_settings(clip_actor(config))
    assert (settings.clip_cov_ratio, settings.clip_cov_lb, settings.clip_cov_ub) == (0.001, 0.5, 2.0)
    assert (settings.clip_cov_seed, settings.prepass_layout) == (7, "train")
    with pytest.raises(ValueError, match="loss_mode=clip_cov_global, but loss_mode is 'vanilla'"):
        ClipCovGlobalPolicyLossConfig(loss_mode="vanilla")
    with pytest.raises(ValueError, match="prepass_layout must be one of"):
        ClipCovGlobalPolicyLossConfig(prepass_layout="micro")


# ---------------------------------------------------------------------------------------------
# high_entropy_global


def high_entropy_actor(policy_loss=None, **actor_kwargs):
    from verl_klcov_global.config import HighEntropyGlobalPolicyLossConfig

    policy_loss = policy_loss if policy_loss is not None else HighEntropyGlobalPolicyLossConfig()
    return ActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                       policy_loss=policy_loss, **actor_kwargs)


def test_high_entropy_defaults_are_the_papers_and_vanillas():
    from verl_klcov_global.config import DEFAULT_ENTROPY_TOP_RATIO, read_high_entropy_settings
    from verl_klcov_global.methods.high_entropy.row import HIGH_ENTROPY

    settings = read_high_entropy_settings(high_entropy_actor(clip_ratio_low=0.2, clip_ratio_high=0.28))
    assert settings.entropy_top_ratio == DEFAULT_ENTROPY_TOP_RATIO == 0.2
    assert (settings.clip_ratio_low, settings.clip_ratio_high, settings.clip_ratio_c) == (0.2, 0.28, 3.0)
    assert settings.prepass_layout == "infer"
    assert global_mode_of(high_entropy_actor()) is HIGH_ENTROPY
    # a plain mapping (what an override without _target_ gives) is read the same way
    mapping = ActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                          clip_ratio=0.3, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=10.0,
                          policy_loss=PolicyLossConfig(loss_mode="high_entropy_global"))
    settings = read_high_entropy_settings(mapping)
    assert (settings.entropy_top_ratio, settings.clip_ratio_low, settings.clip_ratio_high,
            settings.clip_ratio_c) == (0.2, 0.3, 0.3, 10.0)
    assert read_high_entropy_settings(_raw_actor(entropy_top_ratio=0.5)).entropy_top_ratio == 0.5


def _raw_actor(clip_ratio=0.2, actor_fields=None, **policy_loss):
    """The raw (OmegaConf) actor config the driver checks before verl builds its dataclasses."""
    from omegaconf import OmegaConf

    return OmegaConf.create({"policy_loss": {"loss_mode": "high_entropy_global", **policy_loss},
                             "clip_ratio": clip_ratio, **(actor_fields or {})})


@pytest.mark.parametrize("ratio", [0, -0.2, 20, 1.0001, math.nan, math.inf, True, "0.2"])
def test_bad_entropy_top_ratio_names_the_key_and_the_fraction(ratio):
    from verl_klcov_global.config import HighEntropyGlobalPolicyLossConfig, read_high_entropy_settings

    match = (r"entropy_top_ratio must be finite and in \(0, 1\].*actor_rollout_ref\.actor\.policy_loss\.entropy_top_ratio"
             r", e\.g\. =0\.2 \(a fraction: 0\.2 keeps the 20% highest-entropy tokens")
    with pytest.raises(ValueError, match=match):
        HighEntropyGlobalPolicyLossConfig(entropy_top_ratio=ratio)
    with pytest.raises(ValueError, match=match):
        read_high_entropy_settings(_raw_actor(entropy_top_ratio=ratio))


def test_high_entropy_config_dataclass():
    from verl_klcov_global.config import HighEntropyGlobalPolicyLossConfig, read_high_entropy_settings

    config = HighEntropyGlobalPolicyLossConfig(entropy_top_ratio=1.0, prepass_layout="train")
    settings = read_high_entropy_settings(high_entropy_actor(config))
    assert (settings.entropy_top_ratio, settings.prepass_layout) == (1.0, "train")
    with pytest.raises(ValueError, match="loss_mode=high_entropy_global, but loss_mode is 'vanilla'"):
        HighEntropyGlobalPolicyLossConfig(loss_mode="vanilla")
    with pytest.raises(ValueError, match="prepass_layout must be one of"):
        HighEntropyGlobalPolicyLossConfig(prepass_layout="micro")


@pytest.mark.parametrize("key,value,match", [
    ("clip_ratio_high", -0.1, r"clip_ratio_high must be finite and >= 0.*actor_rollout_ref.actor.clip_ratio_high"),
    ("clip_ratio_c", 1.0, r"clip_ratio_c must be finite and > 1.*actor_rollout_ref.actor.clip_ratio_c, e.g. =3.0"),
    ("clip_ratio_c", math.nan, r"clip_ratio_c must be finite and > 1"),
])
def test_bad_vanilla_knobs_for_high_entropy_global(key, value, match):
    from verl_klcov_global.config import read_high_entropy_settings

    with pytest.raises(ValueError, match=match):
        read_high_entropy_settings(_raw_actor(actor_fields={key: value}))


def test_unsupported_strategy_suggests_only_an_upstream_verl_registers(monkeypatch):
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    from verl_klcov_global.config import unsupported_strategy_message

    assert "use loss_mode=kl_cov (per-micro-batch" in unsupported_strategy_message("kl_cov_global", "kl_cov", "x")
    comparator = "high_entropy_per_micro_batch"
    monkeypatch.delitem(POLICY_LOSS_REGISTRY, comparator, raising=False)  # as in a user's process: the lab's only
    lab_only = unsupported_strategy_message("high_entropy_global", comparator, "x")
    assert comparator not in lab_only and "use another loss mode" in lab_only
    monkeypatch.setitem(POLICY_LOSS_REGISTRY, comparator, object())  # where the lab registered it, it is suggested
    assert f"use loss_mode={comparator}" in unsupported_strategy_message("high_entropy_global", comparator, "x")


# -- the common knobs, defined once (0.8.0) -------------------------------------------------------------------

#: Each class's own fields and their defaults as 0.7.0 wrote them out three times (beyond verl's PolicyLossConfig).
FIELDS_0_7_0 = {
    "KLCovGlobalPolicyLossConfig": dict(loss_mode="kl_cov_global", entropy_control_min_ratio=1e-05,
                                        entropy_control_max_ratio=0.02),  # the floor's bounds (after 0.8.0)
    "ClipCovGlobalPolicyLossConfig": dict(loss_mode="clip_cov_global", clip_cov_seed=0),
    "HighEntropyGlobalPolicyLossConfig": dict(loss_mode="high_entropy_global", entropy_top_ratio=0.2,
                                              entropy_control_min_ratio=0.01, entropy_control_max_ratio=1.0),
}
#: The common fields; the entropy floor (after 0.8.0) changed the defaults of ki (0.1), horizon (0) and window (8) and added
#: the hysteresis.
COMMON_0_7_0 = dict(prepass_layout="infer", entropy_target=None, entropy_control_ki=1.0, entropy_control_kp=10.0,
                    entropy_control_min_ratio=1e-05, entropy_control_max_ratio=0.05, entropy_control_horizon=8.0,
                    entropy_control_window=4, entropy_control_hysteresis=0.1)


@pytest.mark.parametrize("name", sorted(FIELDS_0_7_0))
def test_every_mode_class_has_0_7_0s_fields_and_defaults_from_the_one_definition(name):
    import dataclasses

    from verl.workers.config.actor import PolicyLossConfig

    from verl_klcov_global import config

    cls = getattr(config, name)
    assert issubclass(cls, config.GlobalModePolicyLossConfig)
    verls = {f.name for f in dataclasses.fields(PolicyLossConfig)}
    own = {f.name: f.default for f in dataclasses.fields(cls) if f.name not in verls or f.name == "loss_mode"}
    assert own == {**COMMON_0_7_0, **FIELDS_0_7_0[name]}
    assert cls.CONTROL_BOUNDS == (own["entropy_control_min_ratio"], own["entropy_control_max_ratio"])
    instance = cls()  # the defaults validate
    assert (instance.entropy_control_min_ratio, instance.entropy_control_max_ratio) == cls.CONTROL_BOUNDS


@pytest.mark.parametrize("name", sorted(FIELDS_0_7_0))
@pytest.mark.parametrize("key, value, message", [
    ("prepass_layout", "eager", "prepass_layout must be one of"),
    ("entropy_target", -1.0, "entropy_target"),
    ("entropy_control_window", 0, "entropy_control_window"),
])
def test_every_mode_class_validates_the_common_knobs_alike(name, key, value, message):
    from verl_klcov_global import config

    with pytest.raises(ValueError, match=message):
        getattr(config, name)(**{key: value})
