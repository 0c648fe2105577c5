"""Part 1 of docs/ADDING_A_MODE.md, run as written: modes of a user's own module, with no file of the plugin edited.

``examples/own_mode/my_modes.py`` (the page's module, compared with it) registers ``rare_token_kl_global`` (verl's
knobs, no config class) and ``rare_token_capped_kl_global`` (a new knob, ``rare_token_max_prob``, in a subclass of
``KLCovGlobalPolicyLossConfig``). Fast: the config class judged by its own ``loss_mode``, ``--set`` (folded, checked,
validated by the mode's reader), ``--config-name`` taking the new knob from the config, the selection's definition,
exit 2 before any work. Slow (verl's real FSDP engine on CPU, tiny model): the page's two ``diagnose`` commands exit
0, one engine update of each mode at 1 and 8 micro-batches with identical masks, and modes that cannot run (a
selection, an objective that raise) exit 2 with the reason last. ``main_ppo`` with the module in every Ray process:
tests/integration/test_own_mode_main_ppo.py.
"""

from __future__ import annotations

import importlib
import os
import shlex
import subprocess
import sys
import types

import pytest
import torch
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

from verl_klcov_global import cli, plugin
from verl_klcov_global.config import KLCovGlobalPolicyLossConfig, read_kl_cov_settings
from verl_klcov_global.diagnose.errors import DiagnoseError
from verl_klcov_global.diagnose.knobs import ModeCannotRunError, parse_set
from verl_klcov_global.diagnose.run import DiagnoseOptions, _actor_config, run_diagnose, validate
from verl_klcov_global.lab.experiment import EngineSpec, frozen_minibatch, run_block, static_layouts
from verl_klcov_global.layout import padded
from verl_klcov_global.methods.kl_cov.objective import kl_cov_objective
from verl_klcov_global.modes import MODES, ModeSpec, register_mode, unregister_mode

from .support.docs import REPO_ROOT, code_blocks, section

EXAMPLE_DIR = REPO_ROOT / "examples" / "own_mode"
PLAIN, CAPPED = "rare_token_kl_global", "rare_token_capped_kl_global"
PART_1 = "## Part 1: a mode in your own package"
SMALL = dict(blocks=1, batch_size=16, response_len=32)
NOISE_FACTOR = 10


def _forget(*names: str) -> None:
    for name in names:
        unregister_mode(name)
        POLICY_LOSS_REGISTRY.pop(name, None)


@pytest.fixture
def my_modes(monkeypatch):
    """``import my_modes`` from examples/own_mode, as ``--import`` / ``VERL_USE_EXTERNAL_MODULES`` do; forgotten after."""
    monkeypatch.syspath_prepend(str(EXAMPLE_DIR))
    sys.modules.pop("my_modes", None)
    try:
        yield importlib.import_module("my_modes")
    finally:
        sys.modules.pop("my_modes", None)
        _forget(PLAIN, CAPPED)


def test_the_page_shows_the_example_module_as_it_is():
    assert code_blocks(section("ADDING_A_MODE.md", PART_1), "python")[0] == (EXAMPLE_DIR / "my_modes.py").read_text()


def test_the_modes_are_in_the_table_and_verls_registry_only_while_the_module_is_imported(my_modes):
    assert POLICY_LOSS_REGISTRY[PLAIN] is MODES[PLAIN].policy_loss and MODES[PLAIN].config_class is None
    assert MODES[CAPPED].config_class is my_modes.RareTokenCappedPolicyLossConfig


def test_a_config_class_is_judged_by_its_own_loss_mode(my_modes):
    capped = my_modes.RareTokenCappedPolicyLossConfig(rare_token_max_prob=0.3)
    assert capped.loss_mode == CAPPED and capped.kl_cov_ratio == KLCovGlobalPolicyLossConfig().kl_cov_ratio
    with pytest.raises(ValueError, match=rf"carries the knobs of loss_mode={CAPPED}, but loss_mode is 'kl_cov_global'"):
        my_modes.RareTokenCappedPolicyLossConfig(loss_mode="kl_cov_global")
    with pytest.raises(ValueError, match=rf"carries the knobs of loss_mode=kl_cov_global, but loss_mode is '{CAPPED}'"):
        KLCovGlobalPolicyLossConfig(loss_mode=CAPPED)


