"""A user's own loss mode, loaded with ``VERL_USE_EXTERNAL_MODULES``, in a real ``python -m verl.trainer.main_ppo``.

``examples/own_mode/my_modes.py`` is a module outside this package: it registers ``rare_token_kl_global`` (verl's
knobs ``kl_cov_ratio``/``ppo_kl_coef``, no config class) and ``rare_token_capped_kl_global`` (a config class with
a knob of its own, ``rare_token_max_prob``), then calls ``plugin.install()``. The route docs/LOADING.md
documents ("Your own loss mode's module") is only ``VERL_USE_EXTERNAL_MODULES=my_modes`` in the environment of the
command that launches ``main_ppo``, with the module's folder on ``PYTHONPATH``. This file proves that route end to
end, on verl's own ``ppo_trainer`` config with a plain ``loss_mode=`` override:

* the driver imports ``my_modes`` on ``import verl``, so the mode is in the plugin's table when ``main_ppo`` calls
  ``validate_config``: the driver logs ``knobs checked in the driver`` for it, and a bad knob (``kl_cov_ratio=true``;
  the capped mode's ``rare_token_max_prob=2`` through its config class) stops the run there, with the plugin's
  message, before Ray starts;
* the plugin's driver hook copies the driver's ``VERL_USE_EXTERNAL_MODULES`` (``my_modes`` included) into the
  job's Ray ``runtime_env`` (verl prints its ``ray init kwargs``; a ``runtime_env`` variable replaces the inherited
  one in every Ray process), so the actor worker imports ``my_modes`` too: an RLOO step on CPU (legacy trainer, 1
  FSDP2 rank, 2 minibatches) logs the mode's ``actor/rare_token/*`` metrics, with a positive quota, and a real
  prepass on the second minibatch (the first reuses verl's log-prob pass).

The CPU platform and the ``cpu_random`` rollout come from ``tests/trainer_support`` (``CPU_PLUGIN_MODULE``, first in
the same variable), as in ``test_trainer_e2e.py``.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from ..trainer_support.e2e import main_ppo_argv, ray_started, write_dataset
from ..trainer_support.env import CPU_PLUGIN_MODULE, REPO_ROOT, subprocess_env
from .test_trainer_e2e import _logged_steps

pytestmark = [pytest.mark.slow,  # a real main_ppo with Ray on CPU: the slow tier
              # verl 0.8's main_ppo calls validate_config in the TaskRunner, after ray.init: no driver check there
              pytest.mark.needs_driver_validate_config]

OWN_MODE_DIR = os.path.join(REPO_ROOT, "examples", "own_mode")
MODE = "rare_token_kl_global"
CAPPED_MODE = "rare_token_capped_kl_global"
PL = "actor_rollout_ref.actor.policy_loss."
EXTERNAL_MODULES = f"{CPU_PLUGIN_MODULE},my_modes"
PROMPTS, N, MINI_BATCH_PROMPTS = 4, 4, 2  # 16 sequences, 2 optimizer steps of 8
RARE_TOKEN_METRICS = ("quota", "selected", "valid_tokens", "selected_in_micro_batch", "prepass_seconds",
                      "selection_seconds", "prepass_reused")
DRIVER_CHECKED = f"verl-klcov-global: loss_mode={MODE}: knobs checked in the driver"


def _own_mode_env() -> dict[str, str]:
    """The route under test: ``my_modes`` named in ``VERL_USE_EXTERNAL_MODULES``, its folder first on ``PYTHONPATH``."""
    env = subprocess_env(VERL_USE_EXTERNAL_MODULES=EXTERNAL_MODULES)
    env["PYTHONPATH"] = os.pathsep.join((OWN_MODE_DIR, env["PYTHONPATH"]))
    return env


def _main_ppo(work_dir, tiny_model_path, *extra: str, loss_mode: str = MODE) -> tuple[subprocess.CompletedProcess,
                                                                                       str, float]:
    """One ``main_ppo`` (legacy trainer, 1 rank, 1 step) with ``loss_mode`` and ``extra`` overrides appended (a
    later override of a key wins); the process, its stdout + stderr, and its wall time."""
    train_file = write_dataset(str(work_dir / "train.parquet"), n_prompts=2 * PROMPTS)
    argv = main_ppo_argv(
        model_path=tiny_model_path, train_file=train_file, out_dir=str(work_dir), use_v1=False, plugin_config=False,
        n_workers=1, prompts_per_step=PROMPTS, responses_per_prompt=N, mini_batch_prompts=MINI_BATCH_PROMPTS,
        ppo_epochs=1, steps=1, kl_cov_ratio=0.05, loss_mode=loss_mode,
    ) + ["+ray_kwargs.ray_init.include_dashboard=False"] + list(extra)  # no dashboard: a third less CPU on 2 cores
    start = time.monotonic()
    # stdout and stderr apart: a worker's warning on stderr must not split a logged step line
    proc = subprocess.run(argv, cwd=work_dir, env=_own_mode_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=600)
    seconds = time.monotonic() - start
    (work_dir / "main_ppo.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    return proc, proc.stdout + proc.stderr, seconds


def _stops_in_the_driver(work_dir, tiny_model_path, loss_mode: str, overrides: list[str], message: str) -> None:
    """The same command plus ``overrides`` exits non-zero with the plugin's ``message`` before Ray starts."""
    proc, output, seconds = _main_ppo(work_dir, tiny_model_path, *overrides, loss_mode=loss_mode)
    assert proc.returncode != 0, output[-3000:]
    assert message in output, output[-3000:]
    assert "TrainerConfigError" in proc.stderr, proc.stderr[-3000:]
    assert not ray_started(output), output[-3000:]
    print(f"\n{loss_mode}: the driver's error after {seconds:.1f} s")


