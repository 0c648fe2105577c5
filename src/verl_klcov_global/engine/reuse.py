"""Look-ups in verl's kept log-prob pass (:mod:`.kept_pass`): an optimizer step's statistics without a prepass.

Two kinds of look-up read what the pass computed, matching the minibatch's rows by content digest (a shuffled or
re-split minibatch still matches; a row the pass did not see does not):

* **reuse** (:func:`take`): the current policy's log-probs (and entropy) for an optimizer step whose parameters are
  exactly those the pass ran with, in place of the prepass. It is handed over when, and only when, the evidence in
  this worker process says it is that step's own statistics:

  - the weights did not change since the pass (:mod:`.weights`: the engine's weights version is the pass's);
  - the rows are the rows the pass saw, and no two copies of a row got different statistics
    (:attr:`Ambiguity.REFUSE`: such a copy's statistics are not the prepass's for certain);
  - the forward is the prepass's: the pass's forward settings (``use_remove_padding``, ``use_fused_kernels``,
    ``pad_mode``, the temperature, dynamic batching and its token budget or the static micro-batch size) equal
    those the ``infer``-layout prepass would use, i.e. the engine's log-prob inference settings;
  - it has what the step reads: the entropy where the step needs it (``ModeSpec.reads_entropy``), and
    ``prepass_layout=infer`` (never ``train``, which asks for the training micro-batches' forward).

  Any mismatch means a prepass, never stale statistics. On a reused step the statistics are the pass's, bit for
  bit; where verl's numerics depend on which rows share a micro-batch (bf16, packed sequences, some CPUs) they are
  the pass's own numerics, still independent of the training micro-batch size (docs/PREPASS.md).
* **held** (:func:`held_entropy`, :func:`held_proxy`): pi_old's statistics of a pass held for the whole update
  (``prepass_layout=old``'s entropy, Lp-Reg's proxy), read by every optimizer step of the update whatever steps
  came since. They have no other source, so copies of a row are resolved, not refused
  (:attr:`Ambiguity.FIRST_OCCURRENCE`).

Every rank decides locally, then the decision is agreed (:func:`agreed`): every rank reuses or every rank runs the
prepass, whose forward is collective; every rank gets its held statistics or every rank raises.
"""

from __future__ import annotations

import enum
from typing import Optional

import torch
import torch.distributed as dist
from tensordict import TensorDict

from ..layout import padded
from .kept_pass import KeptPass, forward_settings, has_media, is_disabled, non_tensor, row_digests
from .weights import EngineState, state_of

__all__ = ["AMBIGUOUS_ROWS", "Ambiguity", "REUSE_RECORD_NAME", "AgreementGroupError", "agreed", "agreement_group",
           "forget", "held_entropy", "held_on_every_rank", "held_proxy", "kept_nbytes", "kept_rows", "last_reason",
           "rows_in", "take"]

#: ``torch.profiler.record_function`` name of the look-up of verl's statistics.
REUSE_RECORD_NAME = "verl_klcov_global.reuse"
#: Why :attr:`Ambiguity.REFUSE` turns a minibatch down.
AMBIGUOUS_ROWS = "rows of equal content got different statistics in verl's log-prob pass"


class Ambiguity(enum.Enum):
    """What a look-up does with a row whose content the pass saw more than once, with statistics that differ in some
    bit (the copies sat in different micro-batch company: bf16, packed sequences, some CPUs).

    * ``REFUSE`` (reuse): the minibatch is not looked up; the prepass runs. Which copy's last bits the prepass would
      reproduce is not known, and reuse must hand over exactly the prepass's statistics or none.
    * ``FIRST_OCCURRENCE`` (held statistics): every copy gets the statistics of the row's first occurrence in the
      pass. The copies are one sequence under one policy, equal in exact arithmetic; the first occurrence is a
      function of the pass alone (the whole per-rank batch, in its order), so what a row gets does not depend on the
      update's minibatch split, its shuffle, its micro-batches or the epoch, and equal rows get equal statistics.
      Matching each copy to "its own" pass row would need an identity that survives verl's shuffle and minibatch
      split; the content is the only one the rows carry.
    """

    REFUSE = "refuse"
    FIRST_OCCURRENCE = "first occurrence"


class AgreementGroupError(RuntimeError):
    """The engine's collectives do not span the default process group, which the plugin's agreements reduce over."""


# ---------------------------------------------------------------------------------------------
# Finding a minibatch's rows in the kept pass