def test_the_selection_takes_the_rarest_tokens_under_the_cap(my_modes):
    torch.manual_seed(0)
    log_probs = torch.randn(4, 10) - 1.0
    response_mask = torch.rand(4, 10) > 0.2
    fields = types.SimpleNamespace(log_probs=log_probs, response_mask=response_mask)
    settings = types.SimpleNamespace(kl_cov_ratio=0.25)
    result = my_modes.select_rare_tokens(fields, settings, None, max_log_prob=-0.5)
    candidates = response_mask & (log_probs <= -0.5)
    assert result.num_valid == int(candidates.sum()) and int(result.mask.sum()) == result.quota == int(
        candidates.sum() * 0.25)
    assert not (result.mask & ~candidates).any()
    assert log_probs[result.mask].max() <= log_probs[candidates & ~result.mask].min()


def test_set_gives_any_knob_and_moves_those_with_an_option_into_it(my_modes):
    options = validate(DiagnoseOptions(loss_mode=CAPPED, set_knobs={"rare_token_max_prob": 0.3, "kl_cov_ratio": 0.05}))
    assert options.knobs["kl_cov_ratio"] == 0.05 and options.set_knobs == {"rare_token_max_prob": 0.3}
    policy_loss = _actor_config(options, CAPPED).policy_loss
    assert type(policy_loss) is my_modes.RareTokenCappedPolicyLossConfig
    assert (policy_loss.rare_token_max_prob, policy_loss.kl_cov_ratio) == (0.3, 0.05)
    plain = _actor_config(validate(DiagnoseOptions(loss_mode=PLAIN, set_knobs={"ppo_kl_coef": 0.5})), PLAIN)
    assert type(plain.policy_loss).__name__ == "PolicyLossConfig"  # no config class: verl's
    assert (plain.policy_loss.loss_mode, plain.policy_loss.ppo_kl_coef) == (PLAIN, 0.5)
    # the built-in modes take it too: the same as their own options
    assert validate(DiagnoseOptions(loss_mode="stare_global", set_knobs={"stare_top_ratio": 0.2})).knobs["stare_top_ratio"] == 0.2


@pytest.mark.parametrize("set_knobs, message", [
    ({"rare_token_max_prob": 2}, rf"^{CAPPED}: rare_token_max_prob must be a probability in \(0, 1\], got 2; set "),
    ({"rare_token_max_prb": 0.3}, rf"--set rare_token_max_prb: not a knob of the mode diagnosed \(ModeSpec.knobs; "
                                  rf"{CAPPED}: kl_cov_ratio, ppo_kl_coef, rare_token_max_prob, prepass_layout\)"),
    ({"kl_cov_ratio": "lots"}, r"kl_cov_ratio must be finite and in \(0, 1\], got 'lots'"),
])
def test_a_bad_set_value_is_refused_by_the_mode_itself(my_modes, set_knobs, message):
    with pytest.raises(DiagnoseError, match=message):
        validate(DiagnoseOptions(loss_mode=CAPPED, set_knobs=set_knobs))


def test_a_knob_without_a_field_is_named_with_what_to_do(my_modes):
    spec = register_mode(ModeSpec(name="no_class_new_knob_global", upstream=None, metric_prefix="actor/x/",
                                  knobs=("kl_cov_ratio", "my_new_knob"), read_settings=read_kl_cov_settings,
                                  response_fields=(), select=my_modes.select_rare_tokens, objective=kl_cov_objective))
    plugin.install()
    try:
        with pytest.raises(DiagnoseError, match=r"--set my_new_knob: no_class_new_knob_global takes no such key: it has "
                                                r"no config class, and verl's PolicyLossConfig has no field 'my_new_knob'"):
            validate(DiagnoseOptions(loss_mode=spec.name, set_knobs={"my_new_knob": 1}))
    finally:
        _forget(spec.name)


