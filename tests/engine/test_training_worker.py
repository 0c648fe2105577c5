"""The prepass hook under verl's real ``TrainingWorker.train_mini_batch`` (in-process, no Ray, CPU).

``train_mini_batch`` (verl 0.9.1 ``workers/engine_workers.py`` ~243) splits the per-rank batch with
``tu.make_iterator`` (a ``DataLoader`` over row indices, ``shuffle`` from ``dataloader_kwargs``,
generator seeded with ``seed + dp_rank``; every epoch draws a fresh permutation) and calls
``self.train_batch`` once per minibatch and epoch, i.e. once per optimizer step. The hook must run
one prepass per optimizer step, on that step's rows and at that step's parameters.

The reference is independent of verl and of the hook: the rows of each minibatch are identified by
content in the full batch, their response log-probs are computed by a plain ``transformers`` model
loaded with the engine's full state dict at the moment of the prepass, and the selection is made
with ``select_kl_cov_tokens`` on those. That model is another computation (its own padding, all rows in one
forward): its fp32 log-probs differ from the prepass's by ~1e-6 on every CPU. So the mask is checked to be exactly
the selection on the prepass's own log-probs, those within ``LP_TOLERANCE`` of the plain model's, and the plain
model's selection wherever the gap at the top-k boundary exceeds twice the covariances' difference (measured).
"""

from __future__ import annotations

import functools

import pytest
import torch
from verl.utils import tensordict_utils as tu

from verl_klcov_global.engine import prepass as engine_prepass, step as engine_step
from verl_klcov_global.lab import tiny as _tiny
from verl_klcov_global.methods.kl_cov.selection import select_kl_cov_tokens

from ..support.selections import kl_cov_scores, top_k_margin
from ..support.workers import PlainModelReference, build_training_worker, full_state_dict, padded_rows, row_indices

pytestmark = pytest.mark.slow  # verl's real engine / workers / trainer on CPU: the slow tier

BATCH, MINI_BATCH, EPOCHS = 64, 32, 2
PROMPT, RESPONSE = 8, 64
RATIO = 0.005
SEED = 42  # TrainingWorker's data-loader seed (``actor.data_loader_seed``)
LP_TOLERANCE = 1e-4  # engine (FSDP, padded micro-batches) vs plain transformers, fp32: ~1e-6 observed


