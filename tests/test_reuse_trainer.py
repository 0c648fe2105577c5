"""Reuse of verl's log-prob pass on verl 0.9.1's real trainer loop: on-policy runs train bit for bit as with the prepass.

Runs: ``RayPPOTrainer.fit`` (legacy trainer) in-process with verl's real ``ActorRolloutRefWorker`` and FSDP2
engine on CPU, fp32 (:mod:`experiments.local_trainer`), GRPO, 3 steps of 4 prompts x 4 responses, **one
minibatch and one epoch** (the strictly on-policy setup), for each global mode: once as the plugin runs
(reuse on by default) and once with reuse switched off (``engine.kept_pass.disabled()``: the prepass every step).

Required: with reuse every step whose minibatch holds no two rows of equal content logs ``prepass_reused`` 1 and
``prepass_seconds`` 0; a step with such rows (GRPO's random rollouts have some) reuses where verl's pass gave them
equal statistics and else runs the prepass, as ``engine/reuse.py`` is designed to (ambiguous rows): equal rows in
other micro-batch company get other last bits on some CPUs (the AMD EPYC runners), not on others (the Intel Xeon).
Without reuse every step logs 0 and > 0. The parameters at every weight version and every other logged figure
that does not measure time are equal bit for bit (the selections, pg_loss, grad_norm, entropy...), on any CPU by
construction: one minibatch in the pass's row order, so a reused step's statistics are the pass's forward of the
same rows in the same micro-batches as the prepass's, and a step that did not reuse ran that prepass. The v1
trainer's on-policy run is ``tests/integration/test_trainer_e2e.py`` (``main_ppo``, Ray); bypass mode (no actor pass, so no reuse) is
``tests/test_guardrails_trainer.py``; the first step of a resumed run is ``tests/test_restart.py``.
"""

from __future__ import annotations

import pytest
import torch

from verl_klcov_global.engine import kept_pass, reuse, step as engine_step
from verl_klcov_global.lab import cpu as _cpu
from verl_klcov_global.modes import MODES
from experiments import local_trainer

pytestmark = pytest.mark.slow  # verl's real trainer loop on CPU

STEPS = 3
ON_POLICY = dict(prompts_per_step=4, mini_batch_prompts=4, ppo_epochs=1)
#: figures that measure the prepass itself or time, not the training computation
TIMING = ("prepass_reused", "prepass_seconds", "prepass_share", "selection_seconds")


def _deterministic(key: str) -> bool:
    return not (key.startswith(("timing_s/", "timing_per_token_ms/", "perf/")) or key.endswith(TIMING)
                or "memory" in key)


