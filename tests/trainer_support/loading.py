"""Where is the plugin loaded? A TaskRunner and worker group that report it from their own Ray processes.

For ``tests/test_driver_loading.py``: verl 0.9.1's real ``main_ppo.main`` (Hydra, the patched
``validate_config``, ``run_ppo``'s ``ray.init`` with the config's runtime env) runs with
:class:`LoadingProbeTaskRunner` in place of ``TaskRunnerV1``. The probe starts 2 real
``ActorRolloutRefWorker`` processes (``role="actor"``, ``init_model`` run) and writes what each
process sees to the JSON file named by ``$LOADING_PROBE_OUT``.

Nothing here imports ``verl_klcov_global``: the point is to see whether the run loads it.
"""

from __future__ import annotations

import json
import os
import sys

import ray
from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.engine_workers import ActorRolloutRefWorker

WORKERS = 2
PROBE_OUT_ENV = "LOADING_PROBE_OUT"


def process_view() -> dict:
    """What this process sees of the plugin (no import of it)."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
    from verl.workers.engine.base import BaseEngine

    return dict(
        pid=os.getpid(),
        registered=sorted(mode for mode in ("kl_cov_global", "clip_cov_global") if mode in POLICY_LOSS_REGISTRY),
        hook_installed=getattr(BaseEngine.train_batch, "__verl_klcov_global_original__", None) is not None,
        plugin_imported="verl_klcov_global" in sys.modules,
        loader_imported="verl_klcov_global_loader" in sys.modules,
        entry_points_policy=os.environ.get("VERL_USE_EXTERNAL_PLUGINS", "auto"),
        external_modules=os.environ.get("VERL_USE_EXTERNAL_MODULES", ""),
    )


class ProbeActorWorker(ActorRolloutRefWorker):
    """verl's ``ActorRolloutRefWorker`` plus :meth:`view`."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def view(self) -> dict:
        return process_view()


@ray.remote(num_cpus=1)
class LoadingProbeTaskRunner:
    """Stands in for verl's ``TaskRunnerV1``: builds the actor workers, records what every process sees."""

    def run(self, config) -> None:
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

        pool = RayResourcePool(process_on_nodes=[WORKERS], use_gpu=False, max_colocate_count=1)
        worker_cls = RayClassWithInitArgs(cls=ray.remote(ProbeActorWorker), config=config.actor_rollout_ref,
                                          role="actor")
        group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=worker_cls, device_name="cpu")
        group.init_model()
        report = dict(task_runner=process_view(), workers=group.view())
        with open(os.environ[PROBE_OUT_ENV], "w") as f:
            json.dump(report, f)
