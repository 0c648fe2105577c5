"""Data-parallel exchange volume of the global selection, W = 2, vs all-gather-everything.

From the algorithm (``verl_klcov_global/selection.py``), every rank sends per
optimizer step: one all-gather of 5 float64 (per-rank stats), one all-reduce(SUM) of 2 int64,
one all-gather of ``k`` float64 candidates and one all-gather of 2 int64:
``8 * (5 + 2 + k + 2) = 72 + 8k`` bytes, whatever the number of valid tokens.
The alternative (gather every valid token's advantage and log-prob, as verl PR
#7830 proposes) sends ``2 * 4 = 8`` bytes per valid token of the rank (float32).

The formula is checked against a real 2-process gloo run: ``torch.distributed``
is replaced, inside ``verl_klcov_global.selection`` only, by a proxy that counts
each collective call and the bytes of the tensor the rank contributes, and the
sharded selection is compared with the single-process one (bit for bit). The
same run times the distributed selection and, for scale, one all-gather of
every valid token's two float32 values.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

WORLD_SIZE = 2
TOTALS = (8192, 10**6)
SHAPES = {8192: (64, 128), 10**6: (1000, 1000)}  # every token valid; rank r holds rows [r*B/2, (r+1)*B/2)


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
RATIOS = (0.0002, 0.002)


def formula_bytes(k: int) -> int:
    """Bytes one rank contributes to the collectives of one global selection (quota ``k``)."""
    return 8 * (5 + 2 + k + 2)


def all_gather_everything_bytes(valid_on_rank: int) -> int:
    """Bytes one rank contributes when every valid token's (advantage, log-prob) float32 pair is gathered."""
    return 2 * 4 * valid_on_rank


