"""The prepass on verl's real FSDP engine (CPU): its micro-batches, its memory, its trace and its metrics.

* static inference layout: ``ceil(rows / size)`` forwards (13 rows, size 8: 2), agreed over the DP
  group, masks identical to the single-forward prepass; dynamic: verl's split with the log-prob budget;
* memory: the previous step's gradients are gone and, with ``optimizer_offload``, the optimizer
  states have been handed to verl's offload before the prepass forward and loaded back after it
  (on a CPU the "device" is the host, so the calls, their order and the unchanged update are what
  can be checked here, not the bytes);
* the batched log-prob path gives verl's own log-probs bit for bit here (vocab 400 < torch's
  reduction grain), and is independent of the thread count and of the rows sharing a call;
* ``record_function`` names in a profiler trace; ``prepass_share``; ``selected_in_micro_batch``
  as an explicit MEAN metric.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import pytest
import torch
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.workers.engine.utils import prepare_micro_batches
from verl.workers.utils.losses import ppo_loss

from verl_klcov_global.engine import logprobs as engine_logprobs, prepass as engine_prepass, step as engine_step

from verl_klcov_global.layout import fit_width
from verl_klcov_global.lab import cpu as _cpu
from verl_klcov_global.lab import tiny as _tiny
from verl_klcov_global.config import KLCovGlobalSettings
from verl_klcov_global.methods.kl_cov.row import KL_COV
from verl_klcov_global.lab.experiment import EngineSpec, frozen_minibatch

from ..support.gloo import spawn_gloo
from ..support.selections import Recorded, reselect, selection_margin
from .test_reuse import ROW_COMPANY_NOISE

pytestmark = pytest.mark.slow  # verl's real engine / workers / trainer on CPU: the slow tier

ROWS, PROMPT, RESPONSE = 13, 8, 32
RATIO = 0.02


@pytest.fixture(scope="module")
def thirteen_rows(tiny_model_path):
    """13 sequences of varied length (v1 layout), old_log_probs = initial policy + N(0, 0.05)."""
    return frozen_minibatch(EngineSpec(tiny_model_path), 21, batch_size=ROWS, prompt_len=PROMPT,
                            response_len=RESPONSE, vary_lengths=True, micro_batch_size_per_gpu=13)


def _settings(layout="infer"):
    return KLCovGlobalSettings(kl_cov_ratio=RATIO, ppo_kl_coef=1.0, prepass_layout=layout)


def _with_engine_config(engine, **changes):
    engine.engine_config = dataclasses.replace(engine.engine_config, **changes)
    return engine


def _record_forwards(engine):
    """Wrap ``engine.forward_step``: list of (rows, forward_only) per model forward."""
    forwards = []
    real = engine.forward_step

    def recording(micro_batch, loss_function, forward_only):
        forwards.append((len(micro_batch), forward_only))
        return real(micro_batch, loss_function=loss_function, forward_only=forward_only)

    engine.forward_step = recording
    return forwards


# ---------------------------------------------------------------------------------------------
# Micro-batching of the prepass


def test_static_prepass_runs_ceil_rows_over_size_forwards_with_the_single_forward_masks(tiny_model_path,
                                                                                      thirteen_rows, monkeypatch):
    """Premise of the masks: each size puts the rows in other micro-batch company, where a row's fp32 log-probs may
    differ in the last bits on some CPUs. What holds on every CPU, and is checked: each mask is exactly KL-Cov's
    selection on the log-probs its own prepass computed, those are the single forward's within company noise, and
    the masks are the single forward's because the gap at the top-k boundary of the covariance exceeds twice its
    largest difference from the single forward's (measured)."""
    engine = _cpu.build_fsdp_engine(tiny_model_path)
    forwards = _record_forwards(engine)
    log_probs = []
    real_compute = engine_prepass.compute_prepass_log_probs
    monkeypatch.setattr(engine_prepass, "compute_prepass_log_probs",
                        lambda *args: log_probs.append(real_compute(*args)) or log_probs[-1])
    batch = _tiny.set_micro_batching(thirteen_rows.copy(), use_dynamic_bsz=False, micro_batch_size_per_gpu=13)
    records, counts, drift = {}, {}, 0.0
    for size in (16, 8, 5, 4, 1):
        _with_engine_config(engine, infer_micro_batch_size_per_gpu=size)
        forwards.clear()
        result = engine_prepass.run_prepass_and_select(engine, batch, _settings(), KL_COV)
        counts[size] = [rows for rows, _ in forwards]
        assert all(forward_only for _, forward_only in forwards)
        records[size] = Recorded(result, batch, _settings(), KL_COV, None, log_probs[-1], None)
        drift = max(drift, float((log_probs[-1] - log_probs[0]).abs().max()))
    # ceil(13 / size) forwards, row counts differing by at most one (13 rows, size 8: 2 forwards, not 13)
    assert counts == {16: [13], 8: [7, 6], 5: [5, 4, 4], 4: [4, 3, 3, 3], 1: [1] * 13}
    single = records[16]
    assert single.result.selection.mask.sum() == single.result.selection.quota > 1
    assert drift < ROW_COMPANY_NOISE
    margins = {}
    for size, record in records.items():
        assert torch.equal(record.result.selection.mask, reselect(record).mask), size  # on its own log-probs
        gap, cov_drift = selection_margin(single, record.log_probs)
        assert cov_drift == 0 or gap > 2 * cov_drift, (size, gap, cov_drift)  # the premise, measured
        assert torch.equal(record.result.selection.mask, single.result.selection.mask), size
        margins[size] = gap / cov_drift if cov_drift else math.inf
    print(f"\n[static prepass, 13 rows] forwards per size {({s: len(c) for s, c in counts.items()})}, "
          f"max |log-prob - single forward| {drift:.1e}, top-k gap / covariance difference {margins}")


