"""stare_global in verl's real FSDP engine and TrainingWorker (CPU, fp32): the mask, the weights and the gate.

* Invariance: 1 vs 8 training micro-batches (dynamic; static fsdp2 packed): masks and every figure (the gate, W, M,
  the batch entropy) bit for bit, parameters within ``NOISE_FACTOR`` x the ``vanilla`` control's difference.
* The mask is the definition (``tests/selection/test_stare.py``'s plain-Python reference) on the prepass's
  log-probs; the loss verl aggregates on one micro-batch holding the whole minibatch is the fork's formula
  (``tests/test_loss_stare.py``'s transcription) on the loss call's own tensors.
* DP 2 on gloo gives the single process's mask, figures and gate bit for bit.
* The gate through verl's TrainingWorker as the trainers drive it (log-prob pass with ``calculate_entropy=True``,
  then ``train_mini_batch``): the worker's batch entropy is the driver's ``actor/entropy`` (verl's ``agg_loss`` on
  the pass's output) within float32 rounding, for token-mean and seq-mean-token-mean, in all three
  ``prepass_layout`` values, and the gate opens exactly where the fork's would (targets just above and below it).
* Once per trainer step: 2 minibatches x 2 PPO epochs move the adaptive W and M once; the state travels in
  ``optimizer.state_dict()`` and a fresh optimizer that loads it continues bit for bit.
* No log-prob pass (``bypass_mode``): a clear error, not a silent ungated run.
"""

from __future__ import annotations

import functools

import pytest
import torch
from verl.trainer.ppo.core_algos import agg_loss

from verl_klcov_global.config import StareGlobalPolicyLossConfig
from verl_klcov_global import loss as plugin_loss
from verl_klcov_global.engine import batch_entropy
from verl_klcov_global.engine.schedule import RULE_STATE_KEY
from verl_klcov_global.lab import tiny as _tiny
from verl_klcov_global.lab.experiment import (
    EngineSpec, MicroBatchLayout, dynamic_layouts, frozen_minibatch, one_update, run_block, static_layouts,
)
from verl_klcov_global.layout import padded
from verl_klcov_global.methods.stare.row import STARE

from ..selection.test_stare import reference
from ..support.gloo import spawn_gloo
from ..support.selections import recorded_selections
from ..support.workers import build_training_worker
from ..test_loss_stare import fork_pg_losses
from .test_reuse import log_prob_pass, rows, update

pytestmark = pytest.mark.slow  # verl's real engine on CPU: the slow tier

BATCH, PROMPT, RESPONSE = 32, 8, 48
SEQ = PROMPT + RESPONSE
NOISE_FACTOR = 10
MODES = ("vanilla", "stare_global")
#: open: above any entropy the tiny model has (ln(vocabulary) is ~5); C2 and strong weights make the effect visible
STARE_KNOBS = dict(stare_top_ratio=0.2, stare_reweight_w=1.5, stare_reweight_m=0.5, stare_variant="C2",
                   stare_target_entropy=100.0)


def actor_config_for(mode, **kwargs):
    if mode == "stare_global":
        return _tiny.make_actor_config(policy_loss=StareGlobalPolicyLossConfig(**STARE_KNOBS), **kwargs)
    return _tiny.make_actor_config(loss_mode=mode, **kwargs)


def _batch(spec, seed):
    return frozen_minibatch(spec, seed, batch_size=BATCH, prompt_len=PROMPT, response_len=RESPONSE, vary_lengths=True)


def _assert_invariant(results):
    control, ours = results["vanilla"], results["stare_global"]
    assert ours.masks_identical is True
    assert ours.selected_per_layout[0] == ours.selected_per_layout[1] > 0
    assert control.max_param_diff > 0, "no noise floor: the two layouts gave the same control update"
    assert ours.max_param_diff <= NOISE_FACTOR * control.max_param_diff, (ours.max_param_diff, control.max_param_diff)
    return ours.max_param_diff / control.max_param_diff


def _step_figures(spec, batch, layout):
    """One update's STARE metrics (the selection's figures and the rule's: gate, W, M, batch entropy)."""
    outcome = one_update(spec, batch, actor_config_for("stare_global"), layout)
    per_step = [k for k in outcome.metrics if k.startswith(STARE.metric_prefix) and not k.endswith(
        ("_seconds", "prepass_share", "selected_in_micro_batch"))]  # timings; a count per micro-batch
    return outcome, {k: _scalar(outcome.metrics[k]) for k in per_step}


def _scalar(value):
    values = getattr(value, "values", None)
    return float(values[0]) if values is not None else float(value[0] if isinstance(value, list) else value)


