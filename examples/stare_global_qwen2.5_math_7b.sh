#!/usr/bin/env bash
# GRPO + STARE (surprisal-guided token-level advantage reweighting, gated on a target entropy) with
# global (minibatch- and DP-wide) token selection, Qwen2.5-Math-7B, short CoT on DAPO-Math-17k.
#
# Hyperparameters follow the authors' script (Luo et al. 2026, "STARE: Surprisal-Guided Token-Level
# Advantage Reweighting for Policy Entropy Stability", arXiv:2606.19236; script
# recipe/STARE/scripts/run_short_cot_qwen2.5_math_7b_STARE.sh of hp-luo/STARE at bffb9e7, a verl 0.7.0
# fork), ported to verl 0.9.1's `python -m verl.trainer.main_ppo` with only the loss changed:
#   policy_loss.loss_mode=stare + actor.stare.{enabled,variant,top_p_ratio,reweight_w,reweight_m,
#   target_entropy,adaptive,alpha,w_max,m_min}
#   -> policy_loss.loss_mode=stare_global + policy_loss.stare_{variant,top_ratio,reweight_w,reweight_m,
#      target_entropy,adaptive,alpha,w_max,m_min} (this plugin; no `enabled`: the mode is the switch).
# Each value's source is noted [recipe] (from that script), [paper] (the fork's README: its 7B defaults
# P 10%, W 1.1, M 0.9, H_tgt 0.3; W 1.05 and M 0.95 recommended for 14B/32B) or [ours].
#
# Where this differs from the fork (docs/STARE.md):
# - the top-P% of each advantage sign is taken once per optimizer minibatch over all DP ranks (the
#   paper's "batch-internal" quantiles), not inside each training micro-batch on each GPU as the fork's
#   loss does (here ~2 sequences per dynamic micro-batch of 8192 tokens), and the token-mean divides by
#   the minibatch's tokens (the paper's 1/N), not by each micro-batch's;
# - the gate's entropy (verl's actor/entropy: the old policy's mean entropy over the trainer step's batch,
#   from the log-prob pass) is computed in the workers from that same pass (exact integer sums over the DP
#   group), not on the driver: it can read differently from the driver's float32 figure only within
#   about 1e-6 nats of stare_target_entropy. The fork's actor.calculate_entropy=True (its loss only logs
#   the training forward's entropy) is not needed and left out;
# - loss_agg_mode: token-mean (the recipe's). The plugin refuses token-sum and seq-mean-token-sum (the
#   gate's entropy would be a sum) and seq-mean-token-sum-norm without actor.loss_scale_factor;
#   algorithm.rollout_correction.bypass_mode=True is refused (no log-prob pass, so no gate entropy);
# - the gate and W/M are saved with the optimizer in verl's checkpoints ('optimizer' is in save_contents
#   below), so a resumed run continues them; the fork restarts W and M from the config on resume.
#
# DAPO's dynamic sampling, as the recipe sets it, on verl 0.9.1's main_ppo: the v1 trainer's replay buffer drops
# groups whose responses all score the same `acc` and refills them (algorithm.filter_groups). verl 0.9.1's buffer
# ignores max_num_gen_batches (it refills without a limit, and logs that it ignores it) and streams prompts instead
# of generating 3 x the train batch (max_inflight_gen_batches=3 bounds how many train batches are in flight).
# Left out: the fork's `stare` reward manager with its own math scorer (data_source Short_CoT) lives in its
# recipe/STARE/main_stare.py; verl's default reward (by data_source, e.g. math_dapo, which reports `acc`) is used.
#
# Usage (GPU cluster; the plugin must be installed in the environment Ray workers use):
#   MODEL_PATH=/models/Qwen2.5-Math-7B TRAIN_FILE=/data/dapo-math-17k.parquet \
#   TEST_FILE=/data/aime-2024.parquet bash examples/stare_global_qwen2.5_math_7b.sh
# Extra Hydra overrides can be appended as arguments (e.g. the variant C2:
#   actor_rollout_ref.actor.policy_loss.stare_variant=C2).
# PRINT_OVERRIDES=1 prints the overrides one per line instead of launching (used by the tests).
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-/path/to/Qwen2.5-Math-7B}
TRAIN_FILE=${TRAIN_FILE:-/path/to/dapo-math-17k.parquet}
TEST_FILE=${TEST_FILE:-/path/to/aime-2024.parquet}   # [recipe] AIME24 and AIME25 (a list is fine)
NNODES=${NNODES:-2}                          # [recipe] 2 nodes x 8 GPUs
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
STARE_VARIANT=${STARE_VARIANT:-O1}           # [paper][recipe] O1: W on L+ only; C2: also M on L-
STARE_REWEIGHT_W=${STARE_REWEIGHT_W:-1.1}    # [paper][recipe] 1.05 for 14B/32B
STARE_REWEIGHT_M=${STARE_REWEIGHT_M:-0.9}    # [paper][recipe] 0.95 for 14B/32B (used by C2 only)
MAX_PROMPT=1024                              # [recipe]
MAX_RESPONSE=3072                            # [recipe]
ACTOR_TOKEN=$(((MAX_PROMPT + MAX_RESPONSE) * 2))   # [recipe] 8192 per GPU, training micro-batches
INFER_TOKEN=$(((MAX_PROMPT + MAX_RESPONSE) * 3))   # [recipe] 12288 per GPU, log-prob passes (and the prepass)

