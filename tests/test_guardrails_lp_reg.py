"""``lp_reg_global``'s knobs and whole-config findings, before Ray (composed as ``main_ppo`` composes, checked by the
driver's own check): every knob validated with its key named; no log-prob pass (``bypass_mode``), a trainer whose
pass the plugin does not keep, and fused kernels (no logits for the proxy) are errors; verl's ``ppo_trainer`` with
the plugin's class through ``_target_`` and no knob set gives no finding (and the authors' values,
tests/test_loss_routes.py)."""

from __future__ import annotations

import pytest

from verl_klcov_global import driver, guardrails

from .test_guardrails import VALID
from .trainer_support import trainer

PL = "actor_rollout_ref.actor.policy_loss."


def _compose(overrides: list[str]):
    base = [f"{PL}loss_mode=lp_reg_global", f"{PL}_target_=verl_klcov_global.config.LpRegGlobalPolicyLossConfig"]
    overrides = [f"+{o}" if o.startswith(f"{PL}lp_reg_") or o.startswith(f"{PL}prepass_layout") else o
                 for o in overrides]
    return trainer.compose_trainer_config(base + overrides, plugin_config=False)


def _codes(config):
    return sorted(finding.code for finding in guardrails.findings(config))


@pytest.fixture
def valid(tiny_model_path):
    return VALID + [f"actor_rollout_ref.model.path={tiny_model_path}"]


def test_the_target_route_with_no_knob_set_gives_no_finding(valid):
    config = _compose(valid)
    assert _codes(config) == []
    assert driver.check_trainer_config(config) == "lp_reg_global"


@pytest.mark.parametrize("knob, value, words", [
    ("lp_reg_neg_ratio", 1.5, "in [0, 1]"), ("lp_reg_pos_ratio", -0.1, "in [0, 1]"),
    ("lp_reg_min_p", 1.0, "in [0, 1)"), ("lp_reg_min_p", "nan", "finite"), ("lp_reg_neg_ratio", 0.0, "both 0"),
    ("lp_reg_kl_coef", -1.0, ">= 0"), ("lp_reg_kl_coef", "nan", "finite"),
    # beta is lp_reg_kl_coef: a ppo_kl_coef other than verl's 0.1 would be a beta the run does not get
    ("ppo_kl_coef", 1.0, "lp_reg_kl_coef=1.0"), ("ppo_kl_coef", 0.5, "does not read"),
])
def test_a_bad_knob_stops_the_driver_naming_it(valid, knob, value, words):
    config = _compose(valid + [f"{PL}{knob}={value}"])
    with pytest.raises(driver.TrainerConfigError) as caught:
        driver.check_trainer_config(config)
    assert knob in str(caught.value) and words in str(caught.value), str(caught.value)


def test_the_entropy_controller_is_refused(valid):
    config = _compose(valid + [f"+{PL}entropy_target=0.5"])
    with pytest.raises(driver.TrainerConfigError, match="entropy_target.*lp_reg_global does not have"):
        driver.check_trainer_config(config)


@pytest.mark.parametrize("overrides, code, key", [
    (["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_is=null"],
     "proxy-without-log-prob-pass", "algorithm.rollout_correction.bypass_mode"),
    (["trainer.use_v1=true", "trainer.v1.trainer_mode=separate_async"], "proxy-not-kept", "trainer.v1.trainer_mode"),
    (["actor_rollout_ref.model.use_fused_kernels=true"], "proxy-without-logits",
     "actor_rollout_ref.model.use_fused_kernels"),
])
def test_where_the_proxy_cannot_be_computed_the_driver_stops(valid, overrides, code, key):
    config = _compose(valid + overrides)
    assert code in _codes(config)
    with pytest.raises(driver.TrainerConfigError, match=key.replace(".", r"\.")):
        driver.check_trainer_config(config)
