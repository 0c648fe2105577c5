"""The entropy floor's law (``entropy_control.py``), its knobs on every config route, and the driver's checks.

The law is tested on plain numbers: never weaker than the user's ratio, the deficit and the surplus with the
hysteresis band, at most ln 2 per optimizer step, the bound on the entropy-raising side, the anti-wind-up at the
quota floor and at the selection's reach, no movement without valid tokens, the prediction. The knobs: declared in
the three config classes and YAML configs (a plain override with ``--config-name=<mode>``), on verl's config with
``policy_loss._target_`` and ``+``; bad values stop verl's ``validate_config`` (the driver, before Ray) with the key
named, and so does a user's ratio outside the bounds; the whole-config findings (an unreachable target, a
checkpoint without the optimizer).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
import torch
from hydra import compose, initialize_config_dir, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from verl_klcov_global import driver
from verl_klcov_global.config import (
    ClipCovGlobalPolicyLossConfig, HighEntropyGlobalPolicyLossConfig, KLCovGlobalPolicyLossConfig,
)
from verl_klcov_global.entropy_control import (
    CONTROL_KNOBS, MAX_STEP, ControllerState, EntropyControlSettings, check_ratio_within_bounds, decide, floor_error,
    measure_entropy, predict_entropy, settle, validate_entropy_control,
)
from verl_klcov_global.guardrails import findings
from verl_klcov_global.modes import MODES

from .trainer_support import trainer

PL = "actor_rollout_ref.actor.policy_loss."
CLASSES = {"kl_cov_global": KLCovGlobalPolicyLossConfig, "clip_cov_global": ClipCovGlobalPolicyLossConfig,
           "high_entropy_global": HighEntropyGlobalPolicyLossConfig}
SETTINGS = EntropyControlSettings(target=2.0, ki=1.0, kp=10.0, min_ratio=1e-4, max_ratio=0.5, horizon=0.0,
                                  window=4, hysteresis=0.1)
USER = 0.01  # the user's ratio


def _state(ratio: float) -> ControllerState:
    return ControllerState(knob="kl_cov_ratio", log_ratio=math.log(ratio))


def _strength(ratio: float, sign: int) -> float:
    """``s ln(r / r0)``: how much stronger than the user's ratio, in ln units (>= 0 always)."""
    return sign * math.log(ratio / USER)


# ---------------------------------------------------------------------------------------------
# The law


def test_the_error_is_the_deficit_below_the_target_and_the_surplus_above_the_band():
    assert floor_error(SETTINGS, 1.0) == 0.5 and floor_error(SETTINGS, 0.0) == 1.0
    assert floor_error(SETTINGS, 2.0) == 0.0 and floor_error(SETTINGS, 2.2) == 0.0  # the band [2.0, 2.2]
    assert floor_error(SETTINGS, 4.4) == pytest.approx(-0.5) and floor_error(SETTINGS, 1e9) == pytest.approx(-1.0)
    assert floor_error(SETTINGS, None) == 0.0 and floor_error(SETTINGS, math.nan) == 0.0


@pytest.mark.parametrize("sign", [+1, -1])
def test_above_the_target_the_ratio_in_use_is_the_users(sign):
    for entropy in (2.0, 2.1, 3.0, 50.0):
        decision = decide(_state(USER), entropy, 100, SETTINGS, sign, USER)
        assert decision.ratio_in_use == pytest.approx(USER, rel=1e-15)


@pytest.mark.parametrize("sign", [+1, -1])
def test_below_the_target_it_strengthens_by_at_most_ln2_per_step(sign):
    big = decide(_state(USER), 1.0, 100, SETTINGS, sign, USER)  # e = 0.5: kp e = 5, capped at ln 2
    assert big.error == 0.5 and _strength(big.ratio_in_use, sign) == pytest.approx(MAX_STEP)
    small = decide(_state(USER), 1.99, 100, SETTINGS, sign, USER)  # e = 0.005: kp e = 0.05
    assert _strength(small.ratio_in_use, sign) == pytest.approx(10.0 * 0.005)


