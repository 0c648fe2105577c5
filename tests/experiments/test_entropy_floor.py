"""experiments/entropy_floor.py: its plan and its figures, on hand-made runs (the runs themselves are
experiments/real_divergence.py's, tested in test_real_divergence.py)."""

from __future__ import annotations

import pytest

from experiments import entropy_floor as study


def _run(key, mode, seed, entropy, reward, *, ratio=0.002, target=None, ratios=None):
    run = {"key": key, "loss_mode": mode, "seed": seed, "kl_cov_ratio": ratio, "entropy_target": target,
           "seconds": 1.0, "metrics": {study.ENTROPY: entropy, study.REWARD: reward,
                                       study.GRAD_NORM: [2.0, 0.5] * (len(entropy) // 2)}}
    if ratios is not None:
        run["optimizer_steps"] = [{"kl_cov_ratio_in_use": r} for r in ratios]
    return run


def test_the_dose_runs_are_vanilla_and_three_fixed_ratios_per_seed_and_the_floor_waits_for_vanilla():
    items = study.dose_items(16)
    assert [i["key"] for i in items[:4]] == ["seed1/vanilla", "seed1/kl_cov_global/0.002", "seed1/kl_cov_global/0.02",
                                             "seed1/kl_cov_global/0.05"]
    assert len(items) == 12 and all(i["entropy_target"] is None and not i["paired"] for i in items)
    assert {i["seed"] for i in items} == set(study.SEEDS)
    runs = {"seed2/vanilla": _run("seed2/vanilla", "vanilla", 2, [3.0] * 16, [0.5] * 16)}
    floor = study.floor_items({"runs": runs}, 16)
    assert [i["key"] for i in floor] == ["seed2/kl_cov_global/floor"]  # only the seed whose vanilla ran
    (item,) = floor
    assert item["entropy_target"] == pytest.approx(study.TARGET_FACTOR * 3.0)
    assert item["kl_cov_ratio"] == study.USER_RATIO and item["control"] == study.FLOOR_LAW


def test_the_figures_and_the_goal():
    entropy = [3.0, 2.5, 2.0] + [1.0] * 12 + [1.5]
    floor_entropy = [3.0, 2.5, 2.2] + [0.95] * 12 + [2.0]
    runs = {
        "seed1/kl_cov_global/0.002": _run("seed1/kl_cov_global/0.002", "kl_cov_global", 1, entropy, [0.5] * 16),
        "seed1/kl_cov_global/floor": _run("seed1/kl_cov_global/floor", "kl_cov_global", 1, floor_entropy,
                                          [0.5] * 12 + [0.7] * 4, target=2.1, ratios=[0.002, 0.004, 0.008]),
    }
    summary = study.summarize({"runs": runs})
    fixed, floor = summary["runs"]["seed1/kl_cov_global/0.002"], summary["runs"]["seed1/kl_cov_global/floor"]
    assert fixed["min_entropy"] == 1.0 and fixed["last_entropy"] == 1.5 and fixed["steps_clipped"] == 8
    assert floor["steps_below_target"] == 13 and floor["ratio_in_use"] == [0.002, 0.004, 0.008]
    assert summary["goal"]["min_entropy_margin"] == {1: pytest.approx(-0.05)}
    assert summary["goal"]["never_worse"] and summary["goal"]["reward_gap"] == pytest.approx(0.2)
    assert not summary["goal"]["reward_within"]
    report = study.format_report({"runs": runs, "summary": summary})
    assert "seed 1: -0.050" in report and "NOT within 0.1" in report
