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
import math

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
from verl_klcov_global.methods.clip_cov.row import CLIP_COV
from verl_klcov_global.methods.high_entropy.row import HIGH_ENTROPY
from verl_klcov_global.methods.kl_cov.row import KL_COV
from verl_klcov_global.methods.high_entropy.selection import high_entropy_quota

from ..support.gloo import spawn_gloo
from ..support.selections import recorded_selections, reselect, selection_margin
from .test_reuse import ROW_COMPANY_NOISE

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
        engine_config = configs["engine_config"]
        # verl 0.9.1 lets the chunk size be set (small: several chunks here); 0.8.0 has a fixed one
        size = {"entropy_from_logits_chunk_size": 64} if hasattr(engine_config, "entropy_from_logits_chunk_size") else {}
        configs["engine_config"] = dataclasses.replace(engine_config, entropy_from_logits_with_chunking=True,
                                                       entropy_checkpointing=True, **size)
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


def _paper_objective_loss(records, config, model_output, data, dp_group=None):
    """The paper's J_HighEnt on one micro-batch = the whole minibatch, independent of the plugin's selection:
    tau = the k-th largest entropy of the training forward's own entropy (a stable sort: ties by position),
    then verl's ppo_loss with ``vanilla`` on ``A * 1[selected]``, normalised by all tokens (``agg_loss``)."""
    from verl.workers.utils.losses import ppo_loss

    response_mask = padded(data["response_mask"]).bool()
    entropy = fit_width(no_padding_2_padding(model_output["entropy"], data).detach(), response_mask.shape[1])
    values = entropy[response_mask]
    k = high_entropy_quota(values.numel(), RHO)
    chosen = torch.sort(-values.double(), stable=True).indices[:k]
    mask = torch.zeros(response_mask.numel(), dtype=torch.bool)
    mask[response_mask.flatten().nonzero().squeeze(1)[chosen]] = True
    mask = mask.reshape(response_mask.shape)
    records.append((mask, entropy))
    data = data.copy()
    data["advantages"] = padded(data["advantages"]) * mask  # ppo_loss pads every field it reads: padded stays
    return ppo_loss(config, model_output, data, dp_group)


def _update(spec, batch, layout, loss_function):
    engine = spec.build()
    with engine.train_mode():
        engine.train_batch(layout.apply(batch.copy()), loss_function=loss_function)
    params = _cpu.engine_params_flat(engine)
    del engine
    return params


