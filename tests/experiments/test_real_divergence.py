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

import json
import os
from dataclasses import replace

import pytest

from experiments import real_divergence as study_module
from experiments.real_divergence import (
    ENTROPY, MICRO_BATCH_SIZES, MODES, REWARD, compare_pairs, format_report, planned_runs, run_key, run_one,
    study_settings, verdicts,
)


def _run(key, mode, size, entropy):
    return {"key": key, "loss_mode": mode, "micro_batch_size": size, "entropy_target": None, "seconds": 1.0,
            "metrics": {ENTROPY: entropy, REWARD: [0.5] * len(entropy)}, "rollout_digest": ["a"] * len(entropy)}


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


def test_the_study_plans_every_mode_at_both_sizes_and_no_controlled_run():
    items = planned_runs(3)
    assert [i["key"] for i in items] == [run_key(m, b) for m in MODES for b in MICRO_BATCH_SIZES]
    assert len(items) == 6 and all(i["entropy_target"] is None and i["steps"] == 3 for i in items)
    assert all(i.get("paired", True) for i in items)  # each one's weight versions are written for its pair
    settings = study_settings(3)
    assert "controller" not in settings and settings["base"]["steps"] == 3


def test_the_shipped_json_holds_the_planned_runs_under_the_current_settings():
    """docs/real_divergence.json: the six runs, settings a rerun with its --json would accept (resumed_from)."""
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "real_divergence.json")) as f:
        study = json.load(f)
    steps = study["settings"]["base"]["steps"]
    assert study["settings"] == json.loads(json.dumps(study_settings(steps)))
    assert set(study["runs"]) == {i["key"] for i in planned_runs(steps)} and set(study["pairs"]) == set(MODES)
    assert set(study["summary"]) == {"verdicts"}
    assert "kl_cov_global: OK" in format_report(study)


@pytest.mark.slow
def test_two_steps_on_the_tiny_model(tiny_model_path, tmp_path):
    """The six runs of the study (2 steps each) on the tiny model, compared as the study compares them."""
    base = replace(study_module.BASE, max_prompt_length=24, max_response_length=6)
    weights_root, work_root = str(tmp_path / "weights"), str(tmp_path / "work")
    study = {"runs": {}}
    for item in planned_runs(2):
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
