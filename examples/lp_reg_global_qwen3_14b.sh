#!/usr/bin/env bash
# GRPO + Lp-Reg (low-probability regularisation towards a min-p-filtered proxy of the old policy) with
# global (minibatch- and DP-wide) token selection, Qwen3-14B-Base on DAPO-Math-17k.
#
# Hyperparameters follow the authors' script (Huang et al. 2025, "Low-probability Tokens Sustain Exploration
# in Reinforcement Learning with Verifiable Reward", arXiv:2510.03222; script
# recipe/lp_reg/Qwen3_14b_lp_reg_onpolicy_64gpu.sh of CarlanLark/Lp-Reg-dev at 33b27e2, a verl fork run
# through its recipe.dapo.main_dapo), ported to verl 0.9.1's `python -m verl.trainer.main_ppo` with only the
# loss changed:
#   actor.loss_mode=lp_reg + actor.{logp_neg_k_percent,logp_pos_k_percent,minp_p_threshold,minp_old_log_prob,
#   kl_type,ppo_kl_coef}
#   -> policy_loss.loss_mode=lp_reg_global + policy_loss.lp_reg_{neg_ratio,pos_ratio,min_p,kl_coef}
#      (this plugin; beta is lp_reg_kl_coef, not verl's ppo_kl_coef, which verl's YAML sets to 0.1; the proxy
#      is always the old policy's, computed in the log-prob pass, as minp_old_log_prob=True; the KL is always
#      low_var_kl, the script's kl_type).
# Each value's source is noted [recipe] (from that script) or [ours].
#
# Where this differs from the fork (docs/LP_REG.md):
# - the bottom-rho% of the negative-advantage tokens is taken once per optimizer minibatch over all DP ranks,
#   not inside each loss call: with the recipe's dynamic batching (30,720 tokens per GPU, 64 GPUs) their
#   rule regularises nothing in a micro-batch with fewer than 200 negative-advantage tokens (`k > 1`);
# - a quota of 1 is taken (their code needs k > 1);
# - tokens outside the proxy's min-p support get log pi_proxy = -inf (theirs: the logit -1e4): either way
#   they are never regularised;
# - verl's dual-clip surrogate on the other tokens (clip_ratio_c=10 below, the script's): theirs has no dual
#   clip; the two agree wherever the ratio is at most 10;
# - algorithm.rollout_correction.bypass_mode=True, the v1 async trainers and use_fused_kernels=True are
#   refused (the proxy needs the actor's log-prob pass and its logits).
#
# The recipe's `dapo` reward manager with its overlong buffer off (512 tokens, factor 1.0), as the script sets it;
# its dynamic sampling is off there too (filter_groups.enable=False), so it is left at verl's default. The
# script's `use_clip` and `dynamic_coef` (1.0) are fork-only keys with no counterpart here.
#
# Usage (GPU cluster; the plugin must be installed in the environment Ray workers use):
#   MODEL_PATH=/models/Qwen3-14B-Base TRAIN_FILE=/data/dapo-math-17k.parquet \
#   TEST_FILE=/data/test.parquet bash examples/lp_reg_global_qwen3_14b.sh
# Extra Hydra overrides can be appended as arguments (e.g. Qwen2.5-32B's rho-:
#   actor_rollout_ref.actor.policy_loss.lp_reg_neg_ratio=0.005).
# PRINT_OVERRIDES=1 prints the overrides one per line instead of launching (used by the tests).
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-/path/to/Qwen3-14B-Base}
TRAIN_FILE=${TRAIN_FILE:-/path/to/dapo-math-17k.parquet}
TEST_FILE=${TEST_FILE:-/path/to/test.parquet}
NNODES=${NNODES:-8}                          # [recipe] 8 nodes x 8 GPUs
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MAX_PROMPT=$((1024 * 2))                     # [recipe]
MAX_RESPONSE=$((1024 * 8))                   # [recipe]
MAX_TOKEN=$((1024 * 30))                     # [recipe] per GPU: training micro-batches and log-prob passes

