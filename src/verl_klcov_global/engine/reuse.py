"""Reuse of verl's own log-prob pass: an optimizer step's statistics without a prepass, where that is exact.

verl's trainers run the actor's ``compute_log_prob`` on the whole batch (with ``calculate_entropy=True``)
before ``update_actor``, on the same contiguous DP shards. For an optimizer step whose parameters are
exactly those that pass ran with, the prepass would recompute what verl has just computed. This module
keeps what the pass computed, per engine, and hands it to the prepass (:func:`take`) when, and only
when, the evidence in this worker process says it is that step's own statistics:

* **the weights did not change since the pass.** Every engine the plugin has kept statistics for has a
  *weights version* (:func:`weights_version`), bumped by every write of its parameters the plugin can
  see: an optimizer step (torch's ``Optimizer.register_step_post_hook`` on the engine's optimizer: every
  step, whoever makes it), a ``load_state_dict`` of the engine's module (``register_load_state_dict_post_hook``:
  verl's checkpoint load), and verl's sharded weight restore of ``separate_async`` / fully async training
  (PATCH ``weight_restore_bumps_version``: ``verl.utils.fsdp_utils.fsdp{1,2}_sharded_load_from_cpu``).
  A bump frees the kept statistics at once. A rebuilt module or optimizer (``engine.initialize()``) is
  seen by identity. Anything else that writes the parameters in place between the pass and the update
  is not seen (nothing in verl's trainers does);
* **the rows are the rows the pass saw.** Each kept row is keyed by a 128-bit BLAKE2b digest of its
  content: the whole sequence's ``input_ids`` and ``position_ids``, the prompt/response split and the
  row's temperature; the update's rows are looked up by the same digest, so a shuffled or re-split
  minibatch still matches and a row the pass did not see does not. Rows with equal content whose kept
  statistics differ in any bit are not reused (ambiguous). A batch with multi-modal inputs is never
  kept (the digest does not cover them);
* **the forward is the prepass's.** The pass's forward settings (``use_remove_padding``,
  ``use_fused_kernels``, ``pad_mode``, dynamic batching and its token budget or the static micro-batch
  size) equal those the ``infer``-layout prepass would use, i.e. the engine's log-prob inference settings;
* **it has what the step reads.** The entropy where the step needs it (``ModeSpec.reads_entropy``: the
  80/20 mode, or any mode with the entropy controller on), and ``prepass_layout=infer`` (never ``train``: that layout asks for the
  training micro-batches' forward).

Every rank decides locally, then the decision is agreed over the default process group (one all-reduce
of one integer per optimizer step, MIN): either every rank reuses or every rank runs the prepass, whose
forward is collective. Any mismatch means a prepass, never stale statistics.

What is kept (PATCH ``log_prob_pass_keep``, filled only for a pass of an actor whose loss is a global
mode with ``prepass_layout=infer``, with its LoRA adapter on, see :mod:`.patches`): on the host, per
response token, the log-prob (4 bytes in fp32) and, where the step reads it, the entropy (4 bytes);
per row one digest (16 bytes) and an offset (8 bytes), plus a Python dict entry. It is freed by the
first weights bump after the pass, i.e. the update's first optimizer step, or replaced by the next pass.
With ``prepass_layout=old`` and a step that reads entropy (:mod:`.old_policy`), the pass is kept with its
entropy and *held*: a weights bump leaves it (the version still moves, so :func:`take` never hands it to a
later step), every optimizer step of the update reads pi_old's entropy from it (:func:`held_entropy`), and the
next pass replaces it.

On a reused step the statistics are the log-prob pass's, bit for bit. They equal what the prepass would
compute wherever verl's numerics do not depend on which rows share a micro-batch: on an Intel Xeon CPU in
fp32, padded, measured bit for bit; on an AMD EPYC (AVX2) 4.8e-7 apart on 3 of 1,024 tokens with shuffled rows
(``tests/engine/test_reuse.py``, docs/PREPASS.md). In bf16 (or packed sequences) verl's
log-probs depend on the batch shape (verl #6280), and the pass's micro-batches are formed from the whole
per-rank batch, the prepass's from the minibatch: the statistics are then verl's log-prob pass's own
numerics, still independent of the training micro-batch size.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from tensordict import TensorDict

from ..layout import padded
from .proxy import PROXY_OUTPUT_KEY

__all__ = ["REUSE_RECORD_NAME", "after_infer_batch", "agreed", "disabled", "forget", "held_entropy", "held_proxy", "kept_nbytes",
           "kept_rows", "last_reason",
           "log_prob_pass", "take", "weights_changed", "weights_restored", "weights_version"]

#: ``torch.profiler.record_function`` name of the look-up of verl's statistics.
REUSE_RECORD_NAME = "verl_klcov_global.reuse"
#: index value of a digest seen twice with statistics that differ in some bit
_AMBIGUOUS = -1


@dataclass
class _Kept:
    """What one log-prob pass computed on this rank: per row, the response tokens' statistics (host)."""

    version: int
    settings: tuple
    index: dict  # row digest (bytes) -> row of the pass, or _AMBIGUOUS
    offsets: torch.Tensor  # (rows + 1,) int64: row i's tokens are log_probs[offsets[i]:offsets[i + 1]]
    log_probs: torch.Tensor  # (tokens,) the response tokens' log-probs, rows one after another
    entropy: Optional[torch.Tensor]  # (tokens,) or None
    held: bool = False  # kept for the whole update (prepass_layout=old): a weights bump does not free it
    proxy: Optional[torch.Tensor] = None  # (tokens,) Lp-Reg's log pi_proxy (engine/proxy.py), or None

    @property
    def nbytes(self) -> int:
        tensors = [self.offsets, self.log_probs] + [t for t in (self.entropy, self.proxy) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors) + 16 * len(self.index)


