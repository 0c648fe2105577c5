"""Guardrails of ``high_entropy_global``: its ratio's units, ratio 1, and ``entropy_coeff``.

Composed by Hydra as ``main_ppo`` composes (the packaged ``high_entropy_global.yaml``, or a plain
``loss_mode=`` override with the config class set by ``_target_``) and run through verl's own
``validate_config`` with the plugin's patch, as ``test_guardrails.py`` does for the other modes.
"""

from __future__ import annotations

import pytest

from verl_klcov_global import driver, guardrails
from verl_klcov_global.methods.clip_cov.row import CLIP_COV
from verl_klcov_global.methods.high_entropy.row import HIGH_ENTROPY
from verl_klcov_global.methods.kl_cov.row import KL_COV

from .test_guardrails import VALID, _validate
from .trainer_support import trainer

PL = "actor_rollout_ref.actor.policy_loss."
MODE = "high_entropy_global"
ROUTES = ("configs_yaml", "target")


def _compose(route: str, overrides: list[str]):
    if route == "configs_yaml":
        from hydra import compose, initialize_config_dir

        with initialize_config_dir(config_dir=trainer.CONFIG_DIR, version_base=None):
            return compose(config_name=MODE, overrides=overrides)
    base = [f"{PL}loss_mode={MODE}", f"{PL}_target_=verl_klcov_global.config.HighEntropyGlobalPolicyLossConfig"]
    overrides = [f"+{o}" if o.startswith(f"{PL}entropy_top_ratio") else o for o in overrides]
    return trainer.compose_trainer_config(base + overrides, plugin_config=False)


@pytest.fixture
def valid(tiny_model_path):
    return VALID + [f"actor_rollout_ref.model.path={tiny_model_path}"]


def test_the_ratio_warning_threshold_is_per_mode():
    assert (KL_COV.ratio_warning, CLIP_COV.ratio_warning) == (guardrails.RATIO_WARNING,) * 2
    assert HIGH_ENTROPY.ratio_warning is None and HIGH_ENTROPY.ratio_one_is_vanilla
    assert not (KL_COV.ratio_one_is_vanilla or CLIP_COV.ratio_one_is_vanilla)  # ratio 1 penalises/cuts every token


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("value", [0.2, 0.5, 0.05, 0.99])
def test_the_papers_value_and_other_fractions_give_no_finding(route, value, valid):
    config = _compose(route, valid + [f"{PL}entropy_top_ratio={value}"])
    assert guardrails.findings(config) == [] and _validate(config) == []


@pytest.mark.parametrize("route", ROUTES)
def test_twenty_meant_as_percent_stops_the_driver_naming_the_key_and_the_fraction(route, valid):
    config = _compose(route, valid + [f"{PL}entropy_top_ratio=20"])
    with pytest.raises(driver.TrainerConfigError) as caught:
        trainer.validate_trainer_config(config)
    message = str(caught.value)
    assert f"{PL}entropy_top_ratio" in message and "fraction" in message and "20%" in message, message
    # the whole-config finding (diagnose --config-name reports it too) says what 20 would mean
    (finding,) = guardrails.findings(config)
    assert (finding.severity, finding.code, finding.key) == ("error", "ratio-is-percentage", f"{PL}entropy_top_ratio")
    assert "not a percentage" in finding.message and f"set {PL}entropy_top_ratio=0.2" in finding.fix


@pytest.mark.parametrize("route", ROUTES)
def test_ratio_one_warns_that_it_is_vanilla_plus_a_prepass_and_the_run_goes_on(route, valid):
    config = _compose(route, valid + [f"{PL}entropy_top_ratio=1"])
    (message,) = _validate(config)
    assert message.startswith(f"verl-klcov-global: {PL}entropy_top_ratio: entropy_top_ratio=1 selects every valid "
                              f"token: loss_mode={MODE} then updates exactly as verl's vanilla loss"), message
    assert "the paper's value is 0.2" in message and "loss_mode=vanilla" in message


def test_kl_cov_keeps_its_units_warning_at_the_value_that_is_silent_here():
    config = trainer.compose_trainer_config(
        VALID + [f"{PL}loss_mode=kl_cov_global", f"{PL}kl_cov_ratio=0.2"], plugin_config=False)
    assert [f.code for f in guardrails.findings(config)] == ["ratio-units"]


@pytest.mark.parametrize("route", ROUTES)
def test_entropy_coeff_with_this_mode_is_legal(route, valid):
    """verl adds -entropy_coeff * entropy over all valid tokens; the mask gates only the policy gradient."""
    config = _compose(route, valid + ["actor_rollout_ref.actor.entropy_coeff=0.01"])
    assert guardrails.findings(config) == [] and _validate(config) == []
