#!/usr/bin/env bash
# GRPO + KL-Cov with global (minibatch- and DP-wide) token selection, on DAPO-Math-17k.
#
# Hyperparameters follow the published entropy-mechanism recipe for Qwen2.5-7B
# (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
# Language Models", arXiv:2505.22617) as verl shipped it: script recipe/entropy/7b_kl_cov.sh of
# volcengine/verl@246cac4 (the last commit before verl moved its recipes out), ported to
# verl 0.9.1's `python -m verl.trainer.main_ppo` with only the loss mode changed:
#   loss_mode kl_cov -> kl_cov_global (this plugin).
# Each value's source is noted [recipe] (from that script), [paper] (its Table/Sec. on
# KL-Cov: kl_cov_ratio 2e-3 at 7B, 2e-4 at 32B, ppo_kl_coef 1) or [ours].
# The authors' own copy, PRIME-RL/Entropy-Mechanism-of-RL@8850579 recipe/dapo/7b_kl_cov.sh, differs in
# three values: optim.lr 5e-7 (here 1e-6), gen batch 1x (3x) and total_epochs 15 (1000); its knob
# k_percent=0.2 is a percentage (= kl_cov_ratio 0.002). Set actor_rollout_ref.actor.optim.lr=5e-7 for theirs.
#
# DAPO's dynamic sampling and reward, as the recipe sets them, on verl 0.9.1's main_ppo: the v1 trainer's replay
# buffer drops groups whose responses all score the same `acc` and refills them (algorithm.filter_groups), and the
# `dapo` reward manager scores them (its overlong buffer off, as in the recipe). Two differences remain: verl 0.9.1's buffer ignores
# max_num_gen_batches (it refills without a limit, and logs that it ignores it), and it streams prompts instead of
# generating a batch of 3 x the train batch (max_inflight_gen_batches=3 bounds how many train batches are in flight).
#
# Usage (GPU cluster; the plugin must be installed in the environment Ray workers use):
#   MODEL_PATH=/models/Qwen2.5-7B TRAIN_FILE=/data/dapo-math-17k.parquet \
#   TEST_FILE=/data/aime-2024.parquet bash examples/dapo_kl_cov_global.sh
# Extra Hydra overrides can be appended as arguments.
# PRINT_OVERRIDES=1 prints the overrides one per line instead of launching (used by the tests).
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-/path/to/Qwen2.5-7B}
TRAIN_FILE=${TRAIN_FILE:-/path/to/dapo-math-17k.parquet}
TEST_FILE=${TEST_FILE:-/path/to/aime-2024.parquet}
NNODES=${NNODES:-4}                          # [recipe] 4 nodes x 8 GPUs
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
KL_COV_RATIO=${KL_COV_RATIO:-0.002}          # [paper][recipe] 0.002 at 7B (0.0002 at 32B)
MAX_TOKEN=${MAX_TOKEN:-30720}                # [recipe] per-GPU token budget at 7B (20480 at 32B)

