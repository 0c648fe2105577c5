"""``diagnose --loss-mode lp_reg_global``: its row, its verdict and the switch-off (verl's real FSDP engine on CPU,
tiny model, slow); its options and their errors (fast).

The run: vanilla, the authors' per-loss-call rule (``lp_reg_per_micro_batch``, the lab's comparator) and
``lp_reg_global``, 1 vs 4 micro-batches of a 16 x (16 + 64) minibatch at rho- 0.01. One micro-batch holds about 500
negative-advantage tokens (quota 5); each of 4 holds about 130, whose per-call quota max(1, int(1.3)) = 1 is
switched off by the authors' ``k > 1``: the comparator regularises nothing there, the global mode its quota.
"""

from __future__ import annotations

import pytest

from verl_klcov_global import cli
from verl_klcov_global.diagnose.run import DiagnoseOptions, format_report, run_diagnose


def test_the_defaults_are_the_authors_and_reach_both_config_classes():
    from verl_klcov_global.config import read_lp_reg_settings
    from verl_klcov_global.diagnose.run import _actor_config

    options = DiagnoseOptions(loss_mode="lp_reg_global", lp_reg_min_p=0.05)
    assert (options.lp_reg_neg_ratio, options.lp_reg_pos_ratio) == (0.01, 0.0)
    ours = read_lp_reg_settings(_actor_config(options, "lp_reg_global"))
    theirs = read_lp_reg_settings(_actor_config(options, "lp_reg_per_micro_batch"))
    for settings in (ours, theirs):
        assert (settings.neg_ratio, settings.pos_ratio, settings.min_p) == (0.01, 0.0, 0.05)
    assert type(_actor_config(options, "lp_reg_per_micro_batch").policy_loss).__name__ == \
        "LpRegPerMicroBatchPolicyLossConfig"


@pytest.mark.parametrize("args, message", [
    (["--lp-reg-neg-ratio", "2"], "lp_reg_neg_ratio must be finite and in [0, 1]"),
    (["--lp-reg-min-p", "1"], "lp_reg_min_p must be finite and in [0, 1)"),
])
def test_bad_lp_reg_options_fail_clearly(capfd, args, message):
    assert cli.main(["diagnose", "--loss-mode", "lp_reg_global", *args]) == 2
    err = capfd.readouterr().err
    assert message in err and "[block" not in err


@pytest.mark.slow  # verl's engine on CPU: 6 updates of 16 x (16 + 64) tokens
def test_the_lp_reg_row_is_invariant_and_the_authors_rule_switches_off():
    report = run_diagnose(DiagnoseOptions(loss_mode="lp_reg_global", blocks=1, batch_size=16, response_len=64,
                                          micro_batches=4), progress=lambda message: None)
    assert list(report["modes"]) == ["vanilla", "lp_reg_per_micro_batch", "lp_reg_global"]
    ours, theirs = report["modes"]["lp_reg_global"], report["modes"]["lp_reg_per_micro_batch"]
    (one, four), = ours["selected_per_layout"]
    assert ours["masks_identical"] is True and one == four > 1 and ours["ratio_to_control"][0] <= 10
    (their_one, their_four), = theirs["selected_per_layout"]
    assert their_one == one  # one micro-batch holds the minibatch: the same quota
    assert their_four == 0  # every call's quota is 1: switched off by the authors' k > 1
    assert report["invariant"] is True
    verdict = report["verdicts"]["lp_reg_global"]
    assert verdict.startswith("lp_reg_global is INVARIANT") and "lp_reg_per_micro_batch" in verdict
    text = format_report(report)
    assert "lp_reg rho- 0.01" in text and "lp_reg_per_micro_batch" in text
