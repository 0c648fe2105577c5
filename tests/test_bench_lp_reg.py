"""``benchmarks/bench_lp_reg.py`` runs verl's log-prob pass with and without the proxy and reports the cost (it times
nothing here); the bytes kept are the pass's log-prob and proxy per response token plus the row digests."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # verl's real engine on CPU


def test_the_lp_reg_benchmark_runs_both_passes_and_reports_the_cost(tiny_model_path):
    from benchmarks.bench_lp_reg import BATCH, OPERATIONS, report, run

    result = run(reps=1, warmup=0, model_dir=tiny_model_path, model_name="tiny")
    assert all(len(result["samples_seconds"][name]) == 1 for name in OPERATIONS)
    response_tokens = result["config"]["response_tokens"]
    # two float32 per response token (log-prob, proxy), offsets (8 bytes per row + 8) and one 16-byte digest per row
    assert result["kept_bytes"] == 8 * response_tokens + 8 * (BATCH + 1) + 16 * BATCH
    assert result["config"]["vocab"] == 512 and "pass + proxy" in report(result)
