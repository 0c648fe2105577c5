"""``benchmarks/bench_stare.py`` runs its three modes on verl's engine and reports each (it times nothing here)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # verl's real engine on CPU


def test_the_stare_benchmark_runs_every_mode_and_reports_the_ratios(tiny_model_path):
    from benchmarks.bench_stare import MODES, report, run

    result = run(reps=1, warmup=0, model_dir=tiny_model_path)
    assert all(len(result["samples_seconds"][mode]) == 1 for mode in MODES)
    assert set(result["median_paired_ratio_of_stare_global"]) == {"vanilla", "stare_per_micro_batch"}
    assert result["median_selection_ms"] > 0
    assert "stare_global" in report(result)
