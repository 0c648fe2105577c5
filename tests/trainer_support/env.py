"""Environment for Ray processes and ``main_ppo`` subprocesses of the trainer-level tests."""

from __future__ import annotations

import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU_PLUGIN_MODULE = "tests.trainer_support.verl_cpu_plugin"


def ray_process_env(threads_per_process: int = 1) -> dict[str, str]:
    """Variables every Ray process of a test run needs.

    ``PYTHONPATH`` puts this repository first: verl's wheel ships a top-level ``tests``
    package of its own, and ``tests.trainer_support`` must resolve to ours.
    ``VERL_USE_EXTERNAL_MODULES`` makes ``import verl`` install the CPU support in each process.
    """
    pythonpath = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return {
        "PYTHONPATH": pythonpath,
        "VERL_USE_EXTERNAL_MODULES": CPU_PLUGIN_MODULE,
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": str(threads_per_process),
        "MKL_NUM_THREADS": str(threads_per_process),
        "RAY_DEDUP_LOGS": "0",
    }


# Inherited variables that must not reach a test's Ray processes: torch.distributed settings an
# earlier in-process test may have left, an external Ray cluster, verl plugin selections.
INHERITED_ENV_TO_DROP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                         "RAY_ADDRESS", "VERL_USE_EXTERNAL_MODULES", "VERL_USE_EXTERNAL_PLUGINS")


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment without :data:`INHERITED_ENV_TO_DROP`, plus :func:`ray_process_env` and ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in INHERITED_ENV_TO_DROP}
    env.update(ray_process_env(threads_per_process=1), **extra)
    return env
