"""A CPU rollout for verl 0.9.1's trainer: random tokens, registered as ``rollout.name=cpu_random`` (test-only).

verl 0.9.1 ships server rollouts only (vLLM, SGLang, TensorRT-LLM). The trainer needs, per
rollout name, two registrations, and this module supplies the smallest thing behind each:

* ``verl.workers.rollout.replica.RolloutReplicaRegistry`` (trainer/TaskRunner process,
  ``LLMServerManager``): :class:`RandomTokenReplica` starts one :class:`RandomTokenServer` Ray
  actor per replica. The agent loop calls its ``generate(request_id, prompt_ids=...,
  sampling_params=...)``; the trainer calls ``wake_up``/``sleep`` around weight syncs.
* ``verl.workers.rollout.base._ROLLOUT_REGISTRY`` (each ``ActorRolloutRefWorker`` with a rollout
  role, ``init_model``): :class:`RandomTokenRollout`, the in-worker adapter that receives the
  synchronised weights (``checkpoint_engine.backend=naive``). It consumes them, so verl's
  weight export runs every step, and keeps nothing.

Responses are uniform random token ids (never a special token) of random length in
``[1, response_length]``, ended by EOS when shorter than the limit, a pure function of the rollout
seed, the weight version, verl's stable request id and the prompt (``experiments/random_responses.py``;
needs ``rollout.full_determinism=True``): two runs with the same seed and data get the same
rollouts, whichever replica serves a request. They do not depend on the policy: the tests exercise
the trainer's update path, not generation quality. ``log_probs`` are not returned: the trainer
recomputes old log-probs with the actor, as it does for vLLM without ``calculate_log_probs``.
"""

from __future__ import annotations

import os
from typing import Generator, Optional

import ray
from verl.workers.rollout import base as rollout_base
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry

from .rollout_server import RandomTokenServer

ROLLOUT_NAME = "cpu_random"


class RandomTokenReplica(RolloutReplica):
    """One :class:`RandomTokenServer` per replica; it needs no accelerator and no CPU reservation."""

    async def launch_servers(self):
        vocab_size, eos_token_id = _vocab_and_eos(self.model_config)
        self._server_handle = (
            ray.remote(RandomTokenServer)
            .options(num_cpus=0, name=server_name(self.replica_rank, self.name_suffix))
            .remote(vocab_size, eos_token_id, self.config.response_length, self.config.seed)
        )
        self.servers = [self._server_handle]
        self._server_address = f"cpu-random-{self.replica_rank}{self.name_suffix}"

    def rollout_worker_use_gpu(self) -> bool:
        return False


def _vocab_and_eos(model_config) -> tuple[int, Optional[int]]:
    """Vocabulary size and EOS id of the tokenizer next to the model being trained."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_config.get("path"))
    return len(tokenizer), tokenizer.eos_token_id


class RandomTokenRollout(rollout_base.BaseRollout):
    """In-worker side of the rollout: takes the actor's weights after each step and drops them.

    Like vLLM's adapter it tells its replica's server the weight version (``global_steps``),
    which the v1 trainer reads back from every response.
    """

    def __init__(self, config, model_config, device_mesh, *args, **kwargs):
        super().__init__(config, model_config, device_mesh, *args, **kwargs)
        rollout_world_size = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        rank = int(os.environ["RANK"])
        self.replica_rank = rank // rollout_world_size
        self.is_server_leader = rank % rollout_world_size == 0

    async def resume(self, tags: list[str]):
        return None

    async def update_weights(self, weights: Generator, global_steps: Optional[int] = None, **kwargs):
        for _name, _tensor in weights:  # runs verl's per-tensor export, as a real server would
            pass
        if self.is_server_leader and global_steps is not None:
            server = ray.get_actor(server_name(self.replica_rank))
            await server.set_global_steps.remote(global_steps)

    async def release(self):
        return None


def server_name(replica_rank: int, name_suffix: str = "") -> str:
    return f"cpu_random_server_{replica_rank}{name_suffix}"


def register() -> None:
    """Register ``cpu_random`` in both of verl's rollout registries (idempotent)."""
    rollout_base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{__name__}.RandomTokenRollout"
    RolloutReplicaRegistry.register(ROLLOUT_NAME, lambda: RandomTokenReplica)
