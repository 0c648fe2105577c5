"""Reuse of verl's own log-prob pass (``engine/reuse.py``) on verl's real ``TrainingWorker`` (in-process, CPU, fp32).

Each test drives the worker as verl's trainers do: ``infer_batch`` with ``calculate_entropy=True`` and
``compute_loss=False`` (what ``ActorRolloutRefWorker.compute_log_prob`` calls), ``old_log_probs`` set from
its output, then ``train_mini_batch`` (``update_actor``). Every optimizer step's selection is checked
against the prepass's, computed on the same rows at the same parameters with reuse switched off
(:class:`Steps`). Both ways:

* reuse, with the prepass's statistics and masks (bit for bit where this CPU's fp32 numerics of a row do not
  depend on the rows beside it in a micro-batch; else within :data:`ROW_COMPANY_NOISE`, the mask being the
  selection on the reused statistics and at least 90% the prepass's): on-policy (1 minibatch, 1 epoch) for the
  three modes, v1 and legacy layouts, shuffled rows, static and dynamic batching; a KL-Cov step with the
  entropy controller on (the pass's entropy kept, the controller's decision the prepass's); packed sequences in the
  pass's row order (shuffled: the pass's own fp32 numerics, last bits apart from a prepass's); the first
  optimizer step of a 2 x 2 update; the LoRA actor whose reference pass (adapter off) runs between its
  log-prob pass and its update;
* the prepass, where reuse would be stale: the second minibatch and the second epoch, a checkpoint load
  between the pass and the update, ``separate_async``'s weight restores around the pass (verl's own
  ``DetachActorWorker`` methods, in its trainer's order), rows the pass did not see (another batch, one
  token changed, another temperature, another log-prob micro-batch size), no pass at all (``bypass_mode``:
  the old log-probs come from the rollout), ``prepass_layout=train``; over 2 gloo ranks, one rank that
  cannot reuse makes both run the prepass;
* nothing kept where it cannot be used: a loss that is not a global mode, the reference worker.
"""

from __future__ import annotations

import contextlib
import math
import functools

import numpy as np
import pytest
import torch
from verl.utils import tensordict_utils as tu

from verl_klcov_global.config import (
    ClipCovGlobalPolicyLossConfig,
    HighEntropyGlobalPolicyLossConfig,
    KLCovGlobalPolicyLossConfig,
)
from verl_klcov_global.engine import kept_pass, prepass as engine_prepass, reuse, step as engine_step, weights
from verl_klcov_global.lab import tiny as _tiny
from verl_klcov_global.modes import global_mode_of

from ..support.gloo import spawn_gloo
from ..support.workers import build_training_worker

pytestmark = pytest.mark.slow  # verl's real engine / workers on CPU: the slow tier

ROWS, PROMPT, RESPONSE = 32, 8, 32
MODES = ("kl_cov_global", "clip_cov_global", "high_entropy_global")
#: what verl's trainers leave to TrainingWorker (it injects the log-prob or training micro-batching itself)
WORKER_KEYS = ("use_dynamic_bsz", "micro_batch_size_per_gpu", "max_token_len_per_gpu", "use_remove_padding",
               "global_token_num", "update_lr_scheduler", "disable_auto_offload", "compute_loss",
               "calculate_entropy")


def _policy_loss(mode: str, layout: str = "infer"):
    if mode == "kl_cov_global":
        return KLCovGlobalPolicyLossConfig(kl_cov_ratio=0.02, ppo_kl_coef=1.0, prepass_layout=layout)
    if mode == "clip_cov_global":  # window (0, 5): on-policy rows are candidates (no ratio is clipped)
        return ClipCovGlobalPolicyLossConfig(clip_cov_ratio=0.05, clip_cov_lb=0.0, clip_cov_ub=5.0,
                                             prepass_layout=layout)
    return HighEntropyGlobalPolicyLossConfig(entropy_top_ratio=0.2, prepass_layout=layout)


def use_mode(worker, mode: str, *, layout: str = "infer", mini_batch: int = ROWS, epochs: int = 1):
    from verl.workers.utils.losses import ppo_loss

    if mode == "vanilla":
        config = _tiny.make_actor_config(loss_mode="vanilla", ppo_mini_batch_size=mini_batch, ppo_epochs=epochs)
    else:
        config = _tiny.make_actor_config(policy_loss=_policy_loss(mode, layout), ppo_mini_batch_size=mini_batch,
                                         ppo_epochs=epochs)
    worker.set_loss_fn(functools.partial(ppo_loss, config=config))


