"""Loss mode -> its settings reader, the minibatch fields its selection reads, and its selection.

The prepass hook (``hook.py``) is the same for every global loss mode: one no-grad forward
of the optimizer minibatch, then ``mode.select(log_probs, data, settings, group)``, then the
mask travels to the micro-batches. What differs per mode lives here:

* ``kl_cov_global``: advantages, prepass log-probs, ``response_mask`` ->
  :func:`.selection.select_kl_cov_tokens`;
* ``clip_cov_global``: the same plus ``old_log_probs`` and the sequences' token ids
  (``input_ids``, hashed for the reproducible draw) -> :func:`.selection.select_clip_cov_tokens`.

Minibatch layouts (verl 0.9.1): response-level fields are nested (v1 trainer) or padded
(legacy trainer); :func:`padded` reads both. ``input_ids`` is nested prompt + response
(both trainers); a padded ``input_ids`` (B, L) is read with ``attention_mask`` when the
batch has one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist
from tensordict import TensorDict

from .config import (
    CLIP_COV_LOSS_MODE,
    CLIP_COV_METRIC_PREFIX,
    LOSS_MODE,
    METRIC_PREFIX,
    global_loss_mode,
    read_clip_cov_settings,
    read_settings,
)
from .selection import select_clip_cov_tokens, select_kl_cov_tokens

__all__ = [
    "GlobalLossMode", "Selection", "KL_COV", "CLIP_COV", "MODES", "global_mode_of", "padded", "fit_width",
    "sequence_token_ids",
]


class Selection(Protocol):
    """What the hook needs of a selection result (``KLCovSelection``, ``ClipCovSelection``)."""

    mask: torch.Tensor  # (batch, response_len) bool, this rank's minibatch in its original order
    quota: int
    num_selected: int

    def figures(self) -> dict[str, float]: ...


@dataclass(frozen=True)
class GlobalLossMode:
    """One global loss mode as the hook sees it.

    ``read_settings(actor_config)`` validates the knobs (the result has ``prepass_layout``);
    ``select(log_probs, data, settings, group)`` makes the selection from the prepass's
    (batch, width) log-probs and the minibatch ``data``; figures and timings are logged
    under ``metric_prefix``.
    """

    name: str
    metric_prefix: str
    read_settings: Callable[[Any], Any]
    select: Callable[[torch.Tensor, TensorDict, Any, Optional[dist.ProcessGroup]], Selection]


# ---------------------------------------------------------------------------------------------
# Reading the minibatch


def padded(tensor: torch.Tensor) -> torch.Tensor:
    """(batch, max_len) dense view of a jagged nested or already padded per-token field."""
    return tensor.to_padded_tensor(0) if tensor.is_nested else tensor


def fit_width(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Cut or zero-pad dim 1 of a (batch, len) tensor to ``width``."""
    if tensor.shape[1] >= width:
        return tensor[:, :width]
    return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]))


def _response_fields(log_probs: torch.Tensor, data: TensorDict, *keys: str) -> list[torch.Tensor]:
    """``response_mask``, then ``keys``, padded, on the log-probs' device; plus the log-probs at their width."""
    response_mask = padded(data["response_mask"]).to(log_probs.device)
    fields = [padded(data[key]).to(log_probs.device) for key in keys]
    return [response_mask, fit_width(log_probs, response_mask.shape[1]), *fields]


def sequence_token_ids(data: TensorDict) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(batch, length) token ids of each whole sequence (prompt + response) and its real-token mask.

    From ``input_ids``: nested -> padded with the row lengths as mask; padded -> its
    ``attention_mask`` when present (else every position is real).
    """
    if "input_ids" not in data.keys():
        raise KeyError(
            "clip_cov_global needs the minibatch's `input_ids` (prompt + response token ids) to draw its tokens "
            "reproducibly; verl 0.9.1's trainers always send it to the actor update. The minibatch has "
            f"{sorted(data.keys())}"
        )
    ids = data["input_ids"]
    if ids.is_nested:
        lengths = ids.offsets().diff()
        dense = ids.to_padded_tensor(0)
        positions = torch.arange(dense.shape[1], device=dense.device)
        return dense, positions.unsqueeze(0) < lengths.to(dense.device).unsqueeze(1)
    mask = padded(data["attention_mask"]).bool() if "attention_mask" in data.keys() else None
    return ids, mask


# ---------------------------------------------------------------------------------------------
# The modes


def _select_kl_cov(log_probs: torch.Tensor, data: TensorDict, settings, group) -> Selection:
    response_mask, log_probs, advantages = _response_fields(log_probs, data, "advantages")
    return select_kl_cov_tokens(advantages, log_probs, response_mask, settings.kl_cov_ratio, group=group)


def _select_clip_cov(log_probs: torch.Tensor, data: TensorDict, settings, group) -> Selection:
    response_mask, log_probs, advantages, old_log_probs = _response_fields(
        log_probs, data, "advantages", "old_log_probs")
    token_ids, token_mask = sequence_token_ids(data)  # may stay on the host: the selection moves what it hashes
    return select_clip_cov_tokens(
        advantages, log_probs, old_log_probs, response_mask, token_ids, token_mask=token_mask,
        clip_cov_ratio=settings.clip_cov_ratio, clip_cov_lb=settings.clip_cov_lb, clip_cov_ub=settings.clip_cov_ub,
        clip_ratio_low=settings.clip_ratio_low, clip_ratio_high=settings.clip_ratio_high,
        seed=settings.clip_cov_seed, group=group,
    )


KL_COV = GlobalLossMode(LOSS_MODE, METRIC_PREFIX, read_settings, _select_kl_cov)
CLIP_COV = GlobalLossMode(CLIP_COV_LOSS_MODE, CLIP_COV_METRIC_PREFIX, read_clip_cov_settings, _select_clip_cov)
MODES = {mode.name: mode for mode in (KL_COV, CLIP_COV)}


def global_mode_of(actor_config: Any) -> Optional[GlobalLossMode]:
    """The :class:`GlobalLossMode` an actor config selects, or None for every other loss mode."""
    name = global_loss_mode(actor_config)
    return None if name is None else MODES[name]
