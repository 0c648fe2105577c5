#!/usr/bin/env bash
# DAPO + the 80/20 method (policy gradient only on the highest-entropy tokens) with global
# (minibatch- and DP-wide) token selection, Qwen3-14B-Base.
#
# Hyperparameters follow the authors' script for Qwen3-14B (Wang et al. 2025, "Beyond the 80/20
# Rule: High-Entropy Minority Tokens Drive Effective Reinforcement Learning for LLM Reasoning",
# arXiv:2506.01939; script recipe/rlvr_with_high_entropy_tokens_only/
# run_only_top20_high_entropy_tokens_dapo_qwen3_14b.sh of Shenzhi-Wang/Beyond-the-80-20-Rule-RLVR@6f5dda6,
# a verl fork), ported to verl 0.9.1's `python -m verl.trainer.main_ppo` with only the selection changed:
#   actor_rollout_ref.actor.entropy_top_ratio=0.2 (their fork: a top-k per training micro-batch)
#   -> policy_loss.loss_mode=high_entropy_global, policy_loss.entropy_top_ratio=0.2 (this plugin:
#      the top 20% of the optimizer minibatch over all DP ranks, the paper's 1/sum|o| normaliser).
# Each value's source is noted [recipe] (from that script), [paper] (rho = 0.2 for 14B and 32B)
# or [ours].
#
# DAPO's dynamic sampling and reward, as the recipe sets them, on verl 0.9.1's main_ppo: the v1 trainer's replay
# buffer drops groups whose responses all score the same `acc` and refills them (algorithm.filter_groups), and the
# `dapo` reward manager scores them with its overlong buffer (the last 4,096 tokens before the response limit, penalty
# factor 1.0). Two differences remain: verl 0.9.1's buffer ignores
# max_num_gen_batches (it refills without a limit, and logs that it ignores it), and it streams prompts instead of
# generating a batch of 3 x the train batch (max_inflight_gen_batches=3 bounds how many train batches are in flight).
#
# Usage (GPU cluster; the plugin must be installed in the environment Ray workers use):
#   MODEL_PATH=/models/Qwen3-14B-Base TRAIN_FILE=/data/math__combined_54.4k.parquet \
#   TEST_FILE=/data/aime.parquet bash examples/dapo_high_entropy_global.sh
# Extra Hydra overrides can be appended as arguments.
# PRINT_OVERRIDES=1 prints the overrides one per line instead of launching (used by the tests).
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-/path/to/Qwen3-14B-Base}
TRAIN_FILE=${TRAIN_FILE:-/path/to/math__combined_54.4k.parquet}
TEST_FILE=${TEST_FILE:-/path/to/math__aime_repeated_32x_960.parquet}
NNODES=${NNODES:-16}                         # [recipe] 16 nodes x 8 GPUs
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
ENTROPY_TOP_RATIO=${ENTROPY_TOP_RATIO:-0.2}  # [paper][recipe] rho: the top 20% by entropy keep the loss
MAX_PROMPT=2048                              # [recipe]
MAX_RESPONSE=${MAX_RESPONSE:-20480}          # [recipe] 20k
MAX_TOKEN=$((MAX_PROMPT + MAX_RESPONSE))     # [recipe] per-GPU token budget (x SP 8 per micro-batch)

