"""The examples' recipes, whole, in miniature through verl 0.9.1's real trainer on CPU.

Each test runs ``bash examples/<recipe>.sh`` itself, with only the sizes shrunk and what a CPU needs appended
(``tests/trainer_support/miniature.py`` lists every override): DAPO's dynamic sampling with its refill, the
``dapo`` reward manager, dynamic batch sizes, gradient checkpointing, the recipe's loss aggregation and the rest
stay as the recipe sets them. 2 trainer steps on 2 FSDP2 ranks (fake Ray GPUs): the run finishes, logs the mode's
metrics with a full quota on every step, and its dynamic sampling dropped groups and refilled them.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from verl_klcov_global.lab.experiment import max_abs_diff

from ..trainer_support import miniature, step_recorder
from ..trainer_support.env import REPO_ROOT
from .test_trainer_e2e import _logged_steps

pytestmark = pytest.mark.slow  # verl's real trainer with Ray on CPU: the slow tier


def run_recipe(script: str, work_dir, tiny_model_path, *, max_token: int, extra: tuple[str, ...] = (),
               params: bool = False, mini_batch_prompts: int = miniature.MINI_BATCH_PROMPTS) -> dict:
    """``bash examples/<script>`` in miniature in ``work_dir``: its log, logged steps and the workers' records (and,
    with ``params``, the parameters after the last optimizer step)."""
    train_file = miniature.write_miniature_dataset(str(work_dir / "train.parquet"))
    record_dir = work_dir / "steps"
    record_dir.mkdir()
    recording = {step_recorder.RECORD_DIR_ENV: str(record_dir)}
    if params:
        recording[step_recorder.RECORD_PARAMS_ENV] = "1"
    env = miniature.miniature_env(tiny_model_path, train_file, max_token=max_token, **recording)
    path = os.path.join(REPO_ROOT, "examples", script)
    argv = ["bash", path, *miniature.miniature_overrides(str(work_dir), path, mini_batch_prompts=mini_batch_prompts,
                                                          max_token=max_token), *extra]
    proc = subprocess.run(argv, cwd=work_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=900)
    (work_dir / "main_ppo.log").write_text(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return {"log": proc.stdout, "logged": _logged_steps(proc.stdout), "records": step_recorder.read(str(record_dir)),
            "params": step_recorder.read_params(str(record_dir)) if params else None}


def assert_recipe_ran(run: dict, prefix: str, dynamic_sampling: bool) -> None:
    """Every step: the mode's metrics, nothing non-finite, and with dynamic sampling groups dropped and refilled."""
    logged = run["logged"]
    assert sorted(logged) == list(range(1, miniature.STEPS + 1)), run["log"][-3000:]
    for step, metrics in logged.items():
        assert metrics[f"{prefix}nonfinite_tokens"] == 0, (step, {k: v for k, v in metrics.items() if prefix in k})
        assert f"{prefix}prepass_reused" in metrics, step
        evicted = [v for k, v in metrics.items() if k.endswith("filter_groups/evicted_samples")]
        assert (evicted and evicted[0] > 0) if dynamic_sampling else not evicted, (step, evicted)
    assert sorted(run["records"]) == list(range(miniature.GPUS)), run["records"]


#: Each recipe of a distinct combination of settings (Clip-Cov's scripts are KL-Cov's with its loss): its mode's
#: metric prefix, its minibatch shrunk with the batch, whether it runs DAPO's dynamic sampling, a selection figure.
RECIPES = {
    "dapo_kl_cov_global.sh": ("actor/kl_cov/", miniature.MINI_BATCH_PROMPTS, True, "quota"),
    "stare_global_qwen2.5_math_7b.sh": ("actor/stare/", miniature.PROMPTS, True, "gate_on"),
}
#: Not here yet: the 80/20 recipe (Ulysses SP and param offload in the Ray workers), and Lp-Reg's, whose FSDP1 actor
#: syncs its weights to the rollout by staging them on "<device>:<id>", which a CPU does not have.