@dataclass
class _EngineState:
    """Per engine: its weights version, the objects it is hooked on, the kept statistics."""

    module: Any  # weakref.ref to the module the hooks are on
    optimizer: Any  # weakref.ref to the optimizer the hooks are on
    handles: list = field(default_factory=list)
    version: int = 0
    kept: Optional[_Kept] = None
    missing: str = "no log-prob pass kept yet"  # why nothing is kept now (what a look-up then reports)
    reason: str = "no look-up yet"  # the last look-up's outcome: "reused" or its first mismatch


_STATES: "weakref.WeakKeyDictionary[Any, _EngineState]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class _Pass:
    engine: Any
    keep_entropy: bool
    hold: bool = False
    keep: bool = True  # keep the per-token statistics (reuse, held entropy)
    batch_entropy: bool = False  # record the batch-entropy sums (engine/batch_entropy.py)
    keep_proxy: bool = False  # keep Lp-Reg's proxy log-probs (engine/proxy.py); implies hold


_PASS: contextvars.ContextVar[Optional[_Pass]] = contextvars.ContextVar("verl_klcov_global_log_prob_pass",
                                                                         default=None)
_DISABLED = [False]


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """No keeping and no reuse inside this block (tests and benchmarks: the prepass every step). Set it on every
    rank alike: the decision's all-reduce is skipped inside."""
    before = _DISABLED[0]
    _DISABLED[0] = True
    try:
        yield
    finally:
        _DISABLED[0] = before


# ---------------------------------------------------------------------------------------------
# The weights version


def weights_version(engine) -> int:
    """The engine's weights version (0 until the plugin first kept statistics for it)."""
    state = _STATES.get(engine)
    return 0 if state is None else state.version


def weights_changed(engine, why: str) -> None:
    """Bump the engine's weights version and free its kept statistics."""
    state = _STATES.get(engine)
    if state is None:
        return
    state.version += 1
    if state.kept is not None and state.kept.held:
        return  # pi_old's statistics, read by every optimizer step of the update (engine/old_policy.py)
    if state.kept is not None:
        state.missing = f"the weights changed after verl's log-prob pass ({why})"
    state.kept = None


