"""Data-parallel exchange of one selection, W = 2: the 0.1.0 design vs the current one.

Both designs make the same selection (masks compared bit for bit with the
single-process selection here, and in tests/selection/test_kl_cov.py). They differ in what
each rank sends per optimizer step:

* 0.1.0 (``tests/support/legacy_selection.py``): one all-gather of 5 float64, one
  all-reduce of 2 int64, one all-gather of ``k`` float64 candidates, one all-gather of
  2 int64: ``72 + 8k`` bytes, and each rank receives ``W * k`` candidates and runs a
  top-k over them.
* current (``verl_klcov_global.selection``): the same first two collectives (56 bytes),
  then a radix search for the k-th key: one all-reduce of a 256-bin int32 histogram
  (1,024 bytes) per round, at most 8 rounds, then one collective of 8 bytes, then one
  all-reduce of 4 int64 (the exact sums behind the covariance figures, since 0.3.0):
  ``96 + 1024 * rounds <= 8,288`` bytes, whatever ``k`` and ``N``.

``torch.distributed`` is replaced, inside the module that issues the collectives only, by a
proxy that counts each call and the bytes of the tensor the rank contributes. The same
run times both designs on 2 gloo processes (loopback, 1 thread each).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from tests.support.counting_dist import CountingDist

WORLD_SIZE = 2
TOTALS = (8192, 10**6)
SHAPES = {8192: (64, 128), 10**6: (1000, 1000)}  # every token valid; rank r holds rows [r*B/2, (r+1)*B/2)
RATIOS = (0.0002, 0.002, 0.02, 0.2, 1.0)
QUICK_TOTALS = (8192,)
QUICK_RATIOS = (0.0002, 0.2)


def full_tensors(total: int, seed: int = 1):
    """(advantages, log_probs, response_mask) with ``total`` valid tokens, no padding: the seed minibatch's
    64 x 128 for 8,192, else (total/1000, 1000)."""
    rows, width = SHAPES.get(total, (total // 1000, 1000))
    if rows * width != total or rows % WORLD_SIZE:
        raise ValueError(f"{total} valid tokens do not split into {WORLD_SIZE} equal shards of rows of {width}")
    gen = torch.Generator().manual_seed(seed)
    advantages = torch.randn(rows, 1, generator=gen) + 0.1 * torch.randn(rows, width, generator=gen)
    log_probs = -8 * torch.rand(rows, width, generator=gen)
    return advantages, log_probs, torch.ones(rows, width, dtype=torch.bool)


def legacy_formula_bytes(k: int) -> int:
    """Bytes one rank contributes to the collectives of one 0.1.0 selection (quota ``k``)."""
    return 8 * (5 + 2 + k + 2)


def current_formula_bytes(rounds: int) -> int:
    """Bytes one rank contributes to the collectives of one current selection that took ``rounds`` rounds."""
    return 8 * 5 + 8 * 2 + 1024 * rounds + 8 + 8 * 4  # ... + the 4 covariance sums (selection/covariance.py)


def _count(module, select, *args, **kwargs):
    """(result, calls) of ``select(*args, **kwargs)`` with ``module.dist`` counting."""
    counting, original = CountingDist(), module.dist
    module.dist = counting
    try:
        return select(*args, **kwargs), list(counting.calls)
    finally:
        module.dist = original


def _median_seconds(call, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        dist.barrier()
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return sorted(samples)[len(samples) // 2]


def _worker(rank: int, world_size: int, port: int, cases: list[tuple[int, float]], rounds: int,
            malloc_reuse: bool) -> list[dict]:
    """Spawned rank: count and time both designs' sharded selections."""
    if malloc_reuse:
        from ._common import tune_malloc

        tune_malloc()
    torch.set_num_threads(1)
    from verl_klcov_global.lab.cpu import init_process_group_cpu
    from verl_klcov_global.selection import collectives
    from verl_klcov_global.methods.kl_cov.selection import select_kl_cov_tokens

    from tests.support import legacy_selection

    init_process_group_cpu(rank, world_size, port)
    group = dist.group.WORLD
    out = []
    try:
        for total, ratio in cases:
            a, lp, m = full_tensors(total)
            reference = select_kl_cov_tokens(a, lp, m, ratio)  # single process, whole minibatch
            split = a.shape[0] // 2
            rows = slice(0, split) if rank == 0 else slice(split, a.shape[0])
            a, lp, m = a[rows].contiguous(), lp[rows].contiguous(), m[rows].contiguous()
            current, current_calls = _count(collectives, select_kl_cov_tokens, a, lp, m, ratio, group=group)
            legacy, legacy_calls = _count(legacy_selection, legacy_selection.select_kl_cov_tokens, a, lp, m, ratio,
                                          group=group)
            out.append({
                "total_valid": total, "ratio": ratio, "valid_on_rank": int(m.sum()), "quota": current.quota,
                "search_rounds": current.search_rounds,
                "current_calls": current_calls, "legacy_calls": legacy_calls,
                "current_bytes": sum(b for _, b in current_calls), "legacy_bytes": sum(b for _, b in legacy_calls),
                "current_formula_bytes": current_formula_bytes(current.search_rounds),
                "legacy_formula_bytes": legacy_formula_bytes(legacy.quota),
                "masks_equal": torch.equal(current.mask, reference.mask[rows])
                and torch.equal(legacy.mask, reference.mask[rows]),
                "current_seconds": _median_seconds(
                    lambda: select_kl_cov_tokens(a, lp, m, ratio, group=group), rounds),
                "legacy_seconds": _median_seconds(
                    lambda: legacy_selection.select_kl_cov_tokens(a, lp, m, ratio, group=group), rounds),
            })
    finally:
        dist.destroy_process_group()
    return out


