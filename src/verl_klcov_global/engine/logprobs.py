"""PATCH ``prepass_batched_logsumexp``: the prepass's no-grad log-probs of all rows at once, in place in the logits.

:func:`batched_logsumexp` swaps ``verl.utils.torch_functional.logprobs_from_logits_v2``
(the path ``logprobs_from_logits`` takes without flash-attn's cross-entropy kernel or with
``VERL_DISABLE_FLASH_ATTN_CE=1``, and without NPU kernels; the patch catalogue names the verl code) while the no-grad
prepass runs; restored afterwards. Its signature ``(logits, labels)`` is checked once, at import,
by :mod:`verl_klcov_global.seams`. verl loops over rows and allocates one row of temporaries per
``logsumexp``; for float32/float64 logits :func:`log_probs_in_place` computes
``label_logit - logsumexp`` for all rows at once, in place in the logits (which the prepass
reads nothing else from: entropy, sum(pi^2) and distillation are off and verl computes them
before the log-probs), so it allocates only per-row vectors: less than verl's loop. On any
device. What holds:

* CPU: bit-identical to verl's loop when verl sums each row in one thread (rows of at most
  32,768 logits, torch's reduction grain, or one intra-op thread). For wider rows with several
  threads verl's loop splits each row's sum over threads (its values depend on the thread
  count); the batched path sums every row in one thread, independent of the thread count and
  of how many rows share the call: the last bits may differ from verl's loop.
* Accelerators: self-consistency only. The same rows in the same micro-batch shapes give the
  same values run after run (reductions are deterministic), which is what the selection needs;
  the last bits may differ from verl's loop and between micro-batch shapes, as the model's
  own matmuls already do.

bf16/fp16 logits, grad-enabled calls and non-contiguous logits keep verl's path.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch

__all__ = ["batched_logsumexp", "log_probs_in_place"]


@contextlib.contextmanager
def batched_logsumexp() -> Iterator[None]:
    """PATCH ``prepass_batched_logsumexp`` for the duration of the block (see the module docstring)."""
    import verl.utils.torch_functional as verl_F

    original = verl_F.logprobs_from_logits_v2

    def logprobs_from_logits_batched(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        exact_dtype = logits.dtype in (torch.float32, torch.float64)  # verl's bf16/fp16 path stays untouched
        if (torch.is_grad_enabled() or not exact_dtype or logits.dim() < 2 or not logits.shape[0]
                or not logits.is_contiguous()):
            return original(logits, labels)
        return log_probs_in_place(logits, labels)

    verl_F.logprobs_from_logits_v2 = logprobs_from_logits_batched
    try:
        yield
    finally:
        verl_F.logprobs_from_logits_v2 = original


@torch.no_grad()
def log_probs_in_place(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``logits[..., label] - logsumexp(logits, -1)`` over all rows at once; overwrites ``logits``.

    ``logits`` (..., vocab) float, ``labels`` (...) int: returns (...). The same operations as
    ``torch.logsumexp`` (max, infinite maxima set to 0, exp of the difference, sum, log, add the
    max), done in place so that only per-row vectors are allocated.
    """
    label_logits = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
    maxima = torch.amax(logits, dim=-1, keepdim=True)
    maxima.masked_fill_(maxima.abs() == math.inf, 0)
    sums = logits.sub_(maxima).exp_().sum(dim=-1)
    return label_logits - sums.log_().add_(maxima.squeeze(-1))
