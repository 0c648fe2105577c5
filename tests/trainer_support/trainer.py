"""Hydra config and the trainers' actor-update path, for tests that drive real Ray workers.

* :func:`compose_trainer_config` -- ``configs/kl_cov_global.yaml`` (verl's ``ppo_trainer`` plus
  the plugin's policy loss) composed by Hydra with CPU-sized overrides.
* :func:`legacy_update_actor` -- verl 0.9.1's ``RayPPOTrainer._update_actor`` (legacy trainer,
  ``trainer/ppo/ray_trainer.py`` ~1327) run on a stand-in trainer that has only what that method
  reads: ``config`` and ``actor_rollout_wg``.
* :func:`v1_update_actor` -- verl 0.9.1's v1 ``PPOTrainer._update_actor``
  (``trainer/ppo/v1/trainer_base.py`` ~1827) the same way. The v1 trainer hands the worker group
  a TransferQueue ``KVBatchMeta`` (keys + ``extra_info``); verl's ``tqbridge`` turns it into the
  stored per-sample ``TensorDict`` with every ``extra_info`` entry as a non-tensor key
  (``utils/transferqueue_utils.py _async_meta_to_realdata``). :class:`InMemoryBatch` and
  :class:`InMemoryTransferQueueBridge` do exactly that in memory, so no TransferQueue service
  is started; everything from ``update_actor`` on is verl's real Ray path.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any, Sequence

from hydra_plugins.verl_klcov_global_searchpath.verl_klcov_global_searchpath import config_dir

#: The package's configs (src/verl_klcov_global/configs), found as the search-path plugin finds them:
#: without importing the plugin, so tests that check who loads the plugin stay true.
CONFIG_DIR = config_dir()
CONFIG_NAME = "kl_cov_global"


def cpu_overrides(model_path: str, *, n_gpus: int) -> list[str]:
    """Overrides that make ``configs/kl_cov_global.yaml`` run on a CPU with the tiny model (fp32, sdpa)."""
    return [
        f"actor_rollout_ref.model.path={model_path}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        f"trainer.n_gpus_per_node={n_gpus}",
        "trainer.nnodes=1",
        "trainer.device=cpu",
    ]


def compose_trainer_config(overrides: Sequence[str], *, plugin_config: bool = True):
    """The config ``main_ppo`` would get: from ``--config-path=configs --config-name=kl_cov_global``
    (``plugin_config``) or from verl's own ``ppo_trainer`` (no ``--config-*`` options)."""
    from hydra import compose, initialize_config_dir, initialize_config_module

    if plugin_config:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
            return compose(config_name=CONFIG_NAME, overrides=list(overrides))
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


def validate_trainer_config(config):
    """verl's own driver-side check (``main_ppo.main``): ``validate_config``, which builds the ``ActorConfig``."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))


def legacy_update_actor(config, actor_rollout_wg, batch) -> dict[str, Any]:
    """``RayPPOTrainer._update_actor(batch)``; returns the trainer's actor metrics (lists per step)."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    trainer = SimpleNamespace(config=config, actor_rollout_wg=actor_rollout_wg)
    output = RayPPOTrainer._update_actor(trainer, batch)
    return output.meta_info["metrics"]


class InMemoryBatch:
    """Stands in for a TransferQueue ``KVBatchMeta``: the stored rows plus ``extra_info``."""

    def __init__(self, rows):
        self.rows = rows
        self.extra_info: dict[str, Any] = {}


class InMemoryTransferQueueBridge:
    """Worker group as the v1 trainer sees it: ``update_actor(batch_meta)``.

    Materialises the batch like verl's ``tqbridge`` (rows + ``extra_info`` as non-tensor keys),
    calls the real worker group, and keeps the raw output (per-step metric lists) in ``outputs``.
    """

    def __init__(self, worker_group):
        self.worker_group = worker_group
        self.outputs: list = []

    def update_actor(self, batch: InMemoryBatch):
        from verl.utils import tensordict_utils as tu

        data = batch.rows.copy()
        for key, value in batch.extra_info.items():
            tu.assign_non_tensor_data(tensor_dict=data, key=key, val=value)
        output = self.worker_group.update_actor(data)
        self.outputs.append(output)
        return output


def v1_update_actor(config, actor_rollout_wg, rows) -> tuple[dict[str, Any], dict[str, Any]]:
    """v1 ``PPOTrainer._update_actor``; returns (the trainer's reduced metrics, the worker group's raw metrics)."""
    try:
        from verl.trainer.ppo.v1.trainer_base import PPOTrainer
    except ModuleNotFoundError as error:  # verl's v1 trainer imports transfer_queue at module level
        raise RuntimeError(f"verl's v1 trainer cannot be imported ({error}): install the test extras, which "
                           "include TransferQueue (pip install -e '.[test]')") from error

    bridge = InMemoryTransferQueueBridge(actor_rollout_wg)
    trainer = SimpleNamespace(config=config, actor_rollout_wg=bridge)
    metrics: dict[str, Any] = {}
    PPOTrainer._update_actor(trainer, InMemoryBatch(rows), metrics)
    (raw,) = bridge.outputs
    return metrics, dict(raw["metrics"])