def run(*, quick: bool, totals=None, ratios=None, rounds=None, tune_malloc: bool = True,
        progress=print) -> dict[str, Any]:
    from verl_klcov_global.lab.cpu import spawn

    totals = totals or (QUICK_TOTALS if quick else TOTALS)
    ratios = ratios or (QUICK_RATIOS if quick else RATIOS)
    rounds = rounds if rounds is not None else (3 if quick else 7)
    cases = [(total, ratio) for total in totals for ratio in ratios]
    progress(f"[exchange] spawning {WORLD_SIZE} gloo processes: {len(cases)} cases, {rounds} timed rounds each")
    per_rank = spawn(_worker, WORLD_SIZE, cases, rounds, tune_malloc)
    rows = []
    for i, (total, ratio) in enumerate(cases):
        ranks = [per_rank[r][i] for r in range(WORLD_SIZE)]
        rows.append({
            "total_valid": total, "ratio": ratio, "quota": ranks[0]["quota"], "world_size": WORLD_SIZE,
            "per_rank": ranks,
            "search_rounds": ranks[0]["search_rounds"],
            "current_bytes_per_rank": max(r["current_bytes"] for r in ranks),
            "legacy_bytes_per_rank": max(r["legacy_bytes"] for r in ranks),
            "current_calls_per_rank": len(ranks[0]["current_calls"]),
            "legacy_calls_per_rank": len(ranks[0]["legacy_calls"]),
            "counted_equals_formula": all(r["current_bytes"] == r["current_formula_bytes"]
                                          and r["legacy_bytes"] == r["legacy_formula_bytes"] for r in ranks),
            "masks_equal_single_process": all(r["masks_equal"] for r in ranks),
            "current_seconds": max(r["current_seconds"] for r in ranks),
            "legacy_seconds": max(r["legacy_seconds"] for r in ranks),
        })
    return {"world_size": WORLD_SIZE, "rows": rows}


def report(result: dict[str, Any]) -> str:
    from ._common import table

    rows = [[r["total_valid"], r["ratio"], r["quota"],
             f"{r['legacy_calls_per_rank']} / {r['current_calls_per_rank']}",
             r["legacy_bytes_per_rank"], r["current_bytes_per_rank"], r["search_rounds"],
             "yes" if r["counted_equals_formula"] else "NO",
             "yes" if r["masks_equal_single_process"] else "NO",
             r["legacy_seconds"] * 1e3, r["current_seconds"] * 1e3,
             f"{r['current_seconds'] / r['legacy_seconds']:.2f}"] for r in result["rows"]]
    return table(["valid tokens (W=2)", "ratio", "k", "collectives 0.1.0 / now", "bytes/rank 0.1.0",
                  "bytes/rank now", "radix rounds", "counted = formula", "masks = 1-proc",
                  "0.1.0 ms", "now ms", "time now / 0.1.0"], rows)
