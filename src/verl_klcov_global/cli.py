"""Command line: ``verl-klcov-global diagnose`` (also ``python -m verl_klcov_global diagnose``)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verl-klcov-global",
        description=("KL-Cov whose token selection does not depend on the micro-batch size, and on the DP size only "
                     "as far as the prepass log-probs do (README: What is guaranteed) (verl plugin)."),
    )
    commands = parser.add_subparsers(dest="command", required=True)
    diagnose = commands.add_parser(
        "diagnose",
        help="run the experiment of verl issue #7829: does the update depend on the micro-batch size?",
        description=(
            "One optimizer update per (mode, layout) on a frozen minibatch through verl's real FSDP engine: "
            "1 micro-batch vs N, for vanilla (penalty-free control), kl_cov and kl_cov_global, clip_cov and "
            "clip_cov_global (Clip-Cov modes also run the same update twice). Exit status 0 when every global "
            "mode's masks are identical and its parameter differences stay within 10x the control's."
        ),
    )
    diagnose.add_argument("--model", help="local HF checkpoint folder (default: an embedded tiny Qwen2 built locally)")
    diagnose.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available, else cpu")
    diagnose.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    diagnose.add_argument("--micro-batches", type=int, default=8, help="N, the split compared with 1 (default 8)")
    diagnose.add_argument("--layout", default="dynamic", choices=["dynamic", "static"],
                          help="dynamic (token budget, verl's use_dynamic_bsz) or static micro-batches")
    diagnose.add_argument("--blocks", type=int, default=3, help="independent minibatches (seeds) (default 3)")
    diagnose.add_argument("--seed", type=int, default=0)
    diagnose.add_argument("--batch-size", type=int, default=64, help="sequences in the minibatch (default 64)")
    diagnose.add_argument("--prompt-len", type=int, default=16)
    diagnose.add_argument("--response-len", type=int, default=128)
    diagnose.add_argument("--kl-cov-ratio", type=float, default=0.0002)
    diagnose.add_argument("--ppo-kl-coef", type=float, default=1.0)
    diagnose.add_argument("--loss-mode", default="all", choices=["all", "kl_cov_global", "clip_cov_global"],
                          help="which global modes to diagnose (default all)")
    diagnose.add_argument("--clip-cov-ratio", type=float, default=0.002,
                          help="Clip-Cov quota fraction (default 0.002; verl's default 0.0002)")
    diagnose.add_argument("--clip-cov-lb", type=float, default=0.3,
                          help="Clip-Cov window's lower bound (default 0.3, for the tiny model's small covariances; "
                               "verl's default 1.0)")
    diagnose.add_argument("--clip-cov-ub", type=float, default=5.0, help="Clip-Cov window's upper bound (default 5)")
    diagnose.add_argument("--clip-cov-seed", type=int, default=0, help="clip_cov_global's sampling seed (default 0)")
    diagnose.add_argument("--strategy", default="fsdp", choices=["fsdp", "fsdp2"])
    diagnose.add_argument("--json", dest="json_path", help="also write the full report as JSON to this file")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "diagnose":
        from .lab.diagnose import DiagnoseError, DiagnoseOptions, format_report, run_diagnose

        options = DiagnoseOptions(**{k: v for k, v in vars(args).items() if k != "command"})
        try:
            report = run_diagnose(options)
        except DiagnoseError as error:
            print(f"verl-klcov-global diagnose: error: {error}", file=sys.stderr)
            return 2
        print(format_report(report))
        return 0 if report["invariant"] else 1
    return 2  # pragma: no cover - argparse requires a command


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