@pytest.mark.parametrize("rows, size, expected", [(13, 8, [7, 6]), (16, 8, [8, 8]), (12, 16, [12]), (7, 3, [3, 2, 2]),
                                                  (1, 4, [1])])
def test_static_chunk_sizes_without_a_group(rows, size, expected):
    assert engine_prepass.static_prepass_chunk_sizes(rows, size) == expected


def _agree(rank, world_size, scenarios, size):
    """``static_prepass_chunk_sizes`` on this rank for each (rows of rank 0, rows of rank 1); errors as text."""
    import torch.distributed as dist

    results = []
    for rows_per_rank in scenarios:
        try:
            results.append(engine_prepass.static_prepass_chunk_sizes(rows_per_rank[rank], size, dist.group.WORLD))
        except ValueError as error:
            results.append(f"ValueError: {error}")
    return results


@pytest.mark.slow
@pytest.mark.distributed
def test_static_chunk_count_is_agreed_over_the_dp_group_or_every_rank_raises():
    # 13 and 5 rows at size 8: alone, rank 1 would run 1 forward and rank 0 two (FSDP would hang);
    # 17 and 2 rows: 3 forwards, which rank 1 cannot fill: both ranks raise the same error, then go on
    rank0, rank1 = spawn_gloo(_agree, 2, [(13, 5), (17, 2), (16, 16)], 8,
                              verl_platform=True)  # the collective's tensor goes where verl's platform says
    assert [rank0[0], rank1[0]] == [[7, 6], [3, 2]]
    assert rank0[1] == rank1[1] and rank0[1].startswith("ValueError") and "between 2 and 17 rows" in rank0[1]
    assert rank0[2] == rank1[2] == [8, 8]


def test_dynamic_prepass_uses_the_log_prob_token_budget(tiny_model_path, thirteen_rows):
    infer_budget, train_budget = 3 * (PROMPT + RESPONSE), 6 * (PROMPT + RESPONSE)
    engine = _cpu.build_fsdp_engine(tiny_model_path, use_dynamic_bsz=True, infer_max_token_len_per_gpu=infer_budget)
    batch = _tiny.set_micro_batching(thirteen_rows.copy(), use_dynamic_bsz=True, max_token_len_per_gpu=train_budget)
    forwards = _record_forwards(engine)
    budgets = []
    real_infer = engine.infer_batch

    def recording_infer(data, loss_function=None):
        budgets.append(tu.get_non_tensor_data(data, "max_token_len_per_gpu", None))
        return real_infer(data, loss_function=loss_function)

    engine.infer_batch = recording_infer
    engine_prepass.run_prepass_and_select(engine, batch, _settings(), KL_COV)
    expected, _ = prepare_micro_batches(_tiny.set_micro_batching(batch.copy(), use_dynamic_bsz=True,
                                                                 max_token_len_per_gpu=infer_budget))
    assert budgets == [infer_budget]
    assert [rows for rows, _ in forwards] == [len(mb) for mb in expected]
    assert len(forwards) > len(prepare_micro_batches(batch.copy())[0])  # the training budget would give fewer


