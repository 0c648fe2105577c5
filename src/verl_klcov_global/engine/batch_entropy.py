"""The old policy's entropy over the trainer step's whole batch, in the worker: verl's driver-side ``actor/entropy``.

verl's trainers run the actor's log-prob pass with ``calculate_entropy=True`` once per trainer step and the driver
logs ``actor/entropy = agg_loss(entropy, response_mask, loss_agg_mode)`` over the whole batch (the legacy trainer's
``ray_trainer.py``, the v1 trainer's ``trainer_base.py``). That figure never reaches the workers. A mode
whose rule reads it once per trainer step (STARE's gate, ``ModeSpec.update_rule``) gets it here instead:

1. :func:`record_pass` (called by PATCH ``log_prob_pass_keep`` for a pass opened with ``batch_entropy=True``, in
   every ``prepass_layout``) turns this rank's shard of the pass into six integers (:func:`pass_sums`): each
   token's entropy on a fixed grid of 2**-24 nats (:data:`GRID_BITS`), summed exactly, per row and per rank. A pass
   bumps the engine's *pass serial*;
2. :func:`agree` (once per optimizer step, on every rank of the data-parallel group) all-reduces the integers and
   whether this rank's serial is new since the last step: the first optimizer step of an update sees a new pass
   on every rank, the later ones (minibatches, PPO epochs) on none. One all-reduce of 8 int64 per optimizer step;
3. :func:`mean_entropy` turns the group's sums into the driver's aggregate for ``loss_agg_mode``.

Exactness: the sums are integers, so the result is bit-identical for any data-parallel or micro-batch split of the
batch (the per-token values are the pass's own, which the driver also gets). It differs from the driver's float32
reduction of the same values by that reduction's rounding and the grid (at most 2**-25 nats per token, 3e-8), so a
gate can read differently from ``actor/entropy`` only where the entropy is within about 1e-6 of the target.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from tensordict import TensorDict

from ..layout import fit_width, padded

__all__ = ["GRID_BITS", "PassEntropyError", "UpdateEntropy", "agree", "mean_entropy", "pass_sums", "record_pass",
           "recorded_serial"]

#: Each token's entropy is rounded to a multiple of 2**-GRID_BITS nats before the exact integer sums: a token
#: holds at most ln(vocabulary) < 2**5 nats, i.e. < 2**29 units, so an int64 sum holds 2**34 tokens a step.
GRID_BITS = 24
_GRID = float(2 ** GRID_BITS)
#: ``pass_sums``' fields, in order
FIELDS = ("entropy_sum", "tokens", "row_mean_sum", "rows", "nonfinite", "missing")


class PassEntropyError(RuntimeError):
    """The old policy's batch entropy is not available to an update that reads it."""


@dataclass
class _Record:
    serial: int = 0  # passes recorded for this engine in this process
    consumed: int = 0  # the serial the last optimizer step read
    sums: Optional[torch.Tensor] = None  # (6,) int64, FIELDS
    why_missing: str = ""


_RECORDS: "weakref.WeakKeyDictionary[Any, _Record]" = weakref.WeakKeyDictionary()