def weights_restored(module) -> None:
    """Someone wrote ``module``'s parameters (verl's sharded restore): bump every engine that holds it."""
    for engine, state in list(_STATES.items()):
        if state.module() is module:
            weights_changed(engine, "weights restored from a CPU copy")


def _bumper(engine, why: str):
    engine_ref = weakref.ref(engine)

    def hook(*_args, **_kwargs) -> None:
        engine = engine_ref()
        if engine is not None:
            weights_changed(engine, why)

    return hook


def _tracked_state(engine) -> Optional[_EngineState]:
    """The engine's state, hooked on its current module and optimizer (re-hooked when they were rebuilt)."""
    module, optimizer = getattr(engine, "module", None), getattr(engine, "optimizer", None)
    if module is None or optimizer is None or not hasattr(optimizer, "register_step_post_hook") \
            or not hasattr(module, "register_load_state_dict_post_hook"):
        return None
    state = _STATES.get(engine)
    if state is not None and state.module() is module and state.optimizer() is optimizer:
        return state
    version = 0
    if state is not None:  # engine.initialize() built new objects: what was kept is someone else's
        for handle in state.handles:
            handle.remove()
        version = state.version + 1
    state = _EngineState(module=weakref.ref(module), optimizer=weakref.ref(optimizer), version=version)
    state.handles = [
        optimizer.register_step_post_hook(_bumper(engine, "optimizer step")),
        module.register_load_state_dict_post_hook(_bumper(engine, "load_state_dict: a checkpoint load")),
    ]
    _STATES[engine] = state
    return state


# ---------------------------------------------------------------------------------------------
# Keeping what verl's log-prob pass computed


@contextlib.contextmanager
def log_prob_pass(engine, *, keep_entropy: bool, hold: bool = False, keep: bool = True,
                  batch_entropy: bool = False, keep_proxy: bool = False) -> Iterator[None]:
    """Inside this block, a call of ``engine.infer_batch`` is verl's log-prob pass to keep (:func:`after_infer_batch`).

    ``keep=False``: no per-token statistics are kept; ``batch_entropy``: the pass's batch-entropy sums are recorded
    for a mode with a once-per-trainer-step rule (:mod:`.batch_entropy`, in every ``prepass_layout`` and also inside
    :func:`disabled`, which switches reuse off, not the rule's input).

    ``hold``: keep it for the whole update, until the next pass replaces it (``prepass_layout=old``, whose every
    optimizer step reads pi_old's entropy: :func:`held_entropy`); reuse (:func:`take`) still needs the weights
    version of the pass, so a held pass is never handed to a step after the first weights bump.

    ``keep_proxy``: the pass also computes Lp-Reg's proxy log-probs (:mod:`.proxy`; the caller sets
    :data:`.proxy.PROXY_REQUEST_KEY` on the batch) and they are kept and held with it (:func:`held_proxy`)."""
    token = _PASS.set(_Pass(engine, keep_entropy, hold or keep_proxy, keep or keep_proxy, batch_entropy, keep_proxy))
    try:
        yield
    finally:
        _PASS.reset(token)


def after_infer_batch(engine, data: TensorDict, outputs: Any) -> None:
    """Called by PATCH ``log_prob_pass_keep`` after every ``BaseEngine.infer_batch``: keeps the outputs of a
    log-prob pass opened by :func:`log_prob_pass` for this engine; anything else (the prepass's own forwards,
    other engines, other calls) is left alone."""
    current = _PASS.get()
    model_output = outputs.get("model_output") if isinstance(outputs, dict) else None
    proxy = model_output.pop(PROXY_OUTPUT_KEY, None) if isinstance(model_output, dict) else None  # never verl's
    if current is None or current.engine is not engine:
        return
    if current.batch_entropy:
        from . import batch_entropy

        batch_entropy.record_pass(engine, data, outputs)  # never raises
    if not current.keep or (_DISABLED[0] and not current.keep_proxy):  # the proxy has no other source
        return
    state = None
    try:  # whatever goes wrong here costs a prepass later, never verl's pass
        state = _tracked_state(engine)
        if state is None:
            return
        state.kept = None  # a new pass replaces the previous one, whatever happens below
        state.kept, state.missing = _keep(state.version, data, outputs, current.keep_entropy, current.hold,
                                          proxy if current.keep_proxy else None, current.keep_proxy)
    except Exception as error:  # e.g. a layout this code does not know
        if state is not None:
            state.kept = None
            state.missing = f"verl's log-prob pass could not be kept ({type(error).__name__}: {error})"


