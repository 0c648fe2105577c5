"""``diagnose --loss-mode NAME`` for any loss in verl's registry, ``--import MODULE``, ``--all-registered``.

Fast: the exit-2 cases (unknown name, a module that does not import), the choice of verl's own
losses by module, and the verdict by measurement on synthetic figures. Slow (verl's real FSDP engine
on CPU, tiny model): two losses of tests/diagnose/two_user_losses.py, registered by ``--import`` from the
current directory, judged both ways (a top-k inside each call: exit 1; a per-token loss: exit 0), the
user's config class reaching the loss through ``policy_loss._target_``, and a loss that cannot run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.diagnose import two_user_losses
from verl_klcov_global import cli
from verl_klcov_global.diagnose.run import DiagnoseOptions, format_report, summarise
from verl_klcov_global.diagnose.measured import control_of, describe_error, other_layout, split_row
from verl_klcov_global.diagnose.user_losses import verl_own_losses

SMALL = ["--blocks", "1", "--batch-size", "16", "--response-len", "32", "--micro-batches", "4"]
LOSSES_FILE = Path(two_user_losses.__file__)
TOP_K, PER_TOKEN = two_user_losses.TOP_K, two_user_losses.PER_TOKEN


@pytest.fixture
def restore_sys_path(monkeypatch):
    """diagnose puts the current directory on sys.path (as python -m does): undo it after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))


# ---------------------------------------------------------------------------
# Exit status 2: said before any work
# ---------------------------------------------------------------------------


def test_an_unknown_loss_name_is_named_with_the_registered_names(capfd):
    assert cli.main(["diagnose", "--loss-mode", "stare"]) == 2
    err = capfd.readouterr().err
    assert "--loss-mode 'stare' is not in verl's policy-loss registry" in err
    assert all(name in err for name in ("kl_cov", "gspo", "kl_cov_global", "clip_cov_global"))
    assert "--import" in err and "[block" not in err


def test_a_module_that_does_not_import_is_named_with_its_error(tmp_path, monkeypatch, capfd, restore_sys_path):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["diagnose", "--import", "no_such_losses_module", "--loss-mode", TOP_K]) == 2
    err = capfd.readouterr().err
    assert "--import no_such_losses_module: the module does not import: ModuleNotFoundError" in err
    assert str(tmp_path) in err  # where it looked
    (tmp_path / "broken_losses.py").write_text("raise RuntimeError('needs a GPU to register')\n")
    assert cli.main(["diagnose", "--import", "broken_losses", "--loss-mode", TOP_K]) == 2
    err = capfd.readouterr().err
    assert "--import broken_losses: the module does not import: RuntimeError: needs a GPU to register" in err
    assert "[block" not in err


@pytest.mark.parametrize("args, message", [
    (["--loss-mode", "vanilla"], "--loss-mode vanilla is the control"),
    (["--all-registered", "--loss-mode", "kl_cov"], "--all-registered runs every loss verl registers"),
    (["--all-registered", "--config-name", "kl_cov_global"], "drop --config-name"),
])
def test_misused_loss_options_fail_clearly(capfd, args, message):
    assert cli.main(["diagnose", *args]) == 2
    err = capfd.readouterr().err
    assert message in err and "[block" not in err


# ---------------------------------------------------------------------------
# Which losses, and the verdict by measurement
# ---------------------------------------------------------------------------


def test_verl_own_losses_are_chosen_by_the_module_that_defines_them():
    own = verl_own_losses()
    assert {"kl_cov", "clip_cov", "gspo", "geo_mean", "bypass_mode"} <= set(own)
    # the control, the plugin's modes and a user's losses (this module imported them) are not verl's own
    assert not {"vanilla", "kl_cov_global", "clip_cov_global", "high_entropy_global", TOP_K, PER_TOKEN} & set(own)


def test_the_other_layout_keeps_the_micro_batch_count_and_each_row_has_its_control():
    static = other_layout(16, 48, 4, "static")
    assert (static.use_dynamic_bsz, static.micro_batch_size_per_gpu) == (False, 4)
    assert other_layout(18, 48, 4, "static").micro_batch_size_per_gpu == 3  # 5 does not divide 18: the next divisor
    dynamic = other_layout(16, 48, 4, "dynamic")
    assert dynamic.use_dynamic_bsz and dynamic.max_token_len_per_gpu == 4 * 48
    assert control_of(split_row(TOP_K, "static")) == "vanilla[split=static]"
    assert control_of(TOP_K) == control_of("kl_cov_global[prepass=train]") == "vanilla"