def test_prepass_log_probs_are_verls_own_bit_for_bit(tiny_model_path, thirteen_rows):
    """The batched in-place path (vocab 400 < 32,768) against verl's infer_batch with its own loop."""
    engine = _cpu.build_fsdp_engine(tiny_model_path, infer_micro_batch_size_per_gpu=13)
    batch = _tiny.set_micro_batching(thirteen_rows.copy(), use_dynamic_bsz=False, micro_batch_size_per_gpu=13)
    ours = engine_prepass.compute_prepass_log_probs(engine, batch, "infer")
    verls = _tiny.compute_current_log_probs(engine, batch)  # eval mode, verl's logprobs_from_logits_v2
    assert torch.equal(ours, fit_width(verls, ours.shape[1]))


# ---------------------------------------------------------------------------------------------
# Batched log-probs: what holds on a CPU for wide rows


WIDE = 40_000  # wider than torch's reduction grain (32,768): verl's 1-row sums split over threads


def _with_threads(threads, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def test_batched_log_probs_are_verls_for_wide_rows_summed_in_one_thread():
    import verl.utils.torch_functional as verl_F

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, WIDE, generator=gen) * 4
    labels = torch.randint(0, WIDE, (6,), generator=gen)
    expected = _with_threads(1, lambda: verl_F.logprobs_from_logits_v2(logits, labels))
    got = _with_threads(1, lambda: engine_logprobs.log_probs_in_place(logits.clone(), labels))
    assert torch.equal(got, expected)