def _keep(version: int, data: TensorDict, outputs: Any, keep_entropy: bool, hold: bool = False,
          proxy: Optional[torch.Tensor] = None, keep_proxy: bool = False) -> tuple[Optional[_Kept], str]:
    from verl.workers.utils.padding import no_padding_2_padding

    model_output = outputs.get("model_output") if isinstance(outputs, dict) else None
    if not model_output or "log_probs" not in model_output:
        return None, "verl's log-prob pass returned no log-probs"
    if _has_media(data):
        return None, "verl's log-prob pass had multi-modal inputs (not covered by the row digest)"
    digests = _row_digests(data)
    if digests is None:
        return None, "verl's log-prob pass had no nested input_ids/position_ids or no prompts/responses"
    _, response_lens = _split_lengths(data)
    response_lens = response_lens.to("cpu", torch.int64)
    values = [no_padding_2_padding(model_output["log_probs"], data)]
    if keep_entropy:
        if "entropy" not in model_output:
            return None, "verl's log-prob pass computed no entropy (calculate_entropy=False)"
        values.append(no_padding_2_padding(model_output["entropy"], data))
    if keep_proxy:
        if proxy is None:
            return None, ("verl's log-prob pass computed no Lp-Reg proxy (PATCH proxy_log_prob_in_pass did not run: "
                          "is the actor verl's FSDP engine?)")
        values.append(no_padding_2_padding(proxy, data))
    inside = torch.arange(values[0].shape[1]).unsqueeze(0) < response_lens.unsqueeze(1)
    flat = [v.detach().to("cpu")[inside] for v in values]
    offsets = torch.zeros(len(digests) + 1, dtype=torch.int64)
    offsets[1:] = response_lens.cumsum(0)
    index: dict = {}
    for row, digest in enumerate(digests):
        first = index.get(digest)
        if first is None:
            index[digest] = row
        elif first != _AMBIGUOUS and not all(
                torch.equal(f[offsets[row]:offsets[row + 1]], f[offsets[first]:offsets[first + 1]]) for f in flat):
            index[digest] = _AMBIGUOUS
    kept = _Kept(version=version, settings=_pass_settings(data), index=index, offsets=offsets, log_probs=flat[0],
                 entropy=flat[1] if keep_entropy else None, held=hold, proxy=flat[-1] if keep_proxy else None)
    return kept, "kept"


# ---------------------------------------------------------------------------------------------
# Handing it to an optimizer step


def take(engine, data: TensorDict, *, layout: str, needs_entropy: bool) -> Optional[tuple[torch.Tensor,
                                                                                           Optional[torch.Tensor]]]:
    """This step's (log-probs, entropy or None), each (batch, response width) on the engine's device, from verl's
    log-prob pass, or None: then the prepass runs. Collective: every rank calls it and every rank gets the same
    answer (see the module docstring). ``layout`` is ``prepass_layout``; ``needs_entropy`` what the step reads."""
    if layout != "infer" or _DISABLED[0]:  # the same on every rank: no agreement needed
        return None
    with torch.profiler.record_function(REUSE_RECORD_NAME):
        state = None
        try:  # every rank must reach the agreement below, whatever happens here
            state = _STATES.get(engine)
            found, reason = _look_up(engine, state, data, needs_entropy)
        except Exception as error:  # never fail a step for want of reuse: the prepass runs
            found, reason = None, f"look-up failed ({type(error).__name__}: {error})"
        if not agreed(found is not None):
            if found is not None:
                reason = "another rank cannot reuse verl's log-prob pass for this step"
            found = None
        if state is not None:
            state.reason = "reused" if found is not None else reason
    return found


