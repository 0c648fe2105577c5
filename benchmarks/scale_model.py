"""Bytes, rounds and buffer sizes of one selection at W ranks, for both designs, from their formulas.

    .venv/bin/python -m benchmarks.scale_model                    # W = 64, 10^6 valid tokens per rank
    .venv/bin/python -m benchmarks.scale_model --ranks 8 64 512 --tokens-per-rank 250000

The per-rank formulas are the ones ``benchmarks/bench_exchange.py`` checks against bytes
counted on a real 2-rank gloo run (``counted = formula``). Here they are evaluated at any
W: nothing is run, nothing is timed. "received" counts the bytes a rank ends up holding
from an all-gather (``W`` times what each rank sends); an all-reduce's result is the size
of its input. Rounds are collectives in sequence (each one a host sync in this code).
"""

from __future__ import annotations

import argparse

from ._common import table

RADIX_ROUNDS_MAX = 8
HISTOGRAM_BYTES = 256 * 4  # int32 bins while the group holds < 2**31 eligible tokens


def legacy(ranks: int, k: int) -> dict:
    """0.1.0: all-gather 5 float64 stats, all-reduce 2 int64, all-gather k float64 candidates, all-gather 2 int64."""
    return {
        "sent": 8 * (5 + 2 + k + 2),
        "received": ranks * 8 * 5 + 16 + ranks * 8 * k + ranks * 16,
        "rounds": 4,
        "top_k_over": ranks * k,  # values the final top-k runs over, on every rank
    }


def current(ranks: int) -> dict:
    """Now (worst case, 8 radix rounds): all-gather 5 float64, all-reduce 2 int64, <= 8 histograms, one 8-byte call,
    all-reduce 4 int64 (the covariance figures' sums)."""
    return {
        "sent": 8 * 5 + 16 + RADIX_ROUNDS_MAX * HISTOGRAM_BYTES + 8 + 32,
        "received": ranks * 8 * 5 + 16 + RADIX_ROUNDS_MAX * HISTOGRAM_BYTES + ranks * 8 + 32,
        "rounds": 2 + RADIX_ROUNDS_MAX + 1 + 1,
        "top_k_over": 0,
    }


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale_model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[64])
    parser.add_argument("--tokens-per-rank", type=int, default=10**6)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.0002, 0.002, 0.02, 0.2])
    args = parser.parse_args(argv)
    rows = []
    for ranks in args.ranks:
        total = ranks * args.tokens_per_rank
        for ratio in args.ratios:
            k = max(1, int(total * ratio))
            old, new = legacy(ranks, k), current(ranks)
            rows.append([ranks, f"{total:,}", ratio, f"{k:,}",
                         human(old["sent"]), human(old["received"]), f"{old['top_k_over']:,}", old["rounds"],
                         human(new["sent"]), human(new["received"]), new["rounds"]])
    print(table(["W", "valid tokens", "ratio", "k", "0.1.0 sent/rank", "0.1.0 received/rank",
                 "0.1.0 top-k over", "0.1.0 rounds", "now sent/rank (max)", "now received/rank (max)",
                 "now rounds (max)"], rows))
    print(f"\nLocal memory of the search, per rank: one int64 key per local valid token "
          f"({human(8 * args.tokens_per_rank)} at {args.tokens_per_rank:,} tokens), plus the narrowing candidate "
          "set; 0.1.0 also held k local candidates and W*k gathered ones (see 'received').")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
