"""Every route to a global mode gives the same method: the packaged YAML (``--config-name=<mode>``), verl's own
``ppo_trainer`` with ``policy_loss._target_=verl_klcov_global.config.<Class>`` and ``loss_mode=<mode>``, and the
plugin's knobs given on that route with ``+``.

Each config is composed by Hydra as ``main_ppo`` composes it and converted as verl converts it
(``omega_conf_to_dataclass`` of the actor node): the ``policy_loss`` dataclasses and the mode's validated settings must
be equal, field by field. verl's ``actor.yaml`` writes its own ``policy_loss`` keys (``ppo_kl_coef: 0.1``,
``kl_cov_ratio``, ``clip_cov_*``) into the node on every route, so a knob of the plugin that shared one of those names
would take verl's value on the ``_target_`` route and the class's (or the YAML's) elsewhere: this is what the test
catches. The one documented exception: ``kl_cov_global.yaml`` sets ``ppo_kl_coef`` 1.0 (the paper's), while the
``_target_`` route keeps verl's 0.1, as verl's ``kl_cov`` does (README, knob table).

The slow test runs one update of the same minibatch through verl's FSDP engine per route and requires identical
parameters, bit for bit (one computation on the same inputs, in one process).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hydra import compose, initialize_config_dir, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from verl_klcov_global.modes import MODES

from .trainer_support.trainer import CONFIG_DIR

PL = "actor_rollout_ref.actor.policy_loss."
GLOBAL_MODES = ("kl_cov_global", "clip_cov_global", "high_entropy_global", "stare_global", "lp_reg_global")
#: a value other than the default for every knob of the plugin's own (the "+" route), per mode
SET_KNOBS = {
    "kl_cov_global": {"kl_cov_ratio": 0.002, "prepass_layout": "train", "entropy_target": 1.5},
    "clip_cov_global": {"clip_cov_ratio": 0.001, "clip_cov_lb": 0.5, "clip_cov_seed": 7, "entropy_control_kp": 5.0},
    "high_entropy_global": {"entropy_top_ratio": 0.3, "entropy_control_window": 4},
    "stare_global": {"stare_top_ratio": 0.2, "stare_variant": "C2", "stare_reweight_w": 1.2, "stare_reweight_m": 0.8,
                     "stare_target_entropy": 0.5, "stare_adaptive": True, "stare_alpha": 0.02, "stare_w_max": 1.4,
                     "stare_m_min": 0.6, "prepass_layout": "old"},
    "lp_reg_global": {"lp_reg_neg_ratio": 0.005, "lp_reg_pos_ratio": 0.001, "lp_reg_min_p": 0.05,
                      "lp_reg_kl_coef": 0.5, "prepass_layout": "train"},
}
#: what every route also needs to convert (verl refuses an actor without a micro-batch setting)
COMMON = ["actor_rollout_ref.model.path=/m", "actor_rollout_ref.actor.use_dynamic_bsz=True"]
#: (mode, field) -> (packaged YAML's value, the _target_ route's): the documented exceptions
DOCUMENTED_DIFFERENCES = {("kl_cov_global", "ppo_kl_coef"): (1.0, 0.1)}


def _verl_policy_loss_keys() -> set:
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return set(compose(config_name="ppo_trainer").actor_rollout_ref.actor.policy_loss)


def _override(key, value) -> str:
    return f"{key}={str(value).lower() if isinstance(value, bool) else value}"


def packaged_route(mode: str, knobs: dict):
    """``main_ppo --config-name=<mode> policy_loss.<knob>=...`` (the YAML declares every knob: no "+")."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name=mode, overrides=COMMON + [_override(PL + key, value) for key, value in knobs.items()])


def target_route(mode: str, knobs: dict):
    """``main_ppo policy_loss._target_=verl_klcov_global.config.<Class> policy_loss.loss_mode=<mode>`` with each knob
    verl's node lacks given with "+", as README says."""
    verl_keys = _verl_policy_loss_keys()
    cls = MODES[mode].config_class
    overrides = COMMON + [f"{PL}_target_=verl_klcov_global.config.{cls.__name__}", f"{PL}loss_mode={mode}"]
    overrides += [("" if key in verl_keys else "+") + _override(PL + key, value) for key, value in knobs.items()]
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def converted_actor(config):
    """The actor config as verl's driver and workers build it."""
    from verl.utils.config import omega_conf_to_dataclass

    return omega_conf_to_dataclass(config.actor_rollout_ref.actor)


