"""The experiment's helpers (``lab/experiment.py``): the table's modes and their variants (no engine), and one diagnose run
of ``prepass_layout=old`` (verl's engine, slow)."""

from __future__ import annotations

import pytest

from verl_klcov_global.lab.experiment import (
    compared_modes, largest_divisor_at_most, registered_global_modes, train_layout_mode, upstream_counts,
    upstream_mode, variant_of,
)
from verl_klcov_global.methods.clip_cov.row import CLIP_COV
from verl_klcov_global.methods.high_entropy.row import HIGH_ENTROPY
from verl_klcov_global.methods.kl_cov.row import KL_COV
from verl_klcov_global.methods.stare.row import STARE


@pytest.mark.parametrize("rows, limit, expected", [(64, 16, 16), (8, 32, 8), (12, 8, 6), (10, 4, 2), (7, 16, 7), (1, 16, 1)])
def test_the_default_training_micro_batch_size_divides_the_minibatch(rows, limit, expected):
    assert largest_divisor_at_most(rows, limit) == expected


def test_the_compared_modes_come_from_the_table():
    assert registered_global_modes() == ("clip_cov_global", "high_entropy_global", "kl_cov_global", "lp_reg_global",
                                         "stare_global")
    assert (upstream_mode("kl_cov_global"), upstream_mode("clip_cov_global")) == ("kl_cov", "clip_cov")
    assert compared_modes("kl_cov_global") == ("vanilla", "kl_cov", "kl_cov_global", "kl_cov_global[prepass=train]")
    assert compared_modes("clip_cov_global") == ("vanilla", "clip_cov", "clip_cov_global")
    assert variant_of(train_layout_mode("kl_cov_global")) == (KL_COV, "train")
    assert variant_of("clip_cov_global") == (CLIP_COV, None) and variant_of("kl_cov") == (None, None)
    assert upstream_counts("clip_cov") is CLIP_COV and upstream_counts("vanilla") is None
    # high_entropy_global's upstream is the lab's comparator: compared_modes registers it in-process
    assert compared_modes("high_entropy_global") == ("vanilla", "high_entropy_per_micro_batch", "high_entropy_global")
    assert upstream_counts("high_entropy_per_micro_batch") is HIGH_ENTROPY
    # so is stare_global's: the authors' per-loss-call STARE (lab/per_micro_batch.py)
    assert compared_modes("stare_global") == ("vanilla", "stare_per_micro_batch", "stare_global")
    assert upstream_counts("stare_per_micro_batch") is STARE
    # and lp_reg_global's: the authors' per-loss-call Lp-Reg
    assert compared_modes("lp_reg_global") == ("vanilla", "lp_reg_per_micro_batch", "lp_reg_global")


@pytest.mark.slow  # verl's engine on CPU
def test_diagnose_runs_the_old_policy_layout_with_the_pass_a_trainer_would_hold(monkeypatch):
    """``prepass_layout=old`` reads pi_old's entropy from verl's log-prob pass, which diagnose's frozen update has no
    trainer to run: ``one_update`` runs and holds it (``hold_old_policy_pass``), so the 80/20 mode is diagnosed with
    it, the same tokens counted for 1 and 4 micro-batches.

    Premise of the masks: diagnose holds a pass run with each layout's own micro-batches (1 vs 4), other company,
    where a row's fp32 entropy may differ in the last bits on some CPUs. So: each mask is exactly the selection on
    the entropy its step read; where the two held entropies are equal (the same bits), the masks are identical and
    diagnose says INVARIANT; otherwise the entropies are within company noise and the report's mask verdict is what
    the two masks show."""
    import torch

    from verl_klcov_global.engine import reuse
    from verl_klcov_global.diagnose.run import DiagnoseOptions, run_diagnose
    from verl_klcov_global.layout import padded

    from ..engine.test_reuse import ROW_COMPANY_NOISE
    from ..support.selections import recorded_selections

    held = []
    real_held = reuse.held_entropy

    def recording(engine, data):
        entropy, why = real_held(engine, data)
        held.append(entropy)
        return entropy, why

    monkeypatch.setattr(reuse, "held_entropy", recording)  # engine/old_policy.py reads it through the module
    with recorded_selections() as records:
        report = run_diagnose(DiagnoseOptions(loss_mode="high_entropy_global", prepass_layout="old",
                                              compare_prepass_layouts=False, blocks=1, batch_size=16,
                                              response_len=32, micro_batches=4), progress=lambda message: None)
    mode = report["modes"]["high_entropy_global"]
    (selected_one, selected_four), = mode["selected_per_layout"]
    assert selected_one == selected_four > 0
    assert len(records) == len(held) == 2  # one step per layout, each on the pass held for it
    for record, entropy in zip(records, held):
        again = record.mode.select_minibatch(padded(record.data["old_log_probs"]), record.data, record.settings,
                                             None, entropy=entropy)
        assert torch.equal(record.result.selection.mask, again.mask)  # the selection on the entropy it read
    same_masks = torch.equal(records[0].result.selection.mask, records[1].result.selection.mask)
    assert mode["masks_identical"] is same_masks
    if torch.equal(held[0], held[1]):  # the same statistics: the same mask, bit for bit
        assert same_masks
    else:
        assert float((held[0] - held[1]).abs().max()) < ROW_COMPANY_NOISE
    assert report["invariant"] is same_masks  # the same mask, the same update up to the control's noise