overrides=(
  algorithm.adv_estimator=grpo                                   # [recipe]
  algorithm.use_kl_in_reward=False                               # [recipe]
  trainer.use_v1=True                                            # [ours] verl 0.9.1's v1 trainer: its replay buffer runs the dynamic sampling
  algorithm.filter_groups.enable=True                            # [recipe] DAPO dynamic sampling: groups of equal acc dropped, refilled
  algorithm.filter_groups.metric=acc                             # [recipe]
  algorithm.filter_groups.max_num_gen_batches=10                 # [recipe] ignored by verl 0.9.1's v1 buffer (it says so)
  algorithm.filter_groups.max_inflight_gen_batches=3             # [ours] for the recipe's gen batch = 3 x train batch
  algorithm.kl_ctrl.kl_coef=0.0                                  # [recipe]
  data.train_files="${TRAIN_FILE}"
  data.val_files="${TEST_FILE}"
  data.prompt_key=prompt                                         # [recipe]
  data.truncation=left                                           # [recipe]
  data.max_prompt_length="${MAX_PROMPT}"
  data.max_response_length="${MAX_RESPONSE}"
  data.train_batch_size=64                                       # [recipe] prompts per step
  actor_rollout_ref.rollout.n=8                                  # [recipe] responses per prompt
  actor_rollout_ref.model.path="${MODEL_PATH}"
  actor_rollout_ref.model.use_remove_padding=True                # [recipe]
  actor_rollout_ref.model.enable_gradient_checkpointing=True     # [recipe]
  actor_rollout_ref.actor.strategy=fsdp2                         # [ours] stare_global covers fsdp and fsdp2
  actor_rollout_ref.actor.policy_loss._target_=verl_klcov_global.config.StareGlobalPolicyLossConfig  # [ours]
  actor_rollout_ref.actor.policy_loss.loss_mode=stare_global     # [ours] instead of the fork's per-micro-batch stare
  # "+": verl's policy_loss has none of these keys (--config-name=stare_global declares them all)
  +actor_rollout_ref.actor.policy_loss.stare_variant="${STARE_VARIANT}"
  +actor_rollout_ref.actor.policy_loss.stare_top_ratio=0.1       # [paper][recipe] P: top 10% by surprisal of each sign
  +actor_rollout_ref.actor.policy_loss.stare_reweight_w="${STARE_REWEIGHT_W}"
  +actor_rollout_ref.actor.policy_loss.stare_reweight_m="${STARE_REWEIGHT_M}"
  +actor_rollout_ref.actor.policy_loss.stare_target_entropy=0.3  # [paper][recipe] H_tgt, nats per token
  +actor_rollout_ref.actor.policy_loss.stare_adaptive=False      # [paper][recipe] fixed W and M
  +actor_rollout_ref.actor.policy_loss.stare_alpha=0.01          # [recipe] used only with stare_adaptive
  +actor_rollout_ref.actor.policy_loss.stare_w_max=1.5           # [recipe]
  +actor_rollout_ref.actor.policy_loss.stare_m_min=0.5           # [recipe]
  actor_rollout_ref.actor.loss_agg_mode=token-mean               # [recipe]; also how the gate aggregates the entropy
  actor_rollout_ref.actor.entropy_coeff=0                        # [recipe]
  actor_rollout_ref.actor.use_kl_loss=False                      # [recipe]
  actor_rollout_ref.actor.kl_loss_coef=0.0                       # [recipe]
  actor_rollout_ref.actor.clip_ratio_low=0.2                     # [recipe] DAPO's clip-higher
  actor_rollout_ref.actor.clip_ratio_high=0.28                   # [recipe]
  actor_rollout_ref.actor.clip_ratio_c=10.0                      # [recipe] dual clip
  actor_rollout_ref.actor.ppo_mini_batch_size=64                 # [recipe] = the batch: one optimizer step per step
  actor_rollout_ref.actor.use_dynamic_bsz=True                   # [recipe]
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu="${ACTOR_TOKEN}"     # [recipe]
  actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True        # [recipe]; also the prepass's layout
  actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu="${INFER_TOKEN}" # [recipe]
  actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True            # [recipe]
  actor_rollout_ref.ref.log_prob_max_token_len_per_gpu="${INFER_TOKEN}"     # [recipe]
  actor_rollout_ref.actor.ulysses_sequence_parallel_size=1       # [recipe]
  actor_rollout_ref.actor.fsdp_config.param_offload=False        # [recipe]
  actor_rollout_ref.actor.fsdp_config.optimizer_offload=False    # [recipe]
  actor_rollout_ref.actor.fsdp_config.dtype=float16              # [recipe]
  actor_rollout_ref.ref.fsdp_config.dtype=float16                # [recipe]
  actor_rollout_ref.actor.optim.lr=1e-6                          # [recipe]
  actor_rollout_ref.actor.grad_clip=1.0                          # [recipe]
  actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]  # [recipe]; 'optimizer' carries STARE's state
  actor_rollout_ref.rollout.name=vllm                            # [recipe]
  actor_rollout_ref.rollout.mode=async                           # [recipe]
  actor_rollout_ref.rollout.dtype=float16                        # [recipe]
  actor_rollout_ref.rollout.tensor_model_parallel_size=1         # [recipe]
  actor_rollout_ref.rollout.gpu_memory_utilization=0.60          # [recipe]
  actor_rollout_ref.rollout.max_num_batched_tokens=75776         # [recipe]
  actor_rollout_ref.rollout.calculate_log_probs=True             # [recipe]
  actor_rollout_ref.rollout.agent.num_workers=8                  # [recipe]
  actor_rollout_ref.rollout.temperature=1.0                      # [recipe]
  actor_rollout_ref.rollout.top_p=1.0                            # [recipe]
  actor_rollout_ref.rollout.top_k=-1                             # [recipe]
  actor_rollout_ref.rollout.val_kwargs.temperature=1.0           # [recipe]
  actor_rollout_ref.rollout.val_kwargs.top_p=0.7                 # [recipe]
  actor_rollout_ref.rollout.val_kwargs.top_k=-1                  # [recipe]
  actor_rollout_ref.rollout.val_kwargs.do_sample=True            # [recipe]
  actor_rollout_ref.rollout.val_kwargs.n=32                      # [recipe] avg@32
  trainer.logger='["console","wandb"]'                           # [recipe]
  trainer.project_name=verl-klcov-global
  trainer.experiment_name=stare_global-${STARE_VARIANT}-qwen2.5-math-7b
  trainer.n_gpus_per_node="${GPUS_PER_NODE}"
  trainer.nnodes="${NNODES}"
  trainer.val_before_train=False                                 # [recipe]
  trainer.test_freq=10                                           # [recipe]
  trainer.save_freq=10                                           # [recipe]
  trainer.total_epochs=1000                                      # [recipe]
  trainer.resume_mode=auto                                       # [recipe]
  trainer.log_val_generations=10                                 # [recipe]
)

if [ "${PRINT_OVERRIDES:-0}" = "1" ]; then
  printf '%s\n' "${overrides[@]}" "$@"
  exit 0
fi
HYDRA_FULL_ERROR=1 python -m verl.trainer.main_ppo "${overrides[@]}" "$@"