def _kept_of(engine, state: Optional[_EngineState]) -> tuple[Optional[_Kept], str]:
    """What is kept for ``engine`` now, if it was kept for the engine's current module and optimizer; else why not."""
    if state is None:
        return None, "no log-prob pass kept for this engine"
    if state.module() is not getattr(engine, "module", None) or state.optimizer() is not getattr(engine, "optimizer",
                                                                                                   None):
        return None, "the engine's module or optimizer was rebuilt after verl's log-prob pass"
    if state.kept is None:
        return None, state.missing
    return state.kept, "kept"


def _rows_in(kept: _Kept, data: TensorDict) -> tuple[Optional[list[int]], str]:
    """The pass's row of every row of ``data``, matched by digest; or None and the first reason it cannot be."""
    if _has_media(data):
        return None, "the minibatch has multi-modal inputs"
    digests = _row_digests(data)
    if digests is None:
        return None, "the minibatch has no nested input_ids/position_ids or no prompts/responses"
    rows = [kept.index.get(digest) for digest in digests]
    if any(row is None for row in rows):
        return None, f"{sum(row is None for row in rows)} of {len(rows)} rows were not in verl's log-prob pass"
    if any(row == _AMBIGUOUS for row in rows):
        return None, "rows of equal content got different statistics in verl's log-prob pass"
    return rows, "found"


def _look_up(engine, state: Optional[_EngineState], data: TensorDict, needs_entropy: bool):
    kept, reason = _kept_of(engine, state)
    if kept is None:
        return None, reason
    if kept.version != state.version:
        return None, state.missing
    if needs_entropy and kept.entropy is None:
        return None, "verl's log-prob pass kept no entropy and this step reads it"
    expected = _prepass_settings(engine, data)
    if kept.settings != expected:
        return None, f"verl's log-prob pass ran with other forward settings ({kept.settings} != {expected})"
    rows, reason = _rows_in(kept, data)
    if rows is None:
        return None, reason
    return _gather(kept, rows, data), "reused"


def _gather(kept: _Kept, rows: list[int], data: TensorDict, log_probs: bool = True,
            fields: Optional[tuple[Optional[torch.Tensor], ...]] = None) -> tuple[Optional[torch.Tensor], ...]:
    """The kept statistics of ``rows`` as the prepass returns them: (batch, width), zeros after each response
    (``log_probs=False``: the entropy only, the log-probs None; ``fields``: these kept per-token tensors instead)."""
    from verl.utils.device import get_device_id

    width = padded(data["response_mask"]).shape[1]
    rows_t = torch.tensor(rows, dtype=torch.int64)
    starts, lengths = kept.offsets[rows_t], kept.offsets[rows_t + 1] - kept.offsets[rows_t]
    if len(rows) and int(lengths.max()) > width:
        raise ValueError(f"a kept response is longer ({int(lengths.max())}) than the minibatch's width {width}")
    positions = torch.arange(width).unsqueeze(0)
    inside = positions < lengths.unsqueeze(1)
    source = (starts.unsqueeze(1) + positions)[inside]
    device = get_device_id()
    out = []
    for flat in fields if fields is not None else (kept.log_probs if log_probs else None, kept.entropy):
        if flat is None:
            out.append(None)
            continue
        dense = torch.zeros(len(rows), width, dtype=flat.dtype)
        dense[inside] = flat[source]
        out.append(dense.to(device))
    return tuple(out)


