"""The prepass hook in verl's real FSDP engine (CPU): the experiment of verl issue #7829.

Parameter updates are compared against the penalty-free control's noise floor
(``vanilla``: the same update, only re-associated sums differ), never a fixed tolerance.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from verl_klcov_global.lab import tiny as _tiny
from verl_klcov_global.layout import fit_width
from verl_klcov_global.lab.experiment import (
    EngineSpec, MicroBatchLayout, dynamic_layouts, frozen_minibatch, max_abs_diff, one_update, run_block,
    static_layouts,
)

from ..support.selections import recorded_selections

pytestmark = pytest.mark.slow  # verl's real engine / workers / trainer on CPU: the slow tier

BATCH, PROMPT, RESPONSE = 64, 16, 128
SEQ = PROMPT + RESPONSE
NOISE_FACTOR = 10  # kl_cov_global's layout difference must stay within 10x the control's
BLOCKS = (0, 1, 2)


def actor_config_for(mode, **kwargs):
    return _tiny.make_actor_config(loss_mode=mode, kl_cov_ratio=0.0002, ppo_kl_coef=1.0, **kwargs)


def assert_invariant(results, report):
    control = results["vanilla"].max_param_diff
    global_ = results["kl_cov_global"]
    assert global_.masks_identical is True
    assert global_.selected_per_layout == (1, 1)
    assert control > 0, "no noise floor: the two layouts did not differ at all, the comparison proves nothing"
    assert global_.max_param_diff <= NOISE_FACTOR * control, (global_.max_param_diff, control)
    report.append(global_.max_param_diff / control)


@pytest.mark.slow
def test_issue_7829_dynamic_micro_batches_kl_cov_varies_kl_cov_global_does_not(tiny_model_path, capsys):
    spec = EngineSpec(tiny_model_path)
    global_ratios, kl_cov_ratios = [], []
    for seed in BLOCKS:
        batch = frozen_minibatch(spec, seed, batch_size=BATCH, prompt_len=PROMPT, response_len=RESPONSE)
        results = run_block(spec, batch, dynamic_layouts(BATCH, SEQ, 8), actor_config_for,
                            modes=("vanilla", "kl_cov", "kl_cov_global"))
        assert_invariant(results, global_ratios)
        kl_cov = results["kl_cov"]
        assert kl_cov.selected_per_layout == (1, 8)  # 8,192 tokens at 0.0002: one quota vs eight
        kl_cov_ratios.append(kl_cov.max_param_diff / results["vanilla"].max_param_diff)
        assert kl_cov.max_param_diff > 100 * results["vanilla"].max_param_diff
    with capsys.disabled():
        print(f"\n[#7829 dynamic] max|dtheta| / control: kl_cov {[f'{r:.0f}' for r in kl_cov_ratios]}, "
              f"kl_cov_global {[f'{r:.2f}' for r in global_ratios]}")


@pytest.mark.slow
# Padded on FSDP1, packed on FSDP2: packing is the engine's input layout, the same code under either strategy (the
# strategy shards parameters), so the two cells cover both layouts and both strategies. The other two cells, static
# 1 vs 8: test_engine_high_entropy's test_static_micro_batches_1_vs_8 (the same prepass and mask channel). Two blocks
# (the dynamic test above runs three): each cell is 8 updates of a 64-row minibatch on CPU.
@pytest.mark.parametrize("strategy,packed", [("fsdp", False), ("fsdp2", True)], ids=["padded-fsdp", "packed-fsdp2"])
def test_static_micro_batches_64_vs_8(tiny_model_path, strategy, packed, capsys):
    spec = EngineSpec(tiny_model_path, strategy=strategy, use_remove_padding=packed)
    ratios = []
    for seed in BLOCKS[:2]:
        batch = frozen_minibatch(spec, seed, batch_size=BATCH, prompt_len=PROMPT, response_len=RESPONSE)
        results = run_block(spec, batch, static_layouts(BATCH, 8), actor_config_for, modes=("vanilla", "kl_cov_global"))
        assert_invariant(results, ratios)
    with capsys.disabled():
        print(f"\n[static {strategy} {'packed' if packed else 'padded'}] kl_cov_global/control {ratios}")


@pytest.mark.slow
def test_legacy_layout_with_varied_lengths(tiny_model_path):
    spec = EngineSpec(tiny_model_path)
    batch = frozen_minibatch(spec, 7, batch_size=BATCH, prompt_len=PROMPT, response_len=RESPONSE,
                             layout="legacy", vary_lengths=True)
    results = run_block(spec, batch, static_layouts(BATCH, 8), actor_config_for, modes=("vanilla", "kl_cov_global"))
    assert_invariant(results, [])


@contextlib.contextmanager
def upstream_log_probs_recorded(records: list):
    """The log-probs every upstream kl_cov call selects on (its training forward's), in ``records``."""
    from verl.trainer.ppo import core_algos

    original = core_algos.POLICY_LOSS_REGISTRY["kl_cov"]

    def recording(old_log_prob, log_prob, *args, **kwargs):
        records.append(log_prob.detach().clone())
        return original(old_log_prob, log_prob, *args, **kwargs)

    core_algos.POLICY_LOSS_REGISTRY["kl_cov"] = recording
    try:
        yield
    finally:
        core_algos.POLICY_LOSS_REGISTRY["kl_cov"] = original


@pytest.mark.slow
def test_other_loss_terms_stay_intact_against_kl_cov_with_one_micro_batch(tiny_model_path):
    """kl_cov_global over 8 micro-batches == verl's kl_cov over 1 (the reference), with entropy, KL loss, IS weights.

    Premise (bit for bit on any CPU): the engine's inference layout is one forward of the 64 rows, the rows and
    company of the reference's one training micro-batch, so the prepass's log-probs are the ones upstream selects
    on (the same forward; eval mode and no autograd change nothing without dropout), checked first; then both
    penalise the same token. (The default budget, 3 forwards, would put the rows in other company, where the top
    covariance could change places with the next by the last bits on some CPUs.)"""
    spec = EngineSpec(tiny_model_path, infer_max_token_len_per_gpu=BATCH * SEQ)
    batch = frozen_minibatch(spec, 3, batch_size=BATCH, prompt_len=PROMPT, response_len=RESPONSE,
                             with_rollout_is_weights=True, with_ref_log_prob=True, calculate_entropy=True)
    one, eight = dynamic_layouts(BATCH, SEQ, 8)
    extra = dict(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
    upstream = []
    with upstream_log_probs_recorded(upstream):
        reference = one_update(spec, batch, actor_config_for("kl_cov", **extra), one)
    with recorded_selections() as records:
        ours = one_update(spec, batch, actor_config_for("kl_cov_global", **extra), eight)
    (upstream_log_probs,), (record,) = upstream, records
    assert torch.equal(record.log_probs, fit_width(upstream_log_probs, record.log_probs.shape[1]))  # the premise
    control_one = one_update(spec, batch, actor_config_for("vanilla", **extra), one)
    control_eight = one_update(spec, batch, actor_config_for("vanilla", **extra), eight)
    noise = max_abs_diff(control_one.params, control_eight.params)
    assert noise > 0
    assert max_abs_diff(ours.params, reference.params) <= NOISE_FACTOR * noise
    # and the penalty did act: kl_cov_global is not just the control
    assert max_abs_diff(ours.params, control_eight.params) > 100 * noise
    for name in ("actor/kl_cov/quota", "actor/kl_cov/selected", "actor/kl_cov/cov_threshold",
                 "actor/kl_cov/prepass_seconds", "actor/entropy_loss", "kl_loss"):
        assert name in ours.metrics, name


@pytest.mark.slow
def test_bf16_masks_do_not_depend_on_training_micro_batches(tiny_model_path):
    spec = EngineSpec(tiny_model_path, dtype="bf16")
    for seed in (0, 1):
        batch = frozen_minibatch(spec, seed, batch_size=BATCH, prompt_len=PROMPT, response_len=RESPONSE)
        outcomes = [one_update(spec, batch, actor_config_for("kl_cov_global"), layout)
                    for layout in dynamic_layouts(BATCH, SEQ, 8)]
        assert torch.equal(outcomes[0].masks[0], outcomes[1].masks[0])


def _dp_updates(rank, world_size, model_path, batch_file, layout):
    """One update per mode on this rank's contiguous shard of the saved minibatch."""
    batch = torch.load(batch_file, weights_only=False)
    shard = _tiny.shard_for_rank(batch, rank, world_size)
    spec = EngineSpec(model_path)
    with recorded_selections() as records:
        outcomes = {mode: one_update(spec, shard, actor_config_for(mode), layout)
                    for mode in ("vanilla", "kl_cov_global")}
    out = {mode: (o.params, o.masks[0] if o.masks else None) for mode, o in outcomes.items()}
    (record,) = records
    return dict(out, log_probs=record.log_probs)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_dp_ranks_give_the_single_rank_mask_and_update(tiny_model_path, tmp_path, capsys):
    """Premise of the mask (bit for bit on any CPU): the single process's prepass is the ranks' computation. Static
    training micro-batches leave the prepass in the static inference layout of 16 rows: 4 forwards of 16 rows in
    one process, 2 per rank on two over its contiguous half, i.e. the same rows in the same micro-batches, and the
    single process runs with a rank's torch threads; the selection itself does not depend on the split (exact
    group-wide sums). (Dynamic micro-batches would form the inference micro-batches from 64 rows in one process and
    from 32 per rank: other company, whose last bits move on some CPUs.) The update: within NOISE_FACTOR x the
    control's difference between the same two settings."""
    from ..support.gloo import spawn_gloo, threads_of_a_rank

    spec = EngineSpec(tiny_model_path)
    layout = MicroBatchLayout("static 8", use_dynamic_bsz=False, micro_batch_size_per_gpu=8)  # 8 on 1 rank, 4 on 2
    ratios = []
    for seed in (0, 1):
        batch = frozen_minibatch(spec, seed, batch_size=BATCH, prompt_len=PROMPT, response_len=RESPONSE)
        with threads_of_a_rank(2), recorded_selections() as records:
            single = {mode: one_update(spec, batch, actor_config_for(mode), layout)
                      for mode in ("vanilla", "kl_cov_global")}
        batch_file = tmp_path / f"batch{seed}.pt"
        torch.save(batch, batch_file)
        rank0, rank1 = spawn_gloo(_dp_updates, 2, tiny_model_path, str(batch_file), layout)

        # bit for bit by construction: the same rows in the same prepass micro-batches (see the docstring)
        (record,) = records
        assert torch.equal(torch.cat([rank0["log_probs"], rank1["log_probs"]]), record.log_probs)
        assert torch.equal(torch.cat([rank0["kl_cov_global"][1], rank1["kl_cov_global"][1]]),
                           single["kl_cov_global"].masks[0])
        assert torch.equal(rank0["kl_cov_global"][0], rank1["kl_cov_global"][0])  # ranks agree on the update
        control = max_abs_diff(rank0["vanilla"][0], single["vanilla"].params)
        ours = max_abs_diff(rank0["kl_cov_global"][0], single["kl_cov_global"].params)
        assert control > 0
        assert ours <= NOISE_FACTOR * control, (ours, control)
        ratios.append(ours / control)
    with capsys.disabled():
        print(f"\n[DP 2 vs 1] kl_cov_global/control {ratios}")


def test_static_prepass_on_a_minibatch_smaller_than_the_inference_micro_batch(tiny_model_path):
    """12 rows per minibatch, log-prob micro-batch size 16: verl would assert; the prepass uses 12."""
    spec = EngineSpec(tiny_model_path, infer_micro_batch_size_per_gpu=16)
    batch = frozen_minibatch(spec, 5, batch_size=12, prompt_len=PROMPT, response_len=32, micro_batch_size_per_gpu=4)
    outcomes = [one_update(spec, batch, actor_config_for("kl_cov_global"), layout)
                for layout in static_layouts(12, 3)]
    assert outcomes[0].selected_tokens == outcomes[1].selected_tokens == 1
    assert torch.equal(outcomes[0].masks[0], outcomes[1].masks[0])
