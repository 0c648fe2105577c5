"""The plugin in every Ray process of a ``main_ppo`` run, or a stop at start-up that says how to fix it.

verl 0.9.1's real ``verl.trainer.main_ppo.main`` runs (Hydra on verl's own ``ppo_trainer`` config with
a plain ``loss_mode=kl_cov_global`` override, the patched ``validate_config``, ``run_ppo``'s
``ray.init`` with the config's runtime env), with ``TaskRunnerV1`` replaced by
:class:`tests.trainer_support.loading.LoadingProbeTaskRunner`: it starts 2 real
``ActorRolloutRefWorker`` processes, runs their ``init_model`` and records what each Ray process
sees. In every Ray process ``VERL_USE_EXTERNAL_PLUGINS=none``: the entry point is unavailable, as
on a cluster whose workers run without the package metadata or with entry points off. The driver
loads the plugin through its entry point and nothing else names it.

* with the driver's worker loading: the TaskRunner and both workers have the loss modes registered
  and the hook installed;
* control, worker loading off (``VERL_KLCOV_GLOBAL_AUTOLOAD=0``): they have neither (so the first
  test can fail);
* the plugin not importable in the Ray processes (a shadow package on their ``PYTHONPATH``): the
  run stops when the TaskRunner starts, before any worker or model, with the install hint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from verl_klcov_global.install_hint import INSTALL_HINT

from .trainer_support import trainer
from .trainer_support.env import REPO_ROOT, subprocess_env
from .trainer_support.loading import PROBE_OUT_ENV, WORKERS

pytestmark = pytest.mark.slow

_DRIVER = f"""
import sys
sys.path.insert(0, {REPO_ROOT!r})
import verl.trainer.main_ppo as main_ppo
from tests.trainer_support.loading import LoadingProbeTaskRunner
main_ppo.TaskRunnerV1 = LoadingProbeTaskRunner
sys.argv = ["main_ppo"] + sys.argv[1:]
main_ppo.main()
"""


def _run_main_ppo(tmp_path, model_path, *, ray_env: dict[str, str], driver_env: dict[str, str] | None = None):
    probe_out = tmp_path / "probe.json"
    overrides = trainer.cpu_overrides(model_path, n_gpus=WORKERS) + [
        "actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov_global",
        "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.05",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "data.train_batch_size=4",
        "algorithm.adv_estimator=grpo",
        "ray_kwargs.ray_init.num_cpus=8",
        "+ray_kwargs.ray_init.num_gpus=0",
        "+ray_kwargs.ray_init.include_dashboard=False",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.{PROBE_OUT_ENV}='{probe_out}'",
    ] + [f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}='{v}'" for k, v in ray_env.items()]
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _DRIVER, *overrides], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600,
                          env=subprocess_env(**(driver_env or {})))
    report = json.loads(probe_out.read_text()) if probe_out.exists() else None
    return proc, report, time.monotonic() - start


def _processes(report):
    return [report["task_runner"], *report["workers"]]


def test_driver_makes_every_ray_process_load_the_plugin_without_entry_points(tmp_path, tiny_model_path):
    proc, report, _ = _run_main_ppo(tmp_path, tiny_model_path, ray_env={"VERL_USE_EXTERNAL_PLUGINS": "none"})
    assert proc.returncode == 0 and report is not None, proc.stdout[-4000:]
    assert "loss_mode=kl_cov_global: knobs checked in the driver" in proc.stdout
    processes = _processes(report)
    assert len(report["workers"]) == WORKERS and len({p["pid"] for p in processes}) == WORKERS + 1
    for view in processes:
        assert view["entry_points_policy"] == "none", view
        assert view["registered"] == ["clip_cov_global", "kl_cov_global"], view
        assert view["hook_installed"] and view["loader_imported"], view
        # The CPU support the test harness names there is kept, the loader added.
        assert view["external_modules"].split(",") == ["tests.trainer_support.verl_cpu_plugin",
                                                       "verl_klcov_global_loader"], view


def test_control_without_worker_loading_the_workers_lack_the_plugin(tmp_path, tiny_model_path):
    proc, report, _ = _run_main_ppo(tmp_path, tiny_model_path, ray_env={"VERL_USE_EXTERNAL_PLUGINS": "none"},
                                    driver_env={"VERL_KLCOV_GLOBAL_AUTOLOAD": "0"})
    assert proc.returncode == 0 and report is not None, proc.stdout[-4000:]
    assert "worker loading skipped (VERL_KLCOV_GLOBAL_AUTOLOAD=0)" in proc.stdout
    for view in _processes(report):
        assert view["registered"] == [] and not view["hook_installed"] and not view["plugin_imported"], view


def test_plugin_missing_in_the_workers_stops_the_run_at_start_with_the_fix(tmp_path, tiny_model_path):
    shadow = tmp_path / "shadow" / "verl_klcov_global"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'verl_klcov_global' (test: not installed in this worker)\", "
        "name='verl_klcov_global')\n")
    proc, report, seconds = _run_main_ppo(
        tmp_path, tiny_model_path,
        ray_env={"VERL_USE_EXTERNAL_PLUGINS": "none", "PYTHONPATH": f"{shadow.parent}{os.pathsep}{REPO_ROOT}"})
    assert proc.returncode != 0 and report is None, proc.stdout[-4000:]
    out = proc.stdout
    assert ("verl-klcov-global: actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov_global (driver: "
            "verl-klcov-global") in out, out[-4000:]
    assert "needs the plugin in every Ray process" in out and INSTALL_HINT in out, out[-4000:]
    assert "not installed in this worker" in out, out[-4000:]
    # Stopped when the TaskRunner process started: no worker group, no model was built.
    assert "init_model" not in out and "ProbeActorWorker" not in out, out[-4000:]
    print(f"time to the error: {seconds:.1f} s")
