"""Benchmarks of verl-klcov-global. Run from the repository root:

    .venv/bin/python -m benchmarks.run --quick                 # smoke (< 60 s on 2 cores; what CI runs)
    .venv/bin/python -m benchmarks.run --json out/bench.json   # full (~1 min on 2 idle cores, more when busy)
    .venv/bin/python -m benchmarks.run selection --threads 1 2 # one part

Parts: ``step`` (optimizer-step time on verl's FSDP engine, CPU), ``selection``
(``select_kl_cov_tokens`` vs verl's kl_cov selection), ``exchange`` (DP=2 bytes).
Prints tables and, with ``--json``, writes every sample. It asserts nothing about
time: it fails only when something does not run.
"""

from __future__ import annotations

import argparse
import sys
import time

from ._common import quiet

PARTS = ("step", "selection", "exchange")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", nargs="*", metavar="PART", help=f"any of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="smoke: fewer rounds, padded step only")
    parser.add_argument("--json", metavar="PATH", help="write all figures and samples to PATH")
    parser.add_argument("--threads", type=int, nargs="+", metavar="N",
                        help="torch CPU thread counts: the first one for step, every one for selection (the exchange's "
                             "2 processes use 1 each) "
                             "(default: torch's default; --quick: 1, which keeps the smoke fast on a busy runner)")
    parser.add_argument("--reps", type=int, help="timed rounds of the step benchmark (default 7, quick 2)")
    parser.add_argument("--rounds", type=int, help="timed rounds of the selection benchmark (default 15, quick 3)")
    parser.add_argument("--cases", nargs="+", choices=["padded", "packed"],
                        help="step cases (default: padded packed; quick: padded)")
    parser.add_argument("--malloc", choices=["reuse", "default"], default="reuse",
                        help="reuse: glibc keeps freed blocks up to 32 MiB (no page-fault noise, see "
                             "_common.tune_malloc; the default); default: leave glibc as it is")
    parser.add_argument("--strategy", choices=["fsdp", "fsdp2"], default="fsdp")
    parser.add_argument("--model-dir", help="reuse/build the tiny model here (default: a temp dir)")
    parser.add_argument("--selection-impl", metavar="selection.py",
                        help="time this selection.py instead of the installed one (to measure a candidate patch)")
    args = parser.parse_args(argv)
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick and not args.threads:
        args.threads = [1]
    from ._common import tune_malloc

    malloc = tune_malloc() if args.malloc == "reuse" else "default"
    quiet()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads[0])
    import verl_klcov_global  # noqa: F401  (registers kl_cov_global, installs the prepass hook)

    from . import bench_exchange, bench_selection, bench_step
    from ._common import load_average, machine, write_json

    parts = args.parts or list(PARTS)
    payload = {"machine": {**machine(), "malloc": malloc}, "quick": args.quick}
    print(f"# machine: {payload['machine']}", flush=True)
    progress = lambda message: print(message, flush=True)  # noqa: E731
    reports = []
    started = time.perf_counter()
    if "selection" in parts:
        payload["selection"] = bench_selection.run(quick=args.quick, rounds=args.rounds, threads=args.threads,
                                                   selection_impl=args.selection_impl, progress=progress)
        reports.append(("selection: select_kl_cov_tokens vs verl 0.9.1 kl_cov selection code",
                        bench_selection.report(payload["selection"])))
    if "exchange" in parts:
        payload["exchange"] = bench_exchange.run(quick=args.quick, tune_malloc=args.malloc == "reuse",
                                                 progress=progress)
        reports.append(("exchange: bytes each rank sends per selection, 0.1.0 design vs now, DP world size 2",
                        bench_exchange.report(payload["exchange"])))
    if "step" in parts:
        cases = args.cases or (["padded"] if args.quick else ["padded", "packed"])
        payload["step"] = bench_step.run(quick=args.quick, cases=cases, reps=args.reps, strategy=args.strategy,
                                         model_dir=args.model_dir, progress=progress)
        reports.append(("step: engine.train_batch seconds, medians (verl FSDP engine, CPU)",
                        bench_step.report(payload["step"])))
    payload["seconds"] = time.perf_counter() - started
    payload["machine"]["load_average_end"] = load_average()
    for title, text in reports:
        print(f"\n## {title}\n{text}")
    print(f"\ntotal {payload['seconds']:.1f} s")
    if args.json:
        write_json(args.json, payload)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