@pytest.mark.parametrize("sign", [+1, -1])
def test_above_the_band_it_eases_back_to_the_users_ratio_and_never_past_it(sign):
    stronger = _state(USER * math.exp(sign * 0.5))
    eased = decide(stronger, 4.4, 100, SETTINGS, sign, USER)  # surplus e = -0.5: ki e = -0.5
    assert _strength(eased.ratio_in_use, sign) == pytest.approx(0.0, abs=1e-12)
    slight = decide(stronger, 2.42, 100, SETTINGS, sign, USER)  # e = -(2.42 - 2.2) / 2.42
    assert _strength(slight.ratio_in_use, sign) == pytest.approx(0.5 - 0.22 / 2.42)
    held = decide(stronger, 2.1, 100, SETTINGS, sign, USER)  # inside the band: the strength holds
    assert _strength(held.ratio_in_use, sign) == pytest.approx(0.5)


@pytest.mark.parametrize("sign", [+1, -1])
def test_never_weaker_than_the_user_within_the_bound_and_ln2_per_step(sign):
    rng = random.Random(7)
    settings = dataclasses.replace(SETTINGS, horizon=6.0, window=3)
    state, previous = _state(USER), math.log(USER)
    for _ in range(400):
        entropy = rng.choice([rng.uniform(0.0, 5.0), rng.uniform(1.8, 2.4)])
        decision = decide(state, entropy, 100, settings, sign, USER)
        assert _strength(decision.ratio_in_use, sign) >= -1e-12
        assert settings.min_ratio * (1 - 1e-12) <= decision.ratio_in_use <= settings.max_ratio * (1 + 1e-12)
        assert abs(decision.log_ratio - previous) <= MAX_STEP + 1e-12
        state = settle(state, decision, settings, num_valid=1000, reach=1000, sign=sign)
        previous = state.log_ratio


@pytest.mark.parametrize("sign, bound", [(+1, 0.5), (-1, 1e-4)])
def test_it_reaches_at_most_the_bound_on_its_entropy_raising_side(sign, bound):
    state = _state(USER)
    for _ in range(30):
        decision = decide(state, 0.5, 10 ** 6, SETTINGS, sign, USER)
        state = settle(state, decision, SETTINGS, num_valid=10 ** 6, reach=10 ** 6, sign=sign)
    assert decision.ratio_in_use == pytest.approx(bound)


def test_a_users_ratio_outside_the_bounds_is_refused_with_the_keys():
    check_ratio_within_bounds("kl_cov_ratio", 0.5, SETTINGS)  # the bounds themselves are inside
    for ratio in (0.6, 1e-5):
        with pytest.raises(ValueError, match=r"kl_cov_ratio=.* lies outside the entropy controller's bounds "
                                             r"\[0.0001, 0.5\].*policy_loss.kl_cov_ratio inside them.*max_ratio"):
            check_ratio_within_bounds("kl_cov_ratio", ratio, SETTINGS)


def test_no_valid_token_means_no_measurement_and_no_movement():
    state = _state(0.02)
    decision = decide(state, math.nan, 0, SETTINGS, +1, USER)
    assert decision.error == 0.0 and decision.ratio_in_use == pytest.approx(0.02)
    assert settle(state, decision, SETTINGS, num_valid=0, reach=0, sign=+1).log_ratio == state.log_ratio
    assert "entropy_measured" not in decision.figures("kl_cov_ratio", 2.0)  # no NaN reaches a logger


def test_no_strengthening_kept_beyond_the_selections_reach_or_below_the_quota_floor():
    # Clip-Cov with 20 candidates of N = 100: beyond ratio 0.2 every candidate is already cut
    state = _state(0.15)
    rising = decide(state, 1.0, 100, SETTINGS, +1, USER)
    assert rising.ratio_in_use == pytest.approx(0.3)
    assert settle(state, rising, SETTINGS, num_valid=100, reach=20, sign=+1).log_ratio == state.log_ratio
    assert settle(state, rising, SETTINGS, num_valid=100, reach=100, sign=+1).log_ratio == rising.log_ratio
    # easing back is always kept
    falling = decide(state, 4.4, 100, SETTINGS, +1, USER)
    assert settle(state, falling, SETTINGS, 100, 20, sign=+1).log_ratio == falling.log_ratio < state.log_ratio
    # the 80/20 rule (sign -1) at N = 100: below ratio 0.01 the quota is one token whatever the ratio
    low = _state(0.0105)
    down = decide(low, 1.0, 100, SETTINGS, -1, 0.02)
    assert down.ratio_in_use < 0.01 and settle(low, down, SETTINGS, 100, 100, sign=-1).log_ratio == low.log_ratio
    # nothing within reach (no candidate): the ratio acts on nothing, the state does not move
    assert settle(state, falling, SETTINGS, num_valid=100, reach=0, sign=+1).log_ratio == state.log_ratio
    assert settle(state, rising, SETTINGS, 100, 20, sign=+1).steps == state.steps + 1


