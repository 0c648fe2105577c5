"""``diagnose --loss-mode lp_reg_global``: its rows on the peaked policy, its verdict and the switch-off (verl's real
FSDP engine on CPU, tiny model, slow); its options, its errors and which rows run on the peaked policy (fast).

The Lp-Reg rows run on the peaked policy (lab/experiment.py: the tiny model's LM head x8, responses sampled from it
at T=0.5) with their own control ``vanilla[policy=peaked]``: on the tiny model's near-uniform distribution kappa 0.02
keeps every token and nothing is regularised. The run: that control, the authors' per-loss-call rule
(``lp_reg_per_micro_batch``, the lab's comparator) and ``lp_reg_global``, 1 vs 4 micro-batches of a 16 x (16 + 64)
minibatch at rho- 0.01. One micro-batch holds about 500 negative-advantage tokens (quota 4-5); each of 4 holds about
130, whose per-call quota max(1, int(1.3)) = 1 is switched off by the authors' ``k > 1``: the comparator regularises
nothing there, the global mode its quota, and the two updates differ by far more than the control's noise.
"""

from __future__ import annotations

import pytest

from verl_klcov_global import cli
from verl_klcov_global.diagnose.run import DiagnoseOptions, format_report, peaked_policy_modes, run_diagnose, summarise

PEAKED_CONTROL = "vanilla[policy=peaked]"


def test_the_defaults_are_the_authors_and_reach_both_config_classes():
    from verl_klcov_global.config import read_lp_reg_settings
    from verl_klcov_global.diagnose.run import _actor_config

    options = DiagnoseOptions(loss_mode="lp_reg_global", knobs={"lp_reg_min_p": 0.05})
    assert (options.knobs["lp_reg_neg_ratio"], options.knobs["lp_reg_pos_ratio"]) == (0.01, 0.0)
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


def test_the_lp_reg_rows_run_on_the_peaked_policy_only_for_the_embedded_model_and_auto_responses(tiny_model_path):
    assert peaked_policy_modes(DiagnoseOptions()) == ("lp_reg_global",)  # every mode: Lp-Reg's alone
    assert peaked_policy_modes(DiagnoseOptions(loss_mode="lp_reg_global")) == ("lp_reg_global",)
    assert peaked_policy_modes(DiagnoseOptions(loss_mode="stare_global")) == ()
    assert peaked_policy_modes(DiagnoseOptions(loss_mode="lp_reg_global", responses="random")) == ()
    assert peaked_policy_modes(DiagnoseOptions(loss_mode="lp_reg_global", model=tiny_model_path)) == ()


def _block(peaked_control_diff, lp_reg_diff):
    return {
        "vanilla": {"selected_per_layout": (0, 0), "masks_identical": None, "max_param_diff": 1e-9},
        PEAKED_CONTROL: {"selected_per_layout": (0, 0), "masks_identical": None, "max_param_diff": peaked_control_diff},
        "lp_reg_global": {"selected_per_layout": (4, 4), "masks_identical": True, "max_param_diff": lp_reg_diff},
    }


def test_a_row_on_the_peaked_policy_is_judged_against_its_own_control():
    options = DiagnoseOptions(loss_mode="lp_reg_global")
    controls = {PEAKED_CONTROL: PEAKED_CONTROL, "lp_reg_global": PEAKED_CONTROL}
    report = summarise(options, "cpu", ["a", "b"], [_block(8e-9, 4e-8)], controls=controls)
    assert report["invariant"] is True and report["modes"]["lp_reg_global"]["ratio_to_control"] == [5.0]
    assert f"the control's noise floor ({PEAKED_CONTROL}, on the peaked policy)" in report["verdicts"]["lp_reg_global"]
    assert report["controls"] == controls
    assert summarise(options, "cpu", ["a", "b"], [_block(8e-9, 4e-8)])["invariant"] is False  # 40x vanilla's


@pytest.mark.slow  # verl's engine on CPU: 6 updates of 16 x (16 + 64) tokens
def test_the_lp_reg_row_is_invariant_and_the_authors_rule_switches_off_and_moves_the_update():
    report = run_diagnose(DiagnoseOptions(loss_mode="lp_reg_global", blocks=1, batch_size=16, response_len=64,
                                          micro_batches=4), progress=lambda message: None)
    assert list(report["modes"]) == [PEAKED_CONTROL, "lp_reg_per_micro_batch", "lp_reg_global"]
    assert set(report["controls"].values()) == {PEAKED_CONTROL}
    ours, theirs = report["modes"]["lp_reg_global"], report["modes"]["lp_reg_per_micro_batch"]
    (one, four), = ours["selected_per_layout"]
    assert ours["masks_identical"] is True and one == four > 1 and ours["ratio_to_control"][0] <= 10
    (their_one, their_four), = theirs["selected_per_layout"]
    assert their_one == one  # one micro-batch holds the minibatch: the same quota
    assert their_four == 0  # every call's quota is 1: switched off by the authors' k > 1
    assert theirs["ratio_to_control"][0] >= 10  # ours regularises its quota, theirs nothing: the updates differ
    assert report["invariant"] is True
    verdict = report["verdicts"]["lp_reg_global"]
    assert verdict.startswith("lp_reg_global is INVARIANT") and "lp_reg_per_micro_batch" in verdict
    peaked = report["peaked_policy"]
    assert (peaked["lm_head_scale"], peaked["sampling_temperature"], peaked["control"]) == (8.0, 0.5, PEAKED_CONTROL)
    text = format_report(report)
    assert "lp_reg rho- 0.01" in text and "min_p 0.02" in text
    assert "the peaked policy (the tiny model's LM head x8)" in text
