"""Research experiments on verl's trainer loop (not part of the installed plugin).

Importable from a checkout of this repository (run from its root, like ``benchmarks``), e.g.
``python -m experiments.trajectory --png docs/trajectory_cpu.png``. They import the plugin and its
lab (``verl_klcov_global.lab``) as installed by ``scripts/setup.sh``.

* :mod:`.random_responses` -- reproducible random-token responses (standard library only);
* :mod:`.local_trainer` -- verl's trainer loop (``RayPPOTrainer.fit``) in-process on CPU, reproducibly;
* :mod:`.trajectory` -- whole runs compared across micro-batch and DP sizes, and their picture;
* :mod:`.learning_task` -- a 64-id tiny Qwen2 and a target-token reward it learns from scratch;
* :mod:`.policy_rollout` -- rollouts sampled from the policy being trained, reproducibly;
* :mod:`.learning` -- learning runs where entropy collapses, every mode at two micro-batch sizes,
  and their picture (``python -m experiments.learning --png docs/learning_cpu.png``);
* :mod:`.exploration_task` -- a deceptive reward: an easy set worth 0.5, a rare first-token pattern worth 1 more;
* :mod:`.exploration` -- the multi-seed study on it, upstream vs global for the three modes, with intervals
  (``python -m experiments.exploration --png docs/exploration_cpu.png --json docs/exploration_cpu.json``).

This file imports nothing: the ``cpu_random`` rollout server of the ``main_ppo`` tests loads
``random_responses.py`` by its path in fresh Ray processes.
"""