def test_batched_log_probs_do_not_depend_on_threads_or_on_the_rows_sharing_a_call():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(8, WIDE, generator=gen) * 4
    labels = torch.randint(0, WIDE, (8,), generator=gen)
    whole = _with_threads(2, lambda: engine_logprobs.log_probs_in_place(logits.clone(), labels))
    one_thread = _with_threads(1, lambda: engine_logprobs.log_probs_in_place(logits.clone(), labels))
    split = _with_threads(2, lambda: torch.cat([engine_logprobs.log_probs_in_place(logits[:3].clone(), labels[:3]),
                                                engine_logprobs.log_probs_in_place(logits[3:].clone(), labels[3:])]))
    reference = torch.log_softmax(logits.double(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert torch.equal(whole, one_thread) and torch.equal(whole, split)
    assert torch.allclose(whole.double(), reference, atol=1e-5)  # and it is the log-prob


# ---------------------------------------------------------------------------------------------
# Memory: gradients and optimizer states during the prepass


def _adamw_engine(model_path, *, optimizer_offload, **engine_keys):
    """verl's FSDP engine with AdamW (states that offloading moves; plain SGD keeps none)."""
    from verl.workers.engine.base import EngineRegistry

    _cpu.install_cpu_platform()
    configs = _cpu.fsdp_engine_configs(model_path, **{"infer_micro_batch_size_per_gpu": 16, **engine_keys})
    configs["engine_config"] = dataclasses.replace(configs["engine_config"], optimizer_offload=optimizer_offload)
    configs["optimizer_config"] = dataclasses.replace(configs["optimizer_config"], optimizer="AdamW", lr=1e-3)
    torch.manual_seed(0)
    engine = EngineRegistry.new(model_type="language_model", backend="fsdp", **configs)
    engine.initialize()
    return engine


def _two_steps_recording_placement(engine, batch, layout):
    """Two train_batch calls in one verl train-mode context, as TrainingWorker.train_mini_batch makes them.

    Returns (events of step 2, stale gradients before step 2, parameters after). Placement is
    recorded at verl's ``engine.to``, the call verl's train-mode context makes: on this CPU
    platform the device is the host, so the bytes do not move; the calls are what can be checked.
    """
    events = []
    real_to, real_infer, real_fb = engine.to, engine.infer_batch, engine.forward_backward_batch

    def recording_to(device, model=True, optimizer=True, grad=True):
        events.append(f"to({device!r}, model={model}, optimizer={optimizer}, grad={grad})")
        return real_to(device=device, model=model, optimizer=optimizer, grad=grad)

    def recording_infer(data, loss_function=None):
        grads = [p.grad for p in engine.module.parameters()]
        events.append(f"prepass forward (gradients {'none' if all(g is None for g in grads) else 'present'})")
        return real_infer(data, loss_function=loss_function)

    def recording_fb(data, loss_function, forward_only=False):
        if not forward_only:
            events.append("training forward-backward")
        return real_fb(data, loss_function, forward_only=forward_only)

    engine.to, engine.infer_batch, engine.forward_backward_batch = recording_to, recording_infer, recording_fb
    config = _tiny.make_actor_config(policy_loss=_policy_loss(layout))
    loss_function = functools.partial(ppo_loss, config=config)
    with engine.train_mode():
        engine.train_batch(batch.copy(), loss_function=loss_function)
        stale = any(p.grad is not None for p in engine.module.parameters())
        events.clear()
        engine.train_batch(batch.copy(), loss_function=loss_function)
        step_events = list(events)
    return step_events, stale, _cpu.engine_params_flat(engine)


def _policy_loss(layout):
    from verl_klcov_global.config import KLCovGlobalPolicyLossConfig

    return KLCovGlobalPolicyLossConfig(kl_cov_ratio=RATIO, ppo_kl_coef=1.0, prepass_layout=layout)


def test_prepass_runs_without_gradients_and_offloaded_optimizer_states_stay_off_the_device(tiny_model_path,
                                                                                          thirteen_rows):
    from verl.utils.device import get_device_name

    batch = _tiny.set_micro_batching(thirteen_rows.copy(), use_dynamic_bsz=False, micro_batch_size_per_gpu=13)
    runs = {}
    for offload, layout in ((True, "infer"), (False, "infer"), (True, "train")):
        engine = _adamw_engine(tiny_model_path, optimizer_offload=offload)
        events, stale, params = _two_steps_recording_placement(engine, batch, layout)
        assert stale, "no gradients were left from step 1: freeing them proves nothing"
        assert len(engine.optimizer.state) > 0, "AdamW has no states: offloading proves nothing"
        runs[offload, layout] = (events, params)
    # offloaded states: to the host before the prepass forward, back to the device before verl's step
    assert runs[True, "infer"][0] == [
        "to('cpu', model=False, optimizer=True, grad=False)", "prepass forward (gradients none)",
        f"to({get_device_name()!r}, model=False, optimizer=True, grad=False)", "training forward-backward"]
    # not offloaded (on the device during compute_log_prob too), or the training layout: nothing moves
    assert runs[False, "infer"][0] == runs[True, "train"][0] == ["prepass forward (gradients none)",
                                                                 "training forward-backward"]
    # the same two AdamW steps whatever the placement
    assert torch.equal(runs[True, "infer"][1], runs[False, "infer"][1])


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_offloaded_states_stay_on_the_device_when_the_infer_micro_batches_fit_the_training_ones(
        tiny_model_path, thirteen_rows, dynamic):
    """The inference layout with micro-batches no larger than the training ones (the authors' recipes: one token
    budget for both) holds less than the training step with the states on the device: nothing moves, and the
    steps are the ones that moved them (a larger inference budget) bit for bit."""
    if dynamic:  # a training budget of 2,048 tokens against inference budgets of 4,096 (larger) and 2,048 (equal)
        keys = dict(use_dynamic_bsz=True, max_token_len_per_gpu=2048)
        engines = {"larger": dict(infer_max_token_len_per_gpu=4096), "equal": dict(infer_max_token_len_per_gpu=2048)}
    else:  # 13 training rows against 16 (larger) and 13 (equal) inference rows
        keys = dict(use_dynamic_bsz=False, micro_batch_size_per_gpu=13)
        engines = {"larger": dict(infer_micro_batch_size_per_gpu=16), "equal": dict(infer_micro_batch_size_per_gpu=13)}
    runs = {}
    for name, engine_keys in engines.items():
        engine = _adamw_engine(tiny_model_path, optimizer_offload=True, **engine_keys)
        batch = _tiny.set_micro_batching(thirteen_rows.copy(), **keys)
        assert engine_prepass.infer_micro_batches_fit_training(engine, batch) is (name == "equal")
        runs[name] = _two_steps_recording_placement(engine, batch, "infer")
    assert runs["equal"][0] == ["prepass forward (gradients none)", "training forward-backward"]
    assert runs["larger"][0][0].startswith("to('cpu'"), runs["larger"][0]
    assert torch.equal(runs["equal"][2], runs["larger"][2])


def test_optimizer_states_context_reports_whether_it_moved_them(tiny_model_path, thirteen_rows):
    engine = _adamw_engine(tiny_model_path, optimizer_offload=True)
    batch = _tiny.set_micro_batching(thirteen_rows.copy(), use_dynamic_bsz=False, micro_batch_size_per_gpu=13)
    with engine_prepass.optimizer_states_off_device(engine, "infer", batch) as moved:
        assert moved is False  # no AdamW state before the first step: nothing to move
    results = []
    with engine_step.observe_selections(lambda _engine, result: results.append(result)), engine.train_mode():
        for _ in range(2):
            engine.train_batch(batch.copy(), loss_function=functools.partial(
                ppo_loss, config=_tiny.make_actor_config(policy_loss=_policy_loss("infer"))))
    assert [r.optimizer_states_offloaded for r in results] == [False, True]


# ---------------------------------------------------------------------------------------------
# Observability


def _children_names(event):
    names = []
    for child in event.cpu_children:
        names.append(child.name)
        names += _children_names(child)
    return names


def test_profiler_trace_names_the_prepass_and_the_selection_and_metrics_state_their_meaning(tiny_model_path,
                                                                                           thirteen_rows):
    engine = _cpu.build_fsdp_engine(tiny_model_path, infer_micro_batch_size_per_gpu=8)
    batch = _tiny.set_micro_batching(thirteen_rows.copy(), use_dynamic_bsz=False, micro_batch_size_per_gpu=13)
    # two training micro-batches of different sizes, so the per-micro-batch counts can differ
    batch = tu.index_select_tensor_dict(batch, list(range(12)))
    _tiny.set_micro_batching(batch, use_dynamic_bsz=False, micro_batch_size_per_gpu=6)
    results = []
    loss_function = functools.partial(ppo_loss, config=_tiny.make_actor_config(
        loss_mode="kl_cov_global", kl_cov_ratio=0.1, ppo_kl_coef=1.0))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as trace, engine.train_mode(), \
            engine_step.observe_selections(lambda _engine, result: results.append(result)):
        started = time.perf_counter()
        output = engine.train_batch(batch, loss_function=loss_function)
        outside = time.perf_counter() - started
    events = trace.events()
    prepass = [e for e in events if e.name == engine_prepass.PREPASS_RECORD_NAME]
    selection = [e for e in events if e.name == engine_prepass.SELECTION_RECORD_NAME]
    assert len(prepass) == 1 and len(selection) == 1
    inside_prepass = _children_names(prepass[0])
    # verl's forwards run inside the prepass record, 2 for 12 rows / 8: one attention call per layer each
    # (counted by torch's sdpa op: verl 0.9 also names its micro-batches "micro_batch<i>", 0.8 does not)
    layers = engine.module.config.num_hidden_layers  # FSDP1 forwards attribute reads to the HF model
    assert inside_prepass.count("aten::scaled_dot_product_attention") == 2 * layers
    assert engine_prepass.SELECTION_RECORD_NAME not in inside_prepass

    metrics = output["metrics"]
    share = metrics["actor/kl_cov/prepass_share"]
    assert isinstance(share, Metric) and share.aggregation is AggregationType.MEAN
    (share_value,) = share.values
    result = results[0]
    plugin_seconds = result.prepass_seconds + result.selection_seconds
    assert 0 < share_value < 1
    assert plugin_seconds <= plugin_seconds / share_value <= outside  # the share of the wrapped call's time

    per_micro_batch = metrics["actor/kl_cov/selected_in_micro_batch"]
    assert isinstance(per_micro_batch, Metric) and per_micro_batch.aggregation is AggregationType.MEAN
    assert len(per_micro_batch.values) == 2
    assert sum(per_micro_batch.values) == result.selection.num_selected > 0
    assert per_micro_batch.aggregate() == pytest.approx(result.selection.num_selected / 2)