def rows(seed: int, *, layout: str = "v1", temperature: float = 1.0, batch_size: int = ROWS):
    """A batch as verl's trainer hands it to the actor worker (no micro-batching keys)."""
    td = _tiny.make_minibatch(batch_size=batch_size, prompt_len=PROMPT, response_len=RESPONSE, vary_lengths=True,
                              seed=seed, layout=layout, temperature=temperature, group_size=4)
    for key in WORKER_KEYS:
        if key in td.keys():
            del td[key]
    return td


def log_prob_pass(worker, batch, **keys):
    """What ``compute_log_prob`` runs (``trainer/ppo/ray_trainer.py`` ~1290-1304); sets ``batch["old_log_probs"]``
    from its output as the trainers do. Returns the padded (log-probs, entropy)."""
    from verl.workers.utils.padding import no_padding_2_padding, response_from_nested

    data = batch.copy()
    tu.assign_non_tensor(data, calculate_entropy=True, compute_loss=False, **keys)
    output = worker.infer_batch(data)
    log_probs = tu.get(output, "log_probs")
    if batch["response_mask"].is_nested:  # v1: written back nested (trainer_base.py ~1666)
        batch["old_log_probs"] = response_from_nested(log_probs, batch["response_mask"])
    else:  # legacy: padded (ray_trainer.py ~1316)
        batch["old_log_probs"] = no_padding_2_padding(log_probs, batch).float()
    return no_padding_2_padding(log_probs, batch), no_padding_2_padding(tu.get(output, "entropy"), batch)


def update(worker, batch, *, mini_batch: int = ROWS, epochs: int = 1, shuffle: bool = True):
    """``update_actor`` (``_update_actor``: minibatches, epochs, shuffle); returns train_mini_batch's metrics."""
    data = batch.copy()
    tu.assign_non_tensor(data, mini_batch_size=mini_batch, global_batch_size=mini_batch, epochs=epochs, seed=7,
                         dataloader_kwargs={"shuffle": shuffle}, calculate_entropy=False, compute_loss=True,
                         distillation_use_topk=False, distillation_only=False)
    return tu.get(worker.train_mini_batch(data), "metrics")


@contextlib.contextmanager
def _recording_prepass_statistics():
    """The (log-probs, entropy or None) of every prepass forward inside the block, in a list."""
    stats = []
    real_lp, real_both = engine_prepass.compute_prepass_log_probs, engine_prepass.compute_prepass_log_probs_and_entropy
    engine_prepass.compute_prepass_log_probs = lambda *a: stats.append((real_lp(*a), None)) or stats[-1][0]
    engine_prepass.compute_prepass_log_probs_and_entropy = lambda *a: stats.append(real_both(*a)) or stats[-1]
    try:
        yield stats
    finally:
        engine_prepass.compute_prepass_log_probs = real_lp
        engine_prepass.compute_prepass_log_probs_and_entropy = real_both


#: How far a row's fp32 log-prob (or entropy) may move on a CPU with the rows beside it in its micro-batch: 0 on the
#: Intel Xeon runner the 0.5.0 tests were written on; on an AMD EPYC (AVX2) runner, padded, 3 of 1,024 response
#: tokens 4.8e-7 apart between verl's pass (its rows in order) and a prepass of the shuffled minibatch. In the pass's
#: own row order both were bit for bit. A bound, not a measurement of every CPU.
ROW_COMPANY_NOISE = 1e-5