def test_the_state_round_trips_through_a_plain_dict():
    state = ControllerState(knob="clip_cov_ratio", log_ratio=-7.25, steps=12)
    assert ControllerState.from_dict(json.loads(json.dumps(state.to_dict()))) == state
    assert "recent" not in state.to_dict()
    predicting = dataclasses.replace(state, recent=(4.1, 4.0, 3.875))
    assert ControllerState.from_dict(json.loads(json.dumps(predicting.to_dict()))) == predicting
    assert ControllerState.from_dict({"knob": "kl_cov_ratio", "log_ratio": -2.0, "steps": 3}).recent == ()


# ---------------------------------------------------------------------------------------------
# The prediction (entropy_control_horizon, entropy_control_window)

PREDICTING = dataclasses.replace(SETTINGS, target=3.0, horizon=40.0, window=4)


def _run_law(settings, entropies, sign=+1):
    """Feed the law one measured H per optimizer step from the user's ratio; the decisions and the last state."""
    state, decisions = _state(USER), []
    for entropy in entropies:
        decision = decide(state, entropy, 100, settings, sign, USER)
        state = settle(state, decision, settings, num_valid=100, reach=100, sign=sign)
        decisions.append(decision)
    return decisions, state


def test_without_a_horizon_the_law_reads_the_measured_entropy():
    falling = [4.15, 4.1, 4.0, 3.9, 3.7, 3.4, 3.1]
    zero, zero_state = _run_law(dataclasses.replace(PREDICTING, horizon=0.0), falling)
    assert [d.ratio_in_use for d in zero] == [pytest.approx(USER)] * len(falling)  # all above the target
    assert zero_state.recent == () and all(d.predicted is None for d in zero)
    assert all("entropy_predicted" not in d.figures("kl_cov_ratio", 2.0) for d in zero)
    # a history left by an earlier run with a horizon is dropped, so a horizon set again starts a fresh trend
    stale = dataclasses.replace(_state(USER), recent=(4.0, 3.9))
    assert settle(stale, decide(stale, 3.5, 100, SETTINGS, +1, USER), SETTINGS, 100, 100, sign=+1).recent == ()


def test_the_prediction_extrapolates_the_mean_change_over_the_window_once_it_is_full():
    falling = [4.15, 4.14, 4.12, 4.1, 4.06, 4.0]
    decisions, state = _run_law(PREDICTING, falling)
    assert [d.predicted for d in decisions[:4]] == falling[:4]  # fewer than window (4) measured steps before it
    assert decisions[4].predicted == pytest.approx(4.06 + 40 * (4.06 - 4.15) / 4)
    assert decisions[5].predicted == pytest.approx(4.0 + 40 * (4.0 - 4.14) / 4)
    assert state.recent == tuple(falling[-4:])
    assert decisions[4].figures("kl_cov_ratio", 3.0)["entropy_predicted"] == decisions[4].predicted
    # a fall that extrapolates below 0 is floored there (entropy is never negative): the error stays in (0, 1]
    steep, _ = _run_law(PREDICTING, [4.0, 3.5, 3.0, 2.5, 2.0])
    assert steep[-1].predicted == 0.0 and steep[-1].error == 1.0


@pytest.mark.parametrize("sign", [+1, -1])
def test_a_fast_fall_above_the_target_strengthens_the_method_before_the_target_is_crossed(sign):
    falling = [4.15, 4.1, 4.0, 3.9, 3.7]  # every H above the target 3.0, the last falling 0.1125 per step
    plain, _ = _run_law(dataclasses.replace(PREDICTING, horizon=0.0), falling, sign)
    predicted, _ = _run_law(PREDICTING, falling, sign)
    assert _strength(plain[-1].ratio_in_use, sign) == pytest.approx(0.0, abs=1e-12)
    assert _strength(predicted[-1].ratio_in_use, sign) > 0