def pass_sums(entropy: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """This rank's part of the batch-entropy sums: (6,) int64, :data:`FIELDS`.

    Args:
        entropy: (batch, width) the pass's per-token entropy (any float dtype; converted to float32 first, as the
            driver does).
        response_mask: (batch, width), nonzero at the tokens the driver's ``agg_loss`` counts.

    ``entropy_sum``: sum over masked tokens of ``round(H_t * 2**24)``; ``tokens``: their count; ``row_mean_sum``:
    sum over rows with a token of ``round(S_i / n_i)`` (``S_i`` the row's ``entropy_sum``); ``rows``: those rows;
    ``nonfinite``: masked tokens whose entropy is not finite (or off the int64 grid); ``missing`` 0.
    """
    mask = response_mask.bool()
    values = entropy.detach().to(torch.float32).to(torch.float64)
    finite = torch.isfinite(values) & (values.abs() < 2.0 ** 30)
    nonfinite = int((mask & ~finite).sum())
    units = torch.where(mask & finite, (values * _GRID).round(), values.new_zeros(())).to(torch.int64)
    row_sums = units.sum(dim=1)
    row_tokens = mask.sum(dim=1).to(torch.int64)
    has_tokens = row_tokens > 0
    row_means = torch.where(has_tokens, (row_sums.to(torch.float64) / row_tokens.clamp(min=1)).round(),
                            torch.zeros((), dtype=torch.float64)).to(torch.int64)
    return torch.tensor([int(row_sums.sum()), int(row_tokens.sum()), int(row_means.sum()), int(has_tokens.sum()),
                         nonfinite, 0], dtype=torch.int64)


def mean_entropy(sums: torch.Tensor, loss_agg_mode: str, loss_scale_factor: Optional[float] = None) -> float:
    """The driver's ``agg_loss(entropy, response_mask, loss_agg_mode, loss_scale_factor=...)`` from the group's
    :func:`pass_sums`: ``token-mean`` sum / tokens; ``seq-mean-token-mean`` the mean over rows with a token of the
    row's token mean; ``seq-mean-token-sum-norm`` the mean over those rows of the row's sum, divided by
    ``loss_scale_factor``. NaN where the driver's is NaN (a non-finite entropy) or 0/0 (no token)."""
    entropy_sum, tokens, row_mean_sum, rows, nonfinite, _ = (int(x) for x in sums.tolist())
    if nonfinite:
        return math.nan
    if loss_agg_mode == "token-mean":
        return entropy_sum / _GRID / tokens if tokens else math.nan
    if loss_agg_mode == "seq-mean-token-mean":
        return row_mean_sum / _GRID / rows if rows else math.nan
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None:
            raise ValueError("seq-mean-token-sum-norm's batch entropy needs actor.loss_scale_factor")
        return entropy_sum / _GRID / rows / float(loss_scale_factor) if rows else math.nan
    raise ValueError(f"no per-token batch entropy for loss_agg_mode={loss_agg_mode!r}")


def record_pass(engine, data: TensorDict, outputs: Any) -> None:
    """Keep this rank's :func:`pass_sums` of one log-prob pass of ``engine``; never raises (a failure is recorded,
    and the update that reads it raises with the reason on every rank)."""
    record = _RECORDS.get(engine)
    if record is None:
        record = _RECORDS[engine] = _Record()
    record.serial += 1  # first, so that every rank counts this pass whatever happens below
    record.sums, record.why_missing = None, ""
    try:
        from verl.workers.utils.padding import no_padding_2_padding

        model_output = outputs.get("model_output") if isinstance(outputs, dict) else None
        if not model_output or "entropy" not in model_output:
            record.why_missing = "verl's log-prob pass computed no entropy (calculate_entropy=False)"
            return
        if "response_mask" not in data.keys():
            record.why_missing = "verl's log-prob pass had no response_mask"
            return
        response_mask = padded(data["response_mask"])
        entropy = fit_width(no_padding_2_padding(model_output["entropy"], data), response_mask.shape[1])
        record.sums = pass_sums(entropy.to("cpu"), response_mask.to("cpu"))
    except Exception as error:  # never verl's pass's failure
        record.sums = None
        record.why_missing = f"verl's log-prob pass's entropy could not be read ({type(error).__name__}: {error})"


def recorded_serial(engine) -> int:
    """Log-prob passes recorded for ``engine`` in this process (0: none)."""
    record = _RECORDS.get(engine)
    return 0 if record is None else record.serial


@dataclass(frozen=True)
class UpdateEntropy:
    """What one optimizer step learns: ``first`` (the update's first optimizer step: a new pass on every rank) and
    the group's sums of that pass (``sums``, (6,) int64; meaningful when ``first``)."""

    first: bool
    sums: torch.Tensor


def agree(engine, group: Optional[dist.ProcessGroup], mode_name: str) -> UpdateEntropy:
    """Collective over ``group`` (every rank, every optimizer step of a mode that reads the batch entropy): one
    all-reduce of 8 int64. Raises :class:`PassEntropyError` on every rank alike when no pass was recorded (e.g.
    ``bypass_mode``), when the ranks disagree on whether this step starts an update, or when a rank could not read
    its pass."""
    record = _RECORDS.get(engine)
    serial = 0 if record is None else record.serial
    new = serial > 0 and serial != record.consumed
    sums = record.sums if serial > 0 and record.sums is not None else torch.tensor([0, 0, 0, 0, 0, 1],
                                                                                    dtype=torch.int64)
    payload = torch.cat([sums, torch.tensor([int(new), int(serial > 0)], dtype=torch.int64)])
    world = 1
    if group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        from verl.utils.device import get_device_id

        reduced = payload.to(get_device_id())
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=group)
        payload, world = reduced.to("cpu"), dist.get_world_size(group)
    group_sums, new_ranks, ranks_with_pass = payload[:6], int(payload[6]), int(payload[7])
    if ranks_with_pass < world:
        raise PassEntropyError(_no_pass_message(mode_name, f"{world - ranks_with_pass} of {world} ranks"))
    if 0 < new_ranks < world:
        raise PassEntropyError(
            f"{mode_name}: {new_ranks} of {world} data-parallel ranks saw a new log-prob pass before this optimizer "
            "step and the others did not; the batch entropy of the update cannot be agreed")
    first = new_ranks == world
    if first and int(group_sums[5]):
        why = record.why_missing or "see the other ranks' errors"
        raise PassEntropyError(f"{mode_name} reads the old policy's entropy over the trainer step's batch from verl's "
                               f"log-prob pass, and {int(group_sums[5])} of {world} ranks could not read it: {why}")
    if first:
        record.consumed = serial
    return UpdateEntropy(first=first, sums=group_sums)


def _no_pass_message(mode_name: str, who: str) -> str:
    return (f"{mode_name} reads the old policy's entropy over the trainer step's batch (verl's actor/entropy) from "
            f"verl's actor log-prob pass, and {who} saw no such pass before the update. verl runs none with "
            "algorithm.rollout_correction.bypass_mode=True: set it to False. To drive the engine directly, run the "
            "pass first (verl_klcov_global.lab.experiment.hold_old_policy_pass does it for the lab)")