@pytest.fixture(scope="module")
def run(tiny_model_path, tmp_path_factory):
    _cpu.install_cpu_platform()
    _cpu.init_process_group_cpu(0, 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    work_dir = str(tmp_path_factory.mktemp("reuse"))

    def _run(mode: str):
        config = local_trainer.RunConfig(loss_mode=mode, steps=STEPS, **ON_POLICY)
        return local_trainer.run_trainer(config, model_path=tiny_model_path, work_dir=work_dir)

    yield _run
    torch.set_num_threads(threads)


#: why reuse refuses a minibatch with rows of equal content whose pass statistics differ (engine/reuse.py)
AMBIGUOUS = "rows of equal content got different statistics in verl's log-prob pass"


def _has_rows_of_equal_content(data) -> bool:
    ids = data["input_ids"]
    rows = ids.unbind() if ids.is_nested else [r[m.bool()] for r, m in zip(ids, data["attention_mask"])]
    keys = [tuple(r.tolist()) for r in rows]
    return len(set(keys)) < len(keys)


@pytest.fixture
def steps(monkeypatch):
    """Per optimizer step of the runs in the test: (reused, reuse's reason, the minibatch holds rows of equal
    content)."""
    seen = []
    real_run = engine_step.run_prepass_and_select

    def run(engine, data, settings, mode):
        result = real_run(engine, data, settings, mode)
        seen.append((result.reused, reuse.last_reason(engine), _has_rows_of_equal_content(data)))
        return result

    monkeypatch.setattr(engine_step, "run_prepass_and_select", run)
    return seen


@pytest.mark.parametrize("mode", list(MODES))
def test_an_on_policy_run_reuses_every_unambiguous_step_and_trains_as_the_prepass_does(run, steps, mode):
    prefix = MODES[mode].metric_prefix
    reused = run(mode)
    with kept_pass.disabled():
        prepass = run(mode)
    assert len(steps) == 2 * STEPS  # one optimizer step per trainer step
    flags = [m[prefix + "prepass_reused"] for m in reused.metrics]
    assert flags == [float(was_reused) for was_reused, _, _ in steps[:STEPS]]
    for number, (was_reused, reason, equal_rows) in enumerate(steps[:STEPS], 1):
        if not equal_rows:  # nothing ambiguous: reused on every CPU
            assert was_reused, (number, reason)
        elif not was_reused:  # equal rows whose pass statistics differ in the last bits (their micro-batch company)
            assert reason == AMBIGUOUS, (number, reason)
    # reuse exercised: steps without equal rows exist on every CPU (the rollout is random tokens, not the model's)
    assert not all(equal_rows for _, _, equal_rows in steps[:STEPS])
    assert [m[prefix + "prepass_seconds"] == 0.0 for m in reused.metrics] == [flag == 1.0 for flag in flags]
    assert all(m[prefix + "prepass_seconds"] > 0 for m, flag in zip(reused.metrics, flags) if flag == 0.0)
    assert [m[prefix + "prepass_reused"] for m in prepass.metrics] == [0.0] * STEPS
    assert all(m[prefix + "prepass_seconds"] > 0 for m in prepass.metrics)
    assert len(reused.params) == STEPS + 1
    for version, (a, b) in enumerate(zip(reused.params, prepass.params)):
        assert torch.equal(a, b), f"weight version {version}"
    assert not torch.equal(reused.params[0], reused.params[-1])  # it trained
    compared = 0
    for a, b in zip(reused.metrics, prepass.metrics):
        keys = sorted(k for k in set(a) | set(b) if _deterministic(k))
        assert [k for k in keys if a.get(k) != b.get(k)] == [], a["step"]
        compared += len(keys)
    selected = prefix + ("clipped" if mode == "clip_cov_global" else "selected")
    assert all(m[selected] >= 1 for m in reused.metrics)  # the selection acted: not vacuous
    print(f"\n{mode}: {sum(flags):.0f} of {STEPS} on-policy steps reused verl's log-prob pass (steps with rows of "
          f"equal content: {[number for number, (_, _, equal) in enumerate(steps[:STEPS], 1) if equal]}); "
          f"{compared} figures and {len(reused.params)} weight versions equal to the prepass run's, bit for bit")


class _PairedResponses(local_trainer.RandomRollout):
    """Samples 2j and 2j + 1 of every batch get one response: verl repeats each prompt ``n`` times in a row
    (``repeat(interleave=True)``), so with an even ``n`` every group of GRPO holds pairs of equal rows."""

    def respond(self, prompts):
        responses = super().respond(prompts)
        assert all(prompts[i] == prompts[i - i % 2] for i in range(len(prompts)))
        return [responses[i - i % 2] for i in range(len(responses))]


def test_lp_reg_trains_through_repeated_responses_in_the_recipes_packed_dynamic_layout(run, tiny_model_path,
                                                                                        tmp_path):
    """``lp_reg_global`` on verl's trainer loop with a rollout that repeats responses, packed sequences and dynamic
    micro-batches (the recipes' settings), 2 minibatches x 2 epochs: its proxy is read at every optimizer step from
    the pass held for the update, although copies of a row got statistics one ulp apart there (what bf16, packed
    sequences and some CPUs give them; made certain here). Before, every rank raised ``ProxyUnavailableError``."""
    from .support.copies import copies_one_ulp_apart

    config = local_trainer.RunConfig(loss_mode="lp_reg_global", steps=2, prompts_per_step=4, mini_batch_prompts=2,
                                     ppo_epochs=2)
    packed_dynamic = ["actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.use_dynamic_bsz=True",
                      "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=128",
                      "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
                      "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=192"]
    with copies_one_ulp_apart() as moved:
        result = local_trainer.run_trainer(
            config, model_path=tiny_model_path, work_dir=str(tmp_path), extra_overrides=packed_dynamic,
            make_rollout=lambda tokenizer, run_config, params: _PairedResponses(
                tokenizer, seed=run_config.seed, max_prompt_length=run_config.max_prompt_length,
                max_response_length=run_config.max_response_length))
    assert moved == [8, 8]  # every step's pass: 16 rows in 8 pairs
    prefix = MODES["lp_reg_global"].metric_prefix
    assert len(result.metrics) == 2 and all(m[prefix + "selected"] >= 1 for m in result.metrics)
    assert not torch.equal(result.params[0], result.params[-1])  # it trained
