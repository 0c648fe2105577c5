"""Driver-side checks (``driver.py``, PATCH ``validate_config_driver_checks``) on configs composed like ``main_ppo``.

Every knob of both plugin modes, on every route a user can take -- a plain ``loss_mode=`` override of
verl's own ``ppo_trainer`` (verl's ``PolicyLossConfig``, no ``_target_``), the plugin's
``configs/*.yaml``, and ``policy_loss._target_`` set by hand on verl's config -- fails in verl's
``validate_config`` with the plugin's error (not verl's, not a coerced value) naming the key. The
last test runs the real ``python -m verl.trainer.main_ppo`` and checks the error comes before Ray.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf

from verl_klcov_global import driver
from verl_klcov_global.install_hint import INSTALL_HINT

from .trainer_support import trainer
from .trainer_support.e2e import ray_started
from .trainer_support.env import REPO_ROOT, subprocess_env

PL = "actor_rollout_ref.actor.policy_loss."
ROUTES = ("override", "configs_yaml", "target")
CONFIG_CLASS = {"kl_cov_global": "verl_klcov_global.config.KLCovGlobalPolicyLossConfig",
                "clip_cov_global": "verl_klcov_global.config.ClipCovGlobalPolicyLossConfig"}


def _compose(mode: str, route: str, overrides: list[str]):
    """The config main_ppo would get for ``mode`` on ``route``, plus ``overrides``."""
    if route == "configs_yaml":
        from hydra import compose, initialize_config_dir

        with initialize_config_dir(config_dir=trainer.CONFIG_DIR, version_base=None):
            return compose(config_name=mode, overrides=overrides)
    base = [f"{PL}loss_mode={mode}"]
    if route == "target":
        base.append(f"{PL}_target_={CONFIG_CLASS[mode]}")
    return trainer.compose_trainer_config(base + overrides, plugin_config=False)


def _knob(route: str, key: str, value: str, *, plugin_only: bool = False) -> str:
    """Override of ``key``; a key verl's PolicyLossConfig lacks must be added with ``+`` unless the yaml has it."""
    section = "actor_rollout_ref.actor." if key.startswith("clip_ratio") else PL
    plus = "+" if plugin_only and route != "configs_yaml" else ""
    return f"{plus}{section}{key}={value}"


BAD = [  # (mode, key, value, plugin_only, what the error says)
    ("kl_cov_global", "kl_cov_ratio", "true", False, r"kl_cov_ratio must be finite and in \(0, 1\], got True"),
    ("kl_cov_global", "kl_cov_ratio", "1.5", False, r"got 1\.5"),
    ("kl_cov_global", "kl_cov_ratio", "0", False, r"got 0"),
    ("kl_cov_global", "kl_cov_ratio", "inf", False, r"got inf"),
    ("kl_cov_global", "kl_cov_ratio", "'0.1'", False, r"got '0\.1'"),
    ("kl_cov_global", "ppo_kl_coef", "false", False, r"ppo_kl_coef must be finite and >= 0, got False"),
    ("kl_cov_global", "ppo_kl_coef", "nan", False, r"got nan"),
    ("kl_cov_global", "ppo_kl_coef", "-1", False, r"got -1"),
    ("kl_cov_global", "prepass_layout", "batch", True, r"prepass_layout must be one of \('infer', 'train', 'old'\)"),
    ("clip_cov_global", "clip_cov_ratio", "true", False, r"clip_cov_ratio must be finite and in \(0, 1\], got True"),
    ("clip_cov_global", "clip_cov_ratio", "2", False, r"got 2"),
    ("clip_cov_global", "clip_cov_lb", "-inf", False, r"clip_cov_lb must be a finite number, got -inf"),
    ("clip_cov_global", "clip_cov_ub", "'5'", False, r"clip_cov_ub must be a finite number, got '5'"),
    ("clip_cov_global", "clip_cov_lb", "6.0", False, r"clip_cov_lb"),
    ("clip_cov_global", "clip_cov_seed", "true", True, r"clip_cov_seed must be an integer in \[0, 2\*\*53\), got True"),
    ("clip_cov_global", "clip_cov_seed", "0.5", True, r"got 0\.5"),
    ("clip_cov_global", "clip_cov_seed", "-1", True, r"got -1"),
    ("clip_cov_global", "prepass_layout", "'train '", True, r"prepass_layout must be one of"),
    ("clip_cov_global", "clip_ratio_low", "true", False, r"clip_ratio_low must be finite and >= 0, got True"),
    ("clip_cov_global", "clip_ratio_high", "nan", False, r"clip_ratio_high must be finite and >= 0, got nan"),
]


