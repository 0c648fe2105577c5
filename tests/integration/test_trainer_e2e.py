"""End to end: ``python -m verl.trainer.main_ppo``, 2 PPO steps on CPU with ``loss_mode=kl_cov_global``.

verl 0.9.1 runs as users run it -- Hydra config, its own Ray cluster, TaskRunner, agent loop,
reward loop, FSDP2 actor workers -- with three test-only additions from ``tests/trainer_support``,
loaded in every Ray process through ``VERL_USE_EXTERNAL_MODULES``: the CPU platform, a
random-token rollout (``rollout.name=cpu_random``) and a recorder of optimizer steps. Fake Ray GPUs
give 2 data-parallel actor ranks.

The driver loads the plugin **only through its entry point**: nothing in the command line or the
environment names it, and the CPU support does not import it (checked by
``test_cpu_support_does_not_load_the_plugin``). In the Ray processes the entry point and the
driver's worker loader (``driver.py``) both load it; ``tests/test_driver_loading.py`` shows the
loader alone is enough. Two runs:

* ``v1``: the default (v1) trainer on verl's own ``ppo_trainer`` config with
  ``actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov_global`` (plain ``PolicyLossConfig``), PPO with a critic
  (``adv_estimator=gae``), strictly on-policy (one minibatch, one epoch): every optimizer step reuses verl's own
  log-prob pass (``prepass_reused`` 1, ``engine/reuse.py``), on both ranks; the critic's engine trains through the
  same wrapped ``train_batch`` and gets no selection;
* ``legacy``: ``trainer.use_v1=False`` on ``--config-name=kl_cov_global`` (no ``--config-path``: the
  package's config, through its Hydra search-path plugin), the ready config that
  docs/LOADING.md documents (its ``_target_`` imports the plugin too, so this run is not the
  entry-point proof; it is the proof that the documented config trains), 2 minibatches x 2 epochs: the
  first optimizer step of each update reuses the log-prob pass, the other three run the prepass
  (``prepass_reused`` 0.25 as the trainer logs it).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

import verl_klcov_global

from ..trainer_support import step_recorder
from ..trainer_support.e2e import main_ppo_argv, write_dataset
from ..trainer_support.env import CPU_PLUGIN_MODULE, REPO_ROOT, subprocess_env

pytestmark = pytest.mark.slow  # verl's real engine / workers / trainer on CPU: the slow tier

WORKERS = 2                          # FSDP ranks (fake GPUs)
PROMPTS, N = 4, 4                    # prompts per step x responses per prompt = 16 sequences
MINI_BATCH_PROMPTS, EPOCHS = 2, 2    # 8 sequences per optimizer step, 2 PPO epochs (legacy run, vanilla runs)
STEPS = 2                            # trainer steps
RATIO = 0.05
KL_COV_METRICS = ("quota", "selected", "valid_tokens", "nonfinite_tokens", "cov_threshold",
                  "selected_in_micro_batch", "prepass_seconds", "selection_seconds")
_STEP_LINE = re.compile(r"step:(\d+) - (.*)$")
_NUMBER = re.compile(r"^(?:np\.float\d+\()?([^()]+?)\)?$")  # 4.5, or np.float64(4.5) (legacy trainer)


def _logged_steps(log: str) -> dict[int, dict[str, float]]:
    """The console logger's ``step:N - key:value - ...`` lines, as {N: {key: value}}."""
    steps = {}
    for line in log.splitlines():
        match = _STEP_LINE.search(line)
        if match:
            metrics = {}
            for item in match.group(2).split(" - "):
                key, _, value = item.rpartition(":")
                try:
                    metrics[key] = float(_NUMBER.match(value.strip()).group(1))
                except (AttributeError, ValueError):
                    pass
            steps[int(match.group(1))] = metrics
    return steps


