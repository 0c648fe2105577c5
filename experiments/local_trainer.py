"""verl 0.9.1's PPO trainer loop (``RayPPOTrainer.fit``) run in-process on CPU, reproducibly.

Why: a ``python -m verl.trainer.main_ppo`` run on a 2-core CPU spends ~2 minutes starting Ray, its
services and one Python process per worker, and seconds training the tiny model. Comparing many
configurations (loss modes x micro-batch sizes x DP sizes) that way is too slow, so this module
keeps everything that decides what a run computes and drops only the process plumbing:

* verl's own driver loop, unmodified: ``RayPPOTrainer.fit`` of the legacy trainer
  (``trainer/ppo/ray_trainer.py`` ~1405): seeded dataloader (``data.seed``), uid, repeat,
  ``_balance_batch``, old log-probs, GRPO advantages on the driver, ``_update_actor`` (minibatches,
  epochs, micro-batches in the worker), verl's metric reduction;
* verl's own ``ActorRolloutRefWorker(role="actor")`` with its FSDP2 engine, built in this process
  (world size 1) or in each of ``world_size`` gloo processes (:func:`run_spawned`);
* the plugin exactly as in production: its hook wraps the engine's ``train_batch``.

Replaced, because they only move data between processes or generate text:

* Ray's worker group -> :class:`LocalWorkerGroup`: the worker methods the legacy trainer calls
  (``compute_log_prob``, ``update_actor``) with verl's own split / concat of the batch
  (``single_controller/base/decorator.py``); at world size W every process runs the same driver
  loop (SPMD: it is deterministic) and the outputs are all-gathered over gloo;
* the agent loop, rollout servers and reward workers -> :class:`RandomRollout`: reproducible random
  responses (:mod:`.random_responses`, keyed by weight version and sample index like verl's
  ``det-<priority>`` request ids) in the agent loop's output layout, scored by a rule reward;
* the checkpoint engine -> :class:`WeightSync`: records the actor's full parameter vector at every
  weight version (the rollout ignores weights anyway);
* the tracking logger -> :class:`MetricsRecorder`, which keeps every step's metrics dict.

Targets verl 0.9.1 (``RayPPOTrainer.__init__/fit``, ``ActorRolloutRefWorker``, decorator helpers);
a moved seam fails loudly (a missing attribute or a changed signature).
"""

from __future__ import annotations

import contextlib
import os
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import torch

from verl_klcov_global.lab import cpu as _cpu
from . import random_responses

#: Loss modes a run may use: verl's own and the plugin's.
LOSS_MODES = ("vanilla", "kl_cov", "kl_cov_global", "clip_cov", "clip_cov_global", "high_entropy_per_micro_batch",
              "high_entropy_global", "stare_global", "lp_reg_global")
#: ``stare_global``'s config class (its knobs are not keys of verl's ``PolicyLossConfig``).
STARE_CONFIG = "verl_klcov_global.config.StareGlobalPolicyLossConfig"
#: The high-entropy modes and the ``policy_loss`` config class each needs (``entropy_top_ratio`` is not a key of
#: verl's ``PolicyLossConfig``). ``high_entropy_per_micro_batch`` is the authors' rule, the lab's comparator:
#: registered in this process by :func:`run_trainer`, fed each micro-batch's entropy by the lab's loss function.
HIGH_ENTROPY_CONFIGS = {
    "high_entropy_global": "verl_klcov_global.config.HighEntropyGlobalPolicyLossConfig",
    "high_entropy_per_micro_batch": "verl_klcov_global.methods.high_entropy.authors.HighEntropyPerMicroBatchPolicyLossConfig",
}


