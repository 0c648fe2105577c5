"""Whole-config findings (``guardrails.py``) in the driver, on every route a user can take.

The routes are those of ``test_driver.py``: a plain ``loss_mode=`` override of verl's own
``ppo_trainer``, the plugin's ``configs/*.yaml``, and ``policy_loss._target_`` set by hand. Each
config is composed by Hydra as ``main_ppo`` composes it and goes through verl's own
``validate_config`` (the plugin's patch runs first): errors stop it with the plugin's
``TrainerConfigError``; warnings are ``GuardrailWarning`` and verl's own checks then pass (the run
goes on). The slow tests run the real ``python -m verl.trainer.main_ppo`` and measure the time to
each message (stopped before Ray, see there).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import warnings
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from verl_klcov_global import driver, guardrails

from .test_driver import PL, ROUTES, _compose
from .trainer_support import trainer
from .trainer_support.e2e import ray_started
from .trainer_support.env import REPO_ROOT, subprocess_env

ACTOR = "actor_rollout_ref.actor."
RC = "algorithm.rollout_correction."
#: Enough micro-batch settings for verl's own validate_config to pass on verl's defaults.
VALID = ["algorithm.adv_estimator=grpo", f"{ACTOR}ppo_micro_batch_size_per_gpu=4",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"]


@pytest.fixture
def valid(tiny_model_path):
    """:data:`VALID` plus a model verl's validate_config can read (it loads the model's config)."""
    return VALID + [f"actor_rollout_ref.model.path={tiny_model_path}"]


ON_POLICY = ["data.train_batch_size=64", f"{ACTOR}ppo_mini_batch_size=64", f"{ACTOR}ppo_epochs=1"]


def _validate(config) -> list[str]:
    """verl's validate_config as main_ppo calls it; the GuardrailWarnings it emitted."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.validate_trainer_config(config)
    return [str(w.message) for w in caught if issubclass(w.category, guardrails.GuardrailWarning)]


def _codes(config) -> list[str]:
    return [f.code for f in guardrails.findings(config)]


# -- bypass mode -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("mode", ["kl_cov_global", "clip_cov_global"])
def test_bypass_mode_with_rollout_correction_stops_the_driver_naming_both_ways_out(route, mode, valid):
    config = _compose(mode, route, valid + [f"{RC}bypass_mode=True", f"{RC}rollout_is=token", "trainer.use_v1=False"])
    with pytest.raises(driver.TrainerConfigError) as error:
        trainer.validate_trainer_config(config)
    text = str(error.value)
    assert text.startswith("verl-klcov-global: algorithm.rollout_correction.bypass_mode: "), text
    assert f"loss_mode={mode} would silently drop rollout_is=token" in text
    assert "Set algorithm.rollout_correction.bypass_mode=False (decoupled mode" in text
    assert "algorithm.rollout_correction.rollout_is=null" in text
    assert "rewrites loss_mode to 'bypass_mode' in the driver's copy" in text  # the legacy trainer's quirk, named


@pytest.mark.parametrize("setting", [f"{RC}rollout_rs=token_k1", f"{RC}loss_type=reinforce"])
def test_bypass_mode_error_names_every_dropped_setting_on_the_v1_trainer_too(setting, valid):
    config = _compose("kl_cov_global", "override", valid + [f"{RC}bypass_mode=True", setting])
    with pytest.raises(driver.TrainerConfigError, match=re.escape(f"would silently drop {setting.split('.')[-1]}")):
        trainer.validate_trainer_config(config)


@pytest.mark.parametrize("use_v1", [True, False])
def test_plain_bypass_mode_is_allowed_on_both_trainers(use_v1, valid):
    """verl 0.9.1 keeps the worker's loss mode on both trainers (test_guardrails_trainer.py runs the
    legacy one): bypass mode alone only takes the old log-probs from the rollout. No finding."""
    config = _compose("kl_cov_global", "override", valid + [f"{RC}bypass_mode=True", f"trainer.use_v1={use_v1}"])
    assert _validate(config) == []


# -- strictly on-policy KL-Cov ---------------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
def test_on_policy_kl_cov_warns_and_the_run_goes_on(route, valid):
    config = _compose("kl_cov_global", route, valid + ON_POLICY)
    (message,) = _validate(config)  # verl's own validate_config passed after the warning
    assert message.startswith("verl-klcov-global: actor_rollout_ref.actor.ppo_mini_batch_size: loss_mode=kl_cov_global")
    assert "every optimizer update is on-policy" in message and "has no effect" in message
    assert "ppo_mini_batch_size (e.g. =16: 4 minibatches per step)" in message
    assert "ppo_epochs >= 2" in message and "bypass_mode=True" in message


