"""``diagnose --loss-mode stare_global``: its row and verdict (verl's real FSDP engine on CPU, tiny model, slow), its
options and their errors (fast).

The run: vanilla, the authors' per-loss-call rule (``stare_per_micro_batch``, the lab's comparator) and
``stare_global``, 1 vs 4 micro-batches, one small block. The global mode keeps its mask and stays within the control's
noise; the comparator's weighted tokens and update move with the micro-batching.
"""

from __future__ import annotations

import pytest

from verl_klcov_global import cli
from verl_klcov_global.diagnose.run import DiagnoseOptions, format_report, run_diagnose


def test_the_defaults_are_the_papers_with_the_gate_open_and_reach_both_config_classes():
    from verl_klcov_global.config import DEFAULT_STARE_TOP_RATIO, DEFAULT_STARE_REWEIGHT_W, read_stare_settings
    from verl_klcov_global.diagnose.run import _actor_config

    options = DiagnoseOptions(loss_mode="stare_global", knobs={"stare_variant": "C2", "stare_reweight_m": 0.8})
    assert (options.knobs["stare_top_ratio"], options.knobs["stare_reweight_w"]) == (DEFAULT_STARE_TOP_RATIO,
                                                                                    DEFAULT_STARE_REWEIGHT_W)
    assert options.knobs["stare_target_entropy"] > 13  # above ln(vocabulary) of any model: the gate opens
    ours = read_stare_settings(_actor_config(options, "stare_global"))
    theirs = read_stare_settings(_actor_config(options, "stare_per_micro_batch"))
    for settings in (ours, theirs):
        assert (settings.stare_top_ratio, settings.with_negative, settings.reweight_m) == (0.1, True, 0.8)
    assert type(_actor_config(options, "stare_per_micro_batch").policy_loss).__name__ == \
        "StarePerMicroBatchPolicyLossConfig"


@pytest.mark.parametrize("args, message", [
    (["--stare-top-ratio", "2"], "stare_top_ratio must be finite and in [0, 1]"),
    (["--stare-reweight-w", "0.5"], "stare_reweight_w must be finite and >= 1"),
])
def test_bad_stare_options_fail_clearly(capfd, args, message):
    assert cli.main(["diagnose", "--loss-mode", "stare_global", *args]) == 2
    err = capfd.readouterr().err
    assert message in err and "[block" not in err


def test_a_stare_config_is_planned_with_its_knobs_and_the_gate_open(monkeypatch):
    """--config-name=stare_global: P, W, M and the variant from the config (or an override); the gate's target is
    diagnose's (open), the config's shown as theirs; the entropy controller of a kl_cov config does not reach STARE."""
    from verl_klcov_global.diagnose.knobs import knob_default
    from verl_klcov_global.diagnose.run import validate
    from verl_klcov_global.diagnose.user_config import plan_for

    from .test_user_config import REPO, by_name

    monkeypatch.chdir(REPO)
    plan = plan_for(None, "stare_global", ["actor_rollout_ref.actor.policy_loss.stare_top_ratio=0.2",
                                           "actor_rollout_ref.actor.policy_loss.stare_variant=C2"], device="cpu")
    assert plan.options.loss_mode == "stare_global"
    assert (plan.options.knobs["stare_top_ratio"], plan.options.knobs["stare_variant"]) == (0.2, "C2")
    target = by_name(plan)["stare_target_entropy"]
    assert target.value == plan.options.knobs["stare_target_entropy"] == knob_default("stare_target_entropy")
    assert target.yours == 0.3  # the plugin's YAML, the paper's
    every = plan_for(None, "kl_cov_global", ["actor_rollout_ref.actor.policy_loss.entropy_target=1.5"],
                     device="cpu", loss_mode="all")
    assert every.options.entropy_control["entropy_target"] == 1.5
    validate(every.options)  # StareGlobalPolicyLossConfig has no entropy_* knobs: they are not passed to it


@pytest.mark.slow  # verl's engine on CPU: 6 updates of 16 x (16 + 32) tokens
def test_the_stare_row_is_invariant_and_the_authors_per_call_rule_is_not():
    report = run_diagnose(DiagnoseOptions(loss_mode="stare_global", blocks=1, batch_size=16, response_len=32,
                                          micro_batches=4), progress=lambda message: None)
    assert list(report["modes"]) == ["vanilla", "stare_per_micro_batch", "stare_global"]
    ours, theirs = report["modes"]["stare_global"], report["modes"]["stare_per_micro_batch"]
    (one, four), = ours["selected_per_layout"]
    assert ours["masks_identical"] is True and one == four > 0 and ours["ratio_to_control"][0] <= 10
    (their_one, their_four), = theirs["selected_per_layout"]
    # one micro-batch holds the minibatch: the same quotas as ours (they depend on the candidate counts only);
    # four calls take a ceiling each, so at least as many
    assert their_one == one and their_four >= their_one
    assert theirs["masks_identical"] is None and theirs["ratio_to_control"][0] > 10
    assert report["invariant"] is True
    verdict = report["verdicts"]["stare_global"]
    assert verdict.startswith("stare_global is INVARIANT") and "stare_per_micro_batch differs by up to" in verdict
    text = format_report(report)
    assert "stare top_ratio 0.1, W 1.1, O1, target entropy 100" in text and "OK: stare_global is INVARIANT" in text