overrides=(
  algorithm.adv_estimator=grpo                                   # [recipe]
  algorithm.use_kl_in_reward=False                               # [recipe]
  reward.reward_manager.name=dapo                                # [recipe]
  +reward.reward_kwargs.max_resp_len="${MAX_RESPONSE}"           # [recipe] the response length
  +reward.reward_kwargs.overlong_buffer_cfg.enable=False         # [recipe]
  +reward.reward_kwargs.overlong_buffer_cfg.len=512              # [recipe]
  +reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0   # [recipe]
  +reward.reward_kwargs.overlong_buffer_cfg.log=False            # [ours] verl's default
  algorithm.kl_ctrl.kl_coef=0.0                                  # [recipe]
  data.train_files="${TRAIN_FILE}"
  data.val_files="${TEST_FILE}"
  data.prompt_key=prompt                                         # [recipe]
  data.truncation=left                                           # [recipe]
  data.filter_overlong_prompts=False                             # [recipe]
  data.max_prompt_length="${MAX_PROMPT}"
  data.max_response_length="${MAX_RESPONSE}"
  data.train_batch_size=256                                      # [recipe] prompts per step
  data.return_raw_chat=True                                      # [recipe]
  actor_rollout_ref.rollout.n=8                                  # [recipe] responses per prompt
  actor_rollout_ref.model.path="${MODEL_PATH}"
  actor_rollout_ref.model.use_remove_padding=True                # [recipe]
  actor_rollout_ref.model.enable_gradient_checkpointing=True     # [recipe]
  actor_rollout_ref.actor.policy_loss._target_=verl_klcov_global.config.LpRegGlobalPolicyLossConfig  # [ours]
  actor_rollout_ref.actor.policy_loss.loss_mode=lp_reg_global    # [ours] instead of the fork's per-call lp_reg
  # "+": verl's policy_loss has none of these keys (--config-name=lp_reg_global declares them all)
  +actor_rollout_ref.actor.policy_loss.lp_reg_neg_ratio=0.01     # [recipe] logp_neg_k_percent (0.005 for 32B)
  +actor_rollout_ref.actor.policy_loss.lp_reg_pos_ratio=0.0      # [recipe] logp_pos_k_percent: off
  +actor_rollout_ref.actor.policy_loss.lp_reg_min_p=0.02         # [recipe] minp_p_threshold
  +actor_rollout_ref.actor.policy_loss.lp_reg_kl_coef=1.0        # [recipe] beta (the script's ppo_kl_coef=1)
  actor_rollout_ref.actor.loss_agg_mode=token-mean               # [recipe]
  actor_rollout_ref.actor.entropy_coeff=0                        # [recipe]
  actor_rollout_ref.actor.use_kl_loss=False                      # [recipe]
  actor_rollout_ref.actor.kl_loss_coef=0.0                       # [recipe]
  actor_rollout_ref.actor.clip_ratio_low=1.0                     # [recipe]
  actor_rollout_ref.actor.clip_ratio_high=9.0                    # [recipe]
  actor_rollout_ref.actor.clip_ratio_c=10.0                      # [recipe]
  actor_rollout_ref.actor.ppo_mini_batch_size=256                # [recipe] = the batch: one optimizer step per step
  actor_rollout_ref.actor.use_dynamic_bsz=True                   # [recipe]
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu="${MAX_TOKEN}"          # [recipe]
  actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True        # [recipe]; also the prepass's layout
  actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu="${MAX_TOKEN}"   # [recipe]
  actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True            # [recipe]
  actor_rollout_ref.ref.log_prob_max_token_len_per_gpu="${MAX_TOKEN}"       # [recipe]
  actor_rollout_ref.actor.ulysses_sequence_parallel_size=1       # [recipe]
  actor_rollout_ref.actor.fsdp_config.param_offload=False        # [recipe]
  actor_rollout_ref.actor.fsdp_config.optimizer_offload=False    # [recipe]
  actor_rollout_ref.actor.optim.lr=1e-6                          # [recipe]
  actor_rollout_ref.actor.optim.weight_decay=0                   # [recipe]
  actor_rollout_ref.actor.grad_clip=1.0                          # [recipe]
  actor_rollout_ref.rollout.name=vllm                            # [recipe]
  actor_rollout_ref.rollout.gpu_memory_utilization=0.85          # [recipe]
  actor_rollout_ref.rollout.tensor_model_parallel_size=1         # [recipe]
  actor_rollout_ref.rollout.enable_chunked_prefill=True          # [recipe]
  actor_rollout_ref.rollout.max_num_batched_tokens="${MAX_TOKEN}"           # [recipe]
  actor_rollout_ref.rollout.temperature=1.0                      # [recipe]
  actor_rollout_ref.rollout.top_p=1.0                            # [recipe]
  actor_rollout_ref.rollout.top_k=-1                             # [recipe]
  actor_rollout_ref.rollout.val_kwargs.temperature=1.0           # [recipe]
  actor_rollout_ref.rollout.val_kwargs.top_p=1.0                 # [recipe]
  actor_rollout_ref.rollout.val_kwargs.top_k=-1                  # [recipe]
  actor_rollout_ref.rollout.val_kwargs.do_sample=False           # [recipe]
  actor_rollout_ref.rollout.val_kwargs.n=1                       # [recipe]
  trainer.logger='["console","wandb"]'                           # [recipe]
  trainer.project_name=verl-klcov-global
  trainer.experiment_name=lp_reg_global-qwen3-14b
  trainer.n_gpus_per_node="${GPUS_PER_NODE}"
  trainer.nnodes="${NNODES}"
  trainer.val_before_train=False                                 # [recipe]
  trainer.test_freq=8                                            # [recipe]
  trainer.save_freq=64                                           # [recipe]
  trainer.total_epochs=15                                        # [recipe]
  trainer.resume_mode=disable                                    # [recipe]
)

if [ "${PRINT_OVERRIDES:-0}" = "1" ]; then
  printf '%s\n' "${overrides[@]}" "$@"
  exit 0
fi
HYDRA_FULL_ERROR=1 python -m verl.trainer.main_ppo "${overrides[@]}" "$@"
