"""clip_cov_global in verl's real FSDP engine (CPU): one selection per minibatch, upstream's update where it is defined.

Upstream ``clip_cov`` is deterministic only when every candidate fits the quota; there
``clip_cov_global`` at any micro-batching must give upstream's selected set and update on the whole
minibatch in one micro-batch ("same update" = within 10x the noise floor of the penalty-free
control, ``vanilla``, between the same two layouts). With sampling (more candidates than the quota)
the mask must not depend on micro-batching, DP size or earlier calls.

The tiny model's covariances are small (the 99.5th percentile is ~0.5 on these minibatches), so
the window is lowered from verl's 1..5: ``ALL_FIT`` keeps ~50 of 8,192 tokens (quota 163),
``SAMPLED`` ~200 (quota 16).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from verl.trainer.ppo import core_algos

from verl_klcov_global.lab import tiny as _tiny
from verl_klcov_global.config import ClipCovGlobalPolicyLossConfig
from verl_klcov_global.lab.experiment import (
    EngineSpec, MicroBatchLayout, dynamic_layouts, frozen_minibatch, max_abs_diff, one_update, static_layouts,
)

from verl_klcov_global.layout import fit_width

from ..selection.test_clip_cov import upstream_clip_cov_selection
from ..support.selections import recorded_selections

pytestmark = pytest.mark.slow  # verl's real engine / workers / trainer on CPU: the slow tier

BATCH, PROMPT, RESPONSE = 64, 16, 128
SEQ = PROMPT + RESPONSE
NOISE_FACTOR = 10
CLIP = dict(clip_ratio_low=0.2, clip_ratio_high=0.28)
ALL_FIT = dict(clip_cov_ratio=0.02, clip_cov_lb=0.45, clip_cov_ub=5.0)
SAMPLED = dict(clip_cov_ratio=0.002, clip_cov_lb=0.3, clip_cov_ub=5.0)


def actor_config(mode, knobs=ALL_FIT, seed=None):
    from verl.workers.config import PolicyLossConfig

    if seed is None:
        policy_loss = PolicyLossConfig(loss_mode=mode, **knobs)
    else:
        policy_loss = ClipCovGlobalPolicyLossConfig(loss_mode=mode, clip_cov_seed=seed, **knobs)
    return _tiny.make_actor_config(policy_loss=policy_loss, **CLIP)


@contextlib.contextmanager
def upstream_selection_recorded(records: list):
    """Record, for every upstream clip_cov call, its candidate set, quota and the log-probs it selected on (verl's
    own code on its inputs)."""
    original = core_algos.POLICY_LOSS_REGISTRY["clip_cov"]

    def recording(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                  rollout_is_weights=None):
        candidates, clip_num, _ = upstream_clip_cov_selection(
            advantages, log_prob.detach(), old_log_prob, response_mask, config.policy_loss.clip_cov_ratio,
            config.policy_loss.clip_cov_lb, config.policy_loss.clip_cov_ub, config.clip_ratio_low,
            config.clip_ratio_high)
        records.append((candidates, clip_num, log_prob.detach().clone()))
        return original(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)

    core_algos.POLICY_LOSS_REGISTRY["clip_cov"] = recording
    try:
        yield
    finally:
        core_algos.POLICY_LOSS_REGISTRY["clip_cov"] = original


def whole_minibatch_spec(model_path, rows, **kwargs):
    """An engine whose log-prob inference layout (the prepass's) is one forward of the whole ``rows``-row minibatch,
    static or dynamic: the micro-batch company of upstream's reference, one training micro-batch of the same rows."""
    return EngineSpec(model_path, infer_micro_batch_size_per_gpu=rows, infer_max_token_len_per_gpu=rows * SEQ,
                      **kwargs)


def upstream_on_one_micro_batch(spec, batch, knobs=ALL_FIT):
    """verl's clip_cov on the whole minibatch in one micro-batch; asserts it was deterministic there. Returns its
    outcome, candidates and the log-probs it selected on."""
    records = []
    with upstream_selection_recorded(records):
        outcome = one_update(spec, batch, actor_config("clip_cov", knobs), static_layouts(len(batch), 1)[0])
    (candidates, clip_num, log_probs), = records
    assert 0 < int(candidates.sum()) <= clip_num, "every candidate must fit the quota for a deterministic reference"
    return outcome, candidates, log_probs


def check_same_update_as_upstream(spec, batch, layouts, report):
    """clip_cov_global at each layout vs verl's clip_cov on one micro-batch; noise = vanilla(1) vs vanilla(layout).

    Premise of the mask (bit for bit on any CPU): ``spec``'s inference layout is the whole minibatch in one forward
    (:func:`whole_minibatch_spec`), the rows and company of upstream's one training micro-batch, so the prepass's
    log-probs are upstream's (the same forward; eval mode and no autograd change nothing without dropout), checked
    here first. With the prepass in other company (e.g. 16-row forwards) a token's covariance could cross the
    window's bound by the last bits on some CPUs."""
    reference, upstream_mask, upstream_log_probs = upstream_on_one_micro_batch(spec, batch)
    control_one = one_update(spec, batch, actor_config("vanilla"), static_layouts(len(batch), 1)[0])
    noises = []
    for layout in layouts:
        with recorded_selections() as records:
            ours = one_update(spec, batch, actor_config("clip_cov_global"), layout)
        control = one_update(spec, batch, actor_config("vanilla"), layout)
        noise = max_abs_diff(control_one.params, control.params)
        assert noise > 0, "no noise floor: the two layouts did not differ at all, the comparison proves nothing"
        (record,) = records
        assert torch.equal(record.log_probs, fit_width(upstream_log_probs, record.log_probs.shape[1]))  # premise
        (mask,) = ours.masks
        assert torch.equal(mask, upstream_mask.to(mask.device))  # the same selected set, bit for bit
        (figures,) = ours.figures
        assert figures["clipped"] == figures["candidates"] == int(mask.sum())
        difference = max_abs_diff(ours.params, reference.params)
        assert difference <= NOISE_FACTOR * noise, (layout.name, difference, noise)
        # and the selection did act: cutting the gradient of ~50 tokens moves the update far beyond the noise
        assert max_abs_diff(ours.params, control.params) > 100 * noise
        report.append((layout.name, difference / noise))
        noises.append(noise)
    return reference, noises


@pytest.fixture(scope="module")
def padded_batch(tiny_model_path):
    return frozen_minibatch(EngineSpec(tiny_model_path), 0, batch_size=BATCH, prompt_len=PROMPT, response_len=RESPONSE)


@pytest.mark.slow
def test_all_candidates_clipped_dynamic_micro_batches_equal_verl_clip_cov_on_one(tiny_model_path, padded_batch,
                                                                                   capsys):
    """fsdp, padded, dynamic 2 and 8 micro-batches (~90 s, 7 updates): global == upstream(1); upstream(8) is not."""
    spec = whole_minibatch_spec(tiny_model_path, BATCH)
    layouts = [dynamic_layouts(BATCH, SEQ, count)[1] for count in (2, 8)]
    report = []
    reference, noises = check_same_update_as_upstream(spec, padded_batch, layouts, report)
    # upstream per micro-batch: means and quotas of each micro-batch (verl #7829), another update
    upstream_eight = one_update(spec, padded_batch, actor_config("clip_cov"), layouts[1])
    upstream_ratio = max_abs_diff(upstream_eight.params, reference.params) / noises[1]
    assert upstream_ratio > NOISE_FACTOR
    with capsys.disabled():
        print(f"\n[clip_cov all-fit, dynamic] max|dtheta| vs clip_cov(1 micro-batch) / control: "
              f"clip_cov_global {[f'{name}: {r:.2f}' for name, r in report]}, clip_cov(8 micro-batches) "
              f"{upstream_ratio:.0f}")


@pytest.mark.slow
@pytest.mark.parametrize("strategy,packed,micro_batches", [("fsdp", False, 8), ("fsdp2", True, 4)],
                         ids=["fsdp-padded-8", "fsdp2-packed-4"])
def test_all_candidates_clipped_static_micro_batches_equal_verl_clip_cov_on_one(tiny_model_path, padded_batch,
                                                                                strategy, packed, micro_batches,
                                                                                capsys):
    """Static micro-batches: fsdp padded (64 rows, ~40 s), fsdp2 packed (32 rows: packed attention on CPU is
    quadratic in the micro-batch's tokens, ~40 s)."""
    rows = 32 if packed else BATCH
    spec = whole_minibatch_spec(tiny_model_path, rows, strategy=strategy, use_remove_padding=packed)
    batch = frozen_minibatch(spec, 1, batch_size=rows, prompt_len=PROMPT, response_len=RESPONSE) if packed \
        else padded_batch
    report = []
    check_same_update_as_upstream(spec, batch, [static_layouts(rows, micro_batches)[1]], report)
    with capsys.disabled():
        print(f"\n[clip_cov all-fit, static {strategy} {'packed' if packed else 'padded'}] clip_cov_global at "
              f"{micro_batches} micro-batches vs clip_cov(1) / control: {report[0][1]:.2f}")


@pytest.mark.slow
def test_sampled_masks_do_not_depend_on_micro_batching_or_earlier_calls(tiny_model_path, padded_batch, capsys):
    """Quota 16 of ~250 candidates (~40 s): the same draw at 1, 8 dynamic and 4 static micro-batches.

    Premise of the masks (bit for bit on any CPU): the prepass's inference layout is one forward of the 64 rows
    whether the training layout is dynamic (a token budget of 64 rows) or static (64 rows per forward), so its
    log-probs are one computation in all three (checked); the engine's default (a budget of 4,096 tokens: 3
    forwards, vs 4 static forwards of 16 rows) would put the rows in other company for the static layout."""
    spec = whole_minibatch_spec(tiny_model_path, BATCH)
    one, eight = dynamic_layouts(BATCH, SEQ, 8)
    layouts = [one, eight, static_layouts(BATCH, 4)[1]]
    torch.manual_seed(123)
    outcomes = []
    with recorded_selections() as records:
        for layout in layouts:
            torch.rand(17)  # whatever the process-wide RNG holds must not matter
            outcomes.append(one_update(spec, padded_batch, actor_config("clip_cov_global", SAMPLED), layout))
    assert all(torch.equal(r.log_probs, records[0].log_probs) for r in records[1:])  # the premise
    masks = [o.masks[0] for o in outcomes]
    assert all(torch.equal(m, masks[0]) for m in masks[1:])
    figures = outcomes[0].figures[0]
    quota, candidates = figures["quota"], figures["candidates"]
    assert 0 < quota < candidates and int(masks[0].sum()) == quota == figures["clipped"]
    # the update follows the mask: within the control's noise between 1 and 8 micro-batches
    noise = max_abs_diff(one_update(spec, padded_batch, actor_config("vanilla"), one).params,
                         one_update(spec, padded_batch, actor_config("vanilla"), eight).params)
    ratio = max_abs_diff(outcomes[0].params, outcomes[1].params) / noise
    assert ratio <= NOISE_FACTOR
    # another seed draws other tokens (same count)
    other = one_update(spec, padded_batch, actor_config("clip_cov_global", SAMPLED, seed=1), eight).masks[0]
    assert int(other.sum()) == quota and not torch.equal(other, masks[0])
    with capsys.disabled():
        print(f"\n[clip_cov_global sampled: quota {quota:.0f} of {candidates:.0f} candidates] masks identical over "
              f"{len(layouts)} calls; 1 vs 8 micro-batches / control: {ratio:.2f}")


def _dp_update(rank, world_size, model_path, batch_file, layout):
    batch = torch.load(batch_file, weights_only=False)
    shard = _tiny.shard_for_rank(batch, rank, world_size)
    spec = EngineSpec(model_path)
    with recorded_selections() as records:
        outcomes = {mode: one_update(spec, shard, actor_config(mode, SAMPLED), layout)
                    for mode in ("vanilla", "clip_cov_global")}
    (record,) = records
    return dict({mode: (o.params, o.masks[0] if o.masks else None) for mode, o in outcomes.items()},
                log_probs=record.log_probs)


@pytest.mark.slow
@pytest.mark.distributed
def test_sampled_mask_on_two_dp_ranks_is_the_single_rank_mask(tiny_model_path, padded_batch, tmp_path, capsys):
    """2 gloo ranks vs 1 process, the sampled case (~60 s).

    Premise of the mask (bit for bit on any CPU): static training micro-batches of 8 rows leave the prepass in the
    static inference layout of 16 rows, 4 forwards in one process and 2 per rank over its contiguous half: the same
    rows in the same company, with a rank's torch threads (checked: the log-probs are equal); the selection and the
    draw do not depend on the split. (Dynamic micro-batches would form the inference ones from 64 rows vs 32.)"""
    from ..support.gloo import spawn_gloo, threads_of_a_rank

    spec = EngineSpec(tiny_model_path)
    layout = MicroBatchLayout("static 8", use_dynamic_bsz=False, micro_batch_size_per_gpu=8)  # 8 on 1 rank, 4 on 2
    with threads_of_a_rank(2), recorded_selections() as records:
        single = {mode: one_update(spec, padded_batch, actor_config(mode, SAMPLED), layout)
                  for mode in ("vanilla", "clip_cov_global")}
    batch_file = tmp_path / "batch.pt"
    torch.save(padded_batch, batch_file)
    rank0, rank1 = spawn_gloo(_dp_update, 2, tiny_model_path, str(batch_file), layout)
    (record,) = records
    assert torch.equal(torch.cat([rank0["log_probs"], rank1["log_probs"]]), record.log_probs)  # the premise
    mask = single["clip_cov_global"].masks[0]
    assert 0 < int(mask.sum()) < single["clip_cov_global"].figures[0]["candidates"]
    assert torch.equal(torch.cat([rank0["clip_cov_global"][1], rank1["clip_cov_global"][1]]), mask)
    assert torch.equal(rank0["clip_cov_global"][0], rank1["clip_cov_global"][0])
    control = max_abs_diff(rank0["vanilla"][0], single["vanilla"].params)
    ours = max_abs_diff(rank0["clip_cov_global"][0], single["clip_cov_global"].params)
    assert control > 0 and ours <= NOISE_FACTOR * control, (ours, control)
    with capsys.disabled():
        print(f"\n[clip_cov_global sampled, DP 2 vs 1] mask identical; update / control: {ours / control:.2f}")


def test_metrics_of_a_clip_cov_global_step(tiny_model_path):
    """Small minibatch (~10 s): Clip-Cov's selection figures and timings reach verl's metrics, under actor/clip_cov/."""
    spec = EngineSpec(tiny_model_path)
    batch = frozen_minibatch(spec, 2, batch_size=8, prompt_len=8, response_len=32, micro_batch_size_per_gpu=4)
    outcome = one_update(spec, batch, actor_config("clip_cov_global", dict(SAMPLED, clip_cov_lb=0.0)),
                         MicroBatchLayout("2 static", False, micro_batch_size_per_gpu=4))
    for name in ("quota", "candidates", "clipped", "valid_tokens", "nonfinite_tokens", "prepass_seconds",
                 "selection_seconds"):
        assert f"actor/clip_cov/{name}" in outcome.metrics, name
    assert "actor/pg_clipfrac" in outcome.metrics and "actor/ppo_kl" in outcome.metrics
    assert not any(name.startswith("actor/kl_cov/") for name in outcome.metrics)


def test_every_optimizer_step_draws_afresh_and_the_training_micro_batches_do_not_change_the_draw(tiny_model_path):
    """Upstream draws afresh on every loss call. The global draw is seeded with the actor's optimizer-step count:
    with 2 PPO epochs over one minibatch at learning rate 0 (the same candidates in both epochs), the two optimizer
    steps cut different tokens, and training micro-batches of 16 and 4 rows cut the same tokens at each step."""
    import functools

    from verl.workers.utils.losses import ppo_loss

    from verl_klcov_global.engine.step import observe_selections

    from ..support.workers import build_training_worker
    from .test_reuse import ROWS, log_prob_pass, rows, update

    policy_loss = ClipCovGlobalPolicyLossConfig(clip_cov_ratio=0.02, clip_cov_lb=0.0, clip_cov_ub=5.0)
    selections = {}
    for micro in (16, 4):
        worker = build_training_worker(tiny_model_path, lr=0.0, micro_batch_size_per_gpu=micro)
        config = _tiny.make_actor_config(policy_loss=policy_loss, ppo_mini_batch_size=ROWS, ppo_epochs=2, **CLIP)
        worker.set_loss_fn(functools.partial(ppo_loss, config=config))
        batch = rows(51)
        log_prob_pass(worker, batch)
        seen = []
        with observe_selections(lambda _engine, result: seen.append(result.selection)):
            update(worker, batch, mini_batch=ROWS, epochs=2, shuffle=False)
        selections[micro] = seen
    for a, b in zip(selections[16], selections[4], strict=True):
        assert torch.equal(a.mask, b.mask)
    first, second = selections[16]
    assert first.num_candidates == second.num_candidates > first.num_selected == second.num_selected > 0
    assert not torch.equal(first.mask, second.mask)