class CountingDist:
    """Stand-in for ``torch.distributed`` that records every collective (name, bytes this rank contributes)."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def __getattr__(self, name):
        return getattr(dist, name)

    def all_reduce(self, tensor, *args, **kwargs):
        self.calls.append(("all_reduce", tensor.numel() * tensor.element_size()))
        return dist.all_reduce(tensor, *args, **kwargs)

    def all_gather(self, outputs, tensor, *args, **kwargs):
        self.calls.append(("all_gather", tensor.numel() * tensor.element_size()))
        return dist.all_gather(outputs, tensor, *args, **kwargs)

    def __getstate__(self):  # pragma: no cover - never pickled
        raise TypeError("CountingDist is process-local")


def _worker(rank: int, world_size: int, port: int, cases: list[tuple[int, float]], rounds: int,
            malloc_reuse: bool) -> list[dict]:
    """Spawned rank: count the collectives of the sharded selection, time it and the all-gather alternative."""
    if malloc_reuse:
        from ._common import tune_malloc

        tune_malloc()
    from verl_klcov_global import selection as selection_module
    from verl_klcov_global._cpu import init_process_group_cpu

    init_process_group_cpu(rank, world_size, port)
    counting = CountingDist()
    original_dist = selection_module.dist
    out = []
    try:
        for total, ratio in cases:
            a, lp, m = full_tensors(total)
            reference = selection_module.select_kl_cov_tokens(a, lp, m, ratio)  # single process, whole minibatch
            split = a.shape[0] // 2
            rows = slice(0, split) if rank == 0 else slice(split, a.shape[0])
            a, lp, m = a[rows].contiguous(), lp[rows].contiguous(), m[rows].contiguous()
            selection_module.dist = counting
            counting.calls.clear()
            sharded = selection_module.select_kl_cov_tokens(a, lp, m, ratio, group=dist.group.WORLD)
            calls = list(counting.calls)
            selection_module.dist = original_dist
            ours_s, gather_s = [], []
            valid_here = int(m.sum())
            for _ in range(rounds):
                dist.barrier()
                t0 = time.perf_counter()
                selection_module.select_kl_cov_tokens(a, lp, m, ratio, group=dist.group.WORLD)
                ours_s.append(time.perf_counter() - t0)
                dist.barrier()
                t0 = time.perf_counter()
                # all-gather-everything: sizes first (shards differ), then every valid (A, logp) pair, padded
                sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
                dist.all_gather(sizes, torch.tensor([valid_here]))
                width = int(max(s.item() for s in sizes))
                mine = torch.zeros(2, width)
                mine[0, :valid_here], mine[1, :valid_here] = a[m], lp[m]
                parts = [torch.empty_like(mine) for _ in range(world_size)]
                dist.all_gather(parts, mine)
                gather_s.append(time.perf_counter() - t0)
            out.append({
                "total_valid": total, "ratio": ratio, "valid_on_rank": valid_here, "quota": sharded.quota,
                "collective_calls": calls, "bytes_sent_counted": sum(b for _, b in calls),
                "bytes_sent_formula": formula_bytes(sharded.quota),
                "bytes_all_gather_everything": all_gather_everything_bytes(valid_here),
                "mask_equals_single_process": torch.equal(sharded.mask, reference.mask[rows]),
                "ours_seconds": sorted(ours_s)[len(ours_s) // 2],
                "all_gather_everything_seconds": sorted(gather_s)[len(gather_s) // 2],
            })
    finally:
        selection_module.dist = original_dist
        dist.destroy_process_group()
    return out


def run(*, quick: bool, totals=TOTALS, ratios=RATIOS, rounds=None, tune_malloc: bool = True,
        progress=print) -> dict[str, Any]:
    from verl_klcov_global._cpu import spawn

    rounds = rounds if rounds is not None else (3 if quick else 9)
    cases = [(total, ratio) for total in totals for ratio in ratios]
    progress(f"[exchange] spawning {WORLD_SIZE} gloo processes: {len(cases)} cases, {rounds} timed rounds each")
    per_rank = spawn(_worker, WORLD_SIZE, cases, rounds, tune_malloc)
    rows = []
    for i, (total, ratio) in enumerate(cases):
        ranks = [per_rank[r][i] for r in range(WORLD_SIZE)]
        rows.append({
            "total_valid": total, "ratio": ratio, "quota": ranks[0]["quota"], "world_size": WORLD_SIZE,
            "per_rank": ranks,
            "bytes_sent_per_rank_counted": max(r["bytes_sent_counted"] for r in ranks),
            "bytes_sent_per_rank_formula": ranks[0]["bytes_sent_formula"],
            "collective_calls_per_rank": len(ranks[0]["collective_calls"]),
            "bytes_all_gather_everything_per_rank": max(r["bytes_all_gather_everything"] for r in ranks),
            "counted_equals_formula": all(r["bytes_sent_counted"] == r["bytes_sent_formula"] for r in ranks),
            "masks_equal_single_process": all(r["mask_equals_single_process"] for r in ranks),
            "ours_seconds": max(r["ours_seconds"] for r in ranks),
            "all_gather_everything_seconds": max(r["all_gather_everything_seconds"] for r in ranks),
        })
    return {"world_size": WORLD_SIZE, "rows": rows}


def report(result: dict[str, Any]) -> str:
    from ._common import table

    rows = [[r["total_valid"], r["ratio"], r["quota"], r["collective_calls_per_rank"],
             r["bytes_sent_per_rank_formula"], r["bytes_sent_per_rank_counted"],
             r["bytes_all_gather_everything_per_rank"],
             f"{r['bytes_all_gather_everything_per_rank'] / r['bytes_sent_per_rank_counted']:.0f}x",
             "yes" if r["masks_equal_single_process"] else "NO",
             r["ours_seconds"] * 1e3, r["all_gather_everything_seconds"] * 1e3] for r in result["rows"]]
    return table(["valid tokens (W=2)", "ratio", "k", "calls/rank", "bytes/rank (formula)", "bytes/rank (counted)",
                  "all-gather-everything bytes/rank", "ratio", "mask = 1-proc", "ours ms", "all-gather ms"], rows)