# Order matters for time: under pyproject's `-n 2`, xdist gives the 1st and 3rd test (the two driver-only failures)
# to one worker and the 2nd (the Ray run) to the other, so the file takes ~62 s on 2 cores, not ~75.
def test_main_ppo_bad_knob_of_own_mode_stops_in_the_driver_before_ray(tmp_path, tiny_model_path):
    _stops_in_the_driver(tmp_path, tiny_model_path, MODE, [f"{PL}kl_cov_ratio=true"],
                         f"verl-klcov-global: loss_mode={MODE}: kl_cov_ratio must be finite and in (0, 1], got True; "
                         f"set {PL}kl_cov_ratio")


def test_main_ppo_trains_own_mode_loaded_through_verl_use_external_modules(tmp_path, tiny_model_path):
    # with RLOO's leave-one-out baseline in place of GRPO's group mean: the selection reads whatever advantages
    # the estimator wrote
    proc, output, seconds = _main_ppo(tmp_path, tiny_model_path, "algorithm.adv_estimator=rloo")
    assert proc.returncode == 0, output[-6000:]
    assert "'adv_estimator': 'rloo'" in proc.stdout, output[-3000:]

    # the driver imported my_modes before validate_config: the plugin checked the mode's knobs there
    assert DRIVER_CHECKED in output, output[-3000:]
    # ... and forwarded the driver's module list, my_modes included, into the job's runtime_env
    ray_kwargs = [line for line in proc.stdout.splitlines() if line.startswith("ray init kwargs")]
    assert len(ray_kwargs) == 1, output[-3000:]
    assert f"'VERL_USE_EXTERNAL_MODULES': '{EXTERNAL_MODULES},verl_klcov_global_loader'" in ray_kwargs[0], ray_kwargs

    # the actor worker imported my_modes: the step carries the mode's metrics (its own prefix) with a quota
    logged = _logged_steps(proc.stdout)
    assert sorted(logged) == [1], output[-3000:]
    metrics = logged[1]
    for name in RARE_TOKEN_METRICS:
        assert f"actor/rare_token/{name}" in metrics, (name, sorted(metrics))
    assert not [key for key in metrics if key.startswith("actor/kl_cov/")], sorted(metrics)
    assert metrics["actor/rare_token/quota"] > 0 and metrics["actor/rare_token/selected_in_micro_batch"] > 0, metrics
    # 2 minibatches: the first reuses verl's log-prob pass, the second runs the plugin's prepass
    assert metrics["actor/rare_token/prepass_reused"] == 0.5, metrics
    assert metrics["actor/rare_token/prepass_seconds"] > 0, metrics
    print(f"\nmain_ppo with {MODE} from my_modes: {seconds:.1f} s, quota {metrics['actor/rare_token/quota']}, "
          f"selected_in_micro_batch {metrics['actor/rare_token/selected_in_micro_batch']}")


def test_main_ppo_bad_knob_of_own_config_class_stops_in_the_driver_before_ray(tmp_path, tiny_model_path):
    """The capped mode's own knob, through its config class (``_target_`` and a ``+`` key on verl's config)."""
    _stops_in_the_driver(tmp_path, tiny_model_path, CAPPED_MODE,
                         [f"{PL}_target_=my_modes.RareTokenCappedPolicyLossConfig", f"+{PL}rare_token_max_prob=2"],
                         f"verl-klcov-global: loss_mode={CAPPED_MODE}: rare_token_max_prob must be a probability in "
                         f"(0, 1], got 2; set {PL}rare_token_max_prob=0.5")