overrides=(
  algorithm.adv_estimator=grpo                                   # [recipe]
  algorithm.use_kl_in_reward=False                               # [recipe]
  trainer.use_v1=True                                            # [ours] verl 0.9.1's v1 trainer: its replay buffer runs the dynamic sampling
  algorithm.filter_groups.enable=True                            # [recipe] DAPO dynamic sampling: groups of equal acc dropped, refilled
  algorithm.filter_groups.metric=acc                             # [recipe]
  algorithm.filter_groups.max_num_gen_batches=10                 # [recipe] ignored by verl 0.9.1's v1 buffer (it says so)
  algorithm.filter_groups.max_inflight_gen_batches=3             # [ours] for the recipe's gen batch = 3 x train batch
  reward.reward_manager.name=dapo                                # [recipe]
  +reward.reward_kwargs.max_resp_len="${MAX_RESPONSE}"           # [recipe] the response length
  +reward.reward_kwargs.overlong_buffer_cfg.enable=True          # [recipe]
  +reward.reward_kwargs.overlong_buffer_cfg.len=4096             # [recipe]
  +reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0   # [recipe]
  +reward.reward_kwargs.overlong_buffer_cfg.log=False            # [ours] verl's default
  algorithm.kl_ctrl.kl_coef=0.0                                  # [recipe]
  data.train_files="${TRAIN_FILE}"
  data.val_files="${TEST_FILE}"
  data.prompt_key=prompt                                         # [recipe]
  data.truncation=left                                           # [recipe]
  data.max_prompt_length="${MAX_PROMPT}"
  data.max_response_length="${MAX_RESPONSE}"
  data.train_batch_size=512                                      # [recipe] prompts per step
  actor_rollout_ref.rollout.n=16                                 # [recipe] responses per prompt
  actor_rollout_ref.model.path="${MODEL_PATH}"
  actor_rollout_ref.model.use_remove_padding=True                # [recipe]
  actor_rollout_ref.model.enable_gradient_checkpointing=True     # [recipe]
  actor_rollout_ref.actor.strategy=fsdp2                         # [ours] high_entropy_global covers fsdp and fsdp2
  actor_rollout_ref.actor.policy_loss._target_=verl_klcov_global.config.HighEntropyGlobalPolicyLossConfig  # [ours]
  actor_rollout_ref.actor.policy_loss.loss_mode=high_entropy_global  # [ours] instead of the fork's per-micro-batch top-k
  +actor_rollout_ref.actor.policy_loss.entropy_top_ratio="${ENTROPY_TOP_RATIO}"  # [paper] "+": verl's policy_loss has no such key
  actor_rollout_ref.actor.loss_agg_mode=token-mean               # [recipe]
  actor_rollout_ref.actor.entropy_coeff=0                        # [recipe]
  actor_rollout_ref.actor.use_kl_loss=False                      # [recipe]
  actor_rollout_ref.actor.kl_loss_coef=0.0                       # [recipe]
  actor_rollout_ref.actor.clip_ratio_low=0.2                     # [recipe] DAPO's clip-higher
  actor_rollout_ref.actor.clip_ratio_high=0.28                   # [recipe]
  actor_rollout_ref.actor.clip_ratio_c=10.0                      # [recipe] dual clip
  actor_rollout_ref.actor.ppo_mini_batch_size=32                 # [recipe] prompts per optimizer step
  actor_rollout_ref.actor.use_dynamic_bsz=True                   # [recipe]
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu="${MAX_TOKEN}"       # [recipe]
  actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True        # [recipe]; also the prepass's layout
  actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu="${MAX_TOKEN}" # [recipe]
  actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True            # [recipe]
  actor_rollout_ref.ref.log_prob_max_token_len_per_gpu="${MAX_TOKEN}"     # [recipe]
  actor_rollout_ref.actor.ulysses_sequence_parallel_size=8       # [recipe]
  actor_rollout_ref.ref.ulysses_sequence_parallel_size=8         # [recipe]
  actor_rollout_ref.actor.fsdp_config.param_offload=True         # [recipe]
  actor_rollout_ref.actor.fsdp_config.optimizer_offload=True     # [recipe]
  actor_rollout_ref.ref.fsdp_config.param_offload=True           # [recipe]
  actor_rollout_ref.actor.optim.lr=1e-6                          # [recipe]
  actor_rollout_ref.actor.optim.lr_warmup_steps=10               # [recipe]
  actor_rollout_ref.actor.optim.weight_decay=0.1                 # [recipe]
  actor_rollout_ref.actor.grad_clip=1.0                          # [recipe]
  actor_rollout_ref.rollout.name=vllm                            # [recipe]
  actor_rollout_ref.rollout.tensor_model_parallel_size=4         # [recipe]
  actor_rollout_ref.rollout.gpu_memory_utilization=0.80          # [recipe]
  actor_rollout_ref.rollout.enable_chunked_prefill=True          # [recipe]
  actor_rollout_ref.rollout.max_num_batched_tokens="${MAX_TOKEN}"         # [recipe]
  actor_rollout_ref.rollout.temperature=1.0                      # [recipe]
  actor_rollout_ref.rollout.top_p=1.0                            # [recipe]
  actor_rollout_ref.rollout.top_k=-1                             # [recipe]
  actor_rollout_ref.rollout.val_kwargs.temperature=1.0           # [recipe]
  actor_rollout_ref.rollout.val_kwargs.top_p=0.7                 # [recipe]
  actor_rollout_ref.rollout.val_kwargs.top_k=-1                  # [recipe]
  actor_rollout_ref.rollout.val_kwargs.do_sample=True            # [recipe]
  actor_rollout_ref.rollout.val_kwargs.n=1                       # [recipe]
  trainer.logger='["console","wandb"]'                           # [recipe]
  trainer.project_name=verl-klcov-global
  trainer.experiment_name=dapo-high_entropy_global-rho${ENTROPY_TOP_RATIO}
  trainer.n_gpus_per_node="${GPUS_PER_NODE}"
  trainer.nnodes="${NNODES}"
  trainer.val_before_train=True                                  # [recipe]
  trainer.test_freq=5                                            # [recipe]
  trainer.save_freq=5                                            # [recipe]
  trainer.total_epochs=30                                        # [recipe]
)

if [ "${PRINT_OVERRIDES:-0}" = "1" ]; then
  printf '%s\n' "${overrides[@]}" "$@"
  exit 0
fi
HYDRA_FULL_ERROR=1 python -m verl.trainer.main_ppo "${overrides[@]}" "$@"
