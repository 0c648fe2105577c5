"""The audit of ``docs/GUARDRAILS.md``, pinned on verl 0.9.1's real trainer loop.

Runs: ``RayPPOTrainer.fit`` (legacy trainer) in-process with verl's real ``ActorRolloutRefWorker``
and FSDP2 engine on CPU, fp32 (:mod:`experiments.local_trainer`), ``kl_cov_global``,
2 steps of 4 prompts x 4 responses, 2 minibatches x 2 epochs. Where a feature needs the rollout's
log-probs, the rollout adds ``rollout_log_probs`` = ``-log(vocab) + N(0, 0.3)`` (the tiny random
model's log-probs are close to ``-log(vocab)``), seeded per step.

Each test pins one outcome; the trainer's worker is built before ``fit``, as Ray's workers are
built before the driver's loop (``init_workers``), from the same config object here (a Ray
worker gets a pickled copy: it can only be more isolated from the driver's config).
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from verl_klcov_global import driver
from verl_klcov_global.lab import cpu as _cpu
from experiments import local_trainer

from .support.gloo import spawn_gloo

RC = "algorithm.rollout_correction."
ACTOR = "actor_rollout_ref.actor."
KEYS = ("actor/kl_cov/selected", "actor/kl_cov/valid_tokens", "actor/pg_loss", "actor/ppo_kl", "actor/grad_norm")


def _with_rollout_log_probs(trainer, worker, rollout):
    generate = rollout.generate_sequences

    def generate_with_log_probs(batch):
        output = generate(batch)
        mask = output.batch["response_mask"].float()
        noise = torch.randn(mask.shape, generator=torch.Generator().manual_seed(len(rollout.digests)))
        output.batch["rollout_log_probs"] = (-math.log(len(rollout.tokenizer)) + 0.3 * noise) * mask
        return output

    rollout.generate_sequences = generate_with_log_probs


@pytest.fixture(scope="module")
def run(tiny_model_path, tmp_path_factory):
    """``run(*overrides, rollout_log_probs=False, **run_config)`` -> (RunResult, the trainer's config after fit)."""
    _cpu.install_cpu_platform()
    _cpu.init_process_group_cpu(0, 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    work_dir = str(tmp_path_factory.mktemp("audit"))

    def _run(*overrides, rollout_log_probs=False, **fields):
        seen = {}

        def customize(trainer, worker, rollout):
            seen["config"] = trainer.config
            if rollout_log_probs:
                _with_rollout_log_probs(trainer, worker, rollout)

        extra = list(overrides) + (["actor_rollout_ref.rollout.calculate_log_probs=True"] if rollout_log_probs else [])
        result = local_trainer.run_trainer(local_trainer.RunConfig(loss_mode="kl_cov_global", steps=2, **fields),
                                           model_path=tiny_model_path, work_dir=work_dir, extra_overrides=extra,
                                           customize=customize)
        return result, seen["config"]

    yield _run
    torch.set_num_threads(threads)


def _prepass_module():
    """Where the prepass forward lives."""
    from verl_klcov_global.engine import prepass

    return prepass


def _figures(result) -> list[dict]:
    return [{k: m[k] for k in KEYS} for m in result.metrics]


#: One optimizer step per trainer step, so that step 1's logged figures are one selection's.
ONE_UPDATE = dict(mini_batch_prompts=4, ppo_epochs=1)


@pytest.fixture(scope="module")
def decoupled_base(run):
    return run(rollout_log_probs=True, **ONE_UPDATE)[0]


@pytest.fixture(scope="module")
def base(run):
    return run()[0]


# -- rollout correction ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_legacy_trainer_bypass_mode_keeps_the_global_loss_on_the_worker(run, decoupled_base):
    """verl 0.9.1's legacy ``apply_bypass_mode`` rewrites ``loss_mode`` in the driver's config only: the
    worker's loss (built at ``init_model``, before ``fit``) stays ``kl_cov_global``; the old log-probs are
    the rollout's (ppo_kl is the rollout/actor gap from the first update on)."""
    result, config = run(f"{RC}bypass_mode=True", "trainer.use_v1=False", rollout_log_probs=True, **ONE_UPDATE)
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "bypass_mode"  # verl's rewrite, driver side
    for figures in _figures(result):
        assert figures["actor/kl_cov/selected"] >= 1  # the plugin's selection ran in every step
        assert figures["actor/ppo_kl"] > 0.1            # |log pi - log pi_rollout|, not ~0
    assert [f["actor/ppo_kl"] for f in _figures(decoupled_base)] != [f["actor/ppo_kl"] for f in _figures(result)]
    # no actor log-prob pass in bypass mode: the prepass ran in every step (engine/reuse.py); decoupled, the
    # on-policy update (one minibatch, one epoch) took the statistics of verl's log-prob pass instead
    assert [m["actor/kl_cov/prepass_reused"] for m in result.metrics] == [0.0, 0.0]
    assert all(m["actor/kl_cov/prepass_seconds"] > 0 for m in result.metrics)
    assert [m["actor/kl_cov/prepass_reused"] for m in decoupled_base.metrics] == [1.0, 1.0]


@pytest.mark.slow
def test_bypass_mode_with_rollout_is_is_refused_before_the_trainer_starts(run):
    with pytest.raises(driver.TrainerConfigError, match="would silently drop rollout_is=token"):
        run(f"{RC}bypass_mode=True", f"{RC}rollout_is=token", rollout_log_probs=True)


@pytest.mark.slow
def test_decoupled_rollout_is_weights_reach_the_loss_and_leave_the_selection_alone(run, decoupled_base):
    result, _ = run(f"{RC}rollout_is=token", f"{RC}rollout_is_threshold=2.0", rollout_log_probs=True, **ONE_UPDATE)
    assert any(k.startswith("rollout_corr/") for k in result.metrics[0])
    first, base = result.metrics[0], decoupled_base.metrics[0]
    # step 1: same batch, same parameters -> the same selection; the IS weights change the loss
    assert first["actor/kl_cov/selected"] == base["actor/kl_cov/selected"]
    assert first["actor/kl_cov/cov_threshold"] == base["actor/kl_cov/cov_threshold"]
    assert first["actor/pg_loss"] != base["actor/pg_loss"]


@pytest.mark.slow
def test_decoupled_rejection_sampling_shrinks_what_the_prepass_selects_from(run, decoupled_base):
    result, _ = run(f"{RC}rollout_rs=token_k3", f"{RC}rollout_rs_threshold=0.05", rollout_log_probs=True,
                    **ONE_UPDATE)
    first, base = result.metrics[0], decoupled_base.metrics[0]
    assert 0 < first["actor/kl_cov/valid_tokens"] < base["actor/kl_cov/valid_tokens"], (first, base)
    assert first["actor/kl_cov/quota"] < base["actor/kl_cov/quota"] or base["actor/kl_cov/quota"] == 1


# -- engine features ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_entropy_chunking_and_checkpointing_change_nothing_the_selection_sees(run, base):
    """The prepass never computes entropy (``calculate_entropy=False``); with ``entropy_coeff=0`` the
    training step's entropy is only logged. Same selections, same parameters, bit for bit."""
    result, _ = run(f"{ACTOR}entropy_from_logits_with_chunking=True", f"{ACTOR}entropy_checkpointing=True")
    assert [m["actor/kl_cov/selected"] for m in result.metrics] == [m["actor/kl_cov/selected"] for m in base.metrics]
    assert torch.equal(result.params[-1], base.params[-1])


@pytest.mark.slow
def test_use_torch_compile_only_compiles_the_entropy_which_the_prepass_does_not_compute(tiny_model_path):
    """verl 0.9.1 FSDP engine: ``use_torch_compile`` wraps ``compute_entropy_from_logits`` only
    (``transformer_impl.py`` ~183); log-probs go through ``logprobs_from_logits`` uncompiled. The
    prepass asks for no entropy."""
    from verl.workers.engine.fsdp import transformer_impl

    source = inspect.getsource(transformer_impl.FSDPEngine.__init__)
    assert "torch.compile(entropy_from_logits" in source and source.count("torch.compile(") == 1
    assert "calculate_entropy=False" in inspect.getsource(_prepass_module().compute_prepass_log_probs)


def _fused_and_plain(rank, world_size, model_path, work_dir):
    """In a process of its own: verl's fused-kernel monkey patch replaces the HF model class's forward
    process-wide (Ray workers are processes of their own too), and would break later plain runs."""
    torch.set_num_threads(1)
    runs = {}
    for name, extra in (("plain", [f"{ACTOR}strategy=fsdp"]),
                        ("fused", [f"{ACTOR}strategy=fsdp", "actor_rollout_ref.model.use_fused_kernels=True",
                                   "actor_rollout_ref.model.fused_kernel_options.impl_backend=torch"])):
        result = local_trainer.run_trainer(local_trainer.RunConfig(loss_mode="kl_cov_global", steps=2),
                                           model_path=model_path, work_dir=work_dir, extra_overrides=extra)
        runs[name] = ([m["actor/kl_cov/selected"] for m in result.metrics], result.params[-1])
    return runs


@pytest.mark.slow
def test_fused_kernels_torch_backend_run_the_prepass_on_the_same_path(tiny_model_path, tmp_path):
    """``model.use_fused_kernels`` (torch backend; triton is GPU-only): the minibatch carries
    ``use_fused_kernels`` (``TrainingWorker.train_batch`` sets it), the prepass's ``infer_batch`` reads
    the same key, so old log-probs, prepass and training forward all use the fused path. FSDP1: with
    fsdp2 on CPU verl's own fused forward fails in ``compute_log_prob`` (a plain tensor meets the
    DTensor lm_head weight), before any plugin code runs."""
    (runs,) = spawn_gloo(_fused_and_plain, 1, tiny_model_path, str(tmp_path), verl_platform=True)
    (fused_selected, fused_params), (plain_selected, plain_params) = runs["fused"], runs["plain"]
    assert all(n >= 1 for n in fused_selected)
    assert fused_selected == plain_selected  # fp32 on CPU: the fused and the plain log-probs pick the same tokens
    difference = (fused_params - plain_params).abs().max().item()
    print(f"\nfused vs plain (FSDP1, fp32 CPU): selected per step {fused_selected}; max |param difference| after "
          f"2 steps {difference:.3g}")


@pytest.mark.slow
def test_shuffled_epochs_select_per_minibatch_reproducibly(run, base):
    """``ppo_epochs=2`` with ``actor.shuffle=True``: each epoch's minibatches hold other sequences; the
    mask is computed per optimizer step from its minibatch, and the run repeats bit for bit."""
    first, _ = run(f"{ACTOR}shuffle=True")
    second, _ = run(f"{ACTOR}shuffle=True")
    assert torch.equal(first.params[-1], second.params[-1])
    assert _figures(first) == _figures(second)
    assert not torch.equal(first.params[-1], base.params[-1])  # the shuffle did change the minibatches


# -- what the plugin's configs cannot reach ----------------------------------------------------------------


def test_router_replay_needs_an_engine_the_global_modes_refuse():
    """verl 0.9.1 enables router replay only for the megatron and veomni strategies (``engine_workers.py``
    ~498; FSDP forces ``disabled``); the driver refuses both strategies for a global mode."""
    from verl.workers import engine_workers

    source = inspect.getsource(engine_workers.ActorRolloutRefWorker.__init__)
    assert 'rr_mode = "disabled"' in source
    from .test_driver import _compose

    for strategy in ("megatron", "veomni"):
        with pytest.raises(driver.TrainerConfigError, match="strategy=fsdp2"):
            driver.prepare_trainer_config(_compose("kl_cov_global", "override", [f"{ACTOR}strategy={strategy}"]))


def test_v1_async_trainers_update_through_the_shared_update_actor():
    """Every v1 trainer mode inherits ``PPOTrainer._update_actor`` (-> ``update_actor`` ->
    ``train_mini_batch`` -> the hooked ``BaseEngine.train_batch``, driven in ``test_trainer_ray.py``),
    called once per local step by ``PPOTrainer._step_once``."""
    pytest.importorskip("transfer_queue")
    from verl.trainer.ppo.v1 import PPOTrainer, PPOTrainerColocateAsync, PPOTrainerSeparateAsync, PPOTrainerSync

    for cls in (PPOTrainerSync, PPOTrainerColocateAsync, PPOTrainerSeparateAsync):
        assert cls._update_actor is PPOTrainer._update_actor, cls
        assert cls._step_once is PPOTrainer._step_once, cls
    assert "self._update_actor(" in inspect.getsource(PPOTrainer._step_once)


def test_lora_reference_log_probs_bypass_the_hook():
    """``ref_in_actor`` (LoRA): verl computes reference log-probs with ``TrainingWorker.infer_batch`` and
    ``no_lora_adapter`` (adapters disabled around ``engine.infer_batch``). The hook wraps
    ``BaseEngine.train_batch``; the reuse of verl's log-prob pass wraps ``infer_batch`` only to keep a copy of
    what it returns, and never for a call with ``no_lora_adapter`` (``tests/engine/test_reuse.py``), so
    reference log-probs are verl's own. The prepass calls ``engine.infer_batch`` inside the training step with
    the adapters as training has them."""
    from verl.workers.engine.base import BaseEngine
    from verl.workers.engine_workers import TrainingWorker

    from verl_klcov_global.engine import patches

    assert hasattr(BaseEngine.train_batch, "__verl_klcov_global_original__")
    assert hasattr(BaseEngine.infer_batch, "__verl_klcov_global_original__")  # PATCH log_prob_pass_keep
    assert "disable_adapter()" in inspect.getsource(TrainingWorker.infer_batch)  # verl's, unwrapped
    from verl_klcov_global import seams

    assert seams.NO_LORA_ADAPTER_KEY == "no_lora_adapter"  # the seam checks verl's infer_batch pops it
    assert "seams.NO_LORA_ADAPTER_KEY" in inspect.getsource(patches._log_prob_pass_of)
    assert "no_lora_adapter" not in inspect.getsource(_prepass_module())
