"""The memory probe of ``benchmarks/bench_high_entropy.py`` sees what a call allocates and frees."""

from __future__ import annotations

import os
import time

import pytest
import torch

from benchmarks.bench_high_entropy import peak_rss_growth


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc/self/statm (Linux)")
def test_peak_rss_growth_sees_a_temporary_that_is_freed_before_the_call_returns():
    def temporary(mib):
        def call():
            block = torch.ones(mib * 2**18)  # float32: mib MiB, touched
            total = float(block.sum())
            # held long enough for the sampling thread to be scheduled: on a loaded 2-core runner a call of a few
            # ms can end before the sampler runs once (seen in the full suite: growth 4096 B for the 64 MiB block)
            time.sleep(0.2)
            del block
            return total
        return call

    small, large = peak_rss_growth(temporary(8)), peak_rss_growth(temporary(64))
    assert large >= 56 * 2**20, large  # the 64 MiB block was resident at the peak
    assert large - small >= 40 * 2**20, (small, large)