overrides=(
  algorithm.adv_estimator=grpo                                   # [recipe]
  algorithm.use_kl_in_reward=False                               # [recipe]
  trainer.use_v1=True                                            # [ours] verl 0.9.1's v1 trainer: its replay buffer runs the dynamic sampling
  algorithm.filter_groups.enable=True                            # [recipe] DAPO dynamic sampling: groups of equal acc dropped, refilled
  algorithm.filter_groups.metric=acc                             # [recipe]
  algorithm.filter_groups.max_num_gen_batches=10                 # [recipe] ignored by verl 0.9.1's v1 buffer (it says so)
  algorithm.filter_groups.max_inflight_gen_batches=3             # [ours] for the recipe's gen batch = 3 x train batch
  reward.reward_manager.name=dapo                                # [recipe]
  +reward.reward_kwargs.max_resp_len=8192                        # [recipe] the response length
  +reward.reward_kwargs.overlong_buffer_cfg.enable=False         # [recipe]
  +reward.reward_kwargs.overlong_buffer_cfg.len=2048             # [recipe]
  +reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0   # [recipe]
  +reward.reward_kwargs.overlong_buffer_cfg.log=False            # [ours] verl's default
  data.train_files="${TRAIN_FILE}"
  data.val_files="${TEST_FILE}"
  data.prompt_key=prompt                                         # [recipe] DAPO-Math-17k's column
  data.truncation=left                                           # [recipe]
  data.max_prompt_length=2048                                    # [recipe]
  data.max_response_length=8192                                  # [recipe]
  data.train_batch_size=256                                      # [recipe] prompts per step
  actor_rollout_ref.rollout.n=8                                  # [recipe] responses per prompt
  actor_rollout_ref.model.path="${MODEL_PATH}"
  actor_rollout_ref.model.use_remove_padding=True                # [recipe]
  actor_rollout_ref.model.enable_gradient_checkpointing=True     # [recipe]
  actor_rollout_ref.actor.strategy=fsdp2                         # [ours] kl_cov_global covers fsdp and fsdp2
  actor_rollout_ref.actor.policy_loss._target_=verl_klcov_global.config.KLCovGlobalPolicyLossConfig  # [ours]
  actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov_global    # [ours] instead of the recipe's kl_cov
  actor_rollout_ref.actor.policy_loss.kl_cov_ratio="${KL_COV_RATIO}"
  actor_rollout_ref.actor.policy_loss.ppo_kl_coef=1              # [paper][recipe]
  actor_rollout_ref.actor.loss_agg_mode=token-mean               # [recipe]
  actor_rollout_ref.actor.entropy_coeff=0                        # [recipe]
  actor_rollout_ref.actor.use_kl_loss=False                      # [recipe]
  actor_rollout_ref.actor.kl_loss_coef=0.0                       # [recipe]
  actor_rollout_ref.actor.clip_ratio_low=0.2                     # [recipe] (unused by KL-Cov, kept for parity)
  actor_rollout_ref.actor.clip_ratio_high=0.2                    # [recipe]
  actor_rollout_ref.actor.ppo_mini_batch_size=32                 # [recipe] prompts per optimizer step
  actor_rollout_ref.actor.use_dynamic_bsz=True                   # [recipe]
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu="${MAX_TOKEN}"       # [recipe]
  actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True        # [recipe]; also the prepass's layout
  actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu="${MAX_TOKEN}" # [recipe]
  actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True            # [recipe]
  actor_rollout_ref.ref.log_prob_max_token_len_per_gpu="${MAX_TOKEN}"     # [recipe]
  actor_rollout_ref.actor.optim.lr=1e-6                          # [recipe]
  actor_rollout_ref.actor.optim.weight_decay=0                   # [recipe]
  actor_rollout_ref.actor.optim.lr_scheduler_type=constant       # [recipe] warmup_style=constant
  actor_rollout_ref.actor.grad_clip=1.0                          # [recipe]
  actor_rollout_ref.actor.ulysses_sequence_parallel_size=1       # [recipe]
  actor_rollout_ref.rollout.name=vllm                            # [recipe]
  actor_rollout_ref.rollout.tensor_model_parallel_size=2         # [recipe]
  actor_rollout_ref.rollout.gpu_memory_utilization=0.85          # [recipe]
  actor_rollout_ref.rollout.max_num_batched_tokens="${MAX_TOKEN}"         # [recipe]
  actor_rollout_ref.rollout.temperature=1.0                      # [recipe]
  actor_rollout_ref.rollout.top_p=1.0                            # [recipe]
  actor_rollout_ref.rollout.top_k=-1                             # [recipe]
  actor_rollout_ref.rollout.val_kwargs.temperature=1.0           # [recipe]
  actor_rollout_ref.rollout.val_kwargs.top_p=1.0                 # [recipe]
  actor_rollout_ref.rollout.val_kwargs.do_sample=False           # [recipe]
  actor_rollout_ref.rollout.val_kwargs.n=1                       # [recipe]
  trainer.logger='["console","wandb"]'                           # [recipe]
  trainer.project_name=verl-klcov-global
  trainer.experiment_name=dapo-kl_cov_global-ratio${KL_COV_RATIO}
  trainer.n_gpus_per_node="${GPUS_PER_NODE}"
  trainer.nnodes="${NNODES}"
  trainer.val_before_train=False                                 # [recipe]
  trainer.test_freq=4                                            # [recipe]
  trainer.save_freq=32                                           # [recipe]
  trainer.total_epochs=1000                                      # [recipe]
)

if [ "${PRINT_OVERRIDES:-0}" = "1" ]; then
  printf '%s\n' "${overrides[@]}" "$@"
  exit 0
fi
HYDRA_FULL_ERROR=1 python -m verl.trainer.main_ppo "${overrides[@]}" "$@"
