"""The prepass: one no-grad forward of the optimizer minibatch, then the mode's one selection over it.

Called by the wrapped ``train_batch`` (:mod:`.step`) once per optimizer step, for every global
loss mode alike (the mode only chooses the selection, :mod:`verl_klcov_global.modes`):

1. :func:`compute_prepass_log_probs`: eval mode, no grad, only log-probs (no entropy, no
   distillation), micro-batched by :func:`prepass_forward_batches`, PATCH
   ``prepass_batched_logsumexp`` active (:mod:`.logprobs`), RNG states and module mode restored;
   when the step reads the entropy (``ModeSpec.reads_entropy``: a row that sets
   ``prepass_reads_entropy``, ``high_entropy_global``, or any mode with the entropy controller on),
   :func:`compute_prepass_log_probs_and_entropy` instead: the same forward with verl's
   ``calculate_entropy=True`` and the patch off, i.e. the code and micro-batch settings of verl's
   ``compute_log_prob`` (``infer`` layout). Its micro-batches are formed from this minibatch, verl's from the whole
   per-rank batch (and static sizes may re-split them), so the entropy equals ``compute_log_prob``'s wherever verl's
   numerics of a row do not depend on the rows beside it (docs/PREPASS.md says where they do);
2. with the entropy controller on, one step of its law (:func:`.control.steer`): the ratio knob the
   selection uses this step;
3. ``mode.select``: the selection over the minibatch and the data-parallel group (then the controller's
   next state, :func:`.control.settle_after_selection`).

Micro-batching of the prepass (``prepass_layout``):

* ``infer`` (default): the log-prob inference budget verl's ``compute_log_prob`` uses.
  Dynamic batching: ``infer_max_token_len_per_gpu``, split by verl exactly as
  ``compute_log_prob`` would split this minibatch. Static: ``ceil(rows / size)`` forwards
  for ``size = infer_micro_batch_size_per_gpu``, row counts differing by at most one (so
  each <= size); the count is agreed over the DP group (max), because every forward
  all-gathers FSDP parameters on every rank; a rank that would need an empty forward
  makes every rank raise instead of hanging.
* ``train``: the training micro-batch keys of the minibatch, verl's own split.
* ``old`` (opt-in): no forward at all; step 1 reads pi_old's statistics, the minibatch's ``old_log_probs``
  and the entropy of verl's log-prob pass held for the update (:mod:`.old_policy`). Not the current policy.

Peak memory (the prepass must not exceed max(verl's compute_log_prob on the same
minibatch, the training step)). The prepass runs inside verl's train-mode context, where an
offloaded optimizer's states are already on the device; ``compute_log_prob`` runs without
them. So:

With entropy (``prepass_reads_entropy``) the forward is ``compute_log_prob``'s with
``calculate_entropy=True`` (what verl's trainer runs for the old log-probs): the same entropy
temporaries, verl's own log-prob loop (the in-place patch off), so the bound below holds against
``compute_log_prob`` with entropy on the same minibatch.

* ``optimizer_offload=False``: the states are on the device during ``compute_log_prob`` too;
  the prepass holds the same parameters and states, no gradients (the step frees them first),
  and the same micro-batches (``infer``) or the training step's micro-batches without autograd
  (``train``).
* ``optimizer_offload=True`` with ``train``: no copies; each prepass forward is a training
  micro-batch's forward without autograd and gradients, so it stays below the training step.
* ``optimizer_offload=True`` with ``infer`` whose micro-batches are no larger than the training
  ones (a token budget ``infer_max_token_len_per_gpu <= max_token_len_per_gpu``, or as many rows
  or fewer, static): no copies, by the same argument (the authors' recipes set one budget for both).
* ``optimizer_offload=True`` with larger ``infer`` micro-batches: :func:`optimizer_states_off_device`
  moves the states to the host (verl's ``engine.to(..., optimizer=True)``) for the prepass and back
  before verl's step: two host<->device copies of this rank's optimizer-state shard per optimizer
  step. Then the prepass holds what ``compute_log_prob`` holds.

Observability: the forward and the selection run under ``torch.profiler.record_function``
names :data:`PREPASS_RECORD_NAME` and :data:`SELECTION_RECORD_NAME`.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.engine.base import BaseEngine
from verl.workers.utils.padding import no_padding_2_padding

from ..mode_config import OLD_POLICY_LAYOUT
from ..layout import fit_width, padded
from ..modes import ModeSpec, Selection
from . import reuse
from .old_policy import old_policy_statistics
from .control import Steering, settle_after_selection, steer
from .logprobs import batched_logsumexp

__all__ = [
    "PREPASS_RECORD_NAME", "SELECTION_RECORD_NAME", "PrepassResult", "compute_prepass_log_probs",
    "compute_prepass_log_probs_and_entropy",
    "optimizer_states_off_device", "prepass_forward_batches", "preserved_rng_states", "run_prepass_and_select",
    "static_prepass_chunk_sizes",
]

#: ``torch.profiler.record_function`` names of the prepass forward and of the selection.
PREPASS_RECORD_NAME = "verl_klcov_global.prepass"
SELECTION_RECORD_NAME = "verl_klcov_global.selection"


@dataclass(frozen=True)
class PrepassResult:
    """Outcome of one optimizer step's prepass and selection.

    ``selection.mask`` is (batch, response_len) bool over this rank's minibatch,
    in its original sample order; ``mode`` is the loss mode that made it.
    ``optimizer_states_offloaded``: the optimizer states were moved off the device for the
    prepass (see :func:`optimizer_states_off_device`). ``steering``: the entropy controller's step
    (its decision and the settings the selection used), None with the controller off. ``reused``: no
    prepass ran, the statistics are verl's own log-prob pass's (:mod:`.reuse`); then ``prepass_seconds``
    is 0 and ``selection_seconds`` includes the look-up. ``from_old_policy``: ``prepass_layout=old``, no prepass,
    the statistics are pi_old's (:mod:`.old_policy`; ``prepass_seconds`` 0, ``reused`` False). ``settings``: the
    settings the selection used (the controller's ratio in use where it steered): what every micro-batch's loss of
    the step applies.
    """

    selection: Selection
    prepass_seconds: float
    selection_seconds: float
    mode: ModeSpec
    optimizer_states_offloaded: bool = False
    steering: Optional[Steering] = None
    reused: bool = False
    from_old_policy: bool = False
    settings: Any = None

    def figures(self) -> dict[str, float]:
        """The step's figures for logging (names without the mode's prefix): the selection's, the controller's."""
        figures = self.selection.figures()
        if self.steering is not None:
            figures.update(self.steering.figures(self.mode))
        return figures


def run_prepass_and_select(engine: BaseEngine, data: TensorDict, settings: Any, mode: ModeSpec) -> PrepassResult:
    """No-grad log-probs (and entropy when ``mode.reads_entropy(settings)``) of the whole minibatch, then the
    entropy controller's step if it is on, then ``mode``'s one selection over the minibatch and the DP group.
    No forward where verl's own log-prob pass computed them with these very parameters (:func:`.reuse.take`,
    collective)."""
    needs_entropy = mode.reads_entropy(settings)  # the mode's row and its settings, not its name
    started = time.perf_counter()
    from_old_policy = settings.prepass_layout == OLD_POLICY_LAYOUT
    # [reuse] verl's own log-prob pass, where it was made with these very parameters (engine/reuse.py)
    reused = None if from_old_policy else reuse.take(engine, data, layout=settings.prepass_layout,
                                                     needs_entropy=needs_entropy)
    if from_old_policy:  # opt-in: pi_old's statistics at every step, no forward (engine/old_policy.py)
        log_probs, entropy = old_policy_statistics(engine, data, mode_name=mode.name, needs_entropy=needs_entropy)
        offloaded, prepass_seconds = False, 0.0
    elif reused is not None:
        (log_probs, entropy), offloaded, prepass_seconds = reused, False, 0.0
    else:  # [/reuse]
        entropy = None
        with torch.profiler.record_function(PREPASS_RECORD_NAME):
            with optimizer_states_off_device(engine, settings.prepass_layout, data) as offloaded:
                if needs_entropy:
                    log_probs, entropy = compute_prepass_log_probs_and_entropy(engine, data, settings.prepass_layout)
                else:
                    log_probs = compute_prepass_log_probs(engine, data, settings.prepass_layout)
        prepass_seconds = time.perf_counter() - started
    selected_at = started + prepass_seconds
    group = engine.get_data_parallel_group() if dist.is_available() and dist.is_initialized() else None
    steering = None
    with torch.profiler.record_function(SELECTION_RECORD_NAME):
        fields = mode.read_minibatch(log_probs, data, entropy)
        if getattr(settings, "entropy_control", None) is not None:
            steering = steer(engine, mode, settings, fields, group)
            settings = steering.settings
        selection = mode.select(fields, settings, group)
        if steering is not None:
            settle_after_selection(engine, mode, steering, selection)
    finished = time.perf_counter()
    return PrepassResult(
        selection=selection, prepass_seconds=prepass_seconds, selection_seconds=finished - selected_at,
        mode=mode, optimizer_states_offloaded=offloaded, steering=steering, reused=reused is not None,
        from_old_policy=from_old_policy, settings=settings,
    )


def infer_micro_batches_fit_training(engine: BaseEngine, data: TensorDict) -> bool:
    """Whether the ``infer`` layout's micro-batches are no larger than the training step's: with dynamic batching, a
    token budget ``infer_max_token_len_per_gpu`` at most the training ``max_token_len_per_gpu``; static, at most as
    many rows (``infer_micro_batch_size_per_gpu`` against ``micro_batch_size_per_gpu``). False where either is unset."""
    engine_config = engine.engine_config
    if tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
        infer, train = engine_config.infer_max_token_len_per_gpu, "max_token_len_per_gpu"
    else:
        infer, train = engine_config.infer_micro_batch_size_per_gpu, "micro_batch_size_per_gpu"
    train = tu.get_non_tensor_data(data=data, key=train, default=None)
    return infer is not None and train is not None and infer <= train


@contextlib.contextmanager
def optimizer_states_off_device(engine: BaseEngine, layout: str, data: TensorDict) -> Iterator[bool]:
    """Keep an offloaded optimizer's states on the host during an ``infer``-layout prepass whose micro-batches may
    be larger than the training ones; yields whether it moved them.

    With ``optimizer_offload=True`` verl's train-mode context has loaded the states onto the
    device before the step, while verl's ``compute_log_prob`` runs without them. Where the ``infer``
    micro-batches may hold more than the training ones (:func:`infer_micro_batches_fit_training` is
    False) they are moved to the host with verl's ``engine.to(device="cpu", model=False,
    optimizer=True, grad=False)`` and back with ``engine.to(device=<device>, ...)``, the calls
    verl's context makes: two copies of this rank's optimizer-state shard per optimizer step.
    Nothing moves when offloading is off (the states are on the device in ``compute_log_prob`` as
    well), for the ``train`` layout or ``infer`` micro-batches no larger than the training ones (a
    forward without autograd and gradients stays below the training step's), or when no state tensor
    is on the device (none yet before the first step, or the caller keeps them on the host).
    """
    from verl.utils.device import get_device_name

    device = get_device_name()
    optimizer = getattr(engine, "optimizer", None)
    move = (
        layout == "infer"
        and bool(engine.is_optimizer_offload_enabled)  # a property of verl's FSDP engine (a seam, seams.py)
        and optimizer is not None
        and not infer_micro_batches_fit_training(engine, data)
        and any(value.device.type == device for value in _optimizer_state_tensors(optimizer))
    )
    if not move:
        yield False
        return
    engine.to(device="cpu", model=False, optimizer=True, grad=False)
    try:
        yield True
    finally:
        engine.to(device=device, model=False, optimizer=True, grad=False)


def _optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def prepass_forward_batches(engine: BaseEngine, data: TensorDict, layout: str) -> list[TensorDict]:
    """The batches the prepass hands to ``engine.infer_batch``, one call each, with their micro-batch keys.

    Sets those keys on ``data`` itself: pass the prepass's own shallow copy, never the training batch.
    ``layout="train"``: ``[data]`` with its own (training) keys. ``"infer"``, dynamic batching:
    ``[data]`` with ``max_token_len_per_gpu = infer_max_token_len_per_gpu``. ``"infer"``, static:
    ``ceil(rows / infer_micro_batch_size_per_gpu)`` forwards (agreed over the DP group, see
    :func:`static_prepass_chunk_sizes`); ``[data]`` with that micro-batch size when the rows split
    evenly, else one consecutive chunk of rows per forward, each its own single micro-batch.
    """
    if layout == "train":
        return [data]
    use_dynamic_bsz = tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True)
    engine_config = engine.engine_config
    if use_dynamic_bsz:
        if engine_config.infer_max_token_len_per_gpu is None:
            raise ValueError(
                "the global loss modes' prepass uses the log-prob inference layout, but infer_max_token_len_per_gpu is not "
                "set: set actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu, or "
                "actor_rollout_ref.actor.policy_loss.prepass_layout=train"
            )
        tu.assign_non_tensor(data, max_token_len_per_gpu=engine_config.infer_max_token_len_per_gpu)
        return [data]
    if engine_config.infer_micro_batch_size_per_gpu is None:
        raise ValueError(
            "the global loss modes' prepass uses the log-prob inference layout, but infer_micro_batch_size_per_gpu is not "
            "set: set actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu, or "
            "actor_rollout_ref.actor.policy_loss.prepass_layout=train"
        )
    group = engine.get_data_parallel_group() if dist.is_available() and dist.is_initialized() else None
    sizes = static_prepass_chunk_sizes(len(data), engine_config.infer_micro_batch_size_per_gpu, group)
    if len(set(sizes)) == 1:
        tu.assign_non_tensor(data, micro_batch_size_per_gpu=sizes[0])
        return [data]
    chunks, start = [], 0
    for size in sizes:
        chunk = tu.index_select_tensor_dict(data, list(range(start, start + size)))
        tu.assign_non_tensor(chunk, micro_batch_size_per_gpu=size)
        chunks.append(chunk)
        start += size
    return chunks


def static_prepass_chunk_sizes(rows: int, size: int, group=None) -> list[int]:
    """Row counts of the static prepass's forwards: ``n = ceil(rows / size)`` of them, differing by at most one.

    With a process group, ``n`` is the maximum over its ranks (one all-reduce of two integers),
    since every forward all-gathers FSDP parameters on every rank. A rank with fewer than ``n``
    rows would need an empty forward: then every rank raises the same ``ValueError``.
    """
    if size < 1:
        raise ValueError(f"log-prob micro-batch size must be >= 1, got {size}")
    count = max(1, math.ceil(rows / size))
    fewest_rows, most_rows = rows, rows
    if group is not None and dist.get_world_size(group) > 1:
        from verl.utils.device import get_device_id

        agreed = torch.tensor([count, -rows, rows], dtype=torch.int64, device=get_device_id())
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        count, fewest_rows, most_rows = int(agreed[0]), -int(agreed[1]), int(agreed[2])
    if fewest_rows < count:
        raise ValueError(
            f"the global loss modes' static prepass runs the same number of forwards on every data-parallel rank (each "
            f"all-gathers FSDP parameters): {count} forwards of at most {size} rows "
            f"(log_prob_micro_batch_size_per_gpu), but the ranks hold between {fewest_rows} and {most_rows} rows. "
            "Give every rank the same number of rows (verl's minibatch split does), or use dynamic batching "
            "(use_dynamic_bsz=True)"
        )
    base, extra = divmod(rows, count)
    return [base + 1] * extra + [base] * (count - extra)


def compute_prepass_log_probs(engine: BaseEngine, data: TensorDict, layout: str) -> torch.Tensor:
    """Current-policy log-probs of every response token of ``data``: (batch, max_response_len), padded.

    A no-grad forward in eval mode (no dropout) that computes only log-probs: no
    entropy, no distillation, micro-batched by :func:`prepass_forward_batches`; the module's
    mode and the CPU/device RNG states are restored afterwards, so the training step that
    follows is unchanged. (verl's kl_cov scores tokens with the training forward's train-mode
    log-probs; the two differ only for models with active dropout or router noise.)
    PATCH ``prepass_batched_logsumexp`` is active. Mode-agnostic: it knows nothing of the loss or
    the selection.
    """
    return _prepass_forward(engine, data, layout, calculate_entropy=False)[0]


def compute_prepass_log_probs_and_entropy(engine: BaseEngine, data: TensorDict,
                                          layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Current-policy log-probs and entropy of every response token of ``data``, each (batch, max_response_len).

    The forward of :func:`compute_prepass_log_probs` (same micro-batches, eval mode, no grad, RNG
    and module mode restored) with verl's ``calculate_entropy=True``: the entropy is computed by the
    engine's own code (``entropy_from_logits``, or ``entropy_from_logits_with_chunking`` /
    ``entropy_checkpointing`` / ``use_torch_compile`` / fused kernels as configured), so for the same rows in
    the same micro-batches it is the entropy verl's ``compute_log_prob`` returns, bit for bit. PATCH
    ``prepass_batched_logsumexp`` is off here, so the forward is exactly ``compute_log_prob``'s code path (and
    holds at most its memory): the patch overwrites the logits in place, and verl may compute the entropy from
    them after the log-probs (the patch catalogue says which verl does).
    """
    return _prepass_forward(engine, data, layout, calculate_entropy=True)


def _prepass_forward(engine: BaseEngine, data: TensorDict, layout: str, *,
                     calculate_entropy: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(log-probs, entropy or None) of the prepass forward (see the two public functions above)."""
    prepass_data = data.copy()  # shallow: new keys here do not reach the training step
    tu.assign_non_tensor(
        prepass_data,
        calculate_entropy=calculate_entropy,
        calculate_sum_pi_squared=False,
        distillation_use_topk=False,
        distillation_only=False,
    )
    batches = prepass_forward_batches(engine, prepass_data, layout)
    width = padded(data["response_mask"]).shape[1]
    module = engine.module
    was_training = module.training
    log_prob_parts, entropy_parts = [], []
    # the in-place log-prob patch only when the logits feed nothing else (see compute_prepass_log_probs_and_entropy)
    log_prob_path = contextlib.nullcontext() if calculate_entropy else batched_logsumexp()
    with preserved_rng_states(), log_prob_path:
        module.eval()
        try:
            for batch in batches:
                model_output = engine.infer_batch(batch, loss_function=None)["model_output"]
                log_prob_parts.append(fit_width(no_padding_2_padding(model_output["log_probs"], batch), width))
                if calculate_entropy:
                    entropy_parts.append(fit_width(no_padding_2_padding(model_output["entropy"], batch), width))
        finally:
            module.train(was_training)
    log_probs = log_prob_parts[0] if len(log_prob_parts) == 1 else torch.cat(log_prob_parts)
    if not calculate_entropy:
        return log_probs, None
    return log_probs, entropy_parts[0] if len(entropy_parts) == 1 else torch.cat(entropy_parts)


@contextlib.contextmanager
def preserved_rng_states() -> Iterator[None]:
    """Restore the CPU RNG and, on an accelerator, the current device's RNG on exit."""
    cpu_state = torch.random.get_rng_state()
    device_module = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device_module = torch.cuda
    elif hasattr(torch, "npu") and torch.npu.is_available():  # pragma: no cover - Ascend only
        device_module = torch.npu
    device_state = device_module.get_rng_state() if device_module is not None else None
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu_state)
        if device_module is not None:
            device_module.set_rng_state(device_state)