@pytest.mark.parametrize("extra, on_policy", [
    ([], True),
    ([f"{ACTOR}ppo_epochs=2"], False),                                        # the second epoch is off-policy
    ([f"{ACTOR}ppo_mini_batch_size=32"], False),                              # 2 minibatches per step
    ([f"{RC}bypass_mode=True"], False),                                       # old log-probs from the rollout
    ([f"{PL}ppo_kl_coef=0"], False),                                          # no penalty at all
    (["actor_rollout_ref.rollout.n=8"], True),                                # n multiplies both sizes
    ([f"{ACTOR}use_dynamic_bsz=True", f"{ACTOR}ppo_max_token_len_per_gpu=4096",
      "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=4096"], True),  # minibatches are still by prompts
    (["trainer.use_v1=False"], True),
])
def test_on_policy_condition(extra, on_policy):
    config = _compose("kl_cov_global", "override", VALID + ON_POLICY + extra)
    assert ("kl-cov-on-policy" in _codes(config)) is on_policy


def test_on_policy_is_kl_cov_only():
    """Clip-Cov detaches the gradient of the tokens it selects: it acts on-policy too."""
    assert _codes(_compose("clip_cov_global", "override", VALID + ON_POLICY)) == []


@pytest.mark.parametrize("trainer_v1, mini, expected", [
    ({"trainer_mode": "separate_async", "separate_async": {"parameter_sync_step": 1}}, 64, 1),
    ({"trainer_mode": "separate_async", "separate_async": {"parameter_sync_step": 4}}, 16, 4),  # one pi_old a cycle
    ({"trainer_mode": "colocate_async"}, 64, 1),
    ({"trainer_mode": "sync", "sync": {"parameter_sync_step": 2}}, 32, 1),  # old log-probs every local step
    ({"trainer_mode": "sync"}, 16, 4),
])
def test_updates_per_old_log_prob_pass_follows_the_v1_trainer_modes(trainer_v1, mini, expected):
    config = OmegaConf.create({"data": {"train_batch_size": 64},
                               "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": mini, "ppo_epochs": 1}},
                               "trainer": {"use_v1": True, "v1": trainer_v1}})
    assert guardrails.updates_per_old_log_prob_pass(config) == expected


# -- ratio units -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("mode, knob, paper", [("kl_cov_global", "kl_cov_ratio", "0.002 (0.20%) at 7B"),
                                               ("clip_cov_global", "clip_cov_ratio", "0.0002 (0.02%) at 7B and 32B")])
def test_ratio_of_a_percentage_warns_with_the_share_and_the_papers_values(route, mode, knob, paper, valid):
    config = _compose(mode, route, valid + [f"{PL}{knob}=0.2"])
    (message,) = _validate(config)
    assert message.startswith(f"verl-klcov-global: {PL}{knob}: {knob}=0.2 is a fraction, not a percentage: "
                              "it selects 20.00% of each optimizer minibatch's valid response tokens"), message
    assert paper in message
    assert "PRIME-RL's k_percent is a percentage" in message and "SkyRL's kl_cov_frac" in message
    assert f"set {PL}{knob}=0.002" in message


@pytest.mark.parametrize("value, warned", [(0.049, False), (0.05, True), (1.0, True), (0.002, False)])
def test_ratio_threshold(value, warned):
    config = _compose("kl_cov_global", "override", VALID + [f"{PL}kl_cov_ratio={value}"])
    assert ("ratio-units" in _codes(config)) is warned


def test_shipped_configs_have_no_findings(valid):
    for mode in ("kl_cov_global", "clip_cov_global"):
        assert _validate(_compose(mode, "configs_yaml", valid)) == []