def _run_main_ppo(work_dir, tiny_model_path, *, use_v1: bool, plugin_config: bool, mini_batch_prompts: int,
                  epochs: int, adv_estimator: str = "grpo", train_file=None) -> dict:
    """One ``main_ppo`` run with ``kl_cov_global`` in ``work_dir``; its console log, logged steps, the workers'
    per-step records and its train file."""
    train_file = train_file or write_dataset(str(work_dir / "train.parquet"), n_prompts=2 * PROMPTS)
    record_dir = work_dir / "steps"
    record_dir.mkdir()
    env = subprocess_env(**{step_recorder.RECORD_DIR_ENV: str(record_dir)})
    argv = main_ppo_argv(
        model_path=tiny_model_path, train_file=train_file, out_dir=str(work_dir), use_v1=use_v1,
        plugin_config=plugin_config, n_workers=WORKERS, prompts_per_step=PROMPTS, responses_per_prompt=N,
        mini_batch_prompts=mini_batch_prompts, ppo_epochs=epochs, steps=STEPS, kl_cov_ratio=RATIO,
        adv_estimator=adv_estimator,
    )
    # Only the entry point may load the plugin: no module list or external_lib names it.
    assert env["VERL_USE_EXTERNAL_MODULES"] == CPU_PLUGIN_MODULE
    assert not any("external_lib" in arg or "verl_klcov_global" in arg for arg in argv if not plugin_config)
    proc = subprocess.run(argv, cwd=work_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)
    (work_dir / "main_ppo.log").write_text(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return {"log": proc.stdout, "logged": _logged_steps(proc.stdout), "records": step_recorder.read(str(record_dir)),
            "train_file": train_file}


#: the legacy run: ``--config-name=kl_cov_global``, 2 minibatches x 2 epochs
LEGACY = dict(use_v1=False, plugin_config=True, mini_batch_prompts=MINI_BATCH_PROMPTS, epochs=EPOCHS)


@pytest.fixture(scope="module")
def legacy_run(tmp_path_factory, tiny_model_path):
    """The legacy run, made once: its own test and the reproducibility test read it."""
    return _run_main_ppo(tmp_path_factory.mktemp("legacy"), tiny_model_path, **LEGACY)


@pytest.mark.slow
@pytest.mark.parametrize("use_v1, plugin_config, mini_batch_prompts, epochs, reused, adv_estimator",
                         [(True, False, PROMPTS, 1, 1.0, "gae"), (False, True, MINI_BATCH_PROMPTS, EPOCHS, 0.25, "grpo")],
                         ids=["v1", "legacy"])
def test_main_ppo_grpo_on_cpu_runs_kl_cov_global_prepass_per_minibatch(request, tmp_path, tiny_model_path, use_v1,
                                                                       plugin_config, mini_batch_prompts, epochs,
                                                                       reused, adv_estimator):
    optimizer_steps_per_step = epochs * PROMPTS // mini_batch_prompts
    rows_per_rank = mini_batch_prompts * N // WORKERS
    if use_v1:
        run = _run_main_ppo(tmp_path, tiny_model_path, use_v1=use_v1, plugin_config=plugin_config,
                            mini_batch_prompts=mini_batch_prompts, epochs=epochs, adv_estimator=adv_estimator)
    else:
        run = request.getfixturevalue("legacy_run")
    logged, records = run["logged"], run["records"]
    critic_records = {rank: [r for r in rank_records if r["loss"] == "value_loss"]
                      for rank, rank_records in records.items()}
    records = {rank: [r for r in rank_records if r["loss"] != "value_loss"] for rank, rank_records in records.items()}
    if adv_estimator == "gae":  # the critic trained beside the actor, and no selection ran on its minibatches
        assert all(metrics.get("critic/vf_loss") is not None for metrics in logged.values()), run["log"][-3000:]
        assert all(len(rank_records) == STEPS * optimizer_steps_per_step for rank_records in critic_records.values())
        assert all(r["mask_tokens"] is None for rank_records in critic_records.values() for r in rank_records)
    else:
        assert not any(critic_records.values()), critic_records

    # -- the steps finished and their kl_cov metrics are in the trainer's log -----------------------
    assert sorted(logged) == list(range(1, STEPS + 1)), run["log"][-3000:]
    for step, metrics in logged.items():
        for name in KL_COV_METRICS:
            assert f"actor/kl_cov/{name}" in metrics, (step, name, sorted(metrics))
        assert metrics["actor/kl_cov/quota"] >= 1 and metrics["actor/kl_cov/nonfinite_tokens"] == 0
        # verl's log-prob pass stood in for the prepass on the update's first optimizer step, on every rank
        assert metrics["actor/kl_cov/prepass_reused"] == reused, (step, metrics["actor/kl_cov/prepass_reused"])

    # -- inside the workers: one prepass per optimizer step (minibatch x epoch), on every rank ------
    assert sorted(records) == list(range(WORKERS)), records
    for rank, rank_records in records.items():
        assert len(rank_records) == STEPS * optimizer_steps_per_step, (rank, rank_records)
        assert all(r["rows"] == rows_per_rank for r in rank_records), rank_records
        assert all(r["mask_tokens"] is not None for r in rank_records), f"rank {rank}: a step without prepass mask"
        # the workers run the plugin this test imported (the checkout's, or an installed wheel's: scripts/test_wheel.sh)
        assert {r["plugin_file"] for r in rank_records} == {verl_klcov_global.__file__}, rank_records
    assert len({r["pid"] for rank_records in records.values() for r in rank_records}) == WORKERS

    # the ranks' mask slices add up to the global quota each optimizer step; the trainer logs its mean
    for step in range(STEPS):
        window = slice(step * optimizer_steps_per_step, (step + 1) * optimizer_steps_per_step)
        quotas = [sum(r["mask_tokens"] for r in per_step)
                  for per_step in zip(*(rank_records[window] for rank_records in records.values()))]
        assert all(q >= 1 for q in quotas)
        assert logged[step + 1]["actor/kl_cov/quota"] == pytest.approx(sum(quotas) / len(quotas))
    print(f"\n[{'v1' if use_v1 else 'legacy'}] logged quota per step "
          f"{[logged[s]['actor/kl_cov/quota'] for s in sorted(logged)]}, prepass_reused "
          f"{[logged[s]['actor/kl_cov/prepass_reused'] for s in sorted(logged)]}")


def test_cpu_support_does_not_load_the_plugin():
    """The e2e run's only path to the plugin is its entry point: with entry points off, nothing loads it."""
    code = (
        "import sys, verl\n"
        "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY\n"
        "from verl.workers.rollout.replica import RolloutReplicaRegistry\n"
        "from verl.utils.device import get_device_name\n"
        "assert get_device_name() == 'cpu' and 'cpu_random' in RolloutReplicaRegistry._registry\n"
        "assert 'kl_cov_global' not in POLICY_LOSS_REGISTRY\n"
        "assert not [m for m in sys.modules if m.startswith('verl_klcov_global')], 'plugin imported'\n"
        "print('ok')\n"
    )
    env = subprocess_env(VERL_USE_EXTERNAL_PLUGINS="none")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("ok"), proc.stdout[-3000:]


#: Logged keys that measure time or memory (``perf/...``, ``actor/perf/...``), not the training computation.
_VARYING_KEY = re.compile(r"(^|/)(timing_s|timing_per_token_ms|perf)/|seconds$|_share$|memory")


@pytest.mark.slow
def test_two_identical_main_ppo_runs_log_identical_metrics(legacy_run, tmp_path, tiny_model_path):
    """The reproducible CPU trainer path: the legacy ``kl_cov_global`` command (2 FSDP2 ranks, 2 steps of 2
    minibatches x 2 epochs, the plugin's prepass and its reuse of verl's log-prob pass) run a second time logs the
    same rollouts' scores and lengths and the same actor and selection metrics, bit for bit as printed; only timings
    and memory differ. The same command on the same machine: the same computation on the same inputs. The rollout's
    reproducibility comes from ``data.seed`` and ``rollout.full_determinism=True`` (``cpu_random``). (Until 0.7.0 two
    vanilla runs; the first run is now the legacy test's, so the check costs one run, not two.)"""
    second = _run_main_ppo(tmp_path, tiny_model_path, train_file=legacy_run["train_file"], **LEGACY)
    first, second = ({step: {k: v for k, v in metrics.items() if not _VARYING_KEY.search(k)}
                      for step, metrics in run["logged"].items()} for run in (legacy_run, second))
    assert sorted(first) == sorted(second) == list(range(1, STEPS + 1))
    for step in first:
        assert sorted(first[step]) == sorted(second[step]), step
        # not vacuous: the rollout's outcome, the actor update and the selection are among the compared metrics
        for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy",
                    "actor/kl_cov/cov_threshold", "actor/kl_cov/selected"):
            assert key in first[step], (step, key, sorted(first[step]))
        differing = {k: (first[step][k], second[step][k]) for k in first[step]
                     if first[step][k] != second[step][k] and not (math.isnan(first[step][k]) and math.isnan(second[step][k]))}
        assert not differing, (step, differing)
    print(f"\n{len(first[1])} metrics per step identical in both runs, e.g. step 1 critic/score/mean "
          f"{first[1]['critic/score/mean']}, actor/pg_loss {first[1]['actor/pg_loss']}")
