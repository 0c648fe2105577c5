"""Support for tests that drive verl's real ``TrainingWorker`` in-process (no Ray) on CPU.

* :func:`build_training_worker` -- ``verl.workers.engine_workers.TrainingWorker`` built from a
  ``TrainingWorkerConfig`` whose model/engine/optimizer configs are the ones
  ``verl_klcov_global.lab.cpu.build_fsdp_engine`` builds (fp32, sdpa, plain SGD, constant LR), then
  ``reset()`` (= ``engine.initialize()``), exactly as ``ActorRolloutRefWorker.init_model`` does.
* :class:`PlainModelReference` -- log-probs of response tokens computed by a plain transformers
  model loaded with the engine's current full state dict: no verl code on the path (no micro-batching,
  no padding utilities), so it is an independent reference for what the prepass computed.
* :func:`row_indices` -- which rows of the full batch a minibatch holds, found by content.

Targets verl 0.9.1 (``workers/engine_workers.py`` ``TrainingWorker``, ``workers/config/engine.py``
``TrainingWorkerConfig``).
"""

from __future__ import annotations

from typing import Optional

import torch
from tensordict import TensorDict

from verl_klcov_global.lab import cpu as _cpu



def build_training_worker(
    model_path: str,
    *,
    strategy: str = "fsdp",
    lr: float = 0.02,
    clip_grad: float = 0.05,
    use_dynamic_bsz: bool = False,
    micro_batch_size_per_gpu: Optional[int] = 8,
    max_token_len_per_gpu: Optional[int] = 2048,
    infer_micro_batch_size_per_gpu: Optional[int] = 16,
    infer_max_token_len_per_gpu: Optional[int] = 4096,
    seed: int = 0,
):
    """verl's ``TrainingWorker`` (world size 1, gloo, or the group already initialised) around
    ``FSDPEngineWithLMHead``, initialised.

    The configs mirror ``_cpu.build_fsdp_engine`` (fp32, sdpa, ``torch.optim.SGD``, constant LR,
    weight decay 0). ``torch.distributed`` is initialised with plain "gloo" first (verl's own
    ``initialize_global_process_group_ray`` would ask for "cpu:gloo,cpu:gloo", which torch rejects
    on CPU), which also sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT for ``Worker.__init__``; a group
    initialised already (several gloo ranks) is used as it is.
    """
    _cpu.install_cpu_platform()
    if not torch.distributed.is_initialized():  # else: a rank of spawn_gloo's group (DP = its world size)
        _cpu.init_process_group_cpu()

    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker

    torch.manual_seed(seed)
    configs = _cpu.fsdp_engine_configs(
        model_path, strategy=strategy, lr=lr, clip_grad=clip_grad, use_dynamic_bsz=use_dynamic_bsz,
        micro_batch_size_per_gpu=micro_batch_size_per_gpu, max_token_len_per_gpu=max_token_len_per_gpu,
        infer_micro_batch_size_per_gpu=infer_micro_batch_size_per_gpu,
        infer_max_token_len_per_gpu=infer_max_token_len_per_gpu, seed=seed,
    )
    config = TrainingWorkerConfig(model_type="language_model", **configs)
    worker = TrainingWorker(config=config)
    # @register only attaches dispatch metadata (and a TransferQueue bridge that is a pass-through
    # for a TensorDict/plain argument): the decorated methods run as plain methods in-process.
    worker.reset()
    return worker


def full_state_dict(engine) -> dict[str, torch.Tensor]:
    """The engine's full (unsharded) parameters under HF key names, detached copies."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    state = get_model_state_dict(engine.module, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone().float() for k, v in state.items()
    }


class PlainModelReference:
    """A plain ``transformers`` copy of the tiny model, fed with an engine's current parameters."""

    def __init__(self, model_path: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, attn_implementation="sdpa", dtype=torch.float32
        ).eval()

    def load(self, state: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        # Qwen2's rotary inv_freq is a non-persistent buffer: nothing else may be missing.
        assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)

    @torch.no_grad()
    def response_log_probs(self, rows: TensorDict, temperature: float = 1.0) -> torch.Tensor:
        """(B, max_response_len) float32 log-probs of every response token of ``rows`` (v1 layout).

        Built from the per-row ``prompts``/``responses`` token ids only: each sequence is
        ``prompt + response``, right-padded; a causal LM's logits at real positions do not see
        right padding, so no attention mask is needed. Entry j of row i is
        ``log softmax(logits[P_i + j - 1] / T)[response_ij]``; zero beyond the response.
        """
        prompts = rows["prompts"].unbind()
        responses = rows["responses"].unbind()
        seqs = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
        width = max(len(s) for s in seqs)
        input_ids = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            input_ids[i, : len(s)] = s
        logits = self.model(input_ids=input_ids).logits.float() / temperature
        log_probs = torch.log_softmax(logits, dim=-1)
        max_resp = max(len(r) for r in responses)
        out = torch.zeros(len(seqs), max_resp)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            positions = torch.arange(len(p) - 1, len(p) - 1 + len(r))
            out[i, : len(r)] = log_probs[i, positions].gather(-1, r.unsqueeze(-1)).squeeze(-1)
        return out


def _row_key(row: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(x) for x in row.tolist())


def row_indices(minibatch: TensorDict, full: TensorDict) -> list[int]:
    """Index in ``full`` of every row of ``minibatch``, matched on its ``input_ids`` (v1 layout)."""
    where = {}
    for i, row in enumerate(full["input_ids"].unbind()):
        key = _row_key(row)
        assert key not in where, "rows of the full batch are not distinct: cannot identify minibatch rows"
        where[key] = i
    return [where[_row_key(row)] for row in minibatch["input_ids"].unbind()]


def padded_rows(tensor: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """Rows ``indices`` of a nested (or padded) per-token field, as a (len(indices), max_len) tensor."""
    rows = tensor.unbind() if tensor.is_nested else list(tensor)
    chosen = [rows[i] for i in indices]
    width = max(len(r) for r in chosen)
    out = torch.zeros(len(chosen), width, dtype=chosen[0].dtype)
    for i, r in enumerate(chosen):
        out[i, : len(r)] = r
    return out