# A key verl's own PolicyLossConfig lacks (prepass_layout, clip_cov_seed) exists only with the plugin's class.
CASES = [(route, *case) for case in BAD for route in ROUTES if not (case[3] and route == "override")]


@pytest.mark.parametrize("route, mode, key, value, plugin_only, message", CASES,
                         ids=[f"{r}-{m}-{k}={v}" for r, m, k, v, _, _ in CASES])
def test_bad_knob_fails_in_verls_validate_config_with_the_key_on_every_route(route, mode, key, value, plugin_only,
                                                                            message):
    config = _compose(mode, route, [_knob(route, key, value, plugin_only=plugin_only)])
    with pytest.raises(driver.TrainerConfigError, match=f"(?s)^verl-klcov-global: loss_mode={mode}: .*{message}") as error:
        trainer.validate_trainer_config(config)  # verl's validate_config, as main_ppo calls it
    assert re.search(rf"set actor_rollout_ref\.actor\.(policy_loss\.)?{key}", str(error.value)), error.value


@pytest.mark.parametrize("mode", ["kl_cov_global", "clip_cov_global"])
def test_megatron_strategy_is_refused_in_the_driver(mode):
    config = _compose(mode, "override", ["actor_rollout_ref.actor.strategy=megatron"])
    with pytest.raises(driver.TrainerConfigError, match="actor_rollout_ref.actor.strategy=fsdp2"):
        driver.prepare_trainer_config(config)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("mode", ["kl_cov_global", "clip_cov_global"])
def test_good_config_gets_the_worker_loader_in_its_ray_runtime_env(monkeypatch, route, mode):
    monkeypatch.setenv(driver.EXTERNAL_MODULES_ENV, "my_platform_plugin")
    monkeypatch.delenv(driver.AUTOLOAD_ENV, raising=False)
    config = _compose(mode, route, [])
    assert driver.prepare_trainer_config(config) == mode
    assert driver.prepare_trainer_config(config) == mode  # idempotent
    runtime_env = config.ray_kwargs.ray_init.runtime_env
    assert list(runtime_env.py_modules) == [driver.WORKER_LOADER_DIR]
    # The driver's own VERL_USE_EXTERNAL_MODULES is kept: the runtime env's value replaces it in the workers.
    assert runtime_env.env_vars[driver.EXTERNAL_MODULES_ENV] == "my_platform_plugin,verl_klcov_global_loader"
    assert runtime_env.env_vars[driver.REQUIRED_BY_ENV].startswith(f"{PL}loss_mode={mode} (driver: verl-klcov-global ")
    assert runtime_env.env_vars[driver.INSTALL_HINT_ENV] == INSTALL_HINT  # for the loader's message


def test_runtime_env_modules_from_the_config_are_kept_and_autoload_can_be_turned_off(monkeypatch):
    monkeypatch.delenv(driver.EXTERNAL_MODULES_ENV, raising=False)
    config = _compose("kl_cov_global", "override",
                      ["+ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES='a,b'",
                       "+ray_kwargs.ray_init.runtime_env.py_modules=[/x/y]"])
    driver.prepare_trainer_config(config)
    runtime_env = config.ray_kwargs.ray_init.runtime_env
    assert runtime_env.env_vars[driver.EXTERNAL_MODULES_ENV] == "a,b,verl_klcov_global_loader"
    assert list(runtime_env.py_modules) == ["/x/y", driver.WORKER_LOADER_DIR]

    monkeypatch.setenv(driver.AUTOLOAD_ENV, "0")
    config = _compose("kl_cov_global", "override", [])
    driver.prepare_trainer_config(config)
    # verl 0.9's config has an empty runtime_env, 0.8's none at all: either way nothing was added
    assert "env_vars" not in (OmegaConf.select(config, "ray_kwargs.ray_init.runtime_env") or {})


def test_other_loss_modes_are_left_alone():
    config = _compose("vanilla", "override", [f"{PL}kl_cov_ratio=true"])
    before = OmegaConf.to_container(config.ray_kwargs)
    assert driver.prepare_trainer_config(config) is None
    assert OmegaConf.to_container(config.ray_kwargs) == before


def test_the_patch_wraps_verls_validate_config_with_the_expected_signature():
    import inspect

    import verl.utils.config as verl_config

    original = getattr(verl_config.validate_config, "__verl_klcov_global_original__", None)
    assert original is not None, "PATCH validate_config_driver_checks is not installed"
    assert list(inspect.signature(original).parameters) == ["config", "use_reference_policy", "use_critic"]


