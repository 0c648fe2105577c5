"""Learning runs on verl's trainer loop with policy-sampled rollouts (``experiments.learning``), shortened.

The slow test trains the 64-id tiny Qwen2 from scratch for :data:`STEPS` GRPO steps with
``vanilla``, upstream ``kl_cov``, ``kl_cov_global``, ``clip_cov_global``, ``high_entropy_global`` and
``stare_global`` (its gate open: target :data:`experiments.learning.STARE_OPEN_TARGET`, above ln 64; with the default
0.3 the gate would stay shut over these steps and the run be vanilla's) at micro-batch sizes 1
and 4 -- the figure's run shortened (:data:`TEST_BASE`: 4 prompts x 8 responses of 8 tokens per
step, 2 minibatches x 2 PPO epochs, SGD lr 0.1 instead of 0.03 so that 6 steps show learning) --
and asserts:

* vanilla learns: its reward rises and its entropy falls (the full 40-step run's thresholds --
  reward +0.5, entropy to <= 20% -- are the figure's, docs/EVIDENCE.md);
* each global mode's per-step selection counts are identical at both micro-batch sizes, and its
  entropy and reward curves agree within ``NOISE_FACTOR`` (10) times vanilla's own micro-batch
  difference (at least one float32 spacing of the logged entropy);
* upstream ``kl_cov`` differs by more than that;
* ``stare_global`` runs with verl's log-prob pass: its gate reads the pass's batch entropy (verl's ``actor/entropy``
  to float32 rounding), is open at every step, and its weights act (its entropy leaves vanilla's floor).

The tolerance's basis: vanilla's difference between micro-batch sizes is float summation order
only (~1e-7 in parameters per step). Sampling would turn any parameter difference into different
tokens eventually, but a token flips only when its uniform draw lands within that ~1e-7 of a
boundary of the sampling distribution's CDF: over the test's 8 x 512 draws per run that has a
probability of order 1e-3 (here 6 x 256), so the rollouts of vanilla and of the global modes stay identical at both
micro-batch sizes -- the test checks that too -- and their curves differ by float noise only.
Upstream ``kl_cov`` selects different tokens per micro-batch (at size 1 every covariance is 0), so
its parameters differ by the penalty's gradient, its samples part, and its curves split.

Premise of kl_cov_global's comparison, on every CPU: its runs have their log-prob pass (verl's
``log_prob_micro_batch_size_per_gpu``, ``RunConfig.log_prob_micro_batch_size``; the infer-layout prepass
too) at their training micro-batch size; every other run keeps the studies' 4. At the first optimizer
step of a trainer step pi = pi_old, and KL-Cov's penalty coef * |log pi - log pi_old| has the gradient
coef * sign(log pi - log pi_old) * grad log pi. With the pass in the training micro-batch's company (verl's
minibatches are contiguous, ``actor.shuffle`` False) the difference is the same computation's, exactly 0
(torch's gradient of |x| at 0 is 0); with the pass at 4 and training at 1 it is float noise on CPUs whose
rows' last bits follow their micro-batch company (AMD EPYC; ``VERL_KLCOV_EMULATE_COMPANY_NOISE=1``,
tests/support/company_noise.py), and its sign is a full-size gradient: the runs at 1 and 4 then part like
upstream's (the plugin promises the masks there, not the update). At the later optimizer steps pi has
moved by a whole update: the smallest |log pi - log pi_old| on a selected token was 8.7e-4 here (emulator
on), ~1,800x the company noise of 4.8e-7, so the sign is decided. Its two passes differ in the last bits
(other company), which vanilla's floor (pass at 4 at both sizes) does not carry: the comparison is the
stricter for it. The masks are the selection on statistics that differ by float noise; a near-tie flipped
by it would part the runs and fail the ratio (here the quota boundaries stood >= 1.7e-3 (KL-Cov) and
>= 2.9e-6 (80/20; or at exact ties that stayed exact: a prompt's responses share their first position's
entropy) from the next statistic, against ~5e-7 of noise).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from experiments.learning import (
    NOISE_FACTOR, STARE, STARE_KNOBS, STARE_OPEN_TARGET, format_report, learning_run, run_runs, summarize,
)
from experiments.learning import BASE as FIGURE_BASE
from experiments.learning_task import TARGET_IDS, VOCAB_SIZE, build_learning_model, target_fraction
from experiments.policy_rollout import PolicySampler, grpo_advantages, request_seed
from verl_klcov_global.lab.tiny import build_tokenizer

STEPS = 6
TEST_BASE = replace(FIGURE_BASE, steps=STEPS, prompts_per_step=4, mini_batch_prompts=2, lr=0.1)
MODES = ("vanilla", "kl_cov", "kl_cov_global", "clip_cov_global", "high_entropy_global", STARE)
STARE_ROW = f"{STARE} target={STARE_OPEN_TARGET:g}"


@pytest.fixture(scope="module")
def learning_model(tmp_path_factory):
    return build_learning_model(str(tmp_path_factory.mktemp("learning") / "model"))


def test_task_tokenizer_has_64_ids_and_short_prompts():
    tok = build_tokenizer("words")
    assert len(tok) == VOCAB_SIZE and tok.pad_token_id == 0 and tok.eos_token_id == 2
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 123 + 124?"}], add_generation_prompt=True,
                                  tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert len(ids) <= FIGURE_BASE.max_prompt_length and tok.unk_token_id not in ids
    assert not set(ids) & set(TARGET_IDS)
    assert target_fraction([TARGET_IDS[0], 5, TARGET_IDS[-1], 7]) == 0.5 and target_fraction([]) == 0.0


def test_grpo_advantages_are_verls():
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    scores = [0.125, 0.25, 0.0, 0.125, 0.5, 0.5, 0.5, 0.5, 0.375, 0.0]
    groups = ["a", "a", "a", "a", "b", "b", "b", "b", "c", "c"]
    token_scores = torch.zeros(len(scores), 3)
    token_scores[:, -1] = torch.tensor(scores)
    ours = grpo_advantages(scores, groups)
    verls, _ = compute_grpo_outcome_advantage(token_scores, torch.ones(len(scores), 3), index=groups)
    assert torch.equal(torch.tensor(ours, dtype=torch.float32), verls[:, 0])


def test_sampler_draws_a_pure_function_of_weights_and_request(learning_model):
    sampler = PolicySampler(learning_model)
    start = sampler.flat()
    prompts = [[1, 4, 5, 6, 21, 11, 2, 1, 5], [1, 4, 5, 6, 22, 11, 2, 1, 5]]
    seeds = [request_seed(1, 0, f"det-{i}", p) for i, p in enumerate(prompts)]
    first = sampler.sample(prompts, seeds, 8)
    assert sampler.sample(prompts, seeds, 8) == first
    assert all(len(t) == 8 and all(0 <= x < VOCAB_SIZE for x in t) for t in first[0])
    assert first[0][0] != first[0][1]  # different requests, different draws
    # other weights, other draws; the recorded weights again, the same draws
    sampler.load_flat(start + 0.5 * torch.randn(start.shape, generator=torch.Generator().manual_seed(0),
                                                dtype=torch.float64))
    assert sampler.sample(prompts, seeds, 8)[0] != first[0]
    sampler.load_flat(start)
    assert torch.equal(sampler.flat(), start) and sampler.sample(prompts, seeds, 8) == first
    assert request_seed(1, 0, "det-0", prompts[0]) != request_seed(1, 1, "det-0", prompts[0])
    assert request_seed(1, 0, "det-0", prompts[0]) != request_seed(2, 0, "det-0", prompts[0])


@pytest.fixture(scope="module")
def report(learning_model, tmp_path_factory):
    # kl_cov_global's log-prob pass at its training micro-batch size (module docstring: KL-Cov's sign at pi = pi_old)
    runs = [learning_run(TEST_BASE, m, b, stare_target=STARE_OPEN_TARGET if m == STARE else None,
                         log_prob_micro_batch_size=b if m == "kl_cov_global" else None) for m in MODES for b in (1, 4)]
    result = summarize(run_runs(runs, model_path=learning_model, work_dir=str(tmp_path_factory.mktemp("runs")), jobs=1))
    print("\n" + format_report(result))
    return result


@pytest.mark.slow
def test_vanilla_learns_and_its_entropy_falls(report):
    for mbs in (1, 4):
        curve = report["curves"][f"vanilla/mbs{mbs}"]
        assert curve["reward"][-1] - curve["reward"][0] >= 0.05, curve["reward"]
        assert curve["entropy"][0] - curve["entropy"][-1] >= 0.02, curve["entropy"]
        # the rollout samples from the trainer's current weights: its entropy is verl's, to float noise
        assert max(abs(a - b) for a, b in zip(curve["entropy"], curve["sample_entropy"])) < 1e-4


@pytest.mark.slow
def test_global_modes_stay_on_vanillas_floor_and_upstream_kl_cov_splits(report):
    pairs = report["pairs"]
    assert pairs["vanilla"]["same_rollouts"], pairs["vanilla"]
    for mode in ("kl_cov_global", "clip_cov_global", "high_entropy_global", STARE_ROW):
        pair = pairs[mode]
        assert pair["counts_identical"] is True, (mode, pair)
        assert pair["same_rollouts"], (mode, pair)
        assert max(pair["ratio_to_vanilla"].values()) <= NOISE_FACTOR, (mode, pair)
    assert pairs["kl_cov"]["ratio_to_vanilla"]["entropy"] > NOISE_FACTOR, pairs["kl_cov"]
    # not vacuous: the global modes select in every step and log their covariance figures
    for mbs in (1, 4):
        kl = report["curves"][f"kl_cov_global/mbs{mbs}"]
        assert min(kl["selected"]) >= 1 and all(0.0 < s <= 1.0 for s in kl["selected_cov_share"])
        assert all(m > c for m, c in zip(kl["selected_cov_mean"], kl["cov_mean"]))  # the top of the covariance
        assert min(report["curves"][f"clip_cov_global/mbs{mbs}"]["clipped"]) > 0
        # int(0.2 N) of each minibatch's N tokens (logged: means over the step's optimizer steps)
        high = report["curves"][f"high_entropy_global/mbs{mbs}"]
        assert all(0 < s and abs(s - 0.2 * v) < 1 for s, v in zip(high["selected"], high["valid_tokens"]))
        assert all(m >= t for m, t in zip(high["selected_entropy_mean"], high["entropy_threshold"]))


@pytest.mark.slow
def test_stare_reads_verls_log_prob_pass_and_its_weights_act(report):
    """Through verl's trainer (its log-prob pass, then the update): the gate reads the pass's batch entropy, which is
    verl's actor/entropy up to that figure's float32 rounding; open at every step (target above ln 64); W 1.1 on
    ceil(10%) of the A > 0 tokens, none of the A < 0 (variant O1); and the weights change the run beyond vanilla's
    float noise (measured: from step 2)."""
    pairs = report["pairs"]
    floor = max(pairs["vanilla"]["entropy"], pairs["vanilla"]["entropy_resolution"])
    for mbs in (1, 4):
        stare, vanilla = report["curves"][f"{STARE_ROW}/mbs{mbs}"], report["curves"][f"vanilla/mbs{mbs}"]
        assert stare["gate_on"] == [1.0] * STEPS and stare["target_entropy"] == [STARE_OPEN_TARGET] * STEPS
        assert stare["reweight_w_in_use"] == [STARE_KNOBS["stare_reweight_w"]] * STEPS
        assert max(abs(b - h) for b, h in zip(stare["batch_entropy"], stare["entropy"])) < 2e-6
        assert stare["selected_negative"] == [0.0] * STEPS
        # logged: means over the step's optimizer steps of k = ceil(0.1 n), so 0 <= k - 0.1 n < 1 holds for the means
        assert all(0 <= k - 0.1 * n < 1 and k >= 1 for k, n in zip(stare["selected_positive"],
                                                                    stare["candidates_positive"]))
        assert stare["entropy"][0] == vanilla["entropy"][0]  # the same policy before the first update
        assert max(abs(a - b) for a, b in zip(stare["entropy"], vanilla["entropy"])) > NOISE_FACTOR * floor


def test_picture_and_report_render_from_the_documented_json(tmp_path):
    """``--from-json`` (no runs): the committed run's JSON prints its report and draws its picture."""
    import os

    from experiments.learning import main

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    png = tmp_path / "learning.png"
    assert main(["--from-json", os.path.join(root, "docs", "learning_cpu.json"), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 50_000


def test_the_stare_rows_are_configured(tmp_path):
    """stare_global's runs: verl's config as the trainer gets it holds STARE's config class, its knobs (the defaults)
    and the row's target; verl's log-prob pass is on (the legacy trainer always runs it: no bypass mode)."""
    from verl.utils.config import omega_conf_to_dataclass

    from experiments.learning import BASE, STARE_TARGETS, compose_run_config

    for target in STARE_TARGETS:
        run = learning_run(BASE, STARE, 4, stare_target=target)
        config = compose_run_config(run, model_path="/m", train_file="/t.parquet", out_dir=str(tmp_path))
        actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
        loss = actor.policy_loss
        assert type(loss).__name__ == "StareGlobalPolicyLossConfig" and loss.loss_mode == STARE
        assert {key: getattr(loss, key) for key in STARE_KNOBS} == STARE_KNOBS
        assert loss.stare_target_entropy == target and actor.ppo_micro_batch_size_per_gpu == 4
        assert config.algorithm.rollout_correction.bypass_mode is False


@pytest.mark.parametrize("mode, config_class, entropy_in_training", [
    ("high_entropy_global", "HighEntropyGlobalPolicyLossConfig", False),
    ("high_entropy_per_micro_batch", "HighEntropyPerMicroBatchPolicyLossConfig", True),
])
def test_the_high_entropy_rows_are_configured(tmp_path, mode, config_class, entropy_in_training):
    """The figure runs high_entropy_global and the authors' per-micro-batch rule at micro-batch sizes 1 and 4
    (the default --modes), each with its config class, rho 0.2, and the training forward's entropy for the rule."""
    from verl.utils.config import omega_conf_to_dataclass

    from experiments.learning import BASE, MICRO_BATCH_SIZES
    from experiments.local_trainer import LOSS_MODES, compose_config, trainer_overrides

    assert mode in LOSS_MODES and MICRO_BATCH_SIZES == (1, 4) and BASE.entropy_top_ratio == 0.2
    run = replace(BASE, loss_mode=mode, micro_batch_size=1)
    config = compose_config(trainer_overrides(run, model_path="/m", train_file="/t.parquet", out_dir=str(tmp_path)))
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    assert type(actor.policy_loss).__name__ == config_class and actor.policy_loss.loss_mode == mode
    assert actor.policy_loss.entropy_top_ratio == 0.2 and actor.ppo_micro_batch_size_per_gpu == 1
    assert bool(actor.calculate_entropy) is entropy_in_training


def test_the_lp_reg_rows_are_configured(tmp_path):
    """lp_reg_global's runs: its config class with the knobs fixed before the runs (LP_REG_KNOBS), on the legacy
    trainer whose log-prob pass computes the proxy (no bypass mode)."""
    from verl.utils.config import omega_conf_to_dataclass

    from experiments.learning import BASE, LP_REG, LP_REG_KNOBS, compose_run_config

    run = learning_run(BASE, LP_REG, 4)
    config = compose_run_config(run, model_path="/m", train_file="/t.parquet", out_dir=str(tmp_path))
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    loss = actor.policy_loss
    assert type(loss).__name__ == "LpRegGlobalPolicyLossConfig" and loss.loss_mode == LP_REG
    assert {key: getattr(loss, key) for key in LP_REG_KNOBS} == LP_REG_KNOBS and loss.lp_reg_kl_coef == 1.0
    assert loss.ppo_kl_coef == 0.1  # verl's: Lp-Reg's beta is its own knob, left at the authors' 1.0
    assert actor.ppo_micro_batch_size_per_gpu == 4 and config.algorithm.rollout_correction.bypass_mode is False
    from experiments.learning import config_fields

    assert "lp_reg_knobs" not in config_fields(learning_run(BASE, "vanilla", 4))