def test_8_micro_batches_give_the_papers_objective_on_the_whole_minibatch(tiny_model_path, capsys):
    """With entropy_coeff, the KL loss and rollout IS weights on: all verl's, over every token.

    Premise of the mask (bit for bit on any CPU): the engine's inference layout is one forward of the 32 rows, the
    rows and company of the paper's one training micro-batch, so the prepass's eval entropy is the training
    forward's (the same forward; eval mode and no autograd change nothing without dropout), checked first. With the
    prepass in other company (two 16-row forwards) a token's entropy could cross the top-k boundary by the last
    bits on some CPUs."""
    from verl.workers.utils.losses import ppo_loss

    spec = EngineSpec(tiny_model_path, infer_micro_batch_size_per_gpu=BATCH)
    batch = _batch(spec, 2, with_rollout_is_weights=True, with_ref_log_prob=True, calculate_entropy=True)
    one, eight = static_layouts(BATCH, 8)
    extra = dict(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
    records = []
    reference = _update(spec, batch, one, functools.partial(functools.partial(_paper_objective_loss, records),
                                                            config=actor_config_for("vanilla", **extra)))
    with recorded_selections() as selections:
        ours = one_update(spec, batch, actor_config_for("high_entropy_global", **extra), eight)
    control_one = _update(spec, batch, one, functools.partial(ppo_loss, config=actor_config_for("vanilla", **extra)))
    control_eight = one_update(spec, batch, actor_config_for("vanilla", **extra), eight).params
    noise = max_abs_diff(control_one, control_eight)
    (paper_mask, paper_entropy), = records
    (selection,) = selections
    assert noise > 0
    assert torch.equal(selection.entropy, fit_width(paper_entropy, selection.entropy.shape[1]))  # the premise
    assert torch.equal(ours.masks[0], paper_mask)  # the paper's top-k of that entropy, bit for bit
    assert max_abs_diff(ours.params, reference) <= NOISE_FACTOR * noise, (max_abs_diff(ours.params, reference), noise)
    effect = max_abs_diff(ours.params, control_eight)
    assert effect > 100 * noise, "the mask did not move the update beyond the noise: the test proves nothing"
    for name in ("actor/high_entropy/entropy_threshold", "actor/high_entropy/selected_entropy_share",
                 "actor/high_entropy/prepass_seconds", "actor/entropy_loss", "kl_loss"):
        assert name in ours.metrics, name
    with capsys.disabled():
        print(f"\n[paper objective, 1 micro-batch vs high_entropy_global on 8] max|dtheta| / control "
              f"{max_abs_diff(ours.params, reference) / noise:.2f}, mask effect / control {effect / noise:.0f}")


def _sp_run(spec, batch, attention):
    """One update per mode with the Ulysses test attention; what the prepass selected, and on which statistics."""
    layout = MicroBatchLayout("static 4", use_dynamic_bsz=False, micro_batch_size_per_gpu=4)
    with attention() as counts, recorded_selections() as records:
        outcomes = {mode: one_update(spec, batch, actor_config_for(mode), layout) for mode in MODES}
    (record,) = records
    return dict(params={m: o.params for m, o in outcomes.items()}, mask=outcomes["high_entropy_global"].masks[0],
                figures=outcomes["high_entropy_global"].figures[0], all_to_all=counts.all_to_all,
                log_probs=record.log_probs, entropy=record.entropy, record=record)


def _dp_then_sp_updates(rank, world_size, model_path, dp_batch_file, dp_layout, sp_batch_file):
    """On 2 gloo processes (one spawn for both: starting them is the slow part): DP 2 on this rank's contiguous
    shard, then Ulysses SP 2 x DP 1 on the whole SP minibatch."""
    from ..support.ulysses import UlyssesEngineSpec, cpu_varlen_attention

    shard = _tiny.shard_for_rank(torch.load(dp_batch_file, weights_only=False), rank, world_size)
    dp = {mode: one_update(EngineSpec(model_path), shard, actor_config_for(mode), dp_layout) for mode in MODES}
    sp = _sp_run(UlyssesEngineSpec(model_path, sp_size=2), torch.load(sp_batch_file, weights_only=False),
                 cpu_varlen_attention)
    sp.pop("record")  # its minibatch stays here: the test has the same rows
    return dict(dp={mode: (o.params, o.masks[0] if o.masks else None, o.figures[0] if o.figures else None)
                    for mode, o in dp.items()}, sp=sp)


@pytest.mark.distributed
def test_dp_2_and_ulysses_sp_2_give_the_single_process_mask_figures_and_update(tiny_model_path, tmp_path, capsys):
    """DP 2 vs 1, premise (bit for bit on any CPU): static training micro-batches of 4 rows leave the prepass in the
    static inference layout of 16 rows: 2 forwards in one process, 1 per rank over its contiguous half, i.e. the
    same rows in the same company, with a rank's torch threads; the selection's sums are exact group-wide, so the
    mask and every figure are the single process's bit for bit. (Dynamic micro-batches would form the inference
    micro-batch from 32 rows vs 16.)

    SP 2 vs 1, premise: Ulysses shards every sequence, so the two forwards are not one computation and a token's
    fp32 entropy may differ in the last bits on some CPUs. What holds on every CPU: each side's mask and figures are
    exactly the single-process selection on the statistics its own prepass computed (SP counted nothing twice); the
    counts are equal; the masks are equal because the gap at the top-k boundary exceeds twice the largest entropy
    difference between the two sides (measured; the float figures then differ only through those statistics); the
    update is within NOISE_FACTOR x the control's difference."""
    from ..support.gloo import threads_of_a_rank
    from ..support.ulysses import UlyssesEngineSpec, cpu_varlen_attention

    # DP 2 vs 1: static micro-batches of 4 sequences (8 on one rank, 4 per rank on two)
    spec = EngineSpec(tiny_model_path)
    dp_layout = MicroBatchLayout("static 4", use_dynamic_bsz=False, micro_batch_size_per_gpu=4)
    dp_batch = _batch(spec, 4)
    with threads_of_a_rank(2):
        dp_single = {mode: one_update(spec, dp_batch, actor_config_for(mode), dp_layout) for mode in MODES}
    # SP 2 vs 1: packed, the test varlen attention on both sides
    sp_spec = UlyssesEngineSpec(tiny_model_path, sp_size=1)
    with cpu_varlen_attention():
        # seed 10: a gap of 75 float32 spacings at the top-k boundary of the entropy (the tiny model's entropies
        # crowd near ln 512; seed 5 had 7, against SP's 1-2 spacings of difference under the test's emulation)
        sp_batch = frozen_minibatch(sp_spec, 10, batch_size=16, prompt_len=PROMPT, response_len=RESPONSE,
                                    vary_lengths=True, micro_batch_size_per_gpu=4)
    with threads_of_a_rank(2):
        sp_single = _sp_run(sp_spec, sp_batch, cpu_varlen_attention)
    files = tmp_path / "dp.pt", tmp_path / "sp.pt"
    torch.save(dp_batch, files[0])
    torch.save(sp_batch, files[1])
    rank0, rank1 = spawn_gloo(_dp_then_sp_updates, 2, tiny_model_path, str(files[0]), dp_layout, str(files[1]))

    ours_dp = [rank["dp"]["high_entropy_global"] for rank in (rank0, rank1)]
    width = dp_single["high_entropy_global"].masks[0].shape[1]
    # bit for bit by construction (the DP premise above): the mask, and the figures as exact group-wide sums
    assert torch.equal(torch.cat([fit_width(mask, width) for _, mask, _ in ours_dp]),
                       dp_single["high_entropy_global"].masks[0])
    assert ours_dp[0][2] == ours_dp[1][2] == dp_single["high_entropy_global"].figures[0]
    assert torch.equal(ours_dp[0][0], ours_dp[1][0])  # the ranks agree on the update
    dp_control = max_abs_diff(rank0["dp"]["vanilla"][0], dp_single["vanilla"].params)
    dp_ours = max_abs_diff(ours_dp[0][0], dp_single["high_entropy_global"].params)
    assert dp_control > 0 and dp_ours <= NOISE_FACTOR * dp_control, (dp_ours, dp_control)

    record = sp_single["record"]
    assert record.result.selection.mask.equal(sp_single["mask"])
    for rank in (rank0, rank1):
        sp = rank["sp"]
        assert sp["all_to_all"] > 0 and sp_single["all_to_all"] == 0  # verl's Ulysses path ran, on SP 2 only
        # the SP side's selection is the single-process one on the statistics its own forward computed, exactly
        again = record.mode.select_minibatch(sp["log_probs"], record.data, record.settings, None,
                                             entropy=sp["entropy"])
        assert torch.equal(sp["mask"], again.mask) and sp["figures"] == again.figures()
        counts = ("quota", "selected", "valid_tokens", "nonfinite_tokens")
        assert {k: sp["figures"][k] for k in counts} == {k: sp_single["figures"][k] for k in counts}
        assert float((sp["entropy"] - sp_single["entropy"]).abs().max()) < ROW_COMPANY_NOISE
        gap, drift = selection_margin(record, sp["log_probs"], sp["entropy"])
        assert drift == 0 or gap > 2 * drift, f"the premise: top-k gap {gap:.3g} vs entropy difference {drift:.3g}"
        assert torch.equal(sp["mask"], sp_single["mask"])  # follows from the margin
        if drift == 0:  # the same statistics: the same figures
            assert sp["figures"] == sp_single["figures"]
    sp_control = max_abs_diff(rank0["sp"]["params"]["vanilla"], sp_single["params"]["vanilla"])
    sp_ours = max_abs_diff(rank0["sp"]["params"]["high_entropy_global"], sp_single["params"]["high_entropy_global"])
    assert sp_control > 0 and sp_ours <= NOISE_FACTOR * sp_control, (sp_ours, sp_control)
    with capsys.disabled():
        print(f"\n[high_entropy_global] max|dtheta| / control: DP 2 vs 1 {dp_ours / dp_control:.2f}, "
              f"SP 2 vs 1 {sp_ours / sp_control:.2f}; SP top-k gap {gap:.2e} vs entropy difference {drift:.2e}")


def test_two_ppo_epochs_with_shuffle_select_per_optimizer_step_whatever_the_micro_batches(tiny_model_path, capsys):
    """verl's TrainingWorker.train_mini_batch: 2 minibatches x 2 epochs, shuffled; 1 vs 4 micro-batches per step.

    Premises: the first step's prepass is one computation for both micro-batchings (the same 8 rows in one
    inference forward, the same initial weights), so its entropy and mask are bit for bit on any CPU. The later
    steps run at weights that differ by the float noise of the earlier updates (on every CPU), so their entropies
    differ in the last bits: each mask is exactly the selection on its own step's entropy, and the masks are equal
    because the gap at the top-k boundary exceeds twice the largest entropy difference between the two runs
    (measured). The update: within NOISE_FACTOR x the control's difference."""
    from verl.workers.utils.losses import ppo_loss

    from ..support.workers import build_training_worker

    rows, mini = 16, 8  # 2 minibatches x 2 epochs = 4 optimizer steps
    runs = {}
    for mode in MODES:
        for micro in (mini, mini // 4):
            worker = build_training_worker(tiny_model_path, micro_batch_size_per_gpu=micro)
            actor = actor_config_for(mode, ppo_mini_batch_size=mini, ppo_epochs=2, shuffle=True)
            worker.set_loss_fn(functools.partial(ppo_loss, config=actor))
            # seed 7: gaps of at least 37 float32 spacings at every step's top-k boundary (seed 6: 4, against 1-2
            # spacings of difference between the runs under the test's emulation of company noise)
            batch = _tiny.make_minibatch(batch_size=rows, prompt_len=PROMPT, response_len=RESPONSE, vary_lengths=True,
                                         seed=7, global_batch_size=mini, micro_batch_size_per_gpu=micro)
            tu.assign_non_tensor(batch, mini_batch_size=mini, epochs=2, seed=42, dataloader_kwargs={"shuffle": True})
            with recorded_selections() as records:
                worker.train_mini_batch(batch)
            runs[mode, micro] = (records, _cpu.engine_params_flat(worker.engine))
    (steps_one, ours_one) = runs["high_entropy_global", mini]
    (steps_four, ours_four) = runs["high_entropy_global", mini // 4]
    assert len(steps_one) == len(steps_four) == 4  # one selection per optimizer step
    assert torch.equal(steps_one[0].entropy, steps_four[0].entropy)  # the first step: one computation
    margins = []
    for one, four in zip(steps_one, steps_four):
        for step in (one, four):  # each mask is the selection on its own step's statistics
            assert torch.equal(step.result.selection.mask, reselect(step).mask)
        gap, drift = selection_margin(one, four.log_probs, four.entropy)
        assert drift == 0 or gap > 2 * drift, f"the premise: top-k gap {gap:.3g} vs entropy difference {drift:.3g}"
        assert torch.equal(one.result.selection.mask, four.result.selection.mask)  # follows from the margin
        margins.append(gap / drift if drift else math.inf)
    assert not torch.equal(steps_one[0].result.selection.mask, steps_one[2].result.selection.mask)  # epoch 2 reshuffles
    control = max_abs_diff(runs["vanilla", mini][1], runs["vanilla", mini // 4][1])
    ours = max_abs_diff(ours_one, ours_four)
    assert control > 0 and ours <= NOISE_FACTOR * control, (ours, control)
    with capsys.disabled():
        print(f"\n[high_entropy_global 2 epochs shuffled, 1 vs 4 micro-batches] max|dtheta| / control "
              f"{ours / control:.2f}"
              f"; top-k gap / entropy difference per step {[f'{m:.3g}' for m in margins]}")