class Steps:
    """Every optimizer step's outcome, next to the prepass's on the same rows at the same parameters.

    Wraps the hook's ``run_prepass_and_select``: after the real call (which may reuse) it runs it again with
    reuse off, recording the prepass's statistics, before verl's step moves the weights.
    """

    def __init__(self, monkeypatch, *, reference: bool = True):
        self.steps: list[dict] = []
        real_run, real_take = engine_step.run_prepass_and_select, reuse.take
        taken = []

        def take(engine, data, **kwargs):
            taken.append(real_take(engine, data, **kwargs))
            return taken[-1]

        def run(engine, data, settings, mode):
            taken.clear()
            result = real_run(engine, data, settings, mode)
            step = {"result": result, "taken": taken[0] if taken else None, "reason": reuse.last_reason(engine),
                    "data": data, "settings": settings}
            if reference:
                with kept_pass.disabled(), _recording_prepass_statistics() as stats:
                    step["reference"] = real_run(engine, data, settings, mode)
                step["stats"] = stats[0]
            self.steps.append(step)
            return result

        monkeypatch.setattr(reuse, "take", take)  # prepass.py calls it through the module
        monkeypatch.setattr(engine_step, "run_prepass_and_select", run)

    @property
    def reused(self) -> list[bool]:
        return [s["result"].reused for s in self.steps]

    def assert_reuse_is_the_prepass(self, step: dict) -> None:
        """The reused step's statistics are the prepass's: bit for bit where this CPU's fp32 log-probs of a row do
        not depend on the rows beside it in a micro-batch, else within :data:`ROW_COMPANY_NOISE` (see there); the
        mask is the prepass's when the statistics are, and in any case the selection on the reused statistics."""
        result, reference = step["result"], step["reference"]
        assert result.reused and not reference.reused, step["reason"]
        log_probs, entropy = step["taken"]
        prepass_log_probs, prepass_entropy = step["stats"]
        same = torch.equal(log_probs, prepass_log_probs) and (prepass_entropy is None
                                                              or torch.equal(entropy, prepass_entropy))
        if same:
            assert torch.equal(result.selection.mask, reference.selection.mask)
        else:
            assert float((log_probs - prepass_log_probs).abs().max()) < ROW_COMPANY_NOISE
            if prepass_entropy is not None:
                assert float((entropy - prepass_entropy).abs().max()) < ROW_COMPANY_NOISE
            mode, settings, data = result.mode, step["settings"], step["data"]
            if getattr(settings, "entropy_control", None) is None:
                expected = mode.select_minibatch(log_probs, data, settings, None, entropy=entropy)
                assert torch.equal(result.selection.mask, expected.mask)  # the selection on what was reused
            overlap = int((result.selection.mask & reference.selection.mask).sum())
            assert overlap >= 0.9 * int((result.selection.mask | reference.selection.mask).sum())
        assert 0 < int(result.selection.mask.sum()) < int(prepass_log_probs.ne(0).sum())  # a real selection
        assert result.prepass_seconds == 0.0 < reference.prepass_seconds


@pytest.fixture
def worker(tiny_model_path):
    """verl's TrainingWorker (FSDP1, SGD lr 0.1): log-prob micro-batches of 16 rows, training ones of 8. One per
    test (under a second): the module's tests then spread over the xdist workers (tests/conftest.py)."""
    return build_training_worker(tiny_model_path, lr=0.1, clip_grad=1.0, micro_batch_size_per_gpu=8,
                                 infer_micro_batch_size_per_gpu=16)


# ---------------------------------------------------------------------------------------------
# Reuse, bit for bit


@pytest.mark.parametrize("layout", ["v1", "legacy"])
@pytest.mark.parametrize("mode", MODES)
def test_an_on_policy_update_reuses_verls_pass_and_selects_what_the_prepass_selects(worker, monkeypatch, mode,
                                                                                  layout):
    use_mode(worker, mode)
    batch = rows(11, layout=layout)
    steps = Steps(monkeypatch)
    log_prob_pass(worker, batch)
    assert reuse.kept_rows(worker.engine) == ROWS
    kept = reuse.kept_nbytes(worker.engine)
    metrics = update(worker, batch, shuffle=True)  # one optimizer step on the 32 rows, in a shuffled order
    assert steps.reused == [True]
    steps.assert_reuse_is_the_prepass(steps.steps[0])
    prefix = global_mode_of(worker.loss_fn.keywords["config"]).metric_prefix
    assert [float(v) for v in metrics[prefix + "prepass_reused"]] == [1.0]
    assert [float(v) for v in metrics[prefix + "prepass_seconds"]] == [0.0]
    assert reuse.kept_rows(worker.engine) == 0  # freed by the update's optimizer step
    tokens = int(batch["response_mask"].sum()) if not batch["response_mask"].is_nested else int(
        batch["response_mask"].values().sum())
    per_token = 8 if mode == "high_entropy_global" else 4  # fp32 log-prob (+ entropy) per response token
    assert kept == per_token * tokens + 8 * (ROWS + 1) + 16 * ROWS