def test_set_is_parsed_as_yaml_and_refused_where_it_cannot_apply(capfd):
    assert parse_set(["a=0.1", "b=true", "c=O1", "d=[1, 2]"]) == {"a": 0.1, "b": True, "c": "O1", "d": [1, 2]}
    for argv, message in (
        (["--set", "kl_cov_ratio"], "--set 'kl_cov_ratio': give KEY=VALUE"),
        (["--set", "a.b=1"], "--set 'a.b=1': give KEY=VALUE"),
        (["--set", "kl_cov_ratio=0.1", "--set", "kl_cov_ratio=0.2"], "--set kl_cov_ratio is given twice"),
        (["--loss-mode", "kl_cov_global", "--kl-cov-ratio", "0.1", "--set", "kl_cov_ratio=0.2"],
         "--set kl_cov_ratio and --kl-cov-ratio both give kl_cov_ratio; give it once"),
        (["--config-name", "kl_cov_global", "--set", "kl_cov_ratio=0.2"],
         "--set comes from your training config with --config-name; override "
         "actor_rollout_ref.actor.policy_loss.KEY instead"),
    ):
        assert cli.main(["diagnose", *argv]) == 2, argv
        last = capfd.readouterr().err.strip().splitlines()[-1]
        assert last.startswith(f"verl-klcov-global diagnose: error: {message}"), (argv, last)


def test_config_name_takes_the_new_knob_from_the_users_config(my_modes):
    from verl_klcov_global.diagnose.user_config import plan_for

    plan = plan_for(None, "ppo_trainer", [
        "actor_rollout_ref.actor.policy_loss._target_=my_modes.RareTokenCappedPolicyLossConfig",
        f"actor_rollout_ref.actor.policy_loss.loss_mode={CAPPED}",
        "+actor_rollout_ref.actor.policy_loss.rare_token_max_prob=0.3",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    ], device="cpu")
    assert plan.options.loss_mode == CAPPED and plan.options.set_knobs == {"rare_token_max_prob": 0.3}
    (row,) = [s for s in plan.settings if s.name == "rare_token_max_prob"]
    assert (row.value, row.source) == (0.3, "override")


def test_a_mode_whose_reader_or_config_class_raises_exits_2_before_any_work(my_modes, capfd):
    def broken_reader(actor_config):
        raise TypeError("my reader has a bug")

    register_mode(ModeSpec(name="broken_reader_global", upstream=None, metric_prefix="actor/x/", knobs=(),
                           read_settings=broken_reader, response_fields=(), select=my_modes.select_rare_tokens,
                           objective=kl_cov_objective))
    plugin.install()
    try:
        assert cli.main(["diagnose", "--loss-mode", "broken_reader_global"]) == 2
        lines = capfd.readouterr().err.strip().splitlines()
        assert lines[-1] == ("verl-klcov-global diagnose: error: broken_reader_global cannot run: its settings reader "
                             "(ModeSpec.read_settings) raised TypeError: my reader has a bug (--verbose shows the "
                             "traceback)")
        assert not any("[block" in line or "Traceback" in line for line in lines)
    finally:
        _forget("broken_reader_global")


# ---------------------------------------------------------------------------
# verl's real FSDP engine on CPU


