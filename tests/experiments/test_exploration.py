"""The exploration study's task and premise (``experiments.exploration``), shortened.

The slow test trains the 64-id tiny Qwen2 on the deceptive task with the study's shape and knobs
(:data:`experiments.exploration.BASE`) for :data:`PREMISE_STEPS` steps under ``vanilla`` and asserts the
premise the study rests on: E's share of the response tokens rises and P's exact probability (from the
policy's log-probs, not counted from samples) ends below its start -- vanilla drifts toward the easy
optimum and away from the better mode. It can fail: the same run, as long, on a task whose easy path
leads to P (the easy set *is* the hidden ids) must *not* satisfy the premise, and the test checks that.

(Measured by hand, seed 2, 26 steps: giving P's ids E's reward instead -- the hidden ids added to the
easy set, no bonus -- does not break these assertions: the 11 equally rewarded ids compete, GRPO
concentrates on a few, and here the hidden ids lose, so P's probability falls, 0.046 -> 0.013, as it
does on the real task. At 12 steps it is still rising. With the easy set the hidden ids, it ends at 0.73.)

It also runs each global mode for :data:`COUNT_STEPS` steps at both of the study's micro-batch sizes and
asserts that the per-step selection counts (and the sampled rollouts) are identical: why the study runs
the global modes once per seed. Premise, on every CPU: kl_cov_global's runs have their log-prob pass (verl's
``log_prob_micro_batch_size_per_gpu``; the infer-layout prepass too) at their training micro-batch size (the
other modes keep the study's 4: no penalty of |log pi - log pi_old|). At
the first optimizer step of a trainer step pi = pi_old, and KL-Cov's penalty gradient is
coef * sign(log pi - log pi_old) * grad log pi: with the pass in the training micro-batch's company the
difference is exactly 0; with the study's pass at 4 and training at 1 it is float noise on CPUs whose rows'
last bits follow their micro-batch company (AMD EPYC; tests/support/company_noise.py), a full-size gradient
of noise's sign, and kl_cov_global's rollouts part from step 2 (the study's own spot-check at 1 says so
there). The counts are quotas of token counts; the rollouts stay identical while the parameters differ by
float noise only (tests/experiments/test_learning.py's argument).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from experiments.exploration import (
    BASE,
    GLOBAL_MODES,
    MICRO_BATCH_SIZES,
    format_report,
    run_study,
    spot_check_report,
    study_settings,
    summarize,
    vanilla_premise,
    wilson_interval,
    bootstrap_interval,
)
from experiments.exploration_task import TASK, DeceptiveTask

#: Seed 2 and the study's shape: E's share rises from the start, and P's exact probability, after rising
#: while GRPO still samples P, falls below its start before this many steps as E takes over.
PREMISE_SEED = 2
PREMISE_STEPS = 26
COUNT_STEPS = 2

#: The premise broken: the easy path leads to P (E's reward goes to the hidden ids, and E is only them).
P_ON_THE_EASY_PATH = replace(TASK, easy_ids=TASK.hidden_ids)


def _study(plans, base, task=TASK):
    study = {"settings": study_settings(base, task), "seeds": sorted({p["seed"] for p in plans}), "runs": {}}
    return run_study(plans, study, jobs=1, base=base, task=task, progress=lambda message: None)


def _plan(mode, size, seed, steps, name=None, **more):
    return dict(key=f"{name or mode}/seed{seed}", configuration=name or mode, loss_mode=mode,
                micro_batch_size=size, seed=seed, steps=steps, **more)


def test_task_reward_and_exact_probability():
    assert TASK.reward([TASK.hidden_ids[0]] + [TASK.easy_ids[0]] * 7) == pytest.approx(1.0 + 0.5 * 7 / 8)
    assert TASK.reward([TASK.easy_ids[0]] * 8) == 0.5 and TASK.reward([5] * 8) == 0.0
    assert not TASK.shows_pattern([5, TASK.hidden_ids[0]]) and not TASK.shows_pattern([])
    assert P_ON_THE_EASY_PATH.reward([TASK.hidden_ids[0]] + [5] * 7) == 1.0 + 0.5 / 8

    class Uniform:  # logits of 0 everywhere: P's exact probability is len(hidden)/64
        def __call__(self, input_ids):
            import torch

            return type("Out", (), {"logits": torch.zeros(input_ids.shape[0], input_ids.shape[1], 64)})()

    assert TASK.pattern_probability(Uniform(), [[1, 2, 3], [4, 5]]) == [pytest.approx(3 / 64)] * 2
    with pytest.raises(ValueError, match="vocabulary"):
        DeceptiveTask(hidden_ids=(64,))


def test_statistics():
    low, high = wilson_interval(0, 8)
    assert low == 0.0 and 0.3 < high < 0.34  # the rule of three's neighbour: 0/8 does not exclude 1 in 3
    assert wilson_interval(8, 8)[1] == 1.0 and wilson_interval(4, 8)[0] < 0.5 < wilson_interval(4, 8)[1]
    assert bootstrap_interval([1.0] * 8) == (1.0, 1.0)
    values = [0.1, 0.5, 0.2, 0.9, 0.3, 0.4, 0.6, 0.2]
    low, high = bootstrap_interval(values)
    assert low < sum(values) / len(values) < high and bootstrap_interval(values) == (low, high)  # seeded


@pytest.mark.slow
def test_premise_holds_under_vanilla_and_fails_when_the_easy_path_leads_to_p():
    base = replace(BASE, steps=PREMISE_STEPS)
    run = _study([_plan("vanilla", 4, PREMISE_SEED, PREMISE_STEPS)], base)["runs"][f"vanilla/seed{PREMISE_SEED}"]
    premise = vanilla_premise(run["curves"])
    assert 0.02 <= premise["pattern_probability_start"] <= 0.10, premise  # findable but rare
    assert premise["easy_share_rises"], premise
    assert premise["pattern_probability_falls"], premise

    broken = _study([_plan("vanilla", 4, PREMISE_SEED, PREMISE_STEPS)], base,
                    P_ON_THE_EASY_PATH)["runs"][f"vanilla/seed{PREMISE_SEED}"]
    broken_premise = vanilla_premise(broken["curves"])
    assert broken_premise["pattern_probability_start"] == premise["pattern_probability_start"]  # same model, prompts
    assert not broken_premise["pattern_probability_falls"], broken_premise


@pytest.mark.slow
def test_global_modes_select_identically_at_both_micro_batch_sizes():
    base = replace(BASE, steps=COUNT_STEPS)
    small, large = MICRO_BATCH_SIZES
    plans = [_plan(mode, size, 1, COUNT_STEPS, name=mode if size == large else f"{mode}/mbs{size}",
                   **({"log_prob_micro_batch_size": size} if mode == "kl_cov_global" else {}))  # module docstring
             for mode in GLOBAL_MODES for size in MICRO_BATCH_SIZES]
    study = _study(plans, base)
    checks = spot_check_report(study["runs"])
    assert sorted(checks) == sorted(f"{mode}/seed1" for mode in GLOBAL_MODES)
    for key, check in checks.items():
        assert check["selection_counts_identical"], (key, check)
        assert check["rollouts_identical"], (key, check)
    for mode in GLOBAL_MODES:
        counts = study["runs"][f"{mode}/seed1"]["selection_counts"]
        assert counts and any(max(series) > 0 for series in counts.values()), (mode, counts)  # it did select
    study["summary"] = summarize(study)
    assert "spot-check" in format_report(study)
