"""high_entropy_global in verl's real FSDP engine (CPU): the prepass entropy is verl's, the mask does not move.

* The prepass entropy equals, bit for bit, what verl's ``compute_log_prob`` (``TrainingWorker.infer_batch``
  with ``calculate_entropy=True``, as ``ray_trainer._compute_old_log_prob`` asks) returns on the same
  rows in the same micro-batches: padded static, packed dynamic, packed with ``entropy_from_logits_with_chunking``
  and ``entropy_checkpointing``. KL-Cov's and Clip-Cov's prepasses still ask for no entropy and keep the
  in-place log-prob patch.
* Invariance (each axis once): 1 vs 8 micro-batches (dynamic; static fsdp2; static packed), DP 2 on gloo,
  Ulysses SP 2, 2 PPO epochs with shuffle: masks bit for bit, parameters within ``NOISE_FACTOR`` x the
  ``vanilla`` control's difference between the same two settings.
* The paper's objective computed independently on the whole minibatch in one micro-batch (its own
  top-k of the training forward's entropy, by sort; verl's ``ppo_loss`` with ``vanilla`` on ``A * mask``)
  vs ``high_entropy_global`` over 8 micro-batches: within ``NOISE_FACTOR`` x the control's noise, with
  ``entropy_coeff``, the KL loss and rollout IS weights on.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import no_padding_2_padding

from verl_klcov_global.config import HighEntropyGlobalPolicyLossConfig
from verl_klcov_global.engine import prepass as engine_prepass
from verl_klcov_global.engine.step import observe_selections
from verl_klcov_global.lab import cpu as _cpu
from verl_klcov_global.lab import tiny as _tiny
from verl_klcov_global.lab.experiment import (
    EngineSpec, MicroBatchLayout, dynamic_layouts, frozen_minibatch, max_abs_diff, one_update, run_block,
    static_layouts,
)
from verl_klcov_global.layout import fit_width, padded
from verl_klcov_global.modes import CLIP_COV, HIGH_ENTROPY, KL_COV
from verl_klcov_global.selection import high_entropy_quota

pytestmark = pytest.mark.slow  # verl's real engine on CPU: the slow tier

BATCH, PROMPT, RESPONSE = 32, 8, 48
SEQ = PROMPT + RESPONSE
RHO = 0.2
NOISE_FACTOR = 10  # high_entropy_global's layout difference must stay within 10x the control's
MODES = ("vanilla", "high_entropy_global")


def actor_config_for(mode, rho=RHO, **kwargs):
    if mode == "high_entropy_global":
        return _tiny.make_actor_config(policy_loss=HighEntropyGlobalPolicyLossConfig(entropy_top_ratio=rho), **kwargs)
    return _tiny.make_actor_config(loss_mode=mode, **kwargs)


def _batch(spec, seed, **kwargs):
    return frozen_minibatch(spec, seed, batch_size=BATCH, prompt_len=PROMPT, response_len=RESPONSE,
                            vary_lengths=True, **kwargs)


def _assert_invariant(results, batch):
    control, ours = results["vanilla"], results["high_entropy_global"]
    quota = high_entropy_quota(int(padded(batch["response_mask"]).sum()), RHO)
    assert ours.masks_identical is True
    assert ours.selected_per_layout == (quota, quota)
    assert control.max_param_diff > 0, "no noise floor: the two layouts gave the same control update"
    assert ours.max_param_diff <= NOISE_FACTOR * control.max_param_diff, (ours.max_param_diff, control.max_param_diff)
    return ours.max_param_diff / control.max_param_diff


# ---------------------------------------------------------------------------------------------
# The prepass entropy is verl's compute_log_prob entropy, bit for bit


def _training_worker(model_path, *, use_remove_padding=False, use_dynamic_bsz=False, chunked=False,
                     infer_micro_batch_size_per_gpu=8, infer_max_token_len_per_gpu=3 * SEQ):
    """verl's TrainingWorker (what ActorRolloutRefWorker.compute_log_prob calls) with the given engine settings."""
    _cpu.install_cpu_platform()
    _cpu.init_process_group_cpu()
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker

    torch.manual_seed(0)
    configs = _cpu.fsdp_engine_configs(
        model_path, use_remove_padding=use_remove_padding, use_dynamic_bsz=use_dynamic_bsz,
        infer_micro_batch_size_per_gpu=infer_micro_batch_size_per_gpu,
        infer_max_token_len_per_gpu=infer_max_token_len_per_gpu)
    if chunked:  # read when the engine is built (FSDPEngine.__init__): set before
        configs["engine_config"] = dataclasses.replace(
            configs["engine_config"], entropy_from_logits_with_chunking=True, entropy_from_logits_chunk_size=64,
            entropy_checkpointing=True)
    worker = TrainingWorker(config=TrainingWorkerConfig(model_type="language_model", **configs))
    worker.reset()
    return worker


def _compute_log_prob_entropy(worker, batch):
    """verl's compute_log_prob on ``batch``: the trainer's keys (``_compute_old_log_prob``), the worker's infer layout."""
    data = batch.copy()
    for key in ("micro_batch_size_per_gpu", "max_token_len_per_gpu", "use_dynamic_bsz"):
        tu.pop(data, key=key, default=None)  # the trainer's batch has no training keys: the worker fills in its infer layout
    tu.assign_non_tensor(data, calculate_entropy=True, calculate_sum_pi_squared=False, compute_loss=False)
    output = worker.infer_batch(data)
    return (no_padding_2_padding(tu.get(output, "entropy"), data).float(),
            no_padding_2_padding(tu.get(output, "log_probs"), data).float())