@dataclass(frozen=True)
class RunConfig:
    """One trainer run: what varies between the runs compared, and the shared sizes.

    ``prompts_per_step x responses_per_prompt`` sequences per trainer step, split into minibatches of
    ``mini_batch_prompts x responses_per_prompt`` (one optimizer step each) for ``ppo_epochs`` epochs.
    """

    loss_mode: str = "vanilla"
    micro_batch_size: int = 4          # actor.ppo_micro_batch_size_per_gpu
    world_size: int = 1                # data-parallel FSDP ranks
    steps: int = 3
    prompts_per_step: int = 4
    responses_per_prompt: int = 4
    mini_batch_prompts: int = 2
    ppo_epochs: int = 2
    max_prompt_length: int = 32
    max_response_length: int = 24
    # SGD, not verl's default AdamW: AdamW divides by sqrt(v), which blows the float noise of near-zero
    # gradients up to ~lr-sized parameter differences (vanilla's floor ~50x higher here), and a discrete
    # selection computed on parameters that noisy can flip a near-tie (see experiments.trajectory).
    optimizer: str = "SGD"             # actor.optim.optimizer (torch.optim)
    lr: float = 0.05
    seed: int = 1
    kl_cov_ratio: float = 0.05
    ppo_kl_coef: float = 1.0
    clip_cov_ratio: float = 0.02
    clip_cov_lb: float = 0.3
    clip_cov_ub: float = 5.0
    entropy_top_ratio: float = 0.2
    # The entropy controller of a global mode (None: off); the bounds None: the mode's config-class defaults.
    entropy_target: Optional[float] = None
    entropy_control_ki: float = 1.0   # the plugin's defaults (the floor law)
    entropy_control_kp: float = 10.0
    entropy_control_min_ratio: Optional[float] = None
    entropy_control_max_ratio: Optional[float] = None
    entropy_control_horizon: float = 8.0
    entropy_control_window: int = 4
    entropy_control_hysteresis: float = 0.1
    # A global mode's prepass_layout ("infer", the plugin's default, is not written into the config).
    prepass_layout: str = "infer"
    # rollout.log_prob_micro_batch_size_per_gpu: the micro-batch size of verl's log-prob pass (old_log_probs, the
    # logged entropy) and of the infer-layout prepass. None: LOG_PROB_MICRO_BATCH_SIZE, the studies' setting (left out
    # of config_fields, so their JSON and resume checks are unchanged). The tests that compare micro-batch sizes set
    # it to micro_batch_size: then the first optimizer step's training forward is the pass's computation, and KL-Cov's
    # log pi - log pi_old is exactly 0 there on every CPU (with another company it is the sign of float noise on
    # CPUs whose rows' last bits follow their micro-batch company; see the tests' docstrings).
    log_prob_micro_batch_size: Optional[int] = None
    # stare_global's knobs other than its config class's defaults, as (key, value) pairs, e.g.
    # (("stare_target_entropy", 2.0),); left out of config_fields while empty, as the studies before STARE wrote it.
    stare_knobs: tuple = ()
    # lp_reg_global's knobs, as (key, value) pairs; left out of config_fields while empty.
    lp_reg_knobs: tuple = ()

    def label(self) -> str:
        target = "" if self.entropy_target is None else f" target={self.entropy_target:g}"
        layout = "" if self.prepass_layout == "infer" else f" layout={self.prepass_layout}"
        log_prob = "" if self.log_prob_micro_batch_size is None else f" log_prob_mbs={self.log_prob_micro_batch_size}"
        return f"{self.loss_mode}{target}{layout} mbs={self.micro_batch_size}{log_prob} dp={self.world_size}"

    def log_prob_micro_batch(self) -> int:
        """The log-prob pass's micro-batch size per rank (:data:`LOG_PROB_MICRO_BATCH_SIZE` unless set)."""
        return LOG_PROB_MICRO_BATCH_SIZE if self.log_prob_micro_batch_size is None else self.log_prob_micro_batch_size


#: verl's log-prob pass micro-batch size per rank in every run that does not set its own (the studies' runs).
LOG_PROB_MICRO_BATCH_SIZE = 4


def config_fields(run: RunConfig) -> dict:
    """``asdict(run)`` without ``log_prob_micro_batch_size`` while it is None: what the studies write into their JSON
    and compare on resume, as before the field existed."""
    fields = asdict(run)
    if fields["log_prob_micro_batch_size"] is None:
        del fields["log_prob_micro_batch_size"]
    if not fields["stare_knobs"]:
        del fields["stare_knobs"]
    if not fields["lp_reg_knobs"]:
        del fields["lp_reg_knobs"]
    return fields


@dataclass
class RunResult:
    """Per trainer step (1..steps): verl's logged metrics; per weight version (0..steps): parameters."""

    config: RunConfig
    metrics: list[dict[str, float]] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)   # float64, full vector, sorted HF keys (or LatestWeights)
    rollout_digest: list[str] = field(default_factory=list)    # per step: hash of the batch's tokens
    rollout_figures: list[dict[str, float]] = field(default_factory=list)  # per step, if the rollout records any


