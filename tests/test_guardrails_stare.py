"""``stare_global``'s knobs and whole-config findings, before Ray: composed by Hydra as ``main_ppo`` composes (a
``loss_mode=`` override with the config class set by ``_target_``) and checked by the driver's own check.

* every knob is validated with its key named (P in [0, 1], W >= 1, 0 < M <= 1, the variant, and with the schedule
  m_min <= M <= 1 <= W <= w_max); the sum ``loss_agg_mode`` values are refused (the gate would compare a sum with a
  per-token target), and so is ``seq-mean-token-sum-norm`` with or without ``loss_scale_factor`` (the authors' fork
  and verl aggregate the gate's entropy there into two different figures, neither per token);
* ``bypass_mode`` (no log-prob pass, so no batch entropy) and a trainer whose pass the plugin does not see are
  errors; settings that make the mode a no-op, an unused M, a state that a resume would lose and the critic warm-up
  are warnings;
* the paper's defaults give no finding.
"""

from __future__ import annotations

import pytest

from verl_klcov_global import driver, guardrails
from verl_klcov_global.config import StareGlobalPolicyLossConfig, read_stare_settings
from verl_klcov_global.methods.stare.row import STARE

from .test_guardrails import VALID
from .trainer_support import trainer

PL = "actor_rollout_ref.actor.policy_loss."
ACTOR = "actor_rollout_ref.actor."


def _compose(overrides: list[str]):
    base = [f"{PL}loss_mode=stare_global", f"{PL}_target_=verl_klcov_global.config.StareGlobalPolicyLossConfig"]
    overrides = [f"+{o}" if o.startswith(f"{PL}stare_") or o.startswith(f"{PL}prepass_layout") else o
                 for o in overrides]
    return trainer.compose_trainer_config(base + overrides, plugin_config=False)


def _codes(config):
    return sorted(finding.code for finding in guardrails.findings(config))


@pytest.fixture
def valid(tiny_model_path):
    return VALID + [f"actor_rollout_ref.model.path={tiny_model_path}"]


def test_the_papers_defaults_give_no_finding(valid):
    config = _compose(valid)
    assert _codes(config) == []
    assert driver.check_trainer_config(config) == "stare_global"


@pytest.mark.parametrize("knob, value, words", [
    ("stare_top_ratio", 1.5, "in [0, 1]"), ("stare_top_ratio", 10, "in [0, 1]"),
    ("stare_reweight_w", 0.9, ">= 1"), ("stare_reweight_m", 0.0, "(0, 1]"), ("stare_reweight_m", 1.2, "(0, 1]"),
    ("stare_variant", "O2", "O1"), ("stare_alpha", -0.1, ">= 0"), ("stare_w_max", 0.5, ">= 1"),
    ("stare_target_entropy", "nan", "finite"),
])
def test_a_bad_knob_stops_the_driver_naming_it(valid, knob, value, words):
    config = _compose(valid + [f"{PL}{knob}={value}"])
    with pytest.raises(driver.TrainerConfigError) as caught:
        driver.check_trainer_config(config)
    assert f"{PL}{knob}" in str(caught.value) and words in str(caught.value), str(caught.value)


def test_the_schedule_must_start_inside_its_bounds(valid):
    config = _compose(valid + [f"{PL}stare_adaptive=true", f"{PL}stare_reweight_w=1.6"])
    with pytest.raises(driver.TrainerConfigError, match="stare_w_max"):
        driver.check_trainer_config(config)
    with pytest.raises(ValueError, match="stare_m_min"):
        StareGlobalPolicyLossConfig(stare_adaptive=True, stare_reweight_m=0.4)
    StareGlobalPolicyLossConfig(stare_adaptive=False, stare_reweight_m=0.4)  # no schedule: no bounds to start in


@pytest.mark.parametrize("mode", ["token-sum", "seq-mean-token-sum"])
def test_a_sum_loss_agg_mode_is_refused_naming_the_key(valid, mode):
    config = _compose(valid + [f"{ACTOR}loss_agg_mode={mode}"])
    with pytest.raises(driver.TrainerConfigError) as caught:
        driver.check_trainer_config(config)
    assert f"{ACTOR}loss_agg_mode" in str(caught.value) and "sum" in str(caught.value)


