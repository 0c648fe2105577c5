"""Inputs and command line of the end-to-end ``python -m verl.trainer.main_ppo`` run on CPU (test-only)."""

from __future__ import annotations

import os
import sys

from experiments.local_trainer import write_dataset as lab_write_dataset

from .env import REPO_ROOT
from .rollout import ROLLOUT_NAME

REWARD_FILE = os.path.join(REPO_ROOT, "tests", "trainer_support", "reward.py")


#: What ``main_ppo`` prints once it starts Ray (verl's ``ray init kwargs`` line, Ray's own for a local instance).
RAY_STARTED = ("ray init kwargs", "Started a local Ray instance")


def ray_started(output: str) -> bool:
    """Whether a ``main_ppo`` run's ``output`` shows Ray started: a check that stops the run "before Ray" must not."""
    return any(marker in output for marker in RAY_STARTED)


def write_dataset(path: str, n_prompts: int) -> str:
    """A parquet file of ``n_prompts`` chat prompts in verl's RL dataset format (the experiments' writer)."""
    return lab_write_dataset(path, n_prompts, data_source="kl_cov_global_e2e")


def main_ppo_argv(*, model_path: str, train_file: str, out_dir: str, use_v1: bool, plugin_config: bool,
                  n_workers: int, prompts_per_step: int, responses_per_prompt: int, mini_batch_prompts: int,
                  ppo_epochs: int, steps: int, kl_cov_ratio: float, loss_mode: str = "kl_cov_global",
                  adv_estimator: str = "grpo") -> list[str]:
    """``python -m verl.trainer.main_ppo ...`` for a GRPO run on CPU with ``loss_mode=kl_cov_global``.

    ``adv_estimator``: verl's ``algorithm.adv_estimator``; ``gae`` adds a critic on the same model (FSDP2, fp32,
    the actor's micro-batches), as PPO with a value function runs.

    ``plugin_config``: ``--config-name=kl_cov_global`` (the plugin's packaged config, found through its
    Hydra search-path plugin; the plugin's config class) instead of
    verl's own ``ppo_trainer`` with a plain ``loss_mode`` override (``loss_mode``, e.g. ``vanilla``).
    Everything else is CPU sizing:
    fake Ray GPUs (one FSDP rank each), the ``cpu_random`` rollout, fp32, sdpa, one worker per
    helper pool, console logger, no validation, no checkpoints.
    """
    argv = [sys.executable, "-m", "verl.trainer.main_ppo"]
    if plugin_config:  # no --config-path: the installed package's Hydra search-path plugin finds it
        argv += ["--config-name=kl_cov_global"]
    else:
        argv += [f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
                 "actor_rollout_ref.actor.policy_loss.ppo_kl_coef=1.0"]
    return argv + _critic_args(adv_estimator, model_path) + [
        f"algorithm.adv_estimator={adv_estimator}",
        f"actor_rollout_ref.actor.policy_loss.kl_cov_ratio={kl_cov_ratio}",
        f"data.train_files={train_file}",
        f"data.val_files={train_file}",
        f"data.train_batch_size={prompts_per_step}",
        "data.max_prompt_length=32",
        "data.max_response_length=24",
        "data.dataloader_num_workers=0",
        "data.seed=1",                                           # the shuffling sampler's generator
        "actor_rollout_ref.rollout.full_determinism=True",       # stable request ids: reproducible rollouts
        f"actor_rollout_ref.model.path={model_path}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch_prompts}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        f"actor_rollout_ref.actor.ppo_epochs={ppo_epochs}",
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        f"actor_rollout_ref.rollout.name={ROLLOUT_NAME}",
        f"actor_rollout_ref.rollout.n={responses_per_prompt}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.calculate_log_probs=False",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "reward.num_workers=1",
        f"reward.custom_reward_function.path={REWARD_FILE}",
        f"trainer.use_v1={use_v1}",
        f"trainer.n_gpus_per_node={n_workers}",
        "trainer.nnodes=1",
        "trainer.device=cpu",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[console]",
        "trainer.project_name=kl_cov_global_e2e",
        f"trainer.experiment_name={'v1' if use_v1 else 'legacy'}",
        f"trainer.default_local_dir={os.path.join(out_dir, 'checkpoints')}",
        "ray_kwargs.ray_init.num_cpus=16",   # logical: verl reserves 3 CPUs per worker bundle
        f"+ray_kwargs.ray_init.num_gpus={n_workers}",  # fake GPUs: verl's resource pools ask for "GPU"
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]


def _critic_args(adv_estimator: str, model_path: str) -> list[str]:
    """A critic for ``gae`` (none for the estimators without a value function)."""
    if adv_estimator != "gae":
        return []
    return [
        f"critic.model.path={model_path}",
        "+critic.model.override_config.attn_implementation=sdpa",
        "critic.model.use_remove_padding=False",
        "critic.model.enable_gradient_checkpointing=False",
        "critic.strategy=fsdp2",
        "critic.ppo_micro_batch_size_per_gpu=2",
        "critic.fsdp.use_torch_compile=False",
        "+critic.fsdp.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
    ]