def _measured_block(dynamic, static, repeat, static_floor=1e-9):
    row = {"selected_per_layout": None, "masks_identical": None}
    return {
        "vanilla": {**row, "selected_per_layout": (0, 0), "max_param_diff": 1e-9},
        "vanilla[split=static]": {**row, "selected_per_layout": (0, 0), "max_param_diff": static_floor},
        PER_TOKEN: {**row, "max_param_diff": dynamic, "repeat_param_diff": repeat},
        f"{PER_TOKEN}[split=static]": {**row, "max_param_diff": static},
    }


@pytest.mark.parametrize("dynamic, static, repeat, static_floor, invariant", [
    (2e-9, 2e-9, 0.0, 1e-9, True),
    (2e-8, 2e-9, 0.0, 1e-9, False),  # the dynamic split moves the update
    (2e-9, 2e-8, 0.0, 1e-9, False),  # only the static split does
    (2e-9, 2e-9, 2e-8, 1e-9, False),  # another RNG state moves it: a draw at random
    (2e-9, 5e-8, 0.0, 1e-8, True),  # each split against its own control's noise floor
])
def test_a_measured_loss_is_invariant_only_within_10x_in_both_layouts_and_run_again(
        dynamic, static, repeat, static_floor, invariant):
    options = DiagnoseOptions(loss_mode=PER_TOKEN)
    report = summarise(options, "cpu", ["1 micro-batch", "4 micro-batches"],
                       [_measured_block(dynamic, static, repeat, static_floor)], other_layout_name="4 (static)")
    assert report["invariant"] is invariant
    assert report["verdicts"][PER_TOKEN].startswith(f"{PER_TOKEN} is {'INVARIANT' if invariant else 'NOT invariant'}")
    assert report["modes"][PER_TOKEN]["selected_per_layout"] == [None]
    text = format_report(report)
    assert f"{PER_TOKEN} " in text and "gradient clipping off" in text
    assert text.endswith("every loss diagnosed is invariant" if invariant else f"NOT invariant: {PER_TOKEN}")


def _bare_assertion(config):
    raise AssertionError  # what `assert isinstance(config, ActorConfig)` raises outside pytest: no message


def test_an_assertion_without_a_message_says_where_it_failed():
    with pytest.raises(AssertionError) as caught:
        _bare_assertion(None)
    text = describe_error(caught.value)
    assert text.startswith("AssertionError at ") and "test_user_losses.py" in text and "raise AssertionError" in text
    assert describe_error(ValueError("dro_beta must be positive\nmore")) == "ValueError: dro_beta must be positive"


