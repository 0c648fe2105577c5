"""A mode added to the table, as part 2 of docs/ADDING_A_MODE.md writes it: one table entry and one selection function.

``top_advantages_global`` selects the ``kl_cov_ratio`` fraction of tokens with the largest
advantages over the minibatch (and the DP group) and applies KL-Cov's penalty to them. Nothing
in the package names it: registering it in the table is enough for verl's policy-loss registry
(the plugin's one registration route), the driver's checks, and the real FSDP engine's prepass ->
mask -> loss path, whose masks must be identical for 1 and 8 micro-batches
(the page's two code blocks are executed here as written).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn

from verl_klcov_global import driver, plugin
from verl_klcov_global.lab import tiny as _tiny
from verl_klcov_global.lab.experiment import EngineSpec, frozen_minibatch, run_block, static_layouts
from verl_klcov_global.layout import padded
from verl_klcov_global.loss import provide_selection_mask
from verl_klcov_global.modes import MODES, global_mode_of, register_mode, unregister_mode
from verl_klcov_global.selection.knobs import ratio_quota

from .support.docs import code_blocks, section
from .trainer_support import trainer

PART_2 = "## Part 2: a built-in mode of this repository"
NAME = "top_advantages_global"
PREFIX = "actor/top_advantages/"
RATIO = 0.01
NOISE_FACTOR = 10  # the mode's layout difference must stay within 10x the penalty-free control's


def _run_the_pages_blocks() -> dict:
    """Part 2 of docs/ADDING_A_MODE.md, executed as written: the selection block, then the table entry block."""
    module = types.ModuleType("adding_a_mode_part_2")  # a module of its own, as the page's file would be
    sys.modules[module.__name__] = module  # dataclasses look their module up
    for number, block in enumerate(code_blocks(section("ADDING_A_MODE.md", PART_2), "python"), 1):
        exec(compile(block, f"docs/ADDING_A_MODE.md (part 2, block {number})", "exec"), module.__dict__)
    return module.__dict__


PAGE = _run_the_pages_blocks()
#: The one table entry (reusing kl_cov's knobs, reader and objective), as the page defines it.
TOP_ADVANTAGES = PAGE["TOP_ADVANTAGES"]


def test_the_page_defines_the_mode_this_file_tests():
    assert TOP_ADVANTAGES.name == NAME and TOP_ADVANTAGES.metric_prefix == PREFIX
    assert TOP_ADVANTAGES.select is PAGE["select_top_advantages"] and TOP_ADVANTAGES.config_class is None


@pytest.fixture
def third_mode():
    register_mode(TOP_ADVANTAGES)
    plugin.install()  # what the entry point runs: registers every mode of the table
    try:
        yield TOP_ADVANTAGES
    finally:
        unregister_mode(NAME)
        POLICY_LOSS_REGISTRY.pop(NAME, None)


def test_the_table_entry_is_registered_in_verls_registry(third_mode):
    assert get_policy_loss_fn(NAME) is third_mode.policy_loss
    assert third_mode.policy_loss.__name__ == f"compute_policy_loss_{NAME}"
    assert global_mode_of(_tiny.make_actor_config(loss_mode=NAME)) is third_mode
    assert list(MODES)[-1] == NAME


def test_without_the_entry_nothing_knows_the_mode():
    assert NAME not in MODES and NAME not in POLICY_LOSS_REGISTRY
    assert driver.check_trainer_config(trainer.compose_trainer_config(
        [f"actor_rollout_ref.actor.policy_loss.loss_mode={NAME}"], plugin_config=False)) is None


def test_the_driver_checks_its_knobs_and_strategy(third_mode):
    def compose(*overrides):
        return trainer.compose_trainer_config(
            [f"actor_rollout_ref.actor.policy_loss.loss_mode={NAME}", *overrides], plugin_config=False)

    assert driver.check_trainer_config(compose()) == NAME
    with pytest.raises(driver.TrainerConfigError,
                       match=rf"^verl-klcov-global: loss_mode={NAME}: kl_cov_ratio must be finite and in \(0, 1\]"):
        trainer.validate_trainer_config(compose("actor_rollout_ref.actor.policy_loss.kl_cov_ratio=true"))
    with pytest.raises(driver.TrainerConfigError, match=rf"loss_mode={NAME} supports verl's FSDP engine only.*"
                                                        r"actor_rollout_ref.actor.strategy=fsdp2.*another loss mode"):
        driver.check_trainer_config(compose("actor_rollout_ref.actor.strategy=megatron"))


def test_the_loss_takes_its_mask_from_the_channel(third_mode):
    torch.manual_seed(0)
    advantages = torch.randn(4, 6)
    old, new = torch.randn(4, 6), torch.randn(4, 6)
    response_mask = torch.ones(4, 6, dtype=torch.bool)
    config = _tiny.make_actor_config(loss_mode=NAME, kl_cov_ratio=0.25)
    with pytest.raises(RuntimeError, match=f"loss_mode={NAME} was called without a precomputed selection mask"):
        get_policy_loss_fn(NAME)(old, new, advantages, response_mask, config=config)
    mask = advantages >= advantages.flatten().topk(6).values[-1]
    with provide_selection_mask(mask, {"quota": 6.0}):
        _, metrics = get_policy_loss_fn(NAME)(old, new, advantages, response_mask, config=config)
    assert metrics[f"{PREFIX}selected_in_micro_batch"] == 6 and metrics[f"{PREFIX}quota"] == 6


def _actor_config(mode):
    return _tiny.make_actor_config(loss_mode=mode, kl_cov_ratio=RATIO, ppo_kl_coef=1.0)


@pytest.mark.slow
def test_the_real_engine_runs_prepass_mask_loss_identically_for_1_and_8_micro_batches(third_mode, tiny_model_path):
    spec = EngineSpec(tiny_model_path)
    batch = frozen_minibatch(spec, 3, batch_size=16, prompt_len=8, response_len=32)
    results = run_block(spec, batch, static_layouts(16, 8), _actor_config, modes=("vanilla", NAME))
    ours, control = results[NAME], results["vanilla"]
    valid = int(padded(batch["response_mask"]).sum())
    assert ours.masks_identical is True
    assert ours.selected_per_layout == (ratio_quota(valid, RATIO),) * 2 and ratio_quota(valid, RATIO) > 1
    assert control.max_param_diff > 0, "no noise floor: the comparison proves nothing"
    assert ours.max_param_diff <= NOISE_FACTOR * control.max_param_diff, (ours.max_param_diff, control)


@pytest.mark.slow
def test_the_engines_mask_holds_the_largest_advantages_and_the_metrics_carry_the_prefix(third_mode, tiny_model_path):
    from verl_klcov_global.engine.step import observe_selections

    spec = EngineSpec(tiny_model_path)
    batch = frozen_minibatch(spec, 4, batch_size=16, prompt_len=8, response_len=32)
    engine = spec.build()
    results = []
    data = static_layouts(16, 4)[1].apply(batch.copy())
    loss_function = _ppo_loss(_actor_config(NAME))
    with observe_selections(lambda _engine, result: results.append(result)), engine.train_mode():
        output = engine.train_batch(data, loss_function=loss_function)
    (result,) = results
    mask, advantages = result.selection.mask, padded(batch["advantages"])
    valid = padded(batch["response_mask"]).bool()
    assert result.mode is third_mode and int(mask.sum()) == ratio_quota(int(valid.sum()), RATIO)
    assert not (mask & ~valid).any()
    assert advantages[mask].min() >= advantages[valid & ~mask].max()  # exactly the largest advantages
    metrics = output["metrics"]
    assert sum(metrics[f"{PREFIX}selected_in_micro_batch"].values) == int(mask.sum())
    assert f"{PREFIX}prepass_seconds" in metrics and f"{PREFIX}quota" in metrics


def _ppo_loss(config):
    import functools

    from verl.workers.utils.losses import ppo_loss

    return functools.partial(ppo_loss, config=config)
