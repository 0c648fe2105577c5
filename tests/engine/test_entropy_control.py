"""The entropy controller on verl's real engine and ``TrainingWorker`` (CPU, fp32).

* The first optimizer step of any split sees the same parameters, so its measured entropy, its ratio in use,
  its mask and every figure verl's worker returns are bit-identical for 3 vs 5 micro-batches and DP 1 vs 2
  (``TrainingWorker.train_mini_batch``: verl's own metric aggregation over micro-batches, DP ranks and
  optimizer steps), for each mode.
* Later steps: the two layouts' parameters differ by float noise (as vanilla's do), and so do the
  controller's readings; the ratio's trajectories agree to far below the controller's own movement, and
  the parameters stay within ``NOISE_FACTOR`` x vanilla's difference between the same two layouts.
* The knob moves the way the papers say, and only from the user's ratio towards more strength: with the entropy
  below the target, KL-Cov's and Clip-Cov's ratio rises and the 80/20 rule's falls.
* One state per engine, carried by the optimizer's state dict; a target no policy reaches stops the step.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from verl.utils import tensordict_utils as tu

from verl_klcov_global.config import (
    ClipCovGlobalPolicyLossConfig, HighEntropyGlobalPolicyLossConfig, KLCovGlobalPolicyLossConfig,
)
from verl_klcov_global.engine import control as engine_control
from verl_klcov_global.engine.step import observe_selections
from verl_klcov_global.lab import tiny as _tiny
from verl_klcov_global.lab.experiment import largest_divisor_at_most
from verl_klcov_global.layout import fit_width
from verl_klcov_global.modes import MODES

from ..support.gloo import spawn_gloo
from ..support.noise_floor import ratio_to_control
from ..support.workers import build_training_worker

pytestmark = pytest.mark.slow  # verl's real engine and worker on CPU: the slow tier

PROMPT, RESPONSE = 8, 32
NOISE_FACTOR = 10
#: The tiny model starts near-uniform (entropy ~6.23 nats of ln 512 = 6.238): a floor just below ln 512, which the
#: entropy stays under; a target the entropy stays above.
TARGET = math.log(512) - 1e-3
BELOW = 5.0
CONFIGS = {
    "kl_cov_global": (KLCovGlobalPolicyLossConfig, dict(kl_cov_ratio=0.005)),
    "clip_cov_global": (ClipCovGlobalPolicyLossConfig, dict(clip_cov_ratio=0.02, clip_cov_lb=0.3, clip_cov_ub=5.0)),
    "high_entropy_global": (HighEntropyGlobalPolicyLossConfig, dict(entropy_top_ratio=0.2)),
}
#: Which way the ratio goes when the entropy is below the target (the papers' signs, written out here).
BELOW_TARGET_MOVES_RATIO = {"kl_cov_global": "up", "clip_cov_global": "up", "high_entropy_global": "down"}
#: The measured entropy (no horizon), and a gain large enough for a deficit of ~0.1% to move ln(ratio) by ~0.5.
CONTROL = dict(entropy_target=TARGET, entropy_control_kp=500.0, entropy_control_horizon=0.0)


def actor_config(mode: str, target: float = TARGET, **extra):
    if mode == "vanilla":
        return _tiny.make_actor_config(loss_mode="vanilla", **extra)
    cls, knobs = CONFIGS[mode]
    return _tiny.make_actor_config(policy_loss=cls(**knobs, **{**CONTROL, "entropy_target": target}), **extra)


def _figure_keys(metrics: dict, mode: str) -> dict:
    """Every figure the step emits once per optimizer step (timings and the per-micro-batch count aside)."""
    prefix = MODES[mode].metric_prefix
    return {k: [float(v) for v in values] for k, values in metrics.items()
            if k.startswith(prefix) and not k.endswith(("_seconds", "_share", "selected_in_micro_batch"))}


def _train(worker, batch, mode: str, *, micro_batch_size: int, mini_batch_size: int, epochs: int = 1,
           target: float = TARGET):
    """``train_mini_batch`` of ``batch`` (this rank's rows); (its metrics, per optimizer step: mask, decision)."""
    from verl.workers.utils.losses import ppo_loss

    config = actor_config(mode, target, ppo_mini_batch_size=mini_batch_size, ppo_epochs=epochs)
    worker.set_loss_fn(functools.partial(ppo_loss, config=config))
    data = _tiny.set_micro_batching(batch.copy(), use_dynamic_bsz=False, micro_batch_size_per_gpu=micro_batch_size)
    tu.assign_non_tensor(data, mini_batch_size=mini_batch_size, epochs=epochs, seed=42,
                         dataloader_kwargs={"shuffle": False})
    steps = []
    with observe_selections(lambda _engine, result: steps.append((result.selection.mask.clone(), result.steering))):
        output = worker.train_mini_batch(data)
    return tu.get(output, "metrics"), steps


def _batch(worker, rows: int, seed: int, mini_batch_size: int):
    common = dict(batch_size=rows, prompt_len=PROMPT, response_len=RESPONSE, vary_lengths=True, seed=seed,
                  micro_batch_size_per_gpu=largest_divisor_at_most(rows, 8))
    current = _tiny.compute_current_log_probs(worker.engine, _tiny.make_minibatch(**common))
    return _tiny.make_minibatch(**common, log_probs=current, global_batch_size=mini_batch_size)


# ---------------------------------------------------------------------------------------------
# The first optimizer step: bit-identical for 3 vs 5 micro-batches and DP 1 vs 2

ROWS = 30  # 3 or 5 micro-batches of 10 or 6 rows (DP 1), of 5 or 3 rows per rank (DP 2)


def _first_step_runs(rank: int, world_size: int, model_path: str, batch_file: str) -> dict:
    torch.set_num_threads(1)
    batch = _tiny.shard_for_rank(torch.load(batch_file, weights_only=False), rank, world_size)
    runs = {}
    for mode in CONFIGS:
        for micro_batches in (3, 5):
            worker = build_training_worker(model_path)
            metrics, steps = _train(worker, batch, mode, micro_batch_size=ROWS // world_size // micro_batches,
                                    mini_batch_size=ROWS)
            (mask, steering), = steps
            runs[(mode, micro_batches)] = (_figure_keys(metrics, mode), mask, steering.decision)
    return runs


def test_the_first_step_is_bit_identical_for_3_vs_5_micro_batches_and_dp_1_vs_2(tiny_model_path, tmp_path):
    worker = build_training_worker(tiny_model_path)
    batch_file = str(tmp_path / "batch.pt")
    torch.save(_batch(worker, ROWS, seed=3, mini_batch_size=ROWS), batch_file)
    del worker
    single = _first_step_runs(0, 1, tiny_model_path, batch_file)
    ranks = spawn_gloo(_first_step_runs, 2, tiny_model_path, batch_file, verl_platform=True)
    for mode in CONFIGS:
        figures, mask, decision = single[(mode, 3)]
        knob = MODES[mode].ratio_knob
        prefix = MODES[mode].metric_prefix
        # the controller acted and its figures are there, one value per optimizer step
        assert figures[f"{prefix}entropy_target"] == [TARGET]
        assert figures[f"{prefix}entropy_measured"] == [decision.entropy] and decision.entropy < TARGET
        assert figures[f"{prefix}{knob}_in_use"] == [decision.ratio_in_use]
        assert decision.ratio_in_use != CONFIGS[mode][1][knob]
        assert mask.any()
        for other in [single[(mode, 5)], *(rank[(mode, m)] for rank in ranks for m in (3, 5))]:
            assert other[0] == figures, mode  # every figure, bit for bit (float ==)
            assert other[2] == decision
        for micro_batches in (3, 5):
            width = mask.shape[1]
            dp = torch.cat([fit_width(rank[(mode, micro_batches)][1], width) for rank in ranks])
            assert torch.equal(dp, mask), mode
            assert torch.equal(single[(mode, micro_batches)][1], mask), mode
        print(f"\n[{mode}] step 1: H = {decision.entropy!r}, {knob} in use = {decision.ratio_in_use!r}; "
              f"{len(figures)} figures equal bit for bit at 3 and 5 micro-batches, DP 1 and 2")


# ---------------------------------------------------------------------------------------------
# Later steps: the trajectories agree to the layouts' float noise; the knob moves the papers' way

STEPS_ROWS, STEPS_MINI, STEPS_EPOCHS = 32, 8, 2  # 4 minibatches x 2 epochs = 8 optimizer steps


def _trajectory(model_path: str, batch, mode: str, micro_batch_size: int, target: float = TARGET):
    """The run's steering per optimizer step, and its parameters after the update (a full state dict)."""
    from ..support.workers import full_state_dict

    worker = build_training_worker(model_path)
    _, steps = _train(worker, batch, mode, micro_batch_size=micro_batch_size, mini_batch_size=STEPS_MINI,
                      epochs=STEPS_EPOCHS, target=target)
    return [steering for _, steering in steps], full_state_dict(worker.engine)


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_later_steps_agree_to_the_float_noise_and_the_floor_only_strengthens_the_method(tiny_model_path, mode):
    """Below its floor the ratio moves the paper's way, by at most ln 2 a step, never weaker than the user's (the
    two layouts' trajectories agreeing to their float noise); above its floor it is the user's at every step."""
    batch = _batch(build_training_worker(tiny_model_path), STEPS_ROWS, seed=7, mini_batch_size=STEPS_MINI)
    _, vanilla_one = _trajectory(tiny_model_path, batch, "vanilla", STEPS_MINI)
    _, vanilla_four = _trajectory(tiny_model_path, batch, "vanilla", STEPS_MINI // 4)
    one, params_one = _trajectory(tiny_model_path, batch, mode, STEPS_MINI)
    four, params_four = _trajectory(tiny_model_path, batch, mode, STEPS_MINI // 4)
    assert len(one) == len(four) == STEPS_ROWS // STEPS_MINI * STEPS_EPOCHS

    log_ratio = [[math.log(s.decision.ratio_in_use) for s in run] for run in (one, four)]
    assert one[0].decision == four[0].decision  # the first step sees the same parameters
    layout_gap = max(abs(a - b) for a, b in zip(*log_ratio))
    movement = abs(log_ratio[0][-1] - math.log(CONFIGS[mode][1][MODES[mode].ratio_knob]))
    direction = "down" if log_ratio[0][-1] < log_ratio[0][0] else "up"
    assert direction == BELOW_TARGET_MOVES_RATIO[mode]
    assert all(s.decision.entropy < TARGET for s in one)  # a deficit at every step: the law only strengthened
    user = math.log(CONFIGS[mode][1][MODES[mode].ratio_knob])
    strength = [MODES[mode].entropy_sign * (r - user) for r in log_ratio[0]]
    assert all(0 < a <= b for a, b in zip(strength, strength[1:]))  # never weaker than the user's, never easing
    assert all(b - a <= math.log(2) + 1e-12 for a, b in zip([0.0] + strength, strength))  # ln 2 a step at most
    assert movement > 0.5 and layout_gap <= 1e-6 * movement, (layout_gap, movement)
    above, _ = _trajectory(tiny_model_path, batch, mode, STEPS_MINI, target=BELOW)  # the entropy above its floor
    assert all(s.decision.entropy > BELOW for s in above)
    assert [s.decision.ratio_in_use for s in above] == [pytest.approx(math.exp(user), rel=1e-15)] * len(above)
    # tensor by tensor against vanilla's floor (support/noise_floor.py): one rounding of a norm weight near 1 is
    # 16x the whole noise of the weights near 0.04, and which element rounds is luck, not the method
    ratio = ratio_to_control(params_one, params_four, vanilla_one, vanilla_four)
    assert ratio <= NOISE_FACTOR, ratio
    print(f"\n[{mode}] {len(one)} steps: ln(ratio) moved {movement:.3f} ({direction}), 1 vs 4 micro-batches differ by "
          f"at most {layout_gap:.1e} in ln(ratio); parameters {ratio:.2f}x vanilla's noise floor, tensor by tensor")


# ---------------------------------------------------------------------------------------------
# One state per engine, in the optimizer's state dict; an unreachable target


def test_each_engine_keeps_its_own_state_in_its_optimizers_state_dict(tiny_model_path):
    from verl.workers.utils.losses import ppo_loss

    from verl_klcov_global.lab.experiment import EngineSpec, frozen_minibatch

    spec = EngineSpec(model_path=tiny_model_path, infer_micro_batch_size_per_gpu=8)
    batch = frozen_minibatch(spec, seed=5, batch_size=8, prompt_len=PROMPT, response_len=RESPONSE)
    engines = [spec.build(), spec.build()]
    # the first engine predicts (a horizon over a window of 1): its state also carries the measured H
    for engine, target, horizon in zip(engines, (TARGET, BELOW), (40.0, 0.0)):
        policy_loss = KLCovGlobalPolicyLossConfig(kl_cov_ratio=0.005, entropy_target=target,
                                                  entropy_control_horizon=horizon, entropy_control_window=1)
        config = _tiny.make_actor_config(policy_loss=policy_loss)
        with engine.train_mode():
            engine.train_batch(batch.copy(), loss_function=functools.partial(ppo_loss, config=config))
    states = [engine.optimizer.param_groups[0][engine_control.STATE_KEY] for engine in engines]
    assert states[0]["knob"] == states[1]["knob"] == "kl_cov_ratio" and states[0]["steps"] == states[1]["steps"] == 1
    assert states[0]["log_ratio"] > states[1]["log_ratio"] == math.log(0.005)  # below / above its target
    assert len(states[0]["recent"]) == 1 and 0 < states[0]["recent"][0] < math.log(512) and "recent" not in states[1]
    # the carrier: torch's state_dict keeps the entry and load_state_dict brings it back into a fresh engine
    saved = engines[0].optimizer.state_dict()
    fresh = spec.build()
    assert engine_control.STATE_KEY not in fresh.optimizer.param_groups[0]
    fresh.optimizer.load_state_dict(saved)
    assert fresh.optimizer.param_groups[0][engine_control.STATE_KEY] == states[0]
    settings = MODES["kl_cov_global"].read_settings(_tiny.make_actor_config(
        policy_loss=KLCovGlobalPolicyLossConfig(kl_cov_ratio=0.005, entropy_target=TARGET, entropy_control_horizon=40.0,
                                                entropy_control_window=1)))
    restored = engine_control.controller_state(fresh, MODES["kl_cov_global"], settings)
    assert restored.to_dict() == states[0]


def test_a_target_no_policy_reaches_stops_the_first_step_with_the_key(tiny_model_path):
    from verl.workers.utils.losses import ppo_loss

    from verl_klcov_global.lab.experiment import EngineSpec, frozen_minibatch

    spec = EngineSpec(model_path=tiny_model_path, infer_micro_batch_size_per_gpu=8)
    batch = frozen_minibatch(spec, seed=5, batch_size=8, prompt_len=PROMPT, response_len=RESPONSE)
    engine = spec.build()
    vocab_size = engine.model_config.hf_config.vocab_size
    target = math.log(vocab_size) + 0.01
    config = _tiny.make_actor_config(policy_loss=HighEntropyGlobalPolicyLossConfig(entropy_target=target))
    with engine.train_mode(), pytest.raises(ValueError, match=r"entropy_target=.*ln\(vocabulary size\)"):
        engine.train_batch(batch.copy(), loss_function=functools.partial(ppo_loss, config=config))
    assert engine_control.STATE_KEY not in engine.optimizer.param_groups[0]  # nothing stored, nothing trained


def test_every_micro_batchs_loss_applies_the_ratio_the_controller_steered_its_selection_to(tiny_model_path,
                                                                                           monkeypatch):
    """Below the floor the controller strengthens KL-Cov beyond the user's ratio for the step's selection; every
    micro-batch's loss of that step gets the very settings the selection used through the mask channel, never the
    config's, so an objective that reads a steered knob cannot disagree with its own mask."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    from verl_klcov_global import loss as plugin_loss

    worker = build_training_worker(tiny_model_path)
    batch = _batch(worker, 16, seed=7, mini_batch_size=8)
    seen = []
    real = POLICY_LOSS_REGISTRY["kl_cov_global"]

    def recorded(**kwargs):
        seen.append(plugin_loss.provided_selection().settings)
        return real(**kwargs)

    monkeypatch.setitem(POLICY_LOSS_REGISTRY, "kl_cov_global", recorded)
    _, steps = _train(worker, batch, "kl_cov_global", micro_batch_size=4, mini_batch_size=8)
    assert len(steps) == 2 and len(seen) == 4  # 2 optimizer steps of 2 micro-batches
    configured = CONFIGS["kl_cov_global"][1]["kl_cov_ratio"]
    for index, (_, steering) in enumerate(steps):
        assert steering.decision.ratio_in_use > configured  # steered beyond the user's ratio
        for settings in seen[2 * index: 2 * index + 2]:
            assert settings == steering.settings and settings.kl_cov_ratio == steering.decision.ratio_in_use
