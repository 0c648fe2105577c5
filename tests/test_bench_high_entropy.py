"""The memory probe of ``benchmarks/bench_high_entropy.py`` sees what a call allocates and frees."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.bench_high_entropy import peak_rss_growth


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc/self/statm (Linux)")
def test_peak_rss_growth_sees_a_temporary_that_is_freed_before_the_call_returns():
    def temporary(mib):
        def call():
            block = torch.ones(mib * 2**18)  # float32: mib MiB, touched
            total = float(block.sum())
            del block
            return total
        return call

    small, large = peak_rss_growth(temporary(8)), peak_rss_growth(temporary(64))
    assert large >= 56 * 2**20, large  # the 64 MiB block was resident at the peak
    assert large - small >= 40 * 2**20, (small, large)
