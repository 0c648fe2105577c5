"""The experiment's helpers (``lab/experiment.py``) that need no engine: the table's modes and their variants."""

from __future__ import annotations

import pytest

from verl_klcov_global.lab.experiment import (
    compared_modes, largest_divisor_at_most, registered_global_modes, train_layout_mode, upstream_counts,
    upstream_mode, variant_of,
)
from verl_klcov_global.modes import CLIP_COV, HIGH_ENTROPY, KL_COV


@pytest.mark.parametrize("rows, limit, expected", [(64, 16, 16), (8, 32, 8), (12, 8, 6), (10, 4, 2), (7, 16, 7), (1, 16, 1)])
def test_the_default_training_micro_batch_size_divides_the_minibatch(rows, limit, expected):
    assert largest_divisor_at_most(rows, limit) == expected


def test_the_compared_modes_come_from_the_table():
    assert registered_global_modes() == ("clip_cov_global", "high_entropy_global", "kl_cov_global")
    assert (upstream_mode("kl_cov_global"), upstream_mode("clip_cov_global")) == ("kl_cov", "clip_cov")
    assert compared_modes("kl_cov_global") == ("vanilla", "kl_cov", "kl_cov_global", "kl_cov_global[prepass=train]")
    assert compared_modes("clip_cov_global") == ("vanilla", "clip_cov", "clip_cov_global")
    assert variant_of(train_layout_mode("kl_cov_global")) == (KL_COV, "train")
    assert variant_of("clip_cov_global") == (CLIP_COV, None) and variant_of("kl_cov") == (None, None)
    assert upstream_counts("clip_cov") is CLIP_COV and upstream_counts("vanilla") is None
    # high_entropy_global's upstream is the lab's comparator: compared_modes registers it in-process
    assert compared_modes("high_entropy_global") == ("vanilla", "high_entropy_per_micro_batch", "high_entropy_global")
    assert upstream_counts("high_entropy_per_micro_batch") is HIGH_ENTROPY