def rows_in(kept: KeptPass, data: TensorDict, ambiguity: Ambiguity) -> tuple[Optional[list[int]], str]:
    """The pass's row of every row of ``data``, matched by digest (copies of a row resolved by ``ambiguity``); or
    None and the first reason it cannot be."""
    if has_media(data):
        return None, "the minibatch has multi-modal inputs"
    digests = row_digests(data)
    if digests is None:
        return None, "the minibatch has no nested input_ids/position_ids or no prompts/responses"
    rows = [kept.index.get(digest) for digest in digests]
    if any(row is None for row in rows):
        return None, f"{sum(row is None for row in rows)} of {len(rows)} rows were not in verl's log-prob pass"
    if ambiguity is Ambiguity.REFUSE and any(digest in kept.ambiguous for digest in digests):
        return None, AMBIGUOUS_ROWS
    return rows, "found"


def _gather(kept: KeptPass, rows: list[int], data: TensorDict,
            fields: tuple[Optional[torch.Tensor], ...]) -> tuple[Optional[torch.Tensor], ...]:
    """The kept per-token ``fields`` (each flat, as in :class:`.kept_pass.KeptPass`) of ``rows``, as the prepass
    returns them: (batch, width) on verl's device, zeros after each response; None stays None."""
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
    for flat in fields:
        if flat is None:
            out.append(None)
            continue
        dense = torch.zeros(len(rows), width, dtype=flat.dtype)
        dense[inside] = flat[source]
        out.append(dense.to(device))
    return tuple(out)


def _kept_of(engine, state: Optional[EngineState]) -> tuple[Optional[KeptPass], str]:
    """What is kept for ``engine`` now, if it was kept for the engine's current module and optimizer; else why not."""
    if state is None:
        return None, "no log-prob pass kept for this engine"
    if not state.is_current_for(engine):
        return None, "the engine's module or optimizer was rebuilt after verl's log-prob pass"
    if state.kept is None:
        return None, state.missing
    return state.kept, "kept"


# ---------------------------------------------------------------------------------------------
# Reuse: the current policy's statistics for an optimizer step


def take(engine, data: TensorDict, *, layout: str, needs_entropy: bool) -> Optional[tuple[torch.Tensor,
                                                                                           Optional[torch.Tensor]]]:
    """This step's (log-probs, entropy or None), each (batch, response width) on the engine's device, from verl's
    log-prob pass, or None: then the prepass runs. Collective: every rank calls it and every rank gets the same
    answer (see the module docstring). ``layout`` is ``prepass_layout``; ``needs_entropy`` what the step reads."""
    if layout != "infer" or is_disabled():  # the same on every rank: no agreement needed
        return None
    with torch.profiler.record_function(REUSE_RECORD_NAME):
        state = None
        try:  # every rank must reach the agreement below, whatever happens here
            state = state_of(engine)
            found, reason = _look_up(engine, state, data, needs_entropy)
        except Exception as error:  # never fail a step for want of reuse: the prepass runs
            found, reason = None, f"look-up failed ({type(error).__name__}: {error})"
        if not agreed(engine, found is not None):
            if found is not None:
                reason = "another rank cannot reuse verl's log-prob pass for this step"
            found = None
        if state is not None:
            state.reason = "reused" if found is not None else reason
    return found


def _look_up(engine, state: Optional[EngineState], data: TensorDict, needs_entropy: bool):
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
    rows, reason = rows_in(kept, data, Ambiguity.REFUSE)
    if rows is None:
        return None, reason
    return _gather(kept, rows, data, (kept.log_probs, kept.entropy)), "reused"


def _prepass_settings(engine, data: TensorDict) -> tuple:
    """The forward settings the ``infer``-layout prepass would use for ``data`` (:func:`.prepass.prepass_forward_batches`)."""
    dynamic = bool(non_tensor(data, "use_dynamic_bsz", True))
    config = engine.engine_config
    budget = config.infer_max_token_len_per_gpu if dynamic else config.infer_micro_batch_size_per_gpu
    return forward_settings(data) + (("use_dynamic_bsz", dynamic), ("budget", budget))


# ---------------------------------------------------------------------------------------------
# Held: pi_old's statistics for every optimizer step of the update


def _held(engine, data: TensorDict, field: str, missing: str) -> tuple[Optional[torch.Tensor], str]:
    kept, reason = _kept_of(engine, state_of(engine))
    if kept is None:
        return None, reason
    values = getattr(kept, field)
    if not kept.held or values is None:
        return None, missing
    rows, reason = rows_in(kept, data, Ambiguity.FIRST_OCCURRENCE)
    if rows is None:
        return None, reason
    return _gather(kept, rows, data, (values,))[0], "held"


