"""Test-only support for running verl's Ray trainer on a CPU-only machine (not part of the plugin).

verl 0.9.1 has no CPU platform and no CPU rollout; the trainer-level tests supply them.

* :mod:`.verl_cpu_plugin` -- named in ``VERL_USE_EXTERNAL_MODULES`` so that ``import verl`` runs
  :func:`.cpu.install` in every Ray process (driver, TaskRunner, workers, rollout servers).
* :mod:`.cpu` -- the CPU platform of ``verl_klcov_global/lab/cpu.py`` (loaded from its file, so the
  plugin package is NOT imported as a side effect), gloo process groups for verl's workers, the
  CPU rollout, the step recorder.
* :mod:`.rollout`, :mod:`.rollout_server` -- a random-token rollout registered as ``cpu_random``.
* :mod:`.step_recorder` -- one JSON line per optimizer step, written inside the workers.
* :mod:`.workers` -- an ``ActorRolloutRefWorker`` subclass that reports, from its own process,
  every prepass the plugin's hook ran there.
* :mod:`.trainer` -- Hydra composition of ``configs/kl_cov_global.yaml`` and the trainers'
  ``_update_actor`` on a stand-in trainer; :mod:`.batches` -- the batches those receive.
* :mod:`.e2e`, :mod:`.reward` -- dataset, reward and command line of the ``main_ppo`` run.
* :mod:`.env` -- the environment of Ray processes and ``main_ppo`` subprocesses.
"""