@pytest.mark.slow
def test_train_mini_batch_runs_one_prepass_per_optimizer_step_on_its_rows_and_parameters(tiny_model_path,
                                                                                       monkeypatch):
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    # lr/clip larger than build_fsdp_engine's defaults so that log-probs move visibly between steps
    worker = build_training_worker(tiny_model_path, lr=0.1, clip_grad=1.0, micro_batch_size_per_gpu=8)
    actor_config = _tiny.make_actor_config(
        loss_mode="kl_cov_global", kl_cov_ratio=RATIO, ppo_kl_coef=1.0, ppo_mini_batch_size=MINI_BATCH,
        ppo_epochs=EPOCHS, shuffle=True,
    )
    # ``set_loss_fn`` is decorated with verl's @register, which only tags it for the Ray dispatcher:
    # called in-process it runs the method itself.
    worker.set_loss_fn(functools.partial(ppo_loss, config=actor_config))
    assert worker.loss_fn.keywords["config"] is actor_config

    common = dict(batch_size=BATCH, prompt_len=PROMPT, response_len=RESPONSE, vary_lengths=True, seed=5)
    probe = _tiny.make_minibatch(**common)
    full = _tiny.make_minibatch(**common, log_probs=_tiny.compute_current_log_probs(worker.engine, probe),
                                global_batch_size=MINI_BATCH)
    batch = full.copy()
    tu.assign_non_tensor(batch, mini_batch_size=MINI_BATCH, epochs=EPOCHS, seed=SEED,
                         dataloader_kwargs={"shuffle": True})

    reference_model = PlainModelReference(tiny_model_path)
    steps: list[dict] = []

    def recording_train_batch(minibatch):  # TrainingWorker.train_batch, one call per optimizer step
        steps.append({"rows": row_indices(minibatch, full)})
        return TrainingWorker.train_batch(worker, minibatch)

    real_compute = engine_prepass.compute_prepass_log_probs

    def recording_compute(engine, data, layout):
        log_probs = real_compute(engine, data, layout)
        steps[-1].setdefault("prepass_log_probs", []).append(log_probs.clone())
        return log_probs

    events: list[str] = []
    real_optimizer_step = worker.engine.optimizer_step

    def recording_optimizer_step():
        events.append("optimizer_step")
        return real_optimizer_step()

    def observer(engine, result):
        events.append("prepass")
        step = steps[-1]
        step.setdefault("results", []).append(result)
        step["state"] = full_state_dict(engine)  # the parameters this optimizer step starts from

    monkeypatch.setattr(worker, "train_batch", recording_train_batch)
    monkeypatch.setattr(engine_prepass, "compute_prepass_log_probs", recording_compute)
    monkeypatch.setattr(worker.engine, "optimizer_step", recording_optimizer_step)
    with engine_step.observe_selections(observer):
        output = worker.train_mini_batch(batch)

    # -- one prepass per optimizer step -------------------------------------------------------------
    assert len(steps) == EPOCHS * BATCH // MINI_BATCH == 4
    assert events == ["prepass", "optimizer_step"] * 4
    for step in steps:
        assert len(step["results"]) == 1 and len(step["prepass_log_probs"]) == 1

    # -- the minibatches are the ones verl's data loader forms (shuffled, fresh order per epoch) -----
    order = torch.cat([td["i"] for td in tu.make_iterator(
        tu.get_tensordict({"i": torch.arange(BATCH)}), mini_batch_size=MINI_BATCH, epochs=EPOCHS,
        seed=SEED + worker.engine.get_data_parallel_rank(), dataloader_kwargs={"shuffle": True})]).tolist()
    assert [r for step in steps for r in step["rows"]] == order
    per_epoch = BATCH // MINI_BATCH
    for epoch in range(EPOCHS):
        rows = [r for step in steps[epoch * per_epoch:(epoch + 1) * per_epoch] for r in step["rows"]]
        assert sorted(rows) == list(range(BATCH))
    assert steps[0]["rows"] != list(range(MINI_BATCH)), "not shuffled: the row reconstruction is not exercised"
    assert steps[0]["rows"] != steps[per_epoch]["rows"]

    # -- every mask is the selection for that step's rows at that step's parameters -----------------
    states = [step["state"] for step in steps]
    for before, after in zip(states, states[1:]):
        assert any(not torch.equal(before[k], after[k]) for k in before), "parameters did not change"
    advantages = full["advantages"]
    response_mask = full["response_mask"]
    lp_errors = []
    for number, step in enumerate(steps):
        reference_model.load(step["state"])
        rows = step["rows"]
        reference_lp = reference_model.response_log_probs(tu.index_select_tensor_dict(full, rows))
        prepass_lp = step["prepass_log_probs"][0]
        mask_rows = padded_rows(response_mask, rows).bool()
        assert prepass_lp.shape == reference_lp.shape == mask_rows.shape
        lp_errors.append(float((prepass_lp - reference_lp).abs()[mask_rows].max()))
        assert lp_errors[-1] < LP_TOLERANCE, (number, lp_errors[-1])
        step_advantages = padded_rows(advantages, rows)
        reference = select_kl_cov_tokens(step_advantages, reference_lp, mask_rows, RATIO)
        selection = step["results"][0].selection
        assert selection.quota == reference.quota > 1
        # exactly the selection on the log-probs the prepass computed
        ours = select_kl_cov_tokens(step_advantages, prepass_lp, mask_rows, RATIO)
        assert torch.equal(selection.mask.cpu(), ours.mask), f"step {number}: mask is not the prepass's selection"
        # and the plain model's, unless its log-probs (another computation, LP_TOLERANCE apart) move a covariance
        # across the top-k boundary: a flip only where the gap there is within twice the covariances' difference
        gap, drift = top_k_margin(kl_cov_scores(step_advantages, prepass_lp, mask_rows),
                                  kl_cov_scores(step_advantages, reference_lp, mask_rows), mask_rows, reference.quota)
        assert torch.equal(selection.mask.cpu(), reference.mask) or gap <= 2 * drift, \
            f"step {number}: mask is not the reference (top-k gap {gap:.3g}, covariance difference {drift:.3g})"
        step["reference"] = reference

    # -- the second epoch recomputed the log-probs (the parameters moved in between) -----------------
    lengths = [len(r) for r in response_mask.unbind()]
    epoch_lp = [{}, {}]
    for number, step in enumerate(steps):
        for i, row in enumerate(step["rows"]):
            length = lengths[row]
            epoch_lp[number // per_epoch][row] = step["prepass_log_probs"][0][i, :length]
    drift = max(float((epoch_lp[0][r] - epoch_lp[1][r]).abs().max()) for r in range(BATCH))
    assert drift > 100 * max(lp_errors), (drift, lp_errors)

    # -- metrics returned by train_mini_batch --------------------------------------------------------
    metrics = tu.get(output, "metrics")
    for name in ("actor/kl_cov/quota", "actor/kl_cov/selected", "actor/kl_cov/prepass_seconds",
                 "actor/kl_cov/prepass_share", "actor/kl_cov/selected_in_micro_batch"):
        assert name in metrics, name
        assert len(metrics[name]) == len(steps), (name, metrics[name])
    assert [float(v) for v in metrics["actor/kl_cov/quota"]] == [float(s["reference"].quota) for s in steps]
    assert [float(v) for v in metrics["actor/kl_cov/selected"]] == [float(s["reference"].quota) for s in steps]
    assert [float(v) for v in metrics["actor/kl_cov/prepass_seconds"]] == pytest.approx(
        [s["results"][0].prepass_seconds for s in steps])
    assert all(0 < float(v) < 1 for v in metrics["actor/kl_cov/prepass_share"])
    # MEAN over the step's micro-batches (32 rows / 8 per micro-batch): times 4 it is the step's selection
    assert [4 * float(v) for v in metrics["actor/kl_cov/selected_in_micro_batch"]] == pytest.approx(
        [float(s["reference"].quota) for s in steps])
    print(f"\n[worker] quotas {[s['reference'].quota for s in steps]}, log-prob drift between epochs {drift:.2e}, "
          f"prepass vs plain model {max(lp_errors):.1e}")