def test_warnings_can_be_filtered_by_their_class():
    config = _compose("kl_cov_global", "override", VALID + [f"{PL}kl_cov_ratio=0.2"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=guardrails.GuardrailWarning)
        driver.prepare_trainer_config(config)
    assert not [w for w in caught if "verl-klcov-global" in str(w.message)]


# -- prepass_layout=old (pi_old's statistics) -----------------------------------------------------------

OLD = [f"{PL}prepass_layout=old"]


@pytest.mark.parametrize("mode", ["kl_cov_global", "clip_cov_global", "high_entropy_global"])
def test_old_policy_layout_with_bypass_mode_stops_the_driver(mode, valid):
    """bypass_mode runs no actor log-prob pass: the old log-probs are the rollout engine's, not pi_old's."""
    config = _compose(mode, "configs_yaml", valid + OLD + [f"{RC}bypass_mode=True"])
    with pytest.raises(driver.TrainerConfigError) as error:
        trainer.validate_trainer_config(config)
    text = str(error.value)
    assert text.startswith("verl-klcov-global: actor_rollout_ref.actor.policy_loss.prepass_layout: "), text
    assert "bypass_mode=True runs no actor log-prob pass" in text
    assert "Set actor_rollout_ref.actor.policy_loss.prepass_layout=infer" in text and "bypass_mode=False" in text


V1 = ["trainer.use_v1=True"]


@pytest.mark.parametrize("mode, extra, refused", [
    ("high_entropy_global", V1 + ["trainer.v1.trainer_mode=colocate_async"], True),   # the selection reads entropy
    ("high_entropy_global", V1 + ["trainer.v1.trainer_mode=separate_async"], True),
    ("kl_cov_global", V1 + ["trainer.v1.trainer_mode=colocate_async", f"{PL}entropy_target=2.0"], True),  # controller
    ("clip_cov_global", V1 + ["trainer.v1.trainer_mode=separate_async", f"{PL}entropy_target=2.0"], True),
    ("kl_cov_global", V1 + ["trainer.v1.trainer_mode=colocate_async"], False),  # reads old_log_probs only
    ("high_entropy_global", V1 + ["trainer.v1.trainer_mode=sync"], False),      # the pass is kept there
    ("high_entropy_global", ["trainer.use_v1=False"], False),
    ("kl_cov_global", ["trainer.use_v1=False", f"{PL}entropy_target=2.0"], False),
])
def test_old_policy_layout_that_reads_entropy_is_refused_where_the_pass_is_not_kept(mode, extra, refused):
    config = _compose(mode, "configs_yaml", VALID + OLD + extra)
    codes = _codes(config)
    assert ("old-policy-entropy-not-kept" in codes) is refused, codes
    if refused:
        with pytest.raises(driver.TrainerConfigError, match=r"reads pi_old's entropy .* set "
                                                           r"actor_rollout_ref.actor.policy_loss.prepass_layout=infer"
                           .replace(" set ", ".*Set ")):
            driver.check_trainer_config(config)


def test_old_policy_layout_itself_has_no_finding(valid):
    for mode in ("kl_cov_global", "clip_cov_global", "high_entropy_global"):
        assert _validate(_compose(mode, "configs_yaml", valid + OLD)) == []


# -- the real main_ppo -----------------------------------------------------------------------------------


def _main_ppo(tiny_model_path, overrides, marker: str):
    """Run main_ppo; (its output, seconds to the first line holding ``marker`` (None if none), seconds in all)."""
    argv = [sys.executable, "-m", "verl.trainer.main_ppo", "algorithm.adv_estimator=grpo",
            f"actor_rollout_ref.model.path={tiny_model_path}", "trainer.n_gpus_per_node=1", "trainer.device=cpu",
            *overrides]
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=subprocess_env(PYTHONUNBUFFERED="1"))
    lines, first = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if first is None and marker in line:
                first = time.monotonic() - start
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return SimpleNamespace(returncode=proc.returncode, stdout="".join(lines)), first, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.needs_driver_validate_config  # verl 0.8's main_ppo calls validate_config in the TaskRunner, after ray.init
def test_main_ppo_bypass_mode_error_before_ray_starts(tiny_model_path):
    proc, seconds, _ = _main_ppo(tiny_model_path, [f"{PL}loss_mode=kl_cov_global", "trainer.use_v1=False",
                                                   f"{RC}bypass_mode=True", f"{RC}rollout_is=token"],
                                 "TrainerConfigError")
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "TrainerConfigError: verl-klcov-global: algorithm.rollout_correction.bypass_mode: bypass_mode=True with " \
           "loss_mode=kl_cov_global would silently drop rollout_is=token" in proc.stdout, proc.stdout[-3000:]
    assert not ray_started(proc.stdout), proc.stdout[-3000:]
    line = next(line for line in proc.stdout.splitlines() if "TrainerConfigError" in line)
    print(f"time to the error: {seconds:.1f} s\n{line}")