def test_a_controlled_step_reuses_the_pass_entropy_and_decides_as_its_prepass_would(worker, monkeypatch):
    """kl_cov_global's prepass reads no entropy, but with the entropy controller on its step does: the pass's
    entropy is kept (8 bytes per token) and the controller's H, ratio and the mask are the prepass's."""
    from verl.workers.utils.losses import ppo_loss

    from verl_klcov_global.engine import control

    floor = math.log(512) - 1e-3  # the tiny model's entropy (~6.23) lies below it: the floor strengthens KL-Cov
    policy_loss = KLCovGlobalPolicyLossConfig(kl_cov_ratio=0.005, ppo_kl_coef=1.0, entropy_target=floor)
    worker.set_loss_fn(functools.partial(ppo_loss, config=_tiny.make_actor_config(
        policy_loss=policy_loss, ppo_mini_batch_size=ROWS, ppo_epochs=1)))
    batch = rows(11)
    log_prob_pass(worker, batch)
    tokens = int(batch["response_mask"].values().sum())
    assert reuse.kept_nbytes(worker.engine) == 8 * tokens + 8 * (ROWS + 1) + 16 * ROWS  # entropy kept too
    outcomes = []
    real_run = engine_step.run_prepass_and_select

    def run(engine, data, settings, mode):
        group = engine.optimizer.param_groups[0]
        before = dict(group.get(control.STATE_KEY) or {})
        result = real_run(engine, data, settings, mode)  # reuses the pass
        after = group.pop(control.STATE_KEY)
        if before:
            group[control.STATE_KEY] = before
        with kept_pass.disabled():  # the same step from a prepass, from the same controller state
            reference = real_run(engine, data, settings, mode)
        group[control.STATE_KEY] = after
        outcomes.append((result, reference))
        return result

    monkeypatch.setattr(engine_step, "run_prepass_and_select", run)
    update(worker, batch)
    (result, reference), = outcomes
    assert result.reused and not reference.reused
    decision, expected = result.steering.decision, reference.steering.decision
    if decision.entropy == expected.entropy:  # the pass's entropy is the prepass's bit for bit on this CPU
        assert decision == expected  # H, error, ratio: bit for bit
        assert torch.equal(result.selection.mask, reference.selection.mask)
    else:  # the rows beside each row in its micro-batch moved the last bits (ROW_COMPANY_NOISE)
        assert decision.entropy == pytest.approx(expected.entropy, abs=ROW_COMPANY_NOISE)
        assert decision.ratio_in_use == pytest.approx(expected.ratio_in_use, rel=1e-4)
    assert decision.entropy < floor and decision.ratio_in_use > 0.005 and result.selection.mask.any()


def _worker_with(tiny_model_path, **engine):
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker

    from verl_klcov_global.lab import cpu as _cpu

    _cpu.install_cpu_platform()
    _cpu.init_process_group_cpu()
    configs = _cpu.fsdp_engine_configs(tiny_model_path, lr=0.1, clip_grad=1.0, micro_batch_size_per_gpu=8,
                                       infer_micro_batch_size_per_gpu=16, **engine)
    torch.manual_seed(0)
    built = TrainingWorker(config=TrainingWorkerConfig(model_type="language_model", **configs))
    built.reset()
    return built


def test_dynamic_batching_reuses_bit_for_bit(tiny_model_path, monkeypatch):
    """Dynamic batch sizes (verl reorders rows into token-budget micro-batches, then restores the order)."""
    dynamic = _worker_with(tiny_model_path, use_dynamic_bsz=True, max_token_len_per_gpu=200,
                           infer_max_token_len_per_gpu=400)
    use_mode(dynamic, "high_entropy_global")
    batch = rows(23)
    steps = Steps(monkeypatch)
    log_prob_pass(dynamic, batch)
    update(dynamic, batch, shuffle=True)
    assert steps.reused == [True]
    steps.assert_reuse_is_the_prepass(steps.steps[0])