def held_entropy(engine, data: TensorDict) -> tuple[Optional[torch.Tensor], str]:
    """pi_old's entropy of ``data``'s rows, (batch, response width) on the engine's device, from the log-prob pass
    held for this update (:func:`log_prob_pass` with ``hold=True``), whatever optimizer steps came since; or
    ``(None, why not)``. Local: the caller agrees over the ranks. Rows are matched by content, as in :func:`take`."""
    kept, reason = _kept_of(engine, _STATES.get(engine))
    if kept is None:
        return None, reason
    if not kept.held or kept.entropy is None:
        return None, "verl's log-prob pass was kept without its entropy for the whole update"
    rows, reason = _rows_in(kept, data)
    if rows is None:
        return None, reason
    return _gather(kept, rows, data, log_probs=False)[1], "held"


def held_proxy(engine, data: TensorDict) -> tuple[Optional[torch.Tensor], str]:
    """Lp-Reg's proxy log-probs of ``data``'s rows (pi_old's, :mod:`.proxy`), (batch, response width) on the engine's
    device (``-inf`` outside the min-p support, zeros after each response), from the log-prob pass held for this
    update, whatever optimizer steps came since; or ``(None, why not)``. Local: the caller agrees over the ranks.
    Rows are matched by content, as in :func:`take`."""
    kept, reason = _kept_of(engine, _STATES.get(engine))
    if kept is None:
        return None, reason
    if kept.proxy is None:
        return None, "verl's log-prob pass was kept without Lp-Reg's proxy"
    rows, reason = _rows_in(kept, data)
    if rows is None:
        return None, reason
    return _gather(kept, rows, data, fields=(kept.proxy,))[0], "held"


def held_on_every_rank(look_up, engine, data: TensorDict) -> tuple[Optional[torch.Tensor], Optional[str]]:
    """``look_up(engine, data)`` (:func:`held_entropy` or :func:`held_proxy`) agreed over the ranks:
    ``(tensor, None)`` when every rank has one, else ``(None, why)`` on every rank, ``why`` saying whether this rank
    or another has none (a failing look-up counts as none: every rank reaches the agreement, none waits in it)."""
    try:
        held, why = look_up(engine, data)
    except Exception as error:  # every rank must reach the agreement below
        held, why = None, f"look-up failed ({type(error).__name__}: {error})"
    if agreed(held is not None):
        return held, None
    return None, "another rank has none for its minibatch" if held is not None else f"this rank has none: {why}"


def agreed(ok: bool) -> bool:
    """``ok`` on every rank of the default process group (MIN of one integer); ``ok`` alone without one."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ok
    from verl.utils.device import get_device_id

    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=get_device_id())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


# ---------------------------------------------------------------------------------------------
# Rows and settings


def _non_tensor(data: TensorDict, key: str, default: Any) -> Any:
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=data, key=key, default=default)


def _forward_settings(data: TensorDict) -> tuple:
    temperature = data["temperature"] if "temperature" in data.keys() else None
    scalar = None if isinstance(temperature, torch.Tensor) else temperature
    return (("use_remove_padding", bool(_non_tensor(data, "use_remove_padding", True))),
            ("use_fused_kernels", bool(_non_tensor(data, "use_fused_kernels", False))),
            ("pad_mode", _pad_mode(data)),
            ("temperature", None if scalar is None else float(scalar)))


def _pad_mode(data: TensorDict) -> str:
    value = _non_tensor(data, "pad_mode", None)  # verl's DatasetPadMode (a str enum), default NO_PADDING
    return str(getattr(value, "value", value) or "no_padding")


def _pass_settings(data: TensorDict) -> tuple:
    """The forward settings of verl's log-prob pass (its batch, with TrainingWorker's defaults injected)."""
    dynamic = bool(_non_tensor(data, "use_dynamic_bsz", True))
    budget = _non_tensor(data, "max_token_len_per_gpu" if dynamic else "micro_batch_size_per_gpu", None)
    return _forward_settings(data) + (("use_dynamic_bsz", dynamic), ("budget", budget))


def _prepass_settings(engine, data: TensorDict) -> tuple:
    """The forward settings the ``infer``-layout prepass would use for ``data`` (:func:`.prepass.prepass_forward_batches`)."""
    dynamic = bool(_non_tensor(data, "use_dynamic_bsz", True))
    config = engine.engine_config
    budget = config.infer_max_token_len_per_gpu if dynamic else config.infer_micro_batch_size_per_gpu
    return _forward_settings(data) + (("use_dynamic_bsz", dynamic), ("budget", budget))


def _has_media(data: TensorDict) -> bool:
    if "multi_modal_inputs" not in data.keys():
        return False
    value = data["multi_modal_inputs"]
    items = value.tolist() if hasattr(value, "tolist") else list(value)
    return any(bool(item) for item in items)


def _split_lengths(data: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt, response) length of every row, as verl's ``no_padding_2_padding`` reads them."""
    prompts, responses = data["prompts"], data["responses"]
    if prompts.is_nested:
        return prompts.offsets().diff(), responses.offsets().diff()
    attention_mask = data["attention_mask"]
    return (attention_mask[:, : prompts.shape[1]].sum(dim=1), attention_mask[:, prompts.shape[1]:].sum(dim=1))