@pytest.mark.slow
@pytest.mark.needs_driver_validate_config
def test_main_ppo_refuses_the_old_policy_layout_in_bypass_mode_before_ray_starts(tiny_model_path):
    proc, seconds, _ = _main_ppo(tiny_model_path, [f"{PL}loss_mode=high_entropy_global", f"+{PL}prepass_layout=old",
                                                   f"{RC}bypass_mode=True"], "TrainerConfigError")
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "TrainerConfigError: verl-klcov-global: actor_rollout_ref.actor.policy_loss.prepass_layout: " \
           "prepass_layout=old selects from pi_old" in proc.stdout, proc.stdout[-3000:]
    assert not ray_started(proc.stdout), proc.stdout[-3000:]
    print(f"time to the error: {seconds:.1f} s")


@pytest.mark.slow
@pytest.mark.needs_driver_validate_config
def test_main_ppo_prints_the_warnings_by_default(tiny_model_path):
    """Both warnings, printed with Python's default filters; then verl's own validate_config goes on and
    stops at its own check (no micro-batch size set: so the run ends before Ray, cheaply)."""
    proc, seconds, total = _main_ppo(tiny_model_path, [f"{PL}loss_mode=kl_cov_global", f"{PL}kl_cov_ratio=0.2",
                                                       "data.train_batch_size=64", f"{ACTOR}ppo_mini_batch_size=64"],
                                     "GuardrailWarning")
    out = proc.stdout
    assert "GuardrailWarning: verl-klcov-global: actor_rollout_ref.actor.ppo_mini_batch_size: loss_mode=kl_cov_global" \
        in out, out[-3000:]
    assert "GuardrailWarning: verl-klcov-global: actor_rollout_ref.actor.policy_loss.kl_cov_ratio: kl_cov_ratio=0.2 " \
           "is a fraction" in out, out[-3000:]
    # the warnings did not stop the run: verl's own check came after them
    assert "ppo_micro_batch_size_per_gpu' if use_dynamic_bsz is not enabled" in out, out[-3000:]
    assert out.index("GuardrailWarning") < out.index("ppo_micro_batch_size_per_gpu' if use_dynamic_bsz")
    assert not ray_started(out), out[-3000:]
    print(f"time to the first warning: {seconds:.1f} s (to verl's own error after them: {total:.1f} s)\n"
          + "\n".join(l for l in out.splitlines() if "GuardrailWarning" in l))


# -- diagnose --config-name ------------------------------------------------------------------------------


@pytest.mark.parametrize("config_name, mode", [("kl_cov_global", "kl_cov_global"), ("ppo_trainer", "kl_cov")])
def test_diagnose_config_name_reports_the_same_findings_in_notes_and_json(monkeypatch, config_name, mode):
    """The plugin's config, and verl's own with upstream kl_cov (the findings its _global mode would get)."""
    from verl_klcov_global.diagnose.user_config import plan_for

    monkeypatch.chdir(REPO_ROOT)
    overrides = ON_POLICY + [f"{PL}kl_cov_ratio=0.2", f"{RC}bypass_mode=True", f"{RC}rollout_rs=token_k1"]
    if mode != "kl_cov_global":
        overrides.append(f"{PL}loss_mode={mode}")
    plan = plan_for(None, config_name, overrides, device="cpu")
    codes = [f["code"] for f in plan.to_json()["findings"]]
    # bypass mode: no on-policy warning (old log-probs from the rollout), but the dropped RS is an error
    assert codes == ["bypass-ignores-rollout-correction", "ratio-units"], codes
    composed = trainer.compose_trainer_config(
        overrides if mode == "kl_cov_global" else [o.replace(f"={mode}", "=kl_cov_global") for o in overrides],
        plugin_config=mode == "kl_cov_global")
    assert [f.to_json() for f in guardrails.findings(composed)] == plan.findings  # the driver's own findings
    notes = [n for n in plan.notes if "verl-klcov-global: " in n]
    assert notes[0].startswith("error: verl-klcov-global: algorithm.rollout_correction.bypass_mode: ")
    assert notes[1].startswith("warning: verl-klcov-global: actor_rollout_ref.actor.policy_loss.kl_cov_ratio: ")
