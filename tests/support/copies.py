"""Rows of equal content whose statistics in verl's log-prob pass differ in the last bit, made certain on any CPU.

GRPO with ``n > 1`` samples equal responses, the more so as entropy collapses. In bf16, in packed sequences and on some
CPUs, copies of a row that sit in different micro-batch company get log-probs apart in the last bits (reproduced on
CPU in fp32 with verl's FSDP engine, packed, dynamic micro-batches: 4.8e-7). On a CPU whose padded fp32 numerics do
not follow the company the copies come out equal, so a test that must meet such rows makes them differ itself:
:func:`copies_one_ulp_apart`.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch


@contextlib.contextmanager
def copies_one_ulp_apart() -> Iterator[list[int]]:
    """Inside the block, in every log-prob pass the plugin keeps (:func:`verl_klcov_global.engine.kept_pass.log_prob_pass`),
    each later copy of a row (equal content digest) gets log-probs one ulp above its first occurrence's, before the
    plugin keeps them and verl returns them (so ``old_log_probs`` carry it too). Yields the number of copies moved,
    one entry per pass."""
    from verl_klcov_global.engine import kept_pass

    real = kept_pass.after_infer_batch
    moved: list[int] = []

    def nudging(engine, data, outputs):
        current = kept_pass._PASS.get()
        model_output = outputs.get("model_output") if isinstance(outputs, dict) else None
        if current is not None and current.engine is engine and model_output and "log_probs" in model_output:
            digests = kept_pass.row_digests(data)
            if digests is not None:
                moved.append(_move_copies(model_output, digests))
        return real(engine, data, outputs)

    kept_pass.after_infer_batch = nudging
    try:
        yield moved
    finally:
        kept_pass.after_infer_batch = real


def _move_copies(model_output: dict, digests: list[bytes]) -> int:
    log_probs = model_output["log_probs"]
    rows = list(log_probs.unbind())
    first: dict[bytes, int] = {}
    count = 0
    for row, digest in enumerate(digests):
        original = first.setdefault(digest, row)
        if original != row:
            rows[row] = torch.nextafter(rows[original], torch.full_like(rows[original], math.inf))
            count += 1
    if count:
        model_output["log_probs"] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    return count


def with_copies(batch, copies: list[int]):
    """``batch`` with its last ``len(copies)`` rows replaced by copies of the rows ``copies`` (equal content, the same
    advantages and fields): the same number of rows, so the minibatch split is unchanged."""
    from verl.utils import tensordict_utils as tu

    keep = len(batch) - len(copies)
    return tu.index_select_tensor_dict(batch, list(range(keep)) + list(copies))