@pytest.mark.parametrize("scale", [[], [f"{ACTOR}loss_scale_factor=512"]], ids=["no scale", "loss_scale_factor"])
def test_seq_mean_token_sum_norm_is_refused_with_the_reason(valid, scale):
    config = _compose(valid + [f"{ACTOR}loss_agg_mode=seq-mean-token-sum-norm"] + scale)
    with pytest.raises(driver.TrainerConfigError, match=r"padded width.*neither is a per-token entropy.*loss_agg_mode=token-mean"):
        driver.check_trainer_config(config)


def test_seq_mean_token_mean_is_accepted(valid):
    config = _compose(valid + [f"{ACTOR}loss_agg_mode=seq-mean-token-mean"])
    assert driver.check_trainer_config(config) == "stare_global"


def test_bypass_mode_runs_no_log_prob_pass_and_is_an_error(valid):
    config = _compose(valid + ["algorithm.rollout_correction.bypass_mode=true",
                               "algorithm.rollout_correction.rollout_is=null"])
    assert "batch-entropy-without-log-prob-pass" in _codes(config)
    with pytest.raises(driver.TrainerConfigError, match="algorithm.rollout_correction.bypass_mode"):
        driver.check_trainer_config(config)


def test_a_trainer_whose_pass_the_plugin_does_not_see_is_an_error(valid):
    config = _compose(valid + ["trainer.use_v1=true", "trainer.v1.trainer_mode=separate_async"])
    assert "batch-entropy-not-kept" in _codes(config)


@pytest.mark.parametrize("overrides, code", [
    ([f"{PL}stare_reweight_w=1.0"], "stare-weights-one"),
    ([f"{PL}stare_top_ratio=0.0"], "stare-selects-nothing"),
    ([f"{PL}stare_target_entropy=0.0"], "stare-gate-never-opens"),
    ([f"{PL}stare_target_entropy=-1.0"], "stare-gate-never-opens"),
    ([f"{PL}stare_reweight_m=0.8"], "stare-m-unused"),
    ([f"{ACTOR}checkpoint.save_contents=[model]"], "update-rule-not-checkpointed"),
    ([f"{PL}stare_adaptive=true", "trainer.critic_warmup=2"], "update-rule-during-critic-warmup"),
])
def test_settings_that_do_not_do_what_was_meant_warn(valid, overrides, code):
    config = _compose(valid + overrides)
    assert code in _codes(config)
    (finding,) = [f for f in guardrails.findings(config) if f.code == code]
    assert finding.severity == guardrails.WARNING
    with pytest.warns(guardrails.GuardrailWarning, match=finding.key):
        driver.check_trainer_config(config)  # the run goes on


def test_c2_uses_m_and_a_target_above_any_entropy_is_ungated_stare(valid):
    assert _codes(_compose(valid + [f"{PL}stare_variant=C2", f"{PL}stare_reweight_m=0.8"])) == []
    assert _codes(_compose(valid + [f"{PL}stare_target_entropy=1000.0"])) == []


def test_the_mode_has_no_entropy_controller():
    """STARE brings its own entropy feedback (gate, schedule): the plugin's controller would be a second loop on the
    same signal, so the mode has no controlled ratio and its config class no entropy_* knob."""
    assert STARE.entropy_sign == 0
    assert not any(name.startswith("entropy_") for name in StareGlobalPolicyLossConfig.__dataclass_fields__)
    settings = read_stare_settings(_compose(["actor_rollout_ref.model.path=x"]).actor_rollout_ref.actor)
    assert getattr(settings, "entropy_control", None) is None


def test_an_entropy_controller_knob_is_refused_naming_the_gate_instead(valid):
    config = _compose(valid + [f"+{PL}entropy_target=0.5"])
    with pytest.raises(driver.TrainerConfigError) as caught:
        driver.check_trainer_config(config)
    assert f"{PL}entropy_target" in str(caught.value) and "stare_target_entropy" in str(caught.value)


def test_a_schedule_that_cannot_move_keeps_weights_of_one_a_no_op(valid):
    config = _compose(valid + [f"{PL}stare_reweight_w=1.0", f"{PL}stare_adaptive=true", f"{PL}stare_alpha=0.0"])
    assert "stare-weights-one" in _codes(config)
    assert "stare-weights-one" not in _codes(_compose(valid + [f"{PL}stare_reweight_w=1.0",
                                                               f"{PL}stare_adaptive=true"]))


def test_a_percentage_says_what_the_fraction_is_of(valid):
    config = _compose(valid + [f"{PL}stare_top_ratio=10"])
    (finding,) = [f for f in guardrails.findings(config) if f.code == "ratio-is-percentage"]
    assert "each advantage sign" in finding.message and "[0, 1]" in finding.message