@pytest.mark.parametrize("setting", ["padded-static", "packed-dynamic", "packed-chunked-checkpointed"])
def test_prepass_entropy_is_verls_compute_log_prob_entropy_bit_for_bit(tiny_model_path, setting):
    packed, dynamic, chunked = "packed" in setting, "dynamic" in setting, "chunked" in setting
    worker = _training_worker(tiny_model_path, use_remove_padding=packed, use_dynamic_bsz=dynamic, chunked=chunked)
    batch = _tiny.make_minibatch(batch_size=16, prompt_len=PROMPT, response_len=RESPONSE, vary_lengths=True, seed=3,
                                 use_remove_padding=packed, use_dynamic_bsz=dynamic, micro_batch_size_per_gpu=4,
                                 max_token_len_per_gpu=SEQ)  # training layout: not the prepass's
    verls_entropy, verls_log_probs = _compute_log_prob_entropy(worker, batch)
    if chunked:  # verl chunks on the packed path only; checkpointing on both
        import verl.utils.torch_functional as verl_F

        assert worker.engine.compute_entropy_from_logits is verl_F.entropy_from_logits_with_chunking
        assert worker.engine.engine_config.entropy_checkpointing

    calls = []
    real_infer = worker.engine.infer_batch

    def recording_infer(data, loss_function=None):
        calls.append((tu.get_non_tensor_data(data, "calculate_entropy", None), len(data)))
        return real_infer(data, loss_function=loss_function)

    worker.engine.infer_batch = recording_infer
    log_probs, entropy = engine_prepass.compute_prepass_log_probs_and_entropy(worker.engine, batch, "infer")
    width = entropy.shape[1]
    assert torch.equal(entropy, fit_width(verls_entropy, width))
    assert torch.equal(log_probs, fit_width(verls_log_probs, width))  # verl's own log-prob path: the patch is off
    assert all(flag is True for flag, _ in calls) and sum(rows for _, rows in calls) == 16
    mask = padded(batch["response_mask"]).bool()
    assert entropy[mask].min() > 0 and entropy[mask].unique().numel() > mask.sum() // 2  # real, varied entropies


def test_kl_cov_and_clip_cov_prepasses_compute_no_entropy_and_keep_the_in_place_patch(tiny_model_path):
    import verl.utils.torch_functional as verl_F

    engine = _cpu.build_fsdp_engine(tiny_model_path, infer_micro_batch_size_per_gpu=8)
    original = verl_F.logprobs_from_logits_v2
    batch = _tiny.make_minibatch(batch_size=8, prompt_len=PROMPT, response_len=16, vary_lengths=True, seed=1)
    seen = []
    real_infer = engine.infer_batch

    def recording_infer(data, loss_function=None):
        output = real_infer(data, loss_function=loss_function)
        seen.append((tu.get_non_tensor_data(data, "calculate_entropy", None),
                     verl_F.logprobs_from_logits_v2 is original, "entropy" in output["model_output"]))
        return output

    engine.infer_batch = recording_infer
    knobs = {KL_COV: dict(kl_cov_ratio=0.1, ppo_kl_coef=1.0), CLIP_COV: dict(clip_cov_ratio=0.1, clip_cov_lb=-1e9,
                                                                             clip_cov_ub=1e9),
             HIGH_ENTROPY: dict()}
    by_mode = {}
    for mode, policy_loss in knobs.items():
        seen.clear()
        actor = _tiny.make_actor_config(
            policy_loss=(mode.config_class or HighEntropyGlobalPolicyLossConfig)(**policy_loss))
        engine_prepass.run_prepass_and_select(engine, batch.copy(), mode.read_settings(actor), mode)
        by_mode[mode.name] = list(seen)
    # (calculate_entropy, verl's own log-prob function in place, entropy in the output) per forward
    assert by_mode["kl_cov_global"] == by_mode["clip_cov_global"] == [(False, False, False)]
    assert by_mode["high_entropy_global"] == [(True, True, True)]
    assert verl_F.logprobs_from_logits_v2 is original


# ---------------------------------------------------------------------------------------------
# Invariance: training micro-batches, engines, DP, SP, epochs


def test_dynamic_micro_batches_1_vs_8(tiny_model_path, capsys):
    spec = EngineSpec(tiny_model_path)
    batch = _batch(spec, 0)
    results = run_block(spec, batch, dynamic_layouts(BATCH, SEQ, 8), actor_config_for, modes=MODES)
    ratio = _assert_invariant(results, batch)
    with capsys.disabled():
        print(f"\n[high_entropy_global dynamic 1 vs 8] max|dtheta| / control {ratio:.2f}")


@pytest.mark.parametrize("strategy, packed", [("fsdp2", False), ("fsdp", True)], ids=["fsdp2-padded", "fsdp-packed"])
def test_static_micro_batches_1_vs_8(tiny_model_path, strategy, packed, capsys):
    spec = EngineSpec(tiny_model_path, strategy=strategy, use_remove_padding=packed)
    batch = _batch(spec, 1)
    results = run_block(spec, batch, static_layouts(BATCH, 8), actor_config_for, modes=MODES)
    ratio = _assert_invariant(results, batch)
    with capsys.disabled():
        print(f"\n[high_entropy_global static {strategy} {'packed' if packed else 'padded'} 1 vs 8] "
              f"max|dtheta| / control {ratio:.2f}")