@pytest.mark.slow
@pytest.mark.needs_driver_validate_config  # verl 0.8's main_ppo calls validate_config in the TaskRunner, after ray.init
def test_main_ppo_plain_override_bad_knob_fails_before_ray_starts(tiny_model_path):
    """A boolean knob: ``kl_cov_ratio=true`` as a plain override used to train with ratio 1.0."""
    argv = [sys.executable, "-m", "verl.trainer.main_ppo", "algorithm.adv_estimator=grpo",
            f"{PL}loss_mode=kl_cov_global", f"{PL}kl_cov_ratio=true",
            f"actor_rollout_ref.model.path={tiny_model_path}", "trainer.n_gpus_per_node=1", "trainer.device=cpu"]
    start = time.monotonic()
    proc = subprocess.run(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300, env=subprocess_env())
    seconds = time.monotonic() - start
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "verl-klcov-global: loss_mode=kl_cov_global: kl_cov_ratio must be finite and in (0, 1], got True" \
        in proc.stdout, proc.stdout[-3000:]
    assert "set actor_rollout_ref.actor.policy_loss.kl_cov_ratio" in proc.stdout
    assert not ray_started(proc.stdout), proc.stdout[-3000:]
    print(f"time to the error: {seconds:.1f} s")


# -- the same errors where verl's trainer is built (PATCH trainer_config_checks) ---------------------------------

RC = "algorithm.rollout_correction."
TRAINER_BAD = {  # what an entry point that never calls validate_config must still be refused for, and the key named
    "bypass-with-rollout-is": ([f"{RC}bypass_mode=True", f"{RC}rollout_is=token"], f"{RC}bypass_mode"),
    "bad-knob": ([f"{PL}kl_cov_ratio=1.5"], f"set {PL}kl_cov_ratio"),
}


def _verls_trainers():
    """(name, overrides that choose it, build(config)) for verl's trainers: the legacy RayPPOTrainer, and the v1 sync
    trainer where verl has it (verl 0.8.0 has neither the v1 trainer nor the ``trainer.use_v1`` key)."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    def legacy(config):
        return RayPPOTrainer(config=config, tokenizer=None, role_worker_mapping={}, resource_pool_manager=None)

    try:
        from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
    except ImportError:  # verl 0.8.0
        return [("legacy", [], legacy)]
    return [("legacy", ["trainer.use_v1=False"], legacy),
            ("v1-sync", ["trainer.use_v1=True"], lambda config: PPOTrainerSync(config=config))]


def _frames_in_verl(error: BaseException) -> list[str]:
    import traceback

    import verl

    verl_dir = verl.__path__[0]
    return [f"{frame.filename}:{frame.name}" for frame in traceback.extract_tb(error.__traceback__)
            if frame.filename.startswith(verl_dir)]


@pytest.mark.parametrize("case", sorted(TRAINER_BAD))
def test_an_entry_point_that_skips_validate_config_is_refused_when_it_builds_verls_trainer(case):
    overrides, key = TRAINER_BAD[case]
    for name, choose, build in _verls_trainers():
        config = _compose("kl_cov_global", "override", overrides + choose)
        with pytest.raises(driver.TrainerConfigError) as in_driver:
            driver.check_trainer_config(config)
        with pytest.raises(driver.TrainerConfigError) as in_trainer:
            build(config)
        assert str(in_trainer.value) == str(in_driver.value), name
        assert key in str(in_trainer.value), (name, in_trainer.value)
        assert _frames_in_verl(in_trainer.value) == [], f"{name}: verl's own __init__ ran before the check"


def test_a_good_config_reaches_verls_trainer_and_the_trainer_check_does_not_repeat_warnings():
    import warnings

    from verl_klcov_global.guardrails import GuardrailWarning

    # one minibatch per step, ppo_epochs=1: the driver warns kl-cov-on-policy
    name, choose, build = _verls_trainers()[0]
    config = _compose("kl_cov_global", "override",
                      ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8", *choose])
    with pytest.warns(GuardrailWarning, match="kl-cov|on-policy|penalty"):
        driver.check_trainer_config(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GuardrailWarning)
        assert driver.check_in_trainer(config) == "kl_cov_global"
    try:
        build(config)  # None for the tokenizer and the workers: verl's own __init__ may stop on them, past the check
    except driver.TrainerConfigError:
        raise
    except Exception as error:
        assert _frames_in_verl(error), f"{type(error).__name__} raised outside verl's {name} trainer: {error}"