def test_packed_sequences_reuse_the_pass_whose_numerics_follow_its_micro_batches(tiny_model_path, monkeypatch):
    """``use_remove_padding``: in the pass's row order the statistics are the prepass's bit for bit; shuffled, the
    prepass packs other rows together and its fp32 log-probs may differ in the last bits (what docs/PREPASS.md
    says of packed and bf16 numerics): the step still reuses verl's pass, whose numerics these are."""
    packed = _worker_with(tiny_model_path, use_remove_padding=True)
    use_mode(packed, "high_entropy_global")
    steps = Steps(monkeypatch)
    for seed, shuffle in ((24, False), (25, True)):
        batch = rows(seed)
        tu.assign_non_tensor(batch, use_remove_padding=True)
        log_prob_pass(packed, batch)
        update(packed, batch, shuffle=shuffle)
    assert steps.reused == [True, True]
    steps.assert_reuse_is_the_prepass(steps.steps[0])
    (log_probs, entropy), (prepass_log_probs, prepass_entropy) = steps.steps[1]["taken"], steps.steps[1]["stats"]
    # 4.8e-7 measured with torch 2.13 on CPU (tiny model); a bound, not a claim that it is never 0
    assert float((log_probs - prepass_log_probs).abs().max()) < 1e-5
    assert float((entropy - prepass_entropy).abs().max()) < 1e-5