@pytest.mark.parametrize("kind", ["dynamic", "static-fsdp2-packed"])
def test_masks_weights_and_gate_do_not_depend_on_the_micro_batches(tiny_model_path, kind, capsys):
    spec = EngineSpec(tiny_model_path) if kind == "dynamic" else EngineSpec(tiny_model_path, strategy="fsdp2",
                                                                            use_remove_padding=True)
    batch = _batch(spec, 0 if kind == "dynamic" else 1)
    layouts = dynamic_layouts(BATCH, SEQ, 8) if kind == "dynamic" else static_layouts(BATCH, 8)
    ratio = _assert_invariant(run_block(spec, batch, layouts, actor_config_for, modes=MODES))
    (one, figures_one), (eight, figures_eight) = (_step_figures(spec, batch, layout) for layout in layouts)
    assert figures_one == figures_eight
    prefix = STARE.metric_prefix
    assert figures_one[f"{prefix}gate_on"] == 1.0
    assert figures_one[f"{prefix}reweight_w_in_use"] == 1.5 and figures_one[f"{prefix}reweight_m_in_use"] == 0.5
    assert figures_one[f"{prefix}selected_negative"] > 0 and figures_one[f"{prefix}selected_positive"] > 0
    with capsys.disabled():
        print(f"\n[stare_global {kind} 1 vs 8] max|dtheta| / control {ratio:.2f}; batch entropy "
              f"{figures_one[f'{prefix}batch_entropy']:.4f}")


def _recording(calls, policy_loss):
    """``policy_loss`` (the function verl's registry holds), recording each call's tensors, mask, settings and loss."""

    def recorded(**kwargs):
        provided = plugin_loss.provided_selection()
        loss, metrics = policy_loss(**kwargs)
        calls.append((kwargs, provided.mask.clone(), provided.settings, loss.detach().clone()))
        return loss, metrics

    return recorded


def test_the_mask_is_the_definition_and_one_micro_batch_gives_the_forks_loss(tiny_model_path, monkeypatch):
    """On one micro-batch holding the whole minibatch the fork's per-call selection is the global one: the loss
    verl gets equals agg_loss of the fork's per-token formula on the same tensors (token-mean, the gate open)."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    spec = EngineSpec(tiny_model_path)
    batch = _batch(spec, 2)
    calls = []
    monkeypatch.setitem(POLICY_LOSS_REGISTRY, "stare_global", _recording(calls, STARE.policy_loss))
    layout = MicroBatchLayout("static 1", use_dynamic_bsz=False, micro_batch_size_per_gpu=BATCH)
    with recorded_selections() as records:
        one_update(spec, batch, actor_config_for("stare_global"), layout)
    (record,) = records
    selection = record.result.selection
    advantages = padded(record.data["advantages"]).to(record.log_probs.dtype)
    mask, quotas, num_valid, share = reference(record.log_probs, advantages, padded(record.data["response_mask"]),
                                               STARE_KNOBS["stare_top_ratio"], with_negative=True)
    assert torch.equal(selection.mask, mask)
    assert (selection.positive_quota, selection.negative_quota) == (quotas[0][0], quotas[1][0])

    ((inputs, provided_mask, settings, loss),) = calls  # one micro-batch
    assert settings.gate_on and settings.reweight_w == 1.5 and settings.reweight_m == 0.5
    assert torch.equal(provided_mask, mask.to(provided_mask.device))  # the micro-batch is the whole minibatch
    fork = fork_pg_losses(inputs["old_log_prob"], inputs["log_prob"], inputs["advantages"], inputs["response_mask"],
                          top_ratio=0.2, variant="C2", w=1.5, m=0.5, gate_on=True)
    expected = agg_loss(loss_mat=fork, loss_mask=inputs["response_mask"], loss_agg_mode="token-mean",
                        **inputs["config"].global_batch_info)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------
# DP 2


def _dp_update(rank, world_size, model_path, batch_file, layout):
    shard = _tiny.shard_for_rank(torch.load(batch_file, weights_only=False), rank, world_size)
    outcome, figures = _step_figures(EngineSpec(model_path), shard, layout)
    return outcome.masks[0], figures


@pytest.mark.distributed
def test_dp_2_gives_the_single_process_mask_figures_and_gate(tiny_model_path, tmp_path):
    """Premise (bit for bit on any CPU): static training micro-batches of 4 leave the prepass in the static
    inference layout of 16 rows, i.e. the same rows in the same company on 1 and 2 ranks; the log-prob pass for the
    gate is micro-batched the same way; every sum is exact over the group."""
    spec = EngineSpec(tiny_model_path)
    batch = _batch(spec, 3)
    layout = MicroBatchLayout("static 4", use_dynamic_bsz=False, micro_batch_size_per_gpu=4)
    _, single = _step_figures(spec, batch, layout)
    single_mask = one_update(spec, batch, actor_config_for("stare_global"), layout).masks[0]
    batch_file = tmp_path / "batch.pt"
    torch.save(batch, batch_file)
    ranks = spawn_gloo(_dp_update, 2, tiny_model_path, str(batch_file), layout, verl_platform=True)
    assert torch.equal(torch.cat([mask for mask, _ in ranks]), single_mask)
    for _, figures in ranks:
        assert figures == single


# ---------------------------------------------------------------------------------------------
# The gate, through verl's TrainingWorker as the trainers drive it


def _use_stare(worker, *, mini_batch=32, epochs=1, loss_agg_mode="token-mean", **knobs):
    from verl.workers.utils.losses import ppo_loss

    config = _tiny.make_actor_config(policy_loss=StareGlobalPolicyLossConfig(**{**STARE_KNOBS, **knobs}),
                                     ppo_mini_batch_size=mini_batch, ppo_epochs=epochs, loss_agg_mode=loss_agg_mode)
    worker.set_loss_fn(functools.partial(ppo_loss, config=config))


def _driver_entropy(entropy, batch, loss_agg_mode):
    """What verl's driver logs as actor/entropy (ray_trainer.py ~1586): agg_loss over the whole batch, float32."""
    return float(agg_loss(loss_mat=entropy.float(), loss_mask=padded(batch["response_mask"]).float(),
                          loss_agg_mode=loss_agg_mode))


