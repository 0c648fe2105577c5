"""``diagnose --config-name``: composing the user's verl config, the settings and their sources, errors.

Composition tests are fast (Hydra only); one test runs the experiment (real FSDP engine, slow).
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from verl_klcov_global import cli
from verl_klcov_global.diagnose.run import DiagnoseError
from verl_klcov_global.diagnose.user_config import DEFAULT_MAX_TOKENS, PACKAGE_CONFIG_DIR, Shape, plan_for, scale_shape

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A user's config as verl's docs suggest writing one: verl's ppo_trainer plus their own values.
USER_YAML = textwrap.dedent("""\
    hydra:
      searchpath:
        - pkg://verl.trainer.config
    defaults:
      - ppo_trainer
      - _self_
    data:
      max_prompt_length: 256
      max_response_length: 768
    trainer:
      n_gpus_per_node: 4
    actor_rollout_ref:
      model:
        path: {model}
        use_remove_padding: false
      rollout:
        n: 4
      actor:
        ppo_mini_batch_size: 64
        use_dynamic_bsz: true
        ppo_max_token_len_per_gpu: 8192
        loss_agg_mode: seq-mean-token-mean
        clip_ratio_high: 0.28
        fsdp_config:
          mixed_precision:
            param_dtype: fp32
        policy_loss:
          loss_mode: kl_cov
          kl_cov_ratio: 0.002
    """)


def write_user_config(folder, model="/nonexistent/model", name="my_grpo"):
    (folder / f"{name}.yaml").write_text(USER_YAML.format(model=model))
    return str(folder)


def by_name(plan):
    return {setting.name: setting for setting in plan.settings}


def test_user_config_with_overrides_gives_its_settings_and_sources(tmp_path):
    overrides = ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048",
                 "actor_rollout_ref.actor.policy_loss.ppo_kl_coef=0.5"]
    plan = plan_for(write_user_config(tmp_path), "my_grpo", overrides, device="cpu", max_tokens=4096)
    options, settings = plan.options, by_name(plan)

    # per DP rank: 64 prompts x n 4 / 4 GPUs = 64 sequences of 256 + 768 tokens; 2048-token budget -> 32 micro-batches
    assert plan.scaling["full"] == {"sequences": 64, "prompt_len": 256, "response_len": 768}
    assert plan.scaling["micro_batches"] == 32
    # 65,536 tokens > 4096: lengths / 16 (16 + 48), sequences kept; the budget scaled to keep 32 micro-batches
    assert (options.batch_size, options.prompt_len, options.response_len) == (64, 16, 48)
    assert options.layout == "dynamic" and options.micro_batches == 32 and options.max_token_len_per_gpu == 128
    assert options.infer_max_token_len_per_gpu == 128  # log-prob budget follows the actor's (ppo_trainer interpolates)
    assert (options.dtype, options.strategy, options.use_remove_padding) == ("fp32", "fsdp", False)
    assert options.loss_agg_mode == "seq-mean-token-mean"
    assert (options.clip_ratio_high, options.clip_ratio_low) == (0.28, 0.2)
    assert (options.knobs["kl_cov_ratio"], options.knobs["ppo_kl_coef"], options.loss_mode) == (0.002, 0.5,
                                                                                                  "kl_cov_global")
    assert options.model is None  # /nonexistent/model: the embedded tiny model, said plainly
    assert any("/nonexistent/model" in note and "embedded tiny Qwen2" in note for note in plan.notes)

    assert settings["kl_cov_ratio"].source == "config"
    assert settings["ppo_kl_coef"].source == "override"
    assert settings["ppo_max_token_len_per_gpu"].source == "override"
    assert settings["ppo_max_token_len_per_gpu"].yours == 2048 and settings["ppo_max_token_len_per_gpu"].value == 128
    assert settings["log_prob_max_token_len_per_gpu"].source == (
        "override (via actor_rollout_ref.actor.ppo_max_token_len_per_gpu)")
    assert "clip_cov_seed" not in settings  # the rows are the knobs of the modes diagnosed
    assert options.knobs["clip_cov_seed"] == 0  # the others keep the plugin's defaults
    every = by_name(plan_for(str(tmp_path), "my_grpo", overrides, device="cpu", max_tokens=4096, loss_mode="all"))
    assert every["clip_cov_seed"].source == "diagnose default"  # verl's PolicyLossConfig has no such key
    assert settings["model"].source == "diagnose default"
    assert settings["minibatch per DP rank"].yours == "64 x (256 + 768) = 65,536 tokens"
    assert "lengths x0.0625 to 16 + 48" in plan.scaling["text"] and "keep 32 micro-batches" in plan.scaling["text"]
    assert plan.config == {"name": "my_grpo", "path": str(tmp_path), "overrides": overrides}


def test_a_local_model_path_is_used_and_fits_without_scaling(tmp_path, tiny_model_path):
    overrides = ["data.max_prompt_length=16", "data.max_response_length=48", "trainer.n_gpus_per_node=1",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.use_dynamic_bsz=false",
                 "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8"]
    plan = plan_for(write_user_config(tmp_path, model=tiny_model_path), "my_grpo", overrides, device="cpu",
                    max_tokens=4096)
    options = plan.options
    assert options.model == tiny_model_path and by_name(plan)["model"].source == "config"
    assert not plan.scaling["scaled"] and "not scaled" in plan.scaling["text"]
    assert (options.batch_size, options.layout, options.micro_batch_size_per_gpu) == (16, "static", 4)
    assert (options.micro_batches, options.infer_micro_batch_size_per_gpu) == (4, 8)  # used literally
    assert plan_for(str(tmp_path), "my_grpo", overrides, device="cpu", tiny_model=True).options.model is None


def test_plugin_config_found_in_the_package_from_any_directory(monkeypatch, tmp_path):
    import verl_klcov_global

    assert PACKAGE_CONFIG_DIR == os.path.join(os.path.dirname(verl_klcov_global.__file__), "configs")
    monkeypatch.chdir(REPO)
    assert plan_for(None, "kl_cov_global", [], device="cpu").config["path"] == PACKAGE_CONFIG_DIR
    # elsewhere, even next to a ./configs/clip_cov_global.yaml: as main_ppo, diagnose does not read ./configs
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "clip_cov_global.yaml").write_text("not: the plugin's\n")
    monkeypatch.chdir(tmp_path)
    assert plan_for(None, "clip_cov_global", [], device="cpu").config["path"] == PACKAGE_CONFIG_DIR
    # verl's own config, as main_ppo without --config-path; its loss_mode vanilla -> every plugin mode
    plan = plan_for(None, "ppo_trainer", [], device="cpu")
    assert plan.config["path"] == "pkg://verl.trainer.config" and plan.options.loss_mode == "all"


def test_plugin_config_with_no_overrides_is_planned_with_its_gaps_said(monkeypatch):
    monkeypatch.chdir(REPO)
    plan = plan_for(None, "kl_cov_global", [], device="cpu")
    options, settings = plan.options, by_name(plan)
    assert options.loss_mode == "kl_cov_global" and options.prepass_layout == "infer"
    assert (options.dtype, options.use_remove_padding, options.gradient_checkpointing) == ("bf16", True, True)
    # ppo_trainer leaves ppo_micro_batch_size_per_gpu null: a diagnose default, said in a note
    assert settings["ppo_micro_batch_size_per_gpu"].source == "diagnose default"
    assert any("ppo_micro_batch_size_per_gpu is null" in note for note in plan.notes)
    assert options.batch_size * (options.prompt_len + options.response_len) <= DEFAULT_MAX_TOKENS["cpu"]


def test_megatron_goes_on_with_fsdp2_and_says_so(monkeypatch):
    monkeypatch.chdir(REPO)
    plan = plan_for(None, "kl_cov_global", ["actor_rollout_ref.actor.strategy=megatron"], device="cpu")
    assert plan.options.strategy == "fsdp2" and by_name(plan)["strategy"].yours == "megatron"
    assert any("megatron" in note and "fsdp2" in note for note in plan.notes)


def test_scaling_keeps_the_micro_batch_count_or_refuses():
    assert scale_shape(Shape(32, 512, 512), 8, 4096) == Shape(32, 64, 64)
    assert scale_shape(Shape(256, 64, 64), 8, 4096) == Shape(168, 8, 16)  # lengths at the minimum, then sequences
    assert scale_shape(Shape(8, 8, 16), 8, 4096) == Shape(8, 8, 16)
    with pytest.raises(DiagnoseError, match="raise --max-tokens to at least 192"):
        scale_shape(Shape(64, 512, 512), 8, 100)


@pytest.mark.parametrize("args, message", [
    (["--config-path", "/nonexistent/dir", "--config-name", "x"],
     "--config-path '/nonexistent/dir': no such directory"),
    (["--config-name", "no_such_config"], "no_such_config"),
    (["--config-name", "kl_cov_global", "actor_rollout_ref.actor.no_such_key=1"],
     "To append to your config use +actor_rollout_ref.actor.no_such_key=1"),
    (["--config-name", "kl_cov_global", "actor_rollout_ref.actor.ppo_epochs=${"], "cannot parse the Hydra overrides"),
    (["--config-name", "kl_cov_global", "data.max_prompt_length=${no.such.key}"], "Interpolation key 'no.such.key'"),
    (["--config-name", "kl_cov_global", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5"],
     "does not divide the 32 sequences"),
    (["--config-name", "kl_cov_global", "--micro-batches", "4"],
     "--micro-batches comes from your training config with --config-name; override"),
    (["actor_rollout_ref.actor.ppo_epochs=2"], "Hydra overrides actor_rollout_ref.actor.ppo_epochs=2 only apply"),
    (["--max-tokens", "100"], "--max-tokens only applies with --config-name"),
])
def test_unreadable_configs_and_misused_options_fail_clearly(monkeypatch, tmp_path, capfd, args, message):
    monkeypatch.chdir(REPO)
    out = tmp_path / "report.json"
    assert cli.main(["diagnose", *args, "--json", str(out)]) == 2
    err = capfd.readouterr().err
    assert message in err and "[block" not in err  # rejected before any work
    assert not out.exists()


def test_broken_yaml_fails_clearly(tmp_path, capfd):
    (tmp_path / "broken.yaml").write_text("defaults: [ppo_trainer\nactor_rollout_ref: {\n")
    assert cli.main(["diagnose", "--config-path", str(tmp_path), "--config-name", "broken"]) == 2
    assert "cannot compose config 'broken'" in capfd.readouterr().err


def _small_run(tmp_path, budget: int) -> dict:
    """The plugin's config, shrunk to 16 x (16 + 48) tokens per rank, with a token budget of ``budget``."""
    out = tmp_path / f"report-{budget}.json"
    overrides = ["data.max_prompt_length=16", "data.max_response_length=48", "trainer.n_gpus_per_node=1",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                 "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
                 f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
                 "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=1024",
                 "actor_rollout_ref.model.use_remove_padding=false",
                 "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32"]
    code = cli.main(["diagnose", "--config-name", "kl_cov_global", "--blocks", "1", "--device", "cpu",
                     "--json", str(out), *overrides])
    assert code == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_a_smaller_token_budget_shows_in_the_upstream_column_not_the_global_one(monkeypatch, tmp_path, capfd):
    monkeypatch.chdir(REPO)
    reports = {budget: _small_run(tmp_path, budget) for budget in (512, 256)}  # 2 and 4 micro-batches of 1024 tokens
    stdout = capfd.readouterr().out
    assert stdout.startswith("config: kl_cov_global from ")  # the summary comes first
    for budget, micro_batches in ((512, 2), (256, 4)):
        report = reports[budget]
        assert report["layouts"] == ["1 micro-batch", f"{micro_batches} micro-batches"]
        settings = {s["name"]: s for s in report["settings"]}
        assert settings["ppo_max_token_len_per_gpu"] == {
            "name": "ppo_max_token_len_per_gpu", "value": budget, "source": "override",
            "key": "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "yours": None, "note": ""}
        assert report["scaling"]["scaled"] is False
        # upstream kl_cov: one quota per micro-batch; kl_cov_global: one selection, the same mask
        assert report["modes"]["kl_cov"]["selected_per_layout"] == [[1, micro_batches]]
        assert report["modes"]["kl_cov_global"]["selected_per_layout"] == [[1, 1]]
        assert report["modes"]["kl_cov_global"]["masks_identical"] is True
        assert report["invariant"] is True
    assert "clip_cov" not in reports[256]["modes"]  # the config's loss_mode names kl_cov_global only


def test_ulysses_folds_into_the_data_parallel_shard_and_its_budget(monkeypatch):
    monkeypatch.chdir(REPO)
    plan = plan_for(None, "kl_cov_global", ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                                            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"], device="cpu")
    # 8 GPUs / SP 2 = 4 DP ranks of 64 x 1024 tokens; budget 16384 x SP 2 -> 2 micro-batches
    assert plan.scaling["data_parallel_size"] == 4 and plan.scaling["full"]["sequences"] == 64
    assert plan.scaling["micro_batches"] == 2 and plan.options.micro_batches == 2
    assert any("Ulysses sequence parallelism 2" in note for note in plan.notes)


def test_high_entropy_global_config_plans_its_ratio_and_the_authors_rule_as_upstream(monkeypatch):
    """--config-name=high_entropy_global: rho from the config (or an override); the comparator is its upstream."""
    monkeypatch.chdir(REPO)
    plan = plan_for(None, "high_entropy_global", ["actor_rollout_ref.actor.policy_loss.entropy_top_ratio=0.1"],
                    device="cpu")
    assert plan.options.loss_mode == "high_entropy_global" and plan.options.knobs["entropy_top_ratio"] == 0.1
    assert by_name(plan)["entropy_top_ratio"].value == 0.1
    assert plan_for(None, "high_entropy_global", [], device="cpu").options.knobs["entropy_top_ratio"] == 0.2


@pytest.mark.parametrize("name", ["kl_cov_global", "high_entropy_global"])
def test_the_entropy_controller_is_listed_and_diagnosed_with_the_users_settings(monkeypatch, name):
    monkeypatch.chdir(REPO)
    off = plan_for(None, name, [], device="cpu")
    assert [(s.name, s.value) for s in off.settings if s.name == "entropy controller"] == [("entropy controller", "off")]
    assert off.options.entropy_control == {}
    plan = plan_for(None, name, ["actor_rollout_ref.actor.policy_loss.entropy_target=1.5",
                                 "actor_rollout_ref.actor.policy_loss.entropy_control_ki=0.2"], device="cpu")
    rows = {s.name: (s.value, s.source) for s in plan.settings}
    assert rows["entropy_target"] == (1.5, "override") and rows["entropy_control_ki"] == (0.2, "override")
    assert rows["entropy_control_kp"] == (10.0, "config")  # the plugin's YAML declares every knob
    assert plan.options.entropy_control == {
        "entropy_target": 1.5, "entropy_control_ki": 0.2, "entropy_control_kp": 10.0,
        "entropy_control_min_ratio": rows["entropy_control_min_ratio"][0],
        "entropy_control_max_ratio": rows["entropy_control_max_ratio"][0],
        "entropy_control_horizon": 8.0, "entropy_control_window": 4, "entropy_control_hysteresis": 0.1}
    from verl_klcov_global.diagnose.run import _actor_config
    from verl_klcov_global.modes import MODES

    actor = _actor_config(plan.options, name)  # the config diagnose runs the mode with
    assert MODES[name].read_settings(actor).entropy_control.target == 1.5


@pytest.mark.parametrize("overrides, expected", [
    ([], (4, 3, 1)),  # 256 prompts / 64 per minibatch, 1 epoch: the update's first step reuses
    (["data.train_batch_size=64"], (1, 0, 1)),  # on-policy: no prepass at all
    (["data.train_batch_size=128", "actor_rollout_ref.actor.ppo_epochs=2"], (4, 3, 1)),
    (["algorithm.rollout_correction.bypass_mode=True"], (4, 4, 0)),  # no actor log-prob pass
    (["actor_rollout_ref.actor.policy_loss.prepass_layout=train"], (4, 4, 0)),
    (["actor_rollout_ref.actor.policy_loss.prepass_layout=old"], (4, 0, 0)),  # pi_old's statistics, no forward
    (["trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=4"], (4, 3, 1)),
    (["trainer.use_v1=False", "data.train_batch_size=64"], (1, 0, 1)),
])
def test_the_plan_counts_the_prepasses_per_trainer_step_and_those_verls_pass_stands_in_for(monkeypatch, overrides,
                                                                                        expected):
    monkeypatch.chdir(REPO)
    plan = plan_for(None, "clip_cov_global", ["data.train_batch_size=256", "actor_rollout_ref.actor.ppo_mini_batch_size=64"]
                    + overrides, device="cpu")
    counts = plan.to_json()["prepasses"]
    assert (counts["optimizer_steps"], counts["prepasses"], counts["reused"]) == expected, counts["text"]
    assert f"{expected[1]} run" in counts["text"] and "reuse" in counts["text"]


def test_a_kl_cov_config_is_counted_as_kl_cov_global_and_the_on_policy_warning_stays(tmp_path, capfd):
    """verl's own kl_cov (the user's YAML): counted for the switch to kl_cov_global; on-policy, no prepass runs and
    the driver's warning that KL-Cov then has no effect is still in the notes."""
    plan = plan_for(write_user_config(tmp_path), "my_grpo", ["data.train_batch_size=64"], device="cpu")
    assert (plan.prepasses["optimizer_steps"], plan.prepasses["prepasses"], plan.prepasses["reused"]) == (1, 0, 1)
    assert any("kl-cov-on-policy" in str(f) for f in plan.findings)
    assert any("every optimizer update is on-policy" in note for note in plan.notes)
    from verl_klcov_global.diagnose.run import format_settings

    lines = format_settings({**plan.to_json(), "config": plan.config})
    assert any(line.startswith("prepasses: 1 optimizer step per trainer step") for line in lines), lines