def held_entropy(engine, data: TensorDict) -> tuple[Optional[torch.Tensor], str]:
    """pi_old's entropy of ``data``'s rows, (batch, response width) on the engine's device, from the log-prob pass
    held for this update (:func:`.kept_pass.log_prob_pass` with ``hold=True``), whatever optimizer steps came since;
    or ``(None, why not)``. Copies of a row get its first occurrence's (:attr:`Ambiguity.FIRST_OCCURRENCE`). Local:
    the caller agrees over the ranks (:func:`held_on_every_rank`)."""
    return _held(engine, data, "entropy", "verl's log-prob pass was kept without its entropy for the whole update")


def held_proxy(engine, data: TensorDict) -> tuple[Optional[torch.Tensor], str]:
    """Lp-Reg's proxy log-probs of ``data``'s rows (pi_old's, :mod:`.proxy`), (batch, response width) on the engine's
    device (``-inf`` outside the min-p support, zeros after each response), from the log-prob pass held for this
    update, whatever optimizer steps came since; or ``(None, why not)``. Copies of a row get its first occurrence's
    (:attr:`Ambiguity.FIRST_OCCURRENCE`). Local: the caller agrees over the ranks (:func:`held_on_every_rank`)."""
    return _held(engine, data, "proxy", "verl's log-prob pass was kept without Lp-Reg's proxy")


def held_on_every_rank(look_up, engine, data: TensorDict) -> tuple[Optional[torch.Tensor], Optional[str]]:
    """``look_up(engine, data)`` (:func:`held_entropy` or :func:`held_proxy`) agreed over the ranks:
    ``(tensor, None)`` when every rank has one, else ``(None, why)`` on every rank, ``why`` saying whether this rank
    or another has none (a failing look-up counts as none: every rank reaches the agreement, none waits in it)."""
    try:
        held, why = look_up(engine, data)
    except Exception as error:  # every rank must reach the agreement below
        held, why = None, f"look-up failed ({type(error).__name__}: {error})"
    if agreed(engine, held is not None):
        return held, None
    return None, "another rank has none for its minibatch" if held is not None else f"this rank has none: {why}"


# ---------------------------------------------------------------------------------------------
# Agreements


def agreement_group(engine) -> Optional[dist.ProcessGroup]:
    """The group the plugin's agreements reduce over for ``engine``: every rank of the engine's collectives.

    An agreement decides whether a collective runs at all (the prepass forward, whose FSDP all-gathers span the
    engine's whole device mesh) or whether every rank raises together. So it must reach every rank of that mesh,
    Ulysses SP peers included; the engine's data-parallel group (what the selections reduce over, because SP peers
    hold the same rows and must count once) leaves them out. verl's FSDP engine builds its mesh over the whole
    default process group, so that is the group (None). An engine whose mesh spans fewer ranks makes every rank
    raise :class:`AgreementGroupError` (every rank computes the same sizes): an agreement over the default group
    would wait for ranks that never call it.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    mesh = getattr(engine, "device_mesh", None)
    world = dist.get_world_size()
    if mesh is None or mesh.size() != world:
        raise AgreementGroupError(
            f"{type(engine).__name__}'s device mesh spans {'no' if mesh is None else mesh.size()} of the default "
            f"process group's {world} ranks: the plugin's agreements (reuse, held statistics, the static prepass's "
            "forward count) reduce over the default group, as verl's FSDP engine builds its mesh over all of it "
            "(seam: FSDPEngineWithLMHead's device mesh spans the default process group)")
    return None


def agreed(engine, ok: bool) -> bool:
    """``ok`` on every rank of ``engine``'s :func:`agreement_group` (MIN of one integer); ``ok`` alone without one."""
    group = agreement_group(engine)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return ok
    from verl.utils.device import get_device_id

    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=get_device_id())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


# ---------------------------------------------------------------------------------------------
# For diagnostics and tests


def forget(engine) -> None:
    """Drop what is kept for ``engine``, held or not (benchmarks and tests that switch one worker's loss between
    passes: a pass that keeps nothing leaves the previous pass's data, which only a weights bump or a keeping pass
    frees)."""
    state = state_of(engine)
    if state is not None:
        state.kept = None
        state.missing = "dropped by reuse.forget"


def last_reason(engine) -> str:
    """The engine's last reuse look-up: "reused", or why not (the first mismatch found)."""
    state = state_of(engine)
    return "no log-prob pass kept for this engine" if state is None else state.reason


def kept_rows(engine) -> int:
    """Rows of verl's log-prob pass kept for the engine now (0 when none)."""
    state = state_of(engine)
    return 0 if state is None or state.kept is None else state.kept.rows


def kept_nbytes(engine) -> int:
    """Bytes of the tensors kept for the engine now, plus 16 per row digest (0 when none)."""
    state = state_of(engine)
    return 0 if state is None or state.kept is None else state.kept.nbytes