def _differences(a, b) -> dict:
    left, right = dataclasses.asdict(a), dataclasses.asdict(b)
    return {key: (left[key], right.get(key)) for key in left if left[key] != right.get(key)}


@pytest.mark.parametrize("knobs_set", [False, True], ids=["nothing set", "every plugin knob set"])
@pytest.mark.parametrize("mode", GLOBAL_MODES)
def test_the_packaged_yaml_and_the_target_route_convert_to_the_same_config(mode, knobs_set):
    knobs = SET_KNOBS[mode] if knobs_set else {}
    packaged, target = converted_actor(packaged_route(mode, knobs)), converted_actor(target_route(mode, knobs))
    assert type(packaged.policy_loss) is type(target.policy_loss) is MODES[mode].config_class
    expected = {field: values for (name, field), values in DOCUMENTED_DIFFERENCES.items() if name == mode}
    assert _differences(packaged.policy_loss, target.policy_loss) == expected
    for key, value in knobs.items():
        assert getattr(target.policy_loss, key) == value, key
    if not expected:
        assert MODES[mode].read_settings(packaged) == MODES[mode].read_settings(target)


def test_lp_reg_beta_is_the_authors_1_on_every_route_when_unset():
    """beta = 1.0 (the authors' ppo_kl_coef=1, recipe/lp_reg/*.sh) where nothing sets it, although verl's node
    carries ppo_kl_coef 0.1 on every route; a plain ``loss_mode=lp_reg_global`` override (verl's PolicyLossConfig,
    no plugin knobs) reads the same default."""
    from verl_klcov_global.config import read_lp_reg_settings

    plain = converted_actor(_plain_route("lp_reg_global"))
    for actor in (converted_actor(packaged_route("lp_reg_global", {})),
                  converted_actor(target_route("lp_reg_global", {})), plain):
        assert actor.policy_loss.ppo_kl_coef == 0.1  # verl's, written by its actor.yaml
        assert read_lp_reg_settings(actor).kl_coef == 1.0


def test_kl_cov_global_on_a_plain_override_reads_verls_ppo_kl_coef_as_verls_kl_cov():
    from verl_klcov_global.config import read_kl_cov_settings

    assert read_kl_cov_settings(converted_actor(_plain_route("kl_cov_global"))).ppo_kl_coef == 0.1


def _plain_route(mode: str):
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name="ppo_trainer", overrides=COMMON + [f"{PL}loss_mode={mode}"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["stare_global", "lp_reg_global"])
def test_one_engine_update_per_route_gives_identical_parameters(mode, tiny_model_path, tmp_path):
    """One update of the same minibatch through verl's FSDP engine, with the ``policy_loss`` each route converts to
    (nothing set): identical parameters. On a peaked tiny model (LM head x 6), so that Lp-Reg's proxy cuts a tail and
    beta acts on regularised tokens (with verl's 0.1 on one route this update differed from the other's)."""
    from verl_klcov_global.lab import tiny as _tiny
    from verl_klcov_global.lab.experiment import EngineSpec, dynamic_layouts, frozen_minibatch, one_update

    spec = EngineSpec(_tiny.build_peaked_model(str(tmp_path / "peaked"), tiny_model_path, 6.0))
    batch = frozen_minibatch(spec, 0, batch_size=32, prompt_len=8, response_len=48, vary_lengths=True)
    layout = dynamic_layouts(32, 56, 4)[1]
    # Lp-Reg: tests/engine/test_engine_lp_reg.py's knobs, whose kappa cuts a tail of the peaked model with selected
    # tokens inside the support (regularised); STARE: the gate open (a target above any entropy)
    knobs = ({"lp_reg_neg_ratio": 0.05, "lp_reg_pos_ratio": 0.02, "lp_reg_min_p": 0.01} if mode == "lp_reg_global"
             else {"stare_target_entropy": 100.0})
    outcomes = []
    for route in (packaged_route, target_route):
        policy_loss = converted_actor(route(mode, knobs)).policy_loss
        outcomes.append(one_update(spec, batch, _tiny.make_actor_config(policy_loss=policy_loss), layout))
    packaged, target = outcomes
    assert packaged.selected_tokens == target.selected_tokens > 0
    if mode == "lp_reg_global":
        regularised = [v for k, v in packaged.metrics.items() if k == MODES[mode].metric_prefix + "regularised"]
        assert regularised and float(getattr(regularised[0], "values", [regularised[0]])[0]) > 0
    assert torch.equal(packaged.params, target.params)
