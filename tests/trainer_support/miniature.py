"""An example recipe run in miniature on CPU: the script itself, with the sizes shrunk (test-only).

``bash examples/<recipe>.sh <overrides>`` runs the recipe's own ``python -m verl.trainer.main_ppo`` with every
value it sets, and appends :func:`miniature_overrides` (a later Hydra override of a key wins). What the miniature
changes, and nothing else:

* **sizes**: the model (the tiny Qwen2), the data (a parquet of chat prompts), the lengths (prompt 32, response
  24 tokens; the ``dapo`` reward's ``max_resp_len`` the response length and its overlong buffer 8 tokens), the
  batch sizes (4 prompts per step, 2 per optimizer step or all 4 where the recipe makes one, 4 responses each),
  every per-GPU token budget (two sequences), the GPU counts (``NNODES`` 1, ``GPUS_PER_NODE`` 2, rollout tensor parallel 1) and 2 trainer steps;
* **what a CPU needs** to run verl's trainer at all: the CPU platform and the ``cpu_random`` rollout
  (``tests/trainer_support``, through ``VERL_USE_EXTERNAL_MODULES``; it samples no rollout log-probs), fp32 and sdpa (no flash-attention), no
  ``torch.compile``, the console logger (no wandb), no validation or checkpoint, Ray's resources, one agent and
  reward worker, and a reward that varies within a group (:data:`REWARD_FILE`: random tokens never solve a math
  problem, and a constant reward would make every group a filtered one).

Everything else stays as the recipe sets it: dynamic sampling with its refill (``algorithm.filter_groups``), the
``dapo`` reward manager, dynamic batch sizes, Ulysses, offload, gradient checkpointing, ``loss_agg_mode``, epochs.
"""

from __future__ import annotations

import os
import sys

from .e2e import write_dataset
from .env import REPO_ROOT, subprocess_env
from .rollout import ROLLOUT_NAME

REWARD_FILE = os.path.join(REPO_ROOT, "tests", "trainer_support", "miniature_reward.py")
PROMPT_LEN, RESPONSE_LEN, OVERLONG_LEN = 32, 24, 8
PROMPTS, MINI_BATCH_PROMPTS, RESPONSES = 4, 2, 4
GPUS, STEPS = 2, 2
#: the whole minibatch of a rank in one micro-batch, and about two sequences (the recipes' budget, shrunk)
WHOLE_MINIBATCH_BUDGET = MINI_BATCH_PROMPTS * RESPONSES * (PROMPT_LEN + RESPONSE_LEN)
TWO_SEQUENCES_BUDGET = 2 * (PROMPT_LEN + RESPONSE_LEN)


def miniature_env(model_path: str, train_file: str, *, max_token: int, **extra: str) -> dict[str, str]:
    """The script's own environment knobs, shrunk, and the CPU support in every Ray process."""
    env = subprocess_env(**extra)
    env.update(MODEL_PATH=model_path, TRAIN_FILE=train_file, TEST_FILE=train_file, NNODES="1",
               GPUS_PER_NODE=str(GPUS), MAX_TOKEN=str(max_token))
    env["PATH"] = os.pathsep.join((os.path.dirname(sys.executable), env.get("PATH", "")))  # the script's `python`
    return env


def miniature_overrides(out_dir: str, script: str, *, mini_batch_prompts: int = MINI_BATCH_PROMPTS,
                        max_token: int = TWO_SEQUENCES_BUDGET) -> list[str]:
    """The Hydra overrides appended to ``script``'s own: sizes and what a CPU needs (module docstring).
    ``mini_batch_prompts``: the recipe's minibatch shrunk with its batch (all of it where the recipe makes one
    optimizer step per batch); ``max_token``: every per-GPU token budget the recipe sets."""
    actor = "actor_rollout_ref.actor"
    with open(script) as handle:
        dapo_lengths = "reward.reward_kwargs.max_resp_len" in handle.read()
    return [
        # sizes
        f"data.max_prompt_length={PROMPT_LEN}",
        f"data.max_response_length={RESPONSE_LEN}",
        *([f"reward.reward_kwargs.max_resp_len={RESPONSE_LEN}",
           f"reward.reward_kwargs.overlong_buffer_cfg.len={OVERLONG_LEN}"] if dapo_lengths else []),
        f"data.train_batch_size={PROMPTS}",
        f"{actor}.ppo_mini_batch_size={mini_batch_prompts}",
        f"{actor}.ppo_max_token_len_per_gpu={max_token}",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={max_token}",
        f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={max_token}",
        f"actor_rollout_ref.rollout.max_num_batched_tokens={max_token}",
        f"actor_rollout_ref.rollout.n={RESPONSES}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"trainer.total_training_steps={STEPS}",
        # what a CPU needs
        "trainer.device=cpu",
        f"actor_rollout_ref.rollout.name={ROLLOUT_NAME}",
        "actor_rollout_ref.rollout.full_determinism=True",
        "actor_rollout_ref.rollout.calculate_log_probs=False",  # cpu_random samples no log-probs
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"{actor}.use_torch_compile=False",
        f"{actor}.fsdp_config.use_torch_compile=False",
        f"+{actor}.fsdp_config.mixed_precision={{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}}",
        "data.dataloader_num_workers=0",
        "data.seed=1",
        "trainer.logger=[console]",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.default_local_dir={os.path.join(out_dir, 'checkpoints')}",
        f"reward.custom_reward_function.path={REWARD_FILE}",
        "reward.num_workers=1",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "ray_kwargs.ray_init.num_cpus=16",
        f"+ray_kwargs.ray_init.num_gpus={GPUS}",
        "+ray_kwargs.ray_init.include_dashboard=False",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]


def write_miniature_dataset(path: str) -> str:
    """Enough prompts for the refills of 2 steps (dynamic sampling drops the even-indexed prompts' groups)."""
    return write_dataset(path, n_prompts=8 * PROMPTS)
