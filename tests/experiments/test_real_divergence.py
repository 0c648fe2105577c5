"""experiments/real_divergence.py: its runs on the tiny Qwen2 (the study's code path, verl's trainer loop, in seconds)
and its report's figures.

The study runs SmolLM2 for about half an hour (docs/EVIDENCE.md); here the same functions run 2 steps of the
tiny model with the study's knobs but shorter prompts and responses. What this checks is the machinery: six runs,
their weight versions written and deleted once their pair is compared, the mask digests and counts per optimizer
step, upstream's quota per micro-batch, the report.

Premise, asserted: the random tiny model never repeats the number, so every reward and every GRPO advantage is 0.
Then vanilla's gradient is exactly 0 and its runs move by verl's default weight decay alone, the same at both sizes:
its pair is exactly 0 on every CPU. Every KL-Cov covariance is 0, so the global selection is decided by its tie
order alone: its masks at micro-batch 1 and 4 are equal on every CPU. The parameter verdict against vanilla's floor
is not asserted here: from each step's second minibatch on, KL-Cov's penalty has a gradient (the weight decay made
|log pi - log pi_old| nonzero), which carries the CPU's float noise; vanilla's zero gradient carries none (under
tests/support/company_noise.py the global pair moves by 4e-9 against vanilla's 0). The verdict's arithmetic is
checked on figures below; its measurement is the study's, on SmolLM2.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

import pytest

from experiments import real_divergence as study_module
from experiments.real_divergence import (
    CONTROLLED_KEY, ENTROPY, MICRO_BATCH_SIZES, MODES, REWARD, compare_pairs, controller_figures, format_report,
    planned_runs, run_key, run_one, verdicts,
)


def _run(key, mode, size, entropy, *, target=None, steps=None, **extra):
    return {"key": key, "loss_mode": mode, "micro_batch_size": size, "entropy_target": target, "seconds": 1.0,
            "metrics": {ENTROPY: entropy, REWARD: [0.5] * len(entropy)}, "rollout_digest": ["a"] * len(entropy),
            **({"optimizer_steps": steps} if steps is not None else {}), **extra}


def test_the_controller_figures_read_the_ratio_per_optimizer_step():
    ratios = [0.02, 0.04, 0.05, 0.05, 1e-5]
    steps = [{"kl_cov_ratio_in_use": r, "entropy_measured": 2.0, "selected": 1.0, "mask_sha": "x"} for r in ratios]
    study = {"runs": {run_key("vanilla", 4): _run("v", "vanilla", 4, [3.0, 2.5]),
                      CONTROLLED_KEY: _run(CONTROLLED_KEY, "kl_cov_global", 4, [3.0, 2.4], target=2.1, steps=steps)}}
    figures = controller_figures(study)
    moves = sorted([math.log(2), math.log(1.25), 0.0, math.log(0.05 / 1e-5)])
    assert figures["median_abs_dlnr"] == pytest.approx((moves[1] + moves[2]) / 2)
    assert figures["max_abs_dlnr"] == pytest.approx(moves[-1])
    assert (figures["steps_at_upper_bound"], figures["steps_at_lower_bound"]) == (2, 1)
    assert figures["abs_error_last"] == pytest.approx(0.3)
    assert controller_figures({"runs": {}}) is None


def test_a_global_pair_passes_only_with_identical_masks_and_rollouts():
    pair = {"param_max_abs": [0.0, 2e-9], "param_beyond_spacing": [0.0, 0.0], "entropy": [0.0, 1e-9],
            "same_rollouts": [True, True], "same_masks": [True, True]}
    study = {"runs": {"v": _run("v", "vanilla", 4, [3.0, 2.5])},
             "pairs": {"vanilla": dict(pair, param_max_abs=[0.0, 1e-9]), "kl_cov_global": pair,
                       "kl_cov": dict(pair, param_max_abs=[0.0, 1e-6], param_beyond_spacing=[0.0, 1e-6])}}
    result = verdicts(study)
    assert result["kl_cov_global"]["ok"] and result["kl_cov"]["ok"]
    assert result["kl_cov"]["params_ratio"] == pytest.approx(1000.0)
    study["pairs"]["kl_cov_global"] = dict(pair, same_masks=[True, False])
    assert not verdicts(study)["kl_cov_global"]["ok"]


def test_the_controlled_run_waits_for_vanilla():
    first, second = planned_runs(3)
    assert {i["key"] for i in first} == {"vanilla/mbs4", "kl_cov_global/mbs4"}
    assert CONTROLLED_KEY not in {i["key"] for i in second} and len(first) + len(second) == 6
    _, second = planned_runs(3, target=2.0)
    (controlled,) = [i for i in second if i["key"] == CONTROLLED_KEY]
    assert controlled["entropy_target"] == 2.0 and controlled["micro_batch_size"] == 4
    assert not controlled["paired"]  # no pair: its weight versions are not written


@pytest.mark.slow
def test_two_steps_on_the_tiny_model(tiny_model_path, tmp_path):
    """The six runs of the study (2 steps each) on the tiny model, compared as the study compares them."""
    base = replace(study_module.BASE, max_prompt_length=24, max_response_length=6)
    weights_root, work_root = str(tmp_path / "weights"), str(tmp_path / "work")
    first, second = planned_runs(2)
    study = {"runs": {}}
    for item in first + second:
        study["runs"][item["key"]] = run_one(item, model_path=tiny_model_path, weights_root=weights_root,
                                             work_root=work_root, base=base)
    assert all(run["weight_versions"] == 3 for run in study["runs"].values())
    compare_pairs(study, weights_root, progress=lambda message: None)
    assert os.listdir(weights_root) == []  # every pair compared, its weight files deleted
    pairs = study["pairs"]
    assert set(pairs) == set(MODES)
    assert all(r == 0.0 for run in study["runs"].values() for r in run["metrics"][REWARD])  # the premise
    assert max(pairs["vanilla"]["param_max_abs"]) == 0.0
    global_pair = pairs["kl_cov_global"]
    assert all(global_pair["same_masks"]) and len(global_pair["same_masks"]) == 4
    assert all(global_pair["same_counts"]) and global_pair["same_rollouts"][0]
    rows_per_minibatch = base.mini_batch_prompts * base.responses_per_prompt
    for size in MICRO_BATCH_SIZES:  # upstream's floor of one token per micro-batch
        counts = study["runs"][run_key("kl_cov", size)]["upstream_selected"]
        assert len(counts) == 4 and all(n >= rows_per_minibatch // size for n in counts)
    selected = [s["selected"] for s in study["runs"][run_key("kl_cov_global", 1)]["optimizer_steps"]]
    assert all(n >= 1 for n in selected)
    report = format_report(study)
    assert "masks identical at 4/4 optimizer steps" in report and "kl_cov_global:" in report
