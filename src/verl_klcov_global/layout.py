"""Reading verl's minibatch layouts: nested or padded per-token fields in, dense (batch, width) tensors out.

verl 0.9.1's minibatch TensorDict holds response-level fields nested (v1 trainer) or padded
(legacy trainer), and ``input_ids`` nested prompt + response (both trainers; a padded
``input_ids`` (B, L) is read with ``attention_mask`` when the batch has one). Everything
here works on either layout:

* :func:`padded`, :func:`fit_width`: dense views of one field;
* :func:`read_fields`: the :class:`MinibatchFields` a mode's selection reads (its
  ``ModeSpec.response_fields`` / ``sequence_fields``), next to the prepass log-probs;
* :func:`mask_in_layout_of`: the minibatch mask stored in the layout of ``response_mask``, so
  verl's micro-batch split carries each slice to its micro-batch;
* :func:`micro_batch_mask`: a micro-batch's slice read back the way verl's ``ppo_loss`` reads
  ``response_mask``, so the shapes match.

No verl import: only torch and tensordict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from tensordict import TensorDict

__all__ = ["MinibatchFields", "fit_width", "mask_in_layout_of", "micro_batch_mask", "micro_batch_values", "padded",
           "read_fields", "sequence_token_ids", "values_in_layout_of"]


def padded(tensor: torch.Tensor) -> torch.Tensor:
    """(batch, max_len) dense view of a jagged nested or already padded per-token field."""
    return tensor.to_padded_tensor(0) if tensor.is_nested else tensor


def fit_width(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Cut or zero-pad dim 1 of a (batch, len) tensor to ``width``."""
    if tensor.shape[1] >= width:
        return tensor[:, :width]
    return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]))


def sequence_token_ids(data: TensorDict, key: str = "input_ids") -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(batch, length) token ids of each whole sequence (prompt + response) and its real-token mask.

    From ``data[key]``: nested -> padded with the row lengths as mask; padded -> its
    ``attention_mask`` when present (else None: every position is real).
    """
    ids = data[key]
    if ids.is_nested:
        lengths = ids.offsets().diff()
        dense = ids.to_padded_tensor(0)
        positions = torch.arange(dense.shape[1], device=dense.device)
        return dense, positions.unsqueeze(0) < lengths.to(dense.device).unsqueeze(1)
    mask = padded(data["attention_mask"]).bool() if "attention_mask" in data.keys() else None
    return ids, mask


@dataclass(frozen=True)
class MinibatchFields:
    """What a selection reads of one rank's minibatch, dense, in its original sample order.

    ``response_mask``, ``log_probs`` (the prepass's current-policy log-probs) and every
    ``response[key]`` are (batch, response_len) on the log-probs' device; ``sequence[key]`` is
    ``(ids, real)`` of :func:`sequence_token_ids` (left where the batch lives: a selection moves
    what it needs). ``entropy``: the prepass's current-policy entropy, (batch, response_len) like
    ``log_probs``, for a mode whose prepass computes it (``ModeSpec.prepass_reads_entropy``), else None.
    """

    response_mask: torch.Tensor
    log_probs: torch.Tensor
    response: dict[str, torch.Tensor]
    sequence: dict[str, tuple[torch.Tensor, Optional[torch.Tensor]]]
    entropy: Optional[torch.Tensor] = None


def read_fields(log_probs: torch.Tensor, data: TensorDict, response_fields: tuple[str, ...] = (),
                sequence_fields: tuple[str, ...] = (), *, reader: str = "the selection",
                entropy: Optional[torch.Tensor] = None) -> MinibatchFields:
    """The dense :class:`MinibatchFields` of ``data`` for a selection that reads the given fields.

    ``log_probs`` (batch, width) and ``entropy`` (the same, or None) are cut or padded to the width
    of ``response_mask``. A field
    the minibatch lacks raises ``KeyError`` naming ``reader`` (e.g. the loss mode) and the keys present.
    """
    missing = [key for key in ("response_mask", *response_fields, *sequence_fields) if key not in data.keys()]
    if missing:
        raise KeyError(
            f"{reader} needs the minibatch's `{missing[0]}` (its selection reads {list(response_fields)} and "
            f"{list(sequence_fields)}); verl 0.9.1's trainers send `input_ids` and these response fields to the "
            f"actor update. The minibatch has {sorted(data.keys())}"
        )
    response_mask = padded(data["response_mask"]).to(log_probs.device)
    return MinibatchFields(
        response_mask=response_mask,
        log_probs=fit_width(log_probs, response_mask.shape[1]),
        response={key: padded(data[key]).to(log_probs.device) for key in response_fields},
        sequence={key: sequence_token_ids(data, key) for key in sequence_fields},
        entropy=None if entropy is None else fit_width(entropy, response_mask.shape[1]),
    )


def mask_in_layout_of(mask: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``mask`` (batch, width) bool, laid out like ``response_mask`` (nested or padded), in its dtype and on its device.

    The prepass's mask lives where the log-probs were computed (the accelerator); the minibatch
    TensorDict usually lives on the host until verl moves each micro-batch.
    """
    return values_in_layout_of(mask, response_mask, dtype=response_mask.dtype)


def values_in_layout_of(values: torch.Tensor, response_mask: torch.Tensor,
                        dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A (batch, width) per-token tensor laid out like ``response_mask`` (nested or padded), on its device, in
    ``dtype`` (default: ``values``' own)."""
    values = values.to(response_mask.device, dtype or values.dtype)
    if not response_mask.is_nested:
        return values[:, : response_mask.shape[1]]
    offsets = response_mask.offsets()
    lengths = offsets.diff()
    positions = torch.arange(values.shape[1], device=values.device)
    inside = positions.unsqueeze(0) < lengths.to(values.device).unsqueeze(1)
    return torch.nested.nested_tensor_from_jagged(values[inside], offsets=offsets.to(values.device))


def micro_batch_mask(data: TensorDict, key: str) -> torch.Tensor:
    """A micro-batch's (batch, response_len) bool mask ``data[key]``, padded as ``ppo_loss`` pads ``response_mask``."""
    return micro_batch_values(data, key).bool()


def micro_batch_values(data: TensorDict, key: str) -> torch.Tensor:
    """A micro-batch's (batch, response_len) per-token field ``data[key]``, padded (with 0) as ``ppo_loss`` pads
    ``response_mask``."""
    return data.select("response_mask", key).to_padded_tensor()[key]
