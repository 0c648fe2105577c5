"""The memory probe of ``benchmarks/bench_high_entropy.py`` sees what a call allocates and frees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

# The probe as the benchmark uses it: in a fresh process (``measure_memory``'s children), so that nothing else in
# the process frees memory while it samples. In a long pytest worker a garbage collection during the call can free
# a previous test's tensors as the block is touched, and the growth reads 4,096 B for a 64 MiB block (seen in a
# full-suite CI run on a 2-core runner).
_PROBE = textwrap.dedent(
    """
    import gc, json, time
    import torch
    from benchmarks.bench_high_entropy import peak_rss_growth

    def temporary(mib):
        def call():
            block = torch.ones(mib * 2**18)  # float32: mib MiB, touched
            total = float(block.sum())
            time.sleep(0.2)  # held long enough for the sampling thread to be scheduled on a loaded runner
            del block
            return total
        return call

    gc.collect()
    gc.disable()
    print(json.dumps([peak_rss_growth(temporary(8)), peak_rss_growth(temporary(64))]))
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc/self/statm (Linux)")
def test_peak_rss_growth_sees_a_temporary_that_is_freed_before_the_call_returns():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}  # as measure_memory sets for its children
    proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    small, large = json.loads(proc.stdout.strip().splitlines()[-1])
    assert large >= 56 * 2**20, large  # the 64 MiB block was resident at the peak
    assert large - small >= 40 * 2**20, (small, large)