def test_only_the_first_optimizer_step_of_an_update_reuses(worker, monkeypatch):
    use_mode(worker, "kl_cov_global", mini_batch=ROWS // 2, epochs=2)
    batch = rows(12)
    steps = Steps(monkeypatch)
    log_prob_pass(worker, batch)
    metrics = update(worker, batch, mini_batch=ROWS // 2, epochs=2)
    assert steps.reused == [True, False, False, False]
    steps.assert_reuse_is_the_prepass(steps.steps[0])
    assert "optimizer step" in steps.steps[1]["reason"]
    for step in steps.steps[1:]:  # the prepass ran, and its statistics are not the pass's any more
        assert torch.equal(step["result"].selection.mask, step["reference"].selection.mask)
    reused = [float(v) for v in metrics["actor/kl_cov/prepass_reused"]]
    assert reused == [1.0, 0.0, 0.0, 0.0] and np.mean(reused) == 0.25  # what the trainer logs for the step
    seconds = [float(v) for v in metrics["actor/kl_cov/prepass_seconds"]]
    assert seconds[0] == 0.0 and min(seconds[1:]) > 0


def test_the_lora_reference_pass_between_the_pass_and_the_update_is_not_kept(tiny_model_path, monkeypatch):
    from verl.workers.config import HFModelConfig, TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker

    from verl_klcov_global.lab import cpu as _cpu

    _cpu.install_cpu_platform()
    _cpu.init_process_group_cpu()
    configs = _cpu.fsdp_engine_configs(tiny_model_path, strategy="fsdp2", lr=0.5, clip_grad=10.0,
                                       micro_batch_size_per_gpu=8, infer_micro_batch_size_per_gpu=16)
    configs["model_config"] = HFModelConfig(path=tiny_model_path, override_config={"attn_implementation": "sdpa"},
                                            use_remove_padding=False, lora_rank=4, lora_alpha=8,
                                            target_modules="all-linear")
    configs["model_config"].model_type = "language_model"
    torch.manual_seed(0)
    lora = TrainingWorker(config=TrainingWorkerConfig(model_type="language_model", **configs))
    lora.reset()
    use_mode(lora, "kl_cov_global")
    first = rows(13)
    log_prob_pass(lora, first)
    update(lora, first)  # moves the adapter away from its zero init: adapter off != adapter on
    batch = rows(14)
    steps = Steps(monkeypatch)
    actor_log_probs, _ = log_prob_pass(lora, batch)
    kept = reuse.kept_nbytes(lora.engine)
    # the legacy trainer's _compute_ref_log_prob with ref_in_actor (ray_trainer.py ~1266-1280): the same rows
    data = batch.copy()
    tu.assign_non_tensor(data, calculate_entropy=False, compute_loss=False, no_lora_adapter=True)
    from verl.workers.utils.padding import no_padding_2_padding

    reference_log_probs = no_padding_2_padding(tu.get(lora.infer_batch(data), "log_probs"), batch)
    assert not torch.equal(reference_log_probs, actor_log_probs)  # keeping it would be wrong
    assert reuse.kept_nbytes(lora.engine) == kept
    update(lora, batch)
    assert steps.reused == [True]
    steps.assert_reuse_is_the_prepass(steps.steps[0])


# ---------------------------------------------------------------------------------------------
# The prepass, where reuse would be stale


def test_a_checkpoint_load_between_the_pass_and_the_update_runs_the_prepass(tiny_model_path, monkeypatch, tmp_path):
    # FSDP2, as the trainer runs (verl's FSDP1 checkpoint save stages parameters on "<device>:<id>", not on a CPU)
    worker = build_training_worker(tiny_model_path, strategy="fsdp2", lr=0.1, clip_grad=1.0,
                                   micro_batch_size_per_gpu=8, infer_micro_batch_size_per_gpu=16)
    use_mode(worker, "kl_cov_global")
    worker.save_checkpoint(str(tmp_path / "checkpoint"))
    batch = rows(15)
    steps = Steps(monkeypatch)
    log_prob_pass(worker, batch)
    version = weights.weights_version(worker.engine)
    worker.load_checkpoint(str(tmp_path / "checkpoint"))  # verl's engine.load_checkpoint: load_state_dict
    assert weights.weights_version(worker.engine) > version and reuse.kept_rows(worker.engine) == 0
    update(worker, batch)
    assert steps.reused == [False]
    assert "load_state_dict" in steps.steps[0]["reason"]
    assert torch.equal(steps.steps[0]["result"].selection.mask, steps.steps[0]["reference"].selection.mask)


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_separate_async_local_steps_after_the_first_run_the_prepass(tiny_model_path, monkeypatch, strategy):
    """verl's separate_async trainer (``trainer/ppo/v1/trainer_separate_async.py`` ~197-211): local step 0 saves
    the weights (pi_old) and computes the old log-probs directly; step k >= 1 saves the current weights, restores
    pi_old, computes, restores the current ones. Driven here with verl's own ``DetachActorWorker`` methods (the
    whole trainer needs Ray, a standalone rollout and an NCCL checkpoint engine: not on a CPU)."""
    import verl.utils.fsdp_utils as fsdp_utils
    from omegaconf import OmegaConf
    from verl.experimental.separation.engine_workers import DetachActorWorker

    if strategy == "fsdp" and not hasattr(fsdp_utils, "fsdp1_sharded_load_from_cpu"):
        pytest.skip("verl 0.8.0's DetachActorWorker restores FSDP1 with its FSDP2 helper, which refuses FSDP1's "
                    "parameters: separate_async with strategy=fsdp does not run there at all")
    training = build_training_worker(tiny_model_path, strategy=strategy, lr=0.1, clip_grad=1.0,
                                     micro_batch_size_per_gpu=8, infer_micro_batch_size_per_gpu=16)
    use_mode(training, "kl_cov_global")
    detach = DetachActorWorker.__new__(DetachActorWorker)  # its save/restore methods read only these
    detach.actor, detach._strategy_handlers = training, None
    detach.config = OmegaConf.create({"actor": {"strategy": strategy}})
    steps = Steps(monkeypatch)
    # local step 0: pi_old is the current policy
    batch = rows(16)
    detach.save_model_to_cpu(0)
    log_prob_pass(training, batch)
    update(training, batch)
    # local step 1: the old log-probs under pi_old, the update under the current weights
    batch = rows(17)
    detach.save_model_to_cpu(1)
    detach.restore_model_from_cpu(0)
    pass_log_probs, _ = log_prob_pass(training, batch)
    detach.restore_model_from_cpu(1)
    detach.clear_cpu_model(1)
    update(training, batch)
    assert steps.reused == [True, False]
    steps.assert_reuse_is_the_prepass(steps.steps[0])
    assert "restored" in steps.steps[1]["reason"]
    assert not torch.equal(steps.steps[1]["stats"][0], pass_log_probs.to(steps.steps[1]["stats"][0].dtype))


@pytest.mark.parametrize("change", ["another batch", "one token", "another temperature",
                                    "the training micro-batch size", "no pass (bypass_mode)", "prepass_layout=train"])
def test_rows_or_settings_the_pass_did_not_have_run_the_prepass(worker, monkeypatch, change):
    use_mode(worker, "kl_cov_global", layout="train" if change == "prepass_layout=train" else "infer")
    batch = rows(18)
    steps = Steps(monkeypatch)
    keys = {"micro_batch_size_per_gpu": 8} if change == "the training micro-batch size" else {}
    if change == "no pass (bypass_mode)":
        log_prob_pass(worker, batch)
        update(worker, batch)  # reuses; the next update's old log-probs come from the rollout: no actor pass
        batch = rows(19)  # its old_log_probs (make_minibatch's noise) stand for the rollout's
    elif change == "another batch":
        log_prob_pass(worker, rows(19))
    else:
        log_prob_pass(worker, batch, **keys)
    if change == "one token":
        values = batch["input_ids"].values()
        values[len(values) // 2] = (values[len(values) // 2] + 1) % 400
    if change == "another temperature":
        tu.assign_non_tensor(batch, temperature=0.7)
    update(worker, batch)
    last = steps.steps[-1]
    assert last["result"].reused is False, change
    assert torch.equal(last["result"].selection.mask, last["reference"].selection.mask)
    expected = {"another batch": "rows were not in", "one token": "1 of 32 rows were not in",
                "another temperature": "other forward settings", "the training micro-batch size": "other forward",
                "no pass (bypass_mode)": "optimizer step", "prepass_layout=train": None}[change]
    if expected is None:
        assert reuse.kept_rows(worker.engine) == 0 and last["taken"] is None  # nothing kept, nothing asked
    else:
        assert expected in last["reason"], last["reason"]


def test_workers_whose_loss_is_not_a_global_mode_keep_nothing(tiny_model_path):
    from verl.workers.engine_workers import TrainingWorker  # noqa: F401  (the reference worker is one too)

    for loss in ("vanilla", None):  # a vanilla actor; a fused worker's reference (no loss function)
        plain = build_training_worker(tiny_model_path)
        if loss is not None:
            use_mode(plain, loss)
        else:
            plain.loss_fn = None
        log_prob_pass(plain, rows(20))
        assert reuse.kept_rows(plain.engine) == 0
        assert plain.engine not in weights._STATES  # not even hooked: no cost outside the global modes


# ---------------------------------------------------------------------------------------------
# Two ranks agree


def _two_ranks(rank: int, world_size: int, model_path: str):
    import verl_klcov_global  # noqa: F401  (the patches)

    outcomes, steps, taken = [], [], []
    real_run, real_take = engine_step.run_prepass_and_select, reuse.take

    def take(engine, data, **kwargs):
        taken.append(real_take(engine, data, **kwargs))
        return taken[-1]

    def run(engine, data, settings, mode):
        taken.clear()
        result = real_run(engine, data, settings, mode)
        with kept_pass.disabled(), _recording_prepass_statistics() as stats:  # on both ranks alike
            reference = real_run(engine, data, settings, mode)
        if result.reused:  # the premise: the reused statistics are the prepass's, bit for bit
            assert torch.equal(taken[0][0], stats[0][0])
        steps.append((result.reused, torch.equal(result.selection.mask, reference.selection.mask),
                      int(result.selection.mask.sum()), reuse.last_reason(engine)))
        return result

    reuse.take = take  # prepass.py calls it through the module
    engine_step.run_prepass_and_select = run
    worker = build_training_worker(model_path, lr=0.1, clip_grad=1.0, micro_batch_size_per_gpu=8,
                                   infer_micro_batch_size_per_gpu=16)
    use_mode(worker, "kl_cov_global", mini_batch=2 * ROWS)
    for scenario in ("every row seen", "rank 1 has a row the pass did not see"):
        full = rows(21, batch_size=2 * ROWS)
        shard = _tiny.shard_for_rank(full, rank, world_size)  # verl's contiguous DP chunk
        log_prob_pass(worker, shard)
        if scenario != "every row seen" and rank == 1:
            shard = _tiny.shard_for_rank(rows(22, batch_size=2 * ROWS), rank, world_size)
        update(worker, shard, mini_batch=2 * ROWS, shuffle=False)  # the pass's row order: see the test
        outcomes.append(steps[-1])
    return outcomes


@pytest.mark.distributed
def test_two_ranks_reuse_together_or_run_the_prepass_together(tiny_model_path):
    """Premise of ``same_mask`` (bit for bit on any CPU): the update's one minibatch is each rank's shard in the
    pass's row order (no shuffle), so the prepass forwards the same rows in the same micro-batches of 16 as verl's
    log-prob pass: the reused statistics and the prepass's are one computation. (Shuffled, the prepass would put
    the rows in other company, where their fp32 log-probs may differ in the last bits on some CPUs; the
    single-process tests above check that case against the statistics each side used.)"""
    rank0, rank1 = spawn_gloo(_two_ranks, 2, tiny_model_path, verl_platform=True)
    for outcomes in (rank0, rank1):
        (reused, same_mask, selected, _), (reused_after, same_mask_after, _, _) = outcomes
        assert reused and same_mask and selected > 0
        assert not reused_after and same_mask_after  # rank 0 could have reused alone; it ran the prepass
    assert "another rank" in rank0[1][3] and "not in verl's log-prob pass" in rank1[1][3]
    assert rank0[0][2] + rank1[0][2] > 0