def test_at_rest_the_prediction_reads_the_measured_entropy():
    flat = [2.5] * 6
    plain, _ = _run_law(dataclasses.replace(PREDICTING, horizon=0.0), flat)
    predicted, _ = _run_law(PREDICTING, flat)
    assert [d.ratio_in_use for d in plain] == [d.ratio_in_use for d in predicted]
    assert predict_entropy(3.5, (3.5,) * 4, PREDICTING) == 3.5


def test_a_step_without_valid_tokens_adds_nothing_to_the_history():
    state = dataclasses.replace(_state(USER), recent=(4.0, 3.9))
    decision = decide(state, math.nan, 0, PREDICTING, +1, USER)
    assert decision.predicted is None and decision.error == 0.0
    assert settle(state, decision, PREDICTING, num_valid=0, reach=0, sign=+1).recent == (4.0, 3.9)


def test_measure_entropy_is_the_exact_mean_over_valid_tokens():
    entropy = torch.tensor([[1.0, 2.0, float("nan")], [3.0, 0.5, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    mean, count = measure_entropy(entropy, mask, SETTINGS, None)
    assert count == 4 and mean == pytest.approx(6.5 / 4, abs=1e-15)
    assert measure_entropy(entropy, torch.zeros_like(mask), SETTINGS, None)[1] == 0


# ---------------------------------------------------------------------------------------------
# Knobs: validation, the config classes, the YAMLs, the routes


@pytest.mark.parametrize("target, message", [
    (0, "entropy_target must be a finite number of nats > 0"), (-1.0, "got -1.0"), (math.nan, "got nan"),
    (math.inf, "got inf"), (True, "got True"), ("1.5", "got '1.5'")])
def test_a_bad_target_is_refused_with_its_key(target, message):
    with pytest.raises(ValueError, match=f"{message}.*set {PL}entropy_target"):
        validate_entropy_control(target, 0.1, 10.0, 1e-5, 0.05)


@pytest.mark.parametrize("args, message", [
    ((1.5, -0.1, 10.0, 1e-5, 0.05), "entropy_control_ki must be finite and >= 0"),
    ((1.5, 0.1, math.nan, 1e-5, 0.05), "entropy_control_kp must be finite and >= 0"),
    ((1.5, 1.0, 0.0, 1e-5, 0.05), "entropy_control_kp is 0: the controller would never strengthen"),
    ((1.5, 0.1, 10.0, 0.0, 0.05), r"entropy_control_min_ratio must be finite and in \(0, 1\]"),
    ((1.5, 0.1, 10.0, 1e-5, 2.0), r"entropy_control_max_ratio must be finite and in \(0, 1\]"),
    ((1.5, 0.1, 10.0, 0.05, 0.05), "entropy_control_min_ratio must be below entropy_control_max_ratio"),
    ((None, "0.1", 10.0, 1e-5, 0.05), "entropy_control_ki"),  # checked with the controller off too
    ((1.5, 0.1, 10.0, 1e-5, 0.05, -1.0), "entropy_control_horizon must be finite and >= 0"),
    ((1.5, 0.1, 10.0, 1e-5, 0.05, math.inf), "entropy_control_horizon must be finite and >= 0"),
    ((1.5, 0.1, 10.0, 1e-5, 0.05, 40.0, 0), "entropy_control_window must be a whole number of optimizer steps >= 1"),
    ((1.5, 0.1, 10.0, 1e-5, 0.05, 40.0, 2.5), "entropy_control_window must be a whole number"),
    ((1.5, 0.1, 10.0, 1e-5, 0.05, 40.0, True), "entropy_control_window must be a whole number"),
    ((None, 0.1, 10.0, 1e-5, 0.05, 0.0, "8"), "entropy_control_window"),  # checked with the controller off too
    ((1.5, 0.1, 10.0, 1e-5, 0.05, 8.0, 4, -0.1), "entropy_control_hysteresis must be finite and >= 0"),
    ((1.5, 0.1, 10.0, 1e-5, 0.05, 8.0, 4, math.nan), "entropy_control_hysteresis must be finite and >= 0"),
])
def test_bad_gains_and_bounds_are_refused_with_their_keys(args, message):
    with pytest.raises(ValueError, match=message):
        validate_entropy_control(*args)


def test_null_target_is_off_and_the_defaults_are_valid():
    assert validate_entropy_control(None, 0.1, 10.0, 1e-5, 0.05) is None
    for mode, cls in CLASSES.items():
        config = cls()
        assert config.entropy_target is None
        assert MODES[mode].read_settings(_actor(config)).entropy_control is None
        on = MODES[mode].read_settings(_actor(cls(entropy_target=1.5)))
        assert on.entropy_control.target == 1.5
        assert (on.entropy_control.min_ratio, on.entropy_control.max_ratio) == (
            config.entropy_control_min_ratio, config.entropy_control_max_ratio)
        with pytest.raises(ValueError, match="entropy_target"):
            cls(entropy_target=-1.0)  # the class validates on construction (driver and every worker)


def test_every_mode_row_names_its_knob_and_sign():
    assert {name: (mode.ratio_knob, mode.entropy_sign) for name, mode in MODES.items()} == {
        "kl_cov_global": ("kl_cov_ratio", +1), "clip_cov_global": ("clip_cov_ratio", +1),
        "high_entropy_global": ("entropy_top_ratio", -1),
        "stare_global": ("stare_top_ratio", 0),  # STARE has its own gate and schedule: no controller
        "lp_reg_global": ("lp_reg_neg_ratio", 0)}  # Lp-Reg: no ratio whose size moves entropy one known way


def _actor(policy_loss):
    from verl.workers.config import ActorConfig

    return ActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                       policy_loss=policy_loss)


def _compose(mode: str, overrides: list[str], *, route: str = "config_name"):
    """``--config-name=<mode>`` (the plugin's YAML), or verl's ``ppo_trainer`` with ``_target_`` and ``+``."""
    GlobalHydra.instance().clear()
    try:
        if route == "config_name":
            with initialize_config_dir(config_dir=trainer.CONFIG_DIR, version_base=None):
                return compose(config_name=mode, overrides=overrides)
        target = f"{CLASSES[mode].__module__}.{CLASSES[mode].__name__}"
        plus = [f"+{o}" if o.startswith(PL) and o[len(PL):].split("=")[0] in CONTROL_KNOBS else o for o in overrides]
        with initialize_config_module(config_module="verl.trainer.config", version_base=None):
            return compose(config_name="ppo_trainer",
                           overrides=[f"{PL}loss_mode={mode}", f"{PL}_target_={target}", *plus])
    finally:
        GlobalHydra.instance().clear()


@pytest.mark.parametrize("route", ["config_name", "target"])
@pytest.mark.parametrize("mode", list(CLASSES))
def test_the_knobs_take_a_plain_override_and_reach_the_actor_config(mode, route):
    config = _compose(mode, [f"{PL}entropy_target=1.5", f"{PL}entropy_control_ki=0.2", f"{PL}entropy_control_kp=0.5",
                             f"{PL}entropy_control_min_ratio=0.001", f"{PL}entropy_control_max_ratio=0.3",
                             f"{PL}entropy_control_horizon=40", f"{PL}entropy_control_window=4",
                             f"{PL}entropy_control_hysteresis=0.25", f"{PL}kl_cov_ratio=0.002",
                             f"{PL}clip_cov_ratio=0.002", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"],
                      route=route)
    assert driver.check_trainer_config(config) == mode
    from verl.utils.config import omega_conf_to_dataclass

    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)  # what verl's validate_config and workers build
    assert type(actor.policy_loss) is CLASSES[mode]
    control = MODES[mode].read_settings(actor).entropy_control
    assert control == EntropyControlSettings(target=1.5, ki=0.2, kp=0.5, min_ratio=0.001, max_ratio=0.3, horizon=40.0,
                                             window=4, hysteresis=0.25)


BAD = [("entropy_target", "0", r"entropy_target must be a finite number of nats > 0 \(or null: no controller\), got 0"),
       ("entropy_target", "true", "got True"), ("entropy_target", "nan", "got nan"),
       ("entropy_target", "'1.5'", "got '1.5'"), ("entropy_control_ki", "-1", "entropy_control_ki must be"),
       ("entropy_control_kp", "inf", "entropy_control_kp must be"),
       ("entropy_control_max_ratio", "2", "entropy_control_max_ratio must be"),
       ("entropy_control_min_ratio", "0.9", "must be below entropy_control_max_ratio"),
       ("entropy_control_horizon", "-5", "entropy_control_horizon must be"),
       ("entropy_control_window", "0", "entropy_control_window must be"),
       ("entropy_control_hysteresis", "-1", "entropy_control_hysteresis must be"),
       ("kl_cov_ratio", "0.2", r"kl_cov_ratio=0.2 lies outside the entropy controller's bounds \[1e-05, 0.02\]")]


@pytest.mark.parametrize("route", ["config_name", "target"])
@pytest.mark.parametrize("key, value, message", BAD)
def test_a_bad_knob_stops_verls_validate_config_in_the_driver_with_the_key(key, value, message, route):
    target = [] if key == "entropy_target" else [f"{PL}entropy_target=1.5"]
    config = _compose("kl_cov_global", [*target, f"{PL}{key}={value}"], route=route)
    with pytest.raises(driver.TrainerConfigError, match=f"(?s)^verl-klcov-global: loss_mode=kl_cov_global: .*{message}"):
        trainer.validate_trainer_config(config)  # verl's validate_config, as main_ppo calls it before ray.init


# ---------------------------------------------------------------------------------------------
# Whole-config findings


def _model_dir(tmp_path, vocab_size: int) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": vocab_size}))
    return str(tmp_path)


@pytest.mark.parametrize("mode", list(CLASSES))
def test_a_target_at_or_above_ln_vocab_stops_the_driver(mode, tmp_path):
    model = _model_dir(tmp_path, 512)  # ln 512 = 6.238
    ok = _compose(mode, [f"{PL}entropy_target=6.2", f"actor_rollout_ref.model.path={model}"])
    assert not [f for f in findings(ok) if f.code == "entropy-target-unreachable"]
    config = _compose(mode, [f"{PL}entropy_target=6.3", f"actor_rollout_ref.model.path={model}"])
    with pytest.raises(driver.TrainerConfigError, match=r"entropy_target=6\.3 nats is not below ln\(vocabulary size\) "
                                                        r"= ln\(512\) = 6\.238.*policy_loss\.entropy_target"):
        driver.check_trainer_config(config)
    # a path that is not a local directory (a hub name): the worker checks at its first controlled step
    remote = _compose(mode, [f"{PL}entropy_target=6.3", "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B"])
    assert not [f for f in findings(remote) if f.code == "entropy-target-unreachable"]


def test_a_ratio_outside_the_bounds_is_refused_only_with_the_controller_on():
    off = _compose("kl_cov_global", [f"{PL}kl_cov_ratio=0.2"])
    assert driver.check_trainer_config(off) == "kl_cov_global"
    assert not [f for f in findings(off) if f.code.startswith("entropy-control")]


def test_the_floor_warns_where_the_modes_row_carries_evidence_against_it():
    for mode in CLASSES:
        config = _compose(mode, [f"{PL}entropy_target=1.5"])
        warned = [f for f in findings(config) if f.code == "entropy-floor-unproven"]
        assert bool(warned) == bool(MODES[mode].floor_caveat), mode
        assert not [f for f in findings(_compose(mode, [])) if f.code == "entropy-floor-unproven"]  # off: no warning
    (finding,) = [f for f in findings(_compose("kl_cov_global", [f"{PL}entropy_target=1.5"]))
                  if f.code == "entropy-floor-unproven"]
    assert "SmolLM2" in finding.message and f"set {PL}entropy_control_max_ratio to your" in finding.fix


def test_a_checkpoint_without_the_optimizer_warns_that_a_resume_restarts_the_controller():
    config = _compose("high_entropy_global", [f"{PL}entropy_target=1.5",
                                              "actor_rollout_ref.actor.checkpoint.save_contents=[model,extra]"])
    codes = [f.code for f in findings(config)]
    assert "entropy-control-not-checkpointed" in codes
    assert "entropy-control-not-checkpointed" not in [f.code for f in findings(
        _compose("high_entropy_global", [f"{PL}entropy_target=1.5"]))]  # verl's default saves the optimizer