@pytest.mark.slow
def test_the_pages_diagnose_commands_exit_0():
    commands = [line for block in code_blocks(section("ADDING_A_MODE.md", PART_1), "bash")
                for line in block.splitlines() if line.startswith("verl-klcov-global diagnose")]
    assert [shlex.split(c)[shlex.split(c).index("--loss-mode") + 1] for c in commands] == [PLAIN, CAPPED]
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ.get('PATH', '')}"}
    for command, mode in zip(commands, (PLAIN, CAPPED)):
        proc = subprocess.run(["bash", "-c", command], cwd=EXAMPLE_DIR, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, (command, proc.stdout[-3000:], proc.stderr[-3000:])
        assert f"OK: {mode} is INVARIANT to micro-batching: masks identical in all 1 blocks" in proc.stdout
    assert "--set rare_token_max_prob=0.3" in proc.stdout  # the report says what was set


@pytest.mark.slow
def test_one_engine_update_of_each_mode_has_identical_masks_for_1_and_8_micro_batches(my_modes, tiny_model_path):
    spec = EngineSpec(tiny_model_path)
    batch = frozen_minibatch(spec, 3, batch_size=16, prompt_len=8, response_len=32)
    options = validate(DiagnoseOptions(loss_mode=CAPPED, knobs={"kl_cov_ratio": 0.05}, set_knobs={"rare_token_max_prob": 0.3}))
    results = run_block(spec, batch, static_layouts(16, 8), lambda mode: _actor_config(options, mode),
                        modes=("vanilla", PLAIN, CAPPED))
    control = results["vanilla"]
    assert control.max_param_diff > 0, "no noise floor: the comparison proves nothing"
    valid = int(padded(batch["response_mask"]).sum())
    for mode in (PLAIN, CAPPED):
        ours = results[mode]
        assert ours.masks_identical is True, mode
        assert ours.selected_per_layout[0] == ours.selected_per_layout[1] > 1, mode
        assert ours.max_param_diff <= NOISE_FACTOR * control.max_param_diff, (mode, ours.max_param_diff, control)
    assert results[PLAIN].selected_per_layout[0] == int(valid * 0.05)


BROKEN = '''
from verl_klcov_global import plugin
from verl_klcov_global.config import read_kl_cov_settings
from verl_klcov_global.methods.kl_cov.objective import kl_cov_objective
from verl_klcov_global.modes import ModeSpec, register_mode
from my_modes import select_rare_tokens


def select_broken(fields, settings, group):
    raise RuntimeError("my selection is broken")


def objective_broken(old_log_prob, log_prob, advantages, response_mask, mask, settings):
    return {}["no such term"]


for name, select, objective in (("broken_select_global", select_broken, kl_cov_objective),
                                ("broken_objective_global", select_rare_tokens, objective_broken)):
    register_mode(ModeSpec(name=name, upstream=None, metric_prefix="actor/broken/", knobs=("kl_cov_ratio",),
                           read_settings=read_kl_cov_settings, response_fields=(), select=select, objective=objective))
plugin.install()
'''


@pytest.mark.slow
def test_a_mode_that_raises_in_its_update_exits_2_with_the_mode_the_stage_and_the_message(my_modes, tmp_path,
                                                                                         monkeypatch, capfd):
    (tmp_path / "broken_modes.py").write_text(BROKEN)
    monkeypatch.chdir(tmp_path)  # diagnose imports from the current directory, as python -m does
    monkeypatch.setattr(sys, "path", list(sys.path))
    run = ["diagnose", "--import", "broken_modes", "--blocks", "1", "--batch-size", "8", "--response-len", "16",
           "--micro-batches", "2"]
    try:
        assert cli.main([*run, "--loss-mode", "broken_select_global"]) == 2
        err = capfd.readouterr().err
        assert err.strip().splitlines()[-1] == (
            "verl-klcov-global diagnose: error: broken_select_global cannot run: its selection (ModeSpec.select) "
            "raised RuntimeError: my selection is broken (--verbose shows the traceback)")
        assert "[block 1/1] update 3/4: broken_select_global / 1 micro-batch" in err and "Traceback" not in err
        assert cli.main([*run, "--loss-mode", "broken_objective_global", "--verbose"]) == 2
        err = capfd.readouterr().err
        assert err.strip().splitlines()[-1] == ("verl-klcov-global diagnose: error: broken_objective_global cannot "
                                                "run: its objective (ModeSpec.objective) raised KeyError: 'no such term'")
        assert "Traceback (most recent call last)" in err and "in objective_broken" in err
    finally:
        sys.modules.pop("broken_modes", None)
        _forget("broken_select_global", "broken_objective_global")