def test_a_config_naming_a_loss_outside_the_table_plans_that_loss_with_its_policy_loss_node():
    """--config-name: verl's gspo (or a user's loss) is the loss diagnosed; its policy_loss node goes along."""
    from verl_klcov_global.diagnose.user_config import plan_for

    plan = plan_for(None, "ppo_trainer", ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"], device="cpu")
    options, settings = plan.options, {s.name: s for s in plan.settings}
    assert options.loss_mode == "gspo" and options.policy_loss["_target_"] == "verl.workers.config.PolicyLossConfig"
    assert settings["modes diagnosed"].value == "gspo" and "judged by measurement" in settings["modes diagnosed"].note
    assert "clip_cov_seed" not in settings and settings["optimizer"].value == "SGD lr 0.02, no clipping, 1 step"
    # a mode of the table or vanilla: as before, no policy_loss node (the table's config classes are used)
    assert plan_for(None, "ppo_trainer", [], device="cpu").options.policy_loss is None


# ---------------------------------------------------------------------------
# Real runs (verl's FSDP engine on CPU)
# ---------------------------------------------------------------------------


def _run_console_script(folder: Path, *args):
    command = os.path.join(os.path.dirname(sys.executable), "verl-klcov-global")
    return subprocess.run([command, *args], cwd=folder, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_top_k_inside_each_call_is_not_invariant_exit_1(tmp_path):
    """The console script, from a folder holding the user's module: the current directory is importable."""
    shutil.copy(LOSSES_FILE, tmp_path / "my_losses.py")
    proc = _run_console_script(tmp_path, "diagnose", "--import", "my_losses", "--loss-mode", TOP_K, *SMALL,
                               "--json", "report.json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith("[block 1/1] building the frozen minibatch")  # diagnose's own first line
    assert proc.stdout.startswith("model: ") and f"FAIL: {TOP_K} is NOT invariant" in proc.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    figures, static = report["modes"][TOP_K], report["modes"][f"{TOP_K}[split=static]"]
    assert figures["ratio_to_control"][0] > 10 and static["ratio_to_control"][0] > 10
    assert figures["repeat_ratio_to_control"] == [0.0]  # deterministic: the split alone moves it
    assert report["invariant"] is False and report["clip_grad"] is None and report["could_not_run"] == {}
    assert report["options"]["imports"] == ["my_losses"]


@pytest.mark.slow
def test_a_per_token_loss_is_invariant_exit_0(tmp_path, monkeypatch, capfd, restore_sys_path):
    """In this process (the console script's fresh interpreter is the test above), from a folder holding the
    user's module: diagnose puts the current directory on sys.path itself."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(LOSSES_FILE, tmp_path / "my_losses.py")
    code = cli.main(["diagnose", "--import", "my_losses", "--loss-mode", PER_TOKEN, *SMALL, "--json", "report.json"])
    out, err = capfd.readouterr()
    assert code == 0, out + err
    assert err.startswith("[block 1/1] building the frozen minibatch")
    assert f"OK: {PER_TOKEN} is INVARIANT" in out
    report = json.loads((tmp_path / "report.json").read_text())
    import verl

    assert report["invariant"] is True and report["verdicts"].keys() == {PER_TOKEN}
    assert report["verl_version"] == verl.__version__
    for row in (PER_TOKEN, f"{PER_TOKEN}[split=static]"):
        assert report["modes"][row]["ratio_to_control"][0] <= 10
    assert report["modes"][PER_TOKEN]["repeat_ratio_to_control"][0] <= 10


@pytest.mark.slow
def test_the_users_config_class_reaches_the_loss(tmp_path, monkeypatch, restore_sys_path):
    """--config-name with policy_loss._target_ = the user's class: top_fraction 1 keeps every token, so the
    top-k loss becomes vanilla and is invariant (at its default 0.1 it is not: the test above)."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(LOSSES_FILE, tmp_path / "my_losses.py")
    actor = "actor_rollout_ref.actor"
    out = tmp_path / "report.json"
    code = cli.main(["diagnose", "--import", "my_losses", "--config-name", "ppo_trainer", "--blocks", "1",
                     "--json", str(out), "data.max_prompt_length=16", "data.max_response_length=32",
                     "trainer.n_gpus_per_node=1", f"{actor}.ppo_mini_batch_size=16",
                     f"{actor}.ppo_micro_batch_size_per_gpu=4",
                     "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
                     "actor_rollout_ref.model.use_remove_padding=false",
                     f"+{actor}.fsdp_config.mixed_precision.param_dtype=fp32",
                     f"{actor}.policy_loss._target_=my_losses.TopSurprisalConfig",
                     f"{actor}.policy_loss.loss_mode={TOP_K}", f"+{actor}.policy_loss.top_fraction=1.0"])
    report = json.loads(out.read_text())
    assert code == 0, report["verdict"]
    assert report["options"]["loss_mode"] == TOP_K and report["options"]["policy_loss"]["top_fraction"] == 1.0
    settings = {s["name"]: s for s in report["settings"]}
    assert settings["policy_loss config"]["value"] == "my_losses.TopSurprisalConfig"
    assert "kl_cov_ratio" not in settings  # the plugin's knobs do not concern this loss


@pytest.mark.slow
def test_a_loss_that_cannot_run_with_these_settings_is_exit_2_with_its_error(capfd):
    """verl's dro needs policy_loss.dro_beta, which verl does not default."""
    assert cli.main(["diagnose", "--loss-mode", "dro", *SMALL]) == 2
    err = capfd.readouterr().err
    assert "--loss-mode dro: the loss raised ValueError: policy_loss.dro_beta must be a positive value" in err
    assert "--config-name" in err