def _gate_metrics(metrics):
    prefix = STARE.metric_prefix
    return {name: metrics[prefix + name] for name in ("gate_on", "batch_entropy", "reweight_w_in_use")
            if prefix + name in metrics}


def _first(values):
    return float(values[0] if isinstance(values, list) else values)


@pytest.fixture(scope="module")
def worker(tiny_model_path):
    return build_training_worker(tiny_model_path)


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("layout", ["infer", "train", "old"])
def test_the_gate_reads_the_drivers_actor_entropy_and_opens_where_the_forks_does(worker, loss_agg_mode, layout):
    batch = rows(11)
    _use_stare(worker, loss_agg_mode=loss_agg_mode, prepass_layout=layout)
    _, entropy = log_prob_pass(worker, batch)
    driver = _driver_entropy(entropy, batch, loss_agg_mode)
    outcomes = []
    for target in (driver * (1 + 1e-4), driver * (1 - 1e-4)):  # just above: open; just below: closed
        _use_stare(worker, loss_agg_mode=loss_agg_mode, prepass_layout=layout, stare_target_entropy=target)
        log_prob_pass(worker, batch)
        outcomes.append(_gate_metrics(update(worker, batch)))
    opened, closed = outcomes
    assert _first(opened["gate_on"]) == 1.0 and _first(closed["gate_on"]) == 0.0
    worker_entropy = _first(opened["batch_entropy"])
    assert abs(worker_entropy - driver) <= 1e-6 * driver, (worker_entropy, driver)


def test_the_rule_steps_once_per_trainer_step_and_resumes_from_the_optimizer(tiny_model_path):
    """2 minibatches x 2 PPO epochs: four optimizer steps, one rule step; W +alpha, M -alpha per trainer step (the
    entropy below the target). A fresh worker whose optimizer loads the state continues exactly."""
    knobs = dict(stare_adaptive=True, stare_alpha=0.01, stare_reweight_w=1.1, stare_reweight_m=0.9, stare_w_max=1.5,
                 stare_m_min=0.5)
    worker = build_training_worker(tiny_model_path)  # a fresh optimizer: no state kept by another test
    _use_stare(worker, mini_batch=16, epochs=2, **knobs)
    for step in range(2):
        batch = rows(20 + step)
        log_prob_pass(worker, batch)
        metrics = update(worker, batch, mini_batch=16, epochs=2)
        assert metrics[STARE.metric_prefix + "reweight_w_in_use"] == pytest.approx([1.1 + 0.01 * (step + 1)] * 4)
    state = worker.engine.optimizer.param_groups[0][RULE_STATE_KEY]
    assert state["mode"] == "stare_global" and state["state"]["steps"] == 2
    assert state["state"]["reweight_m"] == pytest.approx(0.88)
    saved = worker.engine.optimizer.state_dict()
    assert saved["param_groups"][0][RULE_STATE_KEY] == state

    resumed = build_training_worker(tiny_model_path, seed=1)
    resumed.engine.optimizer.load_state_dict(saved)
    _use_stare(resumed, mini_batch=16, epochs=2, **knobs)
    batch = rows(22)
    log_prob_pass(resumed, batch)
    metrics = update(resumed, batch, mini_batch=16, epochs=2)
    assert metrics[STARE.metric_prefix + "reweight_w_in_use"] == [1.1 + 0.01 + 0.01 + 0.01] * 4
    assert resumed.engine.optimizer.param_groups[0][RULE_STATE_KEY]["state"]["steps"] == 3


def test_an_update_without_a_log_prob_pass_raises_naming_bypass_mode(tiny_model_path):
    spec = EngineSpec(tiny_model_path)
    engine = spec.build()
    batch = _batch(spec, 4)
    td = MicroBatchLayout("static 8", use_dynamic_bsz=False, micro_batch_size_per_gpu=8).apply(batch.copy())
    from verl.workers.utils.losses import ppo_loss

    loss_function = functools.partial(ppo_loss, config=actor_config_for("stare_global"))
    with pytest.raises(batch_entropy.PassEntropyError, match="bypass_mode"), engine.train_mode():
        engine.train_batch(td, loss_function=loss_function)