def _rows(tensor: torch.Tensor) -> list[torch.Tensor]:
    return list(tensor.unbind()) if tensor.is_nested else list(tensor)


def _row_digests(data: TensorDict) -> Optional[list[bytes]]:
    """One 16-byte BLAKE2b digest per row of its forward's inputs, or None when the layout is not known."""
    keys = data.keys()
    if not all(key in keys for key in ("input_ids", "position_ids", "prompts", "responses")):
        return None
    input_ids, position_ids = data["input_ids"], data["position_ids"]
    if not (input_ids.is_nested and position_ids.is_nested):
        return None
    prompt_lens, response_lens = (t.to("cpu", torch.int64) for t in _split_lengths(data))
    temperature = data["temperature"] if "temperature" in keys else None
    per_row_temperature = isinstance(temperature, torch.Tensor) and temperature.numel() == len(prompt_lens)
    ids_rows, position_rows = _rows(input_ids.to("cpu")), _rows(position_ids.to("cpu"))
    if not (len(ids_rows) == len(position_rows) == len(prompt_lens)):
        return None
    temperatures = temperature.reshape(-1).to("cpu", torch.float64) if per_row_temperature else None
    digests = []
    for row, (ids, positions) in enumerate(zip(ids_rows, position_rows)):
        digest = hashlib.blake2b(digest_size=16)
        digest.update(torch.tensor([int(prompt_lens[row]), int(response_lens[row])]).numpy().tobytes())
        for tensor in (ids, positions):
            digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
            digest.update(tensor.contiguous().numpy())  # the buffer itself, no copy
        if temperatures is not None:
            digest.update(temperatures[row].numpy().tobytes())
        digests.append(digest.digest())
    return digests


# ---------------------------------------------------------------------------------------------
# For diagnostics and tests


def forget(engine) -> None:
    """Drop what is kept for ``engine``, held or not (benchmarks and tests that switch one worker's loss between
    passes: a pass that keeps nothing leaves the previous pass's data, which only a weights bump or a keeping pass
    frees)."""
    state = _STATES.get(engine)
    if state is not None:
        state.kept = None
        state.missing = "dropped by reuse.forget"


def last_reason(engine) -> str:
    """The engine's last look-up: "reused", or why not (the first mismatch found)."""
    state = _STATES.get(engine)
    return "no log-prob pass kept for this engine" if state is None else state.reason


def kept_rows(engine) -> int:
    """Rows of verl's log-prob pass kept for the engine now (0 when none)."""
    state = _STATES.get(engine)
    return 0 if state is None or state.kept is None else len(state.kept.offsets) - 1


def kept_nbytes(engine) -> int:
    """Bytes of the tensors kept for the engine now, plus 16 per row digest (0 when none)."""
    state = _STATES.get(engine)
    return 0 if state is None or state.kept is None else state.kept.nbytes