def write_dataset(path: str, n_prompts: int, data_source: str = "trajectory_cpu") -> str:
    """A parquet file of ``n_prompts`` chat prompts in verl's RL dataset format."""
    import pandas as pd

    rows = [
        {
            "data_source": data_source,
            "prompt": [{"role": "user", "content": f"What is {i} + {i + 1}?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i + 1)},
            "extra_info": {"index": i, "split": "train"},
        }
        for i in range(n_prompts)
    ]
    pd.DataFrame(rows).to_parquet(path)
    return path


def trainer_overrides(run: RunConfig, *, model_path: str, train_file: str, out_dir: str) -> list[str]:
    """Hydra overrides of verl's ``ppo_trainer`` config for ``run`` (legacy trainer, GRPO, fp32, sdpa)."""
    if run.loss_mode not in LOSS_MODES:
        raise ValueError(f"loss_mode must be one of {LOSS_MODES}, got {run.loss_mode!r}")
    if run.log_prob_micro_batch() < 1:
        raise ValueError(f"{run.label()}: log_prob_micro_batch_size must be a positive number of rows")
    mini = run.mini_batch_prompts
    if run.prompts_per_step % mini or (mini * run.responses_per_prompt) % (run.world_size * run.micro_batch_size):
        raise ValueError(f"{run.label()}: prompts_per_step must be a multiple of mini_batch_prompts and a minibatch "
                         "(mini_batch_prompts x responses_per_prompt) a multiple of world_size x micro_batch_size")
    policy = "actor_rollout_ref.actor.policy_loss"
    return [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={train_file}",
        f"data.val_files={train_file}",
        f"data.train_batch_size={run.prompts_per_step}",
        f"data.max_prompt_length={run.max_prompt_length}",
        f"data.max_response_length={run.max_response_length}",
        "data.dataloader_num_workers=0",
        f"data.seed={run.seed}",
        f"actor_rollout_ref.model.path={model_path}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={run.micro_batch_size}",
        f"actor_rollout_ref.actor.ppo_epochs={run.ppo_epochs}",
        f"actor_rollout_ref.actor.optim.optimizer={run.optimizer}",
        f"actor_rollout_ref.actor.optim.lr={run.lr}",
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        f"{policy}.loss_mode={run.loss_mode}",
        f"{policy}.kl_cov_ratio={run.kl_cov_ratio}",
        *([] if run.loss_mode == "lp_reg_global" else [f"{policy}.ppo_kl_coef={run.ppo_kl_coef}"]),  # Lp-Reg: its own
        f"{policy}.clip_cov_ratio={run.clip_cov_ratio}",
        f"{policy}.clip_cov_lb={run.clip_cov_lb}",
        f"{policy}.clip_cov_ub={run.clip_cov_ub}",
        *high_entropy_overrides(run),
        *stare_overrides(run),
        *lp_reg_overrides(run),
        *controller_overrides(run),
        *layout_overrides(run),
        f"actor_rollout_ref.rollout.n={run.responses_per_prompt}",
        "actor_rollout_ref.rollout.full_determinism=True",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={run.log_prob_micro_batch()}",
        "actor_rollout_ref.rollout.calculate_log_probs=False",
        f"actor_rollout_ref.rollout.seed={run.seed}",
        "trainer.use_v1=False",
        f"trainer.n_gpus_per_node={run.world_size}",
        "trainer.nnodes=1",
        "trainer.device=cpu",
        f"trainer.total_training_steps={run.steps}",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={os.path.join(out_dir, 'checkpoints')}",
    ]


#: The plugin's config class of each global mode: the entropy controller's knobs are keys of these only.
GLOBAL_CONFIGS = {
    "kl_cov_global": "verl_klcov_global.config.KLCovGlobalPolicyLossConfig",
    "clip_cov_global": "verl_klcov_global.config.ClipCovGlobalPolicyLossConfig",
    "high_entropy_global": HIGH_ENTROPY_CONFIGS["high_entropy_global"],
    "stare_global": STARE_CONFIG,
    "lp_reg_global": "verl_klcov_global.config.LpRegGlobalPolicyLossConfig",
}


def controller_overrides(run: RunConfig) -> list[str]:
    """The entropy controller's knobs of a global mode's run (none when ``entropy_target`` is None), with the
    mode's config class (``high_entropy_overrides`` sets it already for ``high_entropy_global``)."""
    if run.entropy_target is None:
        return []
    if run.loss_mode not in GLOBAL_CONFIGS or run.loss_mode in ("stare_global", "lp_reg_global"):
        raise ValueError(f"{run.label()}: entropy_target needs a global loss mode with the entropy controller "
                         f"({sorted(set(GLOBAL_CONFIGS) - {'stare_global', 'lp_reg_global'})}; stare_global has its "
                         "own gate, lp_reg_global none)")
    policy = "actor_rollout_ref.actor.policy_loss"
    out = [] if run.loss_mode in HIGH_ENTROPY_CONFIGS else [f"{policy}._target_={GLOBAL_CONFIGS[run.loss_mode]}"]
    knobs = {"entropy_target": run.entropy_target, "entropy_control_ki": run.entropy_control_ki,
             "entropy_control_kp": run.entropy_control_kp, "entropy_control_min_ratio": run.entropy_control_min_ratio,
             "entropy_control_max_ratio": run.entropy_control_max_ratio,
             "entropy_control_horizon": run.entropy_control_horizon,
             "entropy_control_window": run.entropy_control_window,
             "entropy_control_hysteresis": run.entropy_control_hysteresis}
    return out + [f"+{policy}.{key}={value!r}" for key, value in knobs.items() if value is not None]


def layout_overrides(run: RunConfig) -> list[str]:
    """``prepass_layout`` of a global mode's run, with the mode's config class where no other override sets it
    (none for the default ``infer``)."""
    if run.prepass_layout == "infer":
        return []
    if run.loss_mode not in GLOBAL_CONFIGS:
        raise ValueError(f"{run.label()}: prepass_layout needs a global loss mode ({sorted(GLOBAL_CONFIGS)})")
    policy = "actor_rollout_ref.actor.policy_loss"
    has_class = run.loss_mode in HIGH_ENTROPY_CONFIGS or run.loss_mode in ("stare_global", "lp_reg_global") or \
        run.entropy_target is not None
    out = [] if has_class else [f"{policy}._target_={GLOBAL_CONFIGS[run.loss_mode]}"]
    return out + [f"+{policy}.prepass_layout={run.prepass_layout}"]


def stare_overrides(run: RunConfig) -> list[str]:
    """``stare_global``'s config class and the knobs of ``run.stare_knobs`` (none for the other modes)."""
    if run.loss_mode != "stare_global":
        if run.stare_knobs:
            raise ValueError(f"{run.label()}: stare_knobs need loss_mode=stare_global")
        return []
    policy = "actor_rollout_ref.actor.policy_loss"
    return [f"{policy}._target_={STARE_CONFIG}"] + [f"+{policy}.{key}={value!r}" for key, value in run.stare_knobs]


def lp_reg_overrides(run: RunConfig) -> list[str]:
    """``lp_reg_global``'s config class and the knobs of ``run.lp_reg_knobs`` (none for the other modes)."""
    if run.loss_mode != "lp_reg_global":
        if run.lp_reg_knobs:
            raise ValueError(f"{run.label()}: lp_reg_knobs need loss_mode=lp_reg_global")
        return []
    policy = "actor_rollout_ref.actor.policy_loss"
    return [f"{policy}._target_={GLOBAL_CONFIGS['lp_reg_global']}"] + [
        f"+{policy}.{key}={value!r}" for key, value in run.lp_reg_knobs]


def high_entropy_overrides(run: RunConfig) -> list[str]:
    """The config class and ``entropy_top_ratio`` of a high-entropy mode (none for the other modes); the
    authors' rule also needs the training forward's entropy (verl's ``actor.calculate_entropy``)."""
    if run.loss_mode not in HIGH_ENTROPY_CONFIGS:
        return []
    policy = "actor_rollout_ref.actor.policy_loss"
    out = [f"{policy}._target_={HIGH_ENTROPY_CONFIGS[run.loss_mode]}", f"+{policy}.entropy_top_ratio={run.entropy_top_ratio}"]
    if run.loss_mode != "high_entropy_global":
        out.append("actor_rollout_ref.actor.calculate_entropy=True")
    return out


#: Overrides that differ between the runs compared: applied to a cached composition of the others
#: (Hydra's compose takes ~2 s a call on the 2-core machine; a run of the tiny model takes a few).
PER_RUN_KEYS = ("actor_rollout_ref.actor.policy_loss.loss_mode", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                "actor_rollout_ref.actor.ppo_mini_batch_size", "trainer.n_gpus_per_node",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu")
_COMPOSED: dict = {}


def compose_config(overrides: Sequence[str]):
    """verl's ``ppo_trainer`` config composed by Hydra, as ``main_ppo`` gets it, validated like ``main_ppo``."""
    import copy

    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    fixed = tuple(o for o in overrides if o.split("=", 1)[0] not in PER_RUN_KEYS)
    if fixed not in _COMPOSED:
        GlobalHydra.instance().clear()
        with initialize_config_module(config_module="verl.trainer.config", version_base=None):
            _COMPOSED[fixed] = compose(config_name="ppo_trainer", overrides=list(fixed))
    config = copy.deepcopy(_COMPOSED[fixed])
    for override in overrides:
        key, value = override.split("=", 1)
        if key in PER_RUN_KEYS:
            OmegaConf.update(config, key, int(value) if value.isdigit() else value, merge=False)
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    return config


# -- the replaced plumbing --------------------------------------------------------------------------------


class LocalWorkerGroup:
    """The legacy trainer's view of its actor worker group, for one in-process worker per gloo rank.

    ``compute_log_prob`` / ``update_actor`` dispatch like verl's ``make_nd_compute_dataproto_dispatch_fn``:
    the batch is cut into ``world_size`` contiguous chunks with verl's own helper, this rank's worker
    runs its chunk, and the ranks' outputs are all-gathered and concatenated with verl's own helper.
    """

    def __init__(self, worker, world_size: int, rank: int):
        self.worker = worker
        self.world_size = world_size
        self.rank = rank
        # RayPPOTrainer._get_dp_size reads the DP rank of every worker from here (all ranks are DP ranks).
        self._dispatch_info = {"actor": list(range(world_size))}

    def _call(self, method: str, data):
        from verl.single_controller.base.decorator import (
            _concat_data_proto_or_future,
            _split_args_kwargs_data_proto,
        )

        if self.world_size == 1:
            return getattr(self.worker, method)(_as_received(data))
        (chunks,), _ = _split_args_kwargs_data_proto(self.world_size, data)
        output = getattr(self.worker, method)(_as_received(chunks[self.rank]))
        gathered = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, output)
        return _concat_data_proto_or_future(gathered)

    def compute_log_prob(self, data):
        return self._call("compute_log_prob", data)

    def update_actor(self, data):
        return self._call("update_actor", data)

    # Checkpointing (``trainer.save_freq``, ``trainer.resume_mode``): every rank saves / loads its own
    # shard, as verl's ONE_TO_ALL dispatch has every worker do.
    def save_checkpoint(self, *args, **kwargs):
        return self.worker.save_checkpoint(*args, **kwargs)

    def load_checkpoint(self, *args, **kwargs):
        return self.worker.load_checkpoint(*args, **kwargs)


def _as_received(data):
    """What a Ray worker receives: a deserialised copy (unlocked, and the worker's pops do not reach the
    driver's batch), not the driver's object or a locked chunk view of it."""
    import pickle

    return pickle.loads(pickle.dumps(data))


class RandomRollout:
    """Stands in for verl's agent loop + reward loop: ``generate_sequences(gen_batch) -> DataProto``.

    Per sample: prompt ids from the tokenizer's chat template (what verl's single-turn agent loop
    sends), a response from :func:`.random_responses.random_response` keyed by the weight version
    and the sample's index in the batch (verl's ``det-<priority>``), the rule reward
    :func:`.random_responses.length_score` of the decoded response at its last token (``rm_scores``).
    The output has the fields of ``AgentLoopWorker._postprocess`` (prompts left-padded to
    ``max_prompt_length``, responses right-padded to ``max_response_length``).
    """

    def __init__(self, tokenizer, *, seed: int, max_prompt_length: int, max_response_length: int):
        self.tokenizer = tokenizer
        self.seed = seed
        self.max_prompt_length = max_prompt_length
        self.max_response_length = max_response_length
        self.weight_version: Optional[int] = None
        self.digests: list[str] = []  # per call: a hash of the generated batch's tokens

    def respond(self, prompts: Sequence[Sequence[int]]) -> list[tuple[list[int], float]]:
        """(response ids, score) per prompt; sample ``i``'s request id is ``det-<i>``."""
        rows = []
        for index, prompt in enumerate(prompts):
            response = random_responses.random_response(
                seed=self.seed, weight_version=self.weight_version, request_key=f"det-{index}", prompt_ids=prompt,
                max_tokens=self.max_response_length, vocab_size=len(self.tokenizer),
                eos_token_id=self.tokenizer.eos_token_id)
            rows.append((response, random_responses.length_score(self.tokenizer.decode(response,
                                                                                       skip_special_tokens=True))))
        return rows

    def generate_sequences(self, gen_batch):
        from verl import DataProto
        from verl.utils.model import compute_position_id_with_mask

        pad = self.tokenizer.pad_token_id
        prompts = []
        for messages in gen_batch.non_tensor_batch["raw_prompt"]:
            prompt = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
            prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)
            if len(prompt) > self.max_prompt_length:
                raise ValueError(f"prompt of {len(prompt)} tokens > data.max_prompt_length={self.max_prompt_length}")
            prompts.append(prompt)
        rows = [(prompt, response, score) for prompt, (response, score) in zip(prompts, self.respond(prompts))]

        n, p_len, r_len = len(rows), self.max_prompt_length, self.max_response_length
        prompts = torch.full((n, p_len), pad, dtype=torch.long)
        responses = torch.full((n, r_len), pad, dtype=torch.long)
        prompt_mask = torch.zeros(n, p_len, dtype=torch.long)
        response_mask = torch.zeros(n, r_len, dtype=torch.long)
        rm_scores = torch.zeros(n, r_len, dtype=torch.float32)
        for i, (prompt, response, score) in enumerate(rows):
            prompts[i, p_len - len(prompt):] = torch.tensor(prompt)
            prompt_mask[i, p_len - len(prompt):] = 1
            responses[i, : len(response)] = torch.tensor(response)
            response_mask[i, : len(response)] = 1
            rm_scores[i, len(response) - 1] = score
        attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
        batch = {
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": compute_position_id_with_mask(attention_mask),
            "rm_scores": rm_scores,
        }
        no_media = np.empty(n, dtype=object)
        no_media[:] = [{} for _ in range(n)]  # fit reads every sample's multi_modal_inputs (text-only: empty)
        non_tensor = {"__num_turns__": np.full(n, 2, dtype=np.int32), "multi_modal_inputs": no_media}
        self.digests.append(_batch_digest(batch["input_ids"]))
        return DataProto.from_dict(tensors=batch, non_tensors=non_tensor,
                                   meta_info={"timing": {}, "reward_extra_keys": []})


class LatestWeights:
    """A weight history for a model too large to keep every version of (SmolLM2: 0.6 GB a version in fp32, 1.2 GB
    in float64): the latest version only, in float32 (an fp32 model's values exactly), and the count of versions
    recorded, so ``len()`` and ``[-1]`` behave as on :class:`RunResult`'s list. ``on_version(index, flat)`` sees
    every version as it is recorded (e.g. to write it to disk for a later comparison)."""

    dtype = torch.float32

    def __init__(self, on_version=None):
        self.latest: Optional[torch.Tensor] = None
        self.count = 0
        self.on_version = on_version

    def append(self, flat: torch.Tensor) -> None:
        self.latest = flat.to(self.dtype)
        if self.on_version is not None:
            self.on_version(self.count, self.latest)
        self.count += 1

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.latest is None or index not in (-1, self.count - 1):
            raise IndexError(f"only the latest weight version is kept (version {self.count - 1}), not {index}")
        return self.latest


class WeightSync:
    """Stands in for verl's ``CheckpointEngineManager``: ``update_weights(global_steps)`` after every actor
    update (and once before training) records the actor's full parameters (in the history's ``dtype``,
    float64 for a plain list) and tells the rollout the weight version; ``sleep_replicas`` has nothing to do."""

    def __init__(self, worker, rollout: RandomRollout, params):
        self.worker = worker
        self.rollout = rollout
        self.params = params

    def update_weights(self, global_steps: int):
        dtype = getattr(self.params, "dtype", torch.float64)
        # a collective at world size > 1
        self.params.append(_cpu.engine_params_flat(self.worker.actor.engine, dtype=dtype))
        self.rollout.weight_version = global_steps

    def sleep_replicas(self):
        return None


class MetricsRecorder:
    """Stands in for ``verl.utils.tracking.Tracking`` inside ``fit``: keeps each step's metrics."""

    records: list[dict[str, float]] = []

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def log(self, data: dict, step: int) -> None:
        MetricsRecorder.records.append({"step": step, **{k: _number(v) for k, v in data.items()}})

    def finish(self, *args: Any, **kwargs: Any) -> None:
        pass


def _number(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


class _ResourcePools:
    """What ``fit`` asks the resource pool manager: the number of (fake) GPUs, for throughput metrics."""

    def __init__(self, n: int):
        self.n = n

    def get_n_gpus(self) -> int:
        return self.n


@contextlib.contextmanager
def _recording_metrics():
    import verl.utils.tracking as tracking

    original = tracking.Tracking
    MetricsRecorder.records = []
    tracking.Tracking = MetricsRecorder
    try:
        yield MetricsRecorder.records
    finally:
        tracking.Tracking = original


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _batch_digest(input_ids: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(input_ids.numpy().tobytes()).hexdigest()[:16]


def run_trainer(run: RunConfig, *, model_path: str, work_dir: str, rank: int = 0, make_rollout=None,
                dataset=write_dataset, extra_overrides: Sequence[str] = (), customize=None,
                weights=None) -> RunResult:
    """One run of ``RayPPOTrainer.fit`` for ``run``; torch.distributed must be initialised with
    ``run.world_size`` ranks (:func:`run_local` / :func:`run_spawned` do that).

    ``make_rollout(tokenizer, run, params)`` (default: :class:`RandomRollout`) builds the rollout;
    ``params`` is the list :class:`WeightSync` appends every weight version to. ``dataset(path,
    n_prompts)`` writes the training prompts (default: :func:`write_dataset`).
    ``extra_overrides``: more Hydra overrides of verl's config, replacing those of
    :func:`trainer_overrides` with the same key (e.g. ``trainer.save_freq=1``,
    ``trainer.resume_mode=auto``). ``customize(trainer, worker, rollout)``: called once everything
    is wired, just before ``fit`` (e.g. to wrap the rollout). ``weights``: the weight history
    (default: every version, float64, in ``result.params``; :class:`LatestWeights` for a large model).
    A resumed run logs the steps after its checkpoint only, and records one weight version more than
    it logs steps."""
    import verl_klcov_global  # noqa: F401  -- the plugin: losses registered, hook installed
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.utils import Role
    from verl.utils import hf_tokenizer
    from verl.workers.engine_workers import ActorRolloutRefWorker

    if torch.distributed.get_world_size() != run.world_size:
        raise RuntimeError(f"{run.label()}: torch.distributed has {torch.distributed.get_world_size()} ranks")
    n_prompts = run.steps * run.prompts_per_step
    train_file = os.path.join(work_dir, f"train-{n_prompts}.parquet")
    if rank == 0 and not os.path.exists(train_file):
        os.makedirs(work_dir, exist_ok=True)
        dataset(train_file, n_prompts)
    if run.world_size > 1:
        torch.distributed.barrier()
    overrides = trainer_overrides(run, model_path=model_path, train_file=train_file, out_dir=work_dir)
    replaced = {o.split("=", 1)[0] for o in extra_overrides}
    overrides = [o for o in overrides if o.split("=", 1)[0] not in replaced] + list(extra_overrides)
    config = compose_config(overrides)
    _seed_everything(run.seed)

    tokenizer = hf_tokenizer(model_path)
    worker = ActorRolloutRefWorker(config=config.actor_rollout_ref, role="actor")
    worker.init_model()
    if run.loss_mode in HIGH_ENTROPY_CONFIGS and run.loss_mode != "high_entropy_global":
        _use_lab_comparator(worker)
    result = RunResult(config=run)
    if weights is not None:
        result.params = weights
    if make_rollout is None:
        rollout = RandomRollout(tokenizer, seed=run.seed, max_prompt_length=run.max_prompt_length,
                                max_response_length=run.max_response_length)
    else:
        rollout = make_rollout(tokenizer, run, result.params)
    trainer = RayPPOTrainer(config=config, tokenizer=tokenizer,
                            role_worker_mapping={Role.ActorRollout: ActorRolloutRefWorker},
                            resource_pool_manager=_ResourcePools(run.world_size), device_name="cpu")
    # What init_workers would build, in-process (see the module docstring).
    trainer.actor_rollout_wg = LocalWorkerGroup(worker, run.world_size, rank)
    trainer.async_rollout_manager = rollout
    trainer.checkpoint_manager = WeightSync(worker, rollout, result.params)
    trainer.async_rollout_mode = True
    trainer.teacher_model_manager = None
    trainer.distillation_config = None

    if customize is not None:
        customize(trainer, worker, rollout)

    with _recording_metrics() as records:
        trainer.fit()
    result.metrics = [dict(r) for r in records]
    result.rollout_digest = list(rollout.digests)
    result.rollout_figures = [dict(f) for f in getattr(rollout, "figures", [])]
    resumed = int(result.metrics[0]["step"]) - 1 if result.metrics else 0  # 0 unless resumed from a checkpoint
    if len(result.metrics) != run.steps - resumed or len(result.params) != run.steps - resumed + 1:
        raise RuntimeError(f"{run.label()}: {len(result.metrics)} logged steps and {len(result.params)} weight "
                           f"versions, expected {run.steps - resumed} and {run.steps - resumed + 1}")
    del trainer, worker
    return result


def _use_lab_comparator(worker) -> None:
    """Register the authors' per-micro-batch rule in this process and give the worker the lab's loss function,
    which hands it each micro-batch's entropy (:mod:`verl_klcov_global.lab.per_micro_batch`)."""
    import functools

    from verl_klcov_global.lab import per_micro_batch
    from verl_klcov_global.methods.high_entropy.authors import COMPARATOR

    per_micro_batch.register(COMPARATOR)
    config = worker.loss_fn.keywords["config"]  # functools.partial(ppo_loss, config=actor_config)
    worker.loss_fn = functools.partial(per_micro_batch.ppo_loss_with_entropy, config=config)
    worker.actor.set_loss_fn(worker.loss_fn)


def run_local(runs: Sequence[RunConfig], *, model_path: str, work_dir: str, progress=None,
              **trainer_kwargs) -> list[RunResult]:
    """World-size-1 runs, one after another in this process (one gloo group of size 1 for all);
    ``trainer_kwargs`` go to :func:`run_trainer` (``make_rollout``, ``dataset``)."""
    _cpu.install_cpu_platform()
    _cpu.init_process_group_cpu(0, 1)
    # The tiny model's ops are far too small for intra-op threads: one thread is faster, and much
    # faster on a shared machine (2 threads on 2 busy cores stall each other).
    torch.set_num_threads(1)
    results = []
    for run in runs:
        if run.world_size != 1:
            raise ValueError(f"{run.label()}: run_local runs world size 1 only; use run_spawned")
        if progress:
            progress(f"run {run.label()}")
        results.append(run_trainer(run, model_path=model_path, work_dir=work_dir, **trainer_kwargs))
    return results


def _spawned_rank(rank: int, world_size: int, port: int, runs, model_path: str, work_dir: str, quiet: bool):
    from verl_klcov_global.lab.quiet import quiet_verl

    _cpu.install_cpu_platform()
    _cpu.init_process_group_cpu(rank, world_size, port)
    with quiet_verl() if quiet else contextlib.nullcontext():
        results = [run_trainer(run, model_path=model_path, work_dir=work_dir, rank=rank) for run in runs]
    return results if rank == 0 else None


def run_spawned(runs: Sequence[RunConfig], *, model_path: str, work_dir: str, quiet: bool = False) -> list[RunResult]:
    """Runs of one world size W > 1, one after another in W spawned gloo processes; rank 0's results.
    ``quiet`` hides verl's chatter in those processes."""
    sizes = {run.world_size for run in runs}
    if len(sizes) != 1:
        raise ValueError(f"run_spawned needs runs of one world size, got {sorted(sizes)}")
    (world_size,) = sizes
    return _cpu.spawn(_spawned_rank, world_size, list(runs), model_path, work_dir, quiet)[0]