@pytest.mark.parametrize("script", list(RECIPES))
def test_the_recipe_runs_in_miniature(tmp_path, tiny_model_path, script):
    prefix, mini_batch_prompts, dynamic_sampling, figure = RECIPES[script]
    run = run_recipe(script, tmp_path, tiny_model_path, max_token=miniature.TWO_SEQUENCES_BUDGET,
                     mini_batch_prompts=mini_batch_prompts)
    assert_recipe_ran(run, prefix, dynamic_sampling)
    assert all(f"{prefix}{figure}" in metrics for metrics in run["logged"].values())
    if figure == "quota":
        assert all(m[f"{prefix}quota"] >= 1 and m[f"{prefix}selected"] == m[f"{prefix}quota"]
                   for m in run["logged"].values())


#: A second training micro-batching: every rank's minibatch in one micro-batch (verl's log-prob pass, and so the
#: selection's statistics, keep the script's budget).
WHOLE_MINIBATCH = (f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={miniature.WHOLE_MINIBATCH_BUDGET}",)
NOISE_FACTOR = 10


#: verl 0.9.1's v1 trainer fills a batch with dynamic sampling in the order the groups finish, so two runs of one
#: command may give a rank other rows. The two-budget comparison needs the same rows on both sides: it runs the
#: recipe on the legacy trainer, whose batches are reproducible, without dynamic sampling.
REPRODUCIBLE_BATCHES = ("trainer.use_v1=False", "algorithm.filter_groups.enable=False")


@pytest.fixture(scope="module")
def kl_cov_runs(tmp_path_factory, tiny_model_path):
    """The KL-Cov recipe at two training budgets, with its penalty (``ppo_kl_coef`` 1) and penalty-free (0)."""
    runs = {}
    for coef in ("1", "0"):
        for name, extra in (("two sequences", ()), ("whole minibatch", WHOLE_MINIBATCH)):
            work_dir = tmp_path_factory.mktemp(f"kl_cov-coef{coef}-{name.replace(' ', '_')}")
            runs[coef, name] = run_recipe(
                "dapo_kl_cov_global.sh", work_dir, tiny_model_path, max_token=miniature.TWO_SEQUENCES_BUDGET,
                extra=(*REPRODUCIBLE_BATCHES, *extra, f"actor_rollout_ref.actor.policy_loss.ppo_kl_coef={coef}"),
                params=True)
    return runs


def test_the_kl_cov_recipe_selects_and_updates_alike_at_two_training_budgets(kl_cov_runs):
    """The same rollouts (``cpu_random`` does not read the weights), so every optimizer step selects as many tokens
    at both budgets, and the first (the initial policy's statistics on both sides) the same tokens on each rank; the
    parameters after 2 steps differ no more than ``NOISE_FACTOR`` x the penalty-free runs' difference between the
    same two budgets, and the penalty moved them further than that. (After the first update the two sides'
    statistics differ by that noise, so which rank holds a near-tied token may differ: counts are compared there.)"""
    def selected(run):  # per optimizer step, per rank
        return list(zip(*([r["mask_tokens"] for r in records] for _, records in sorted(run["records"].items()))))

    first, second = kl_cov_runs["1", "two sequences"], kl_cov_runs["1", "whole minibatch"]
    assert selected(first)[0] == selected(second)[0]
    assert [sum(step) for step in selected(first)] == [sum(step) for step in selected(second)]
    for step in first["logged"]:
        assert first["logged"][step]["actor/kl_cov/selected"] == second["logged"][step]["actor/kl_cov/selected"]
    control = max_abs_diff(kl_cov_runs["0", "two sequences"]["params"], kl_cov_runs["0", "whole minibatch"]["params"])
    ours = max_abs_diff(first["params"], second["params"])
    effect = max_abs_diff(first["params"], kl_cov_runs["0", "two sequences"]["params"])
    assert control > 0, "the two budgets gave bit-identical control updates: no noise floor to compare to"
    assert ours <= NOISE_FACTOR * control, (ours, control)
    assert effect > NOISE_FACTOR * control, ("the penalty did not move the update beyond the tolerance", effect)
    print(f"\n[KL-Cov recipe, 2 budgets] selected per step {selected(first)}; kl_cov_global {ours:.3g} vs "
          f"control {control:.3g}, penalty effect {effect:.3g}")
