"""Whole training runs, upstream vs global: does ``ppo_micro_batch_size_per_gpu`` change the run?

``python -m experiments.trajectory --png docs/trajectory_cpu.png`` trains the tiny model
with verl's trainer loop (:mod:`.local_trainer`) once per loss mode and micro-batch size -- GRPO,
several minibatches and PPO epochs per step -- and compares the two micro-batch sizes step by step:
the logged actor metrics and the distance between the parameter vectors. ``vanilla`` (no
covariance selection) gives the noise floor: the floating-point difference the micro-batch size
makes anyway (a different summation order). A global mode passes when every difference stays
within :data:`NOISE_FACTOR` times vanilla's for the same metric and its own selection metrics are
identical; the upstream modes are expected to split.

Optionally (``--dp``) the same with 2 data-parallel ranks vs 1, one minibatch per step (with several,
verl's contiguous DP sharding gives the ranks different minibatches than one rank would get, so
even vanilla would train on different data).
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
from dataclasses import replace
from typing import Optional, Sequence

import torch

from .local_trainer import RunConfig, RunResult, config_fields, run_local, run_spawned
from .study_cli import (
    add_output_arguments, add_run_arguments, load_pyplot, new_parser, redraw_from_json,
    save_figure, write_outputs,
)
from verl_klcov_global.modes import MODES

#: A global mode may differ between micro-batch sizes by at most this many times vanilla's difference.
NOISE_FACTOR = 10.0
#: Metrics compared step by step (verl's names in the trainer's logged metrics).
ACTOR_METRICS = ("actor/pg_loss", "actor/ppo_kl", "actor/grad_norm", "actor/entropy")
#: Plugin selection counts that must be identical (not just close) between micro-batch sizes. (KL-Cov's
#: ``cov_threshold`` is a float computed from the current parameters, which drift apart by float noise
#: over a run like vanilla's: it is reported, not required to be identical.)
SELECTION_METRICS = ("quota", "selected", "clipped", "candidates", "valid_tokens", "nonfinite_tokens")
THRESHOLD_METRIC = "actor/kl_cov/cov_threshold"
METHODS = {spec.upstream: (spec.upstream, spec.name) for spec in MODES.values()}  # the mode table's pairs
MICRO_BATCH_SIZES = (1, 4)
PICTURE_STEPS = 6  # the command's default: longer curves than the test's 3 steps


def mbs_runs(base: RunConfig, modes: Sequence[str], log_prob_follows_training: Sequence[str] = ()) -> list[RunConfig]:
    """Each mode at each of :data:`MICRO_BATCH_SIZES`; the modes in ``log_prob_follows_training`` with verl's log-prob
    pass (and the infer-layout prepass) at the run's training micro-batch size instead of ``base``'s
    (``RunConfig.log_prob_micro_batch_size``)."""
    return [replace(base, loss_mode=m, micro_batch_size=mbs,
                    log_prob_micro_batch_size=mbs if m in log_prob_follows_training else base.log_prob_micro_batch_size)
            for m in modes for mbs in MICRO_BATCH_SIZES]


def dp_runs(base: RunConfig, modes: Sequence[str]) -> list[RunConfig]:
    """DP 1 and DP 2 runs with one minibatch per step (see the module docstring)."""
    one = replace(base, mini_batch_prompts=base.prompts_per_step, micro_batch_size=4)
    return [replace(one, loss_mode=m, world_size=w) for m in modes for w in (1, 2)]


def param_distance(a: RunResult, b: RunResult) -> list[float]:
    """max |theta_a - theta_b| per weight version 0..steps."""
    return [float((x - y).abs().max()) for x, y in zip(a.params, b.params)]


def param_diff_beyond_spacing(a: RunResult, b: RunResult) -> list[float]:
    """Per weight version 0..steps: the largest |theta_a - theta_b| among the parameters that differ by more than one
    float32 spacing at their own magnitude (0.0 when none does). A difference of one rounding is no evidence of a
    different update however large the parameter (one rounding of a norm weight near 1, 1.2e-7, is 16x the whole
    float noise of the weights near 0.04 -- tests/support/noise_floor.py); :func:`verdict` reads this."""
    import numpy as np

    out = []
    for x, y in zip(a.params, b.params):
        diff = (x - y).abs()
        spacing = torch.from_numpy(np.spacing(torch.maximum(x.abs(), y.abs()).to(torch.float32).numpy())).double()
        beyond = diff[diff > spacing]
        out.append(float(beyond.max()) if beyond.numel() else 0.0)
    return out


def param_l2_distance(a: RunResult, b: RunResult) -> list[float]:
    """||theta_a - theta_b||_2 per weight version 0..steps."""
    return [float((x - y).norm()) for x, y in zip(a.params, b.params)]


def metric_differences(a: RunResult, b: RunResult, names: Sequence[str]) -> dict[str, list[float]]:
    """|a - b| per step for each metric both runs logged."""
    out = {}
    for name in names:
        if all(name in m for m in a.metrics) and all(name in m for m in b.metrics):
            out[name] = [abs(x[name] - y[name]) for x, y in zip(a.metrics, b.metrics)]
    return out


def selection_metric_names(result: RunResult) -> list[str]:
    prefix = getattr(MODES.get(result.config.loss_mode), "metric_prefix", None)
    if prefix is None:
        return []
    return [prefix + n for n in SELECTION_METRICS if prefix + n in result.metrics[0]]


def float32_resolution(a: RunResult, b: RunResult, names: Sequence[str]) -> dict[str, float]:
    """Per metric, the largest float32 spacing at its logged values: verl computes entropy and grad_norm
    in float32, so a difference below one spacing cannot show (vanilla's may be exactly 0 there)."""
    import numpy as np

    return {name: max(float(np.spacing(np.float32(abs(m[name])))) for m in a.metrics + b.metrics)
            for name in names if all(name in m for m in a.metrics + b.metrics)}


def compare_pair(a: RunResult, b: RunResult) -> dict:
    """Step-by-step differences between two runs that differ in one setting."""
    return {
        "float32_resolution": float32_resolution(a, b, ACTOR_METRICS),
        "param_max_abs_diff": param_distance(a, b),
        "param_diff_beyond_spacing": param_diff_beyond_spacing(a, b),
        "param_l2_diff": param_l2_distance(a, b),
        "metrics": metric_differences(a, b, ACTOR_METRICS),
        "selection_metrics": metric_differences(a, b, selection_metric_names(a)),
        "threshold": metric_differences(a, b, [THRESHOLD_METRIC]).get(THRESHOLD_METRIC),
        "same_rollouts": a.rollout_digest == b.rollout_digest,
    }


def is_timing_metric(name: str) -> bool:
    """Wall-clock and memory figures: they differ between any two runs and are never compared."""
    return any(word in name for word in ("timing", "perf/", "seconds", "share", "memory"))


def repeat_check(a: RunResult, b: RunResult) -> dict:
    """Two runs of one configuration: are rollouts, every logged metric (but timings) and parameters identical?"""
    names = sorted(k for k in a.metrics[0] if not is_timing_metric(k))
    differing = sorted({k for x, y in zip(a.metrics, b.metrics) for k in names
                        if x.get(k) != y.get(k) and not (x.get(k) != x.get(k) and y.get(k) != y.get(k))})
    return {
        "run": a.config.label(),
        "same_rollouts": a.rollout_digest == b.rollout_digest,
        "metrics_compared": len(names),
        "metrics_differing": differing,
        "param_max_abs_diff": max(param_distance(a, b)),
        "identical": a.rollout_digest == b.rollout_digest and not differing and max(param_distance(a, b)) == 0.0,
    }


def _ratio(diff: float, floor: float) -> float:
    if diff == 0.0:
        return 0.0
    return math.inf if floor == 0.0 else diff / floor


def verdict(pairs: dict[str, dict], control: str = "vanilla") -> dict[str, dict]:
    """Per mode: the largest ratio of its difference to the control's (per metric, max over steps; for a
    metric, at least its float32 resolution) and whether a global mode is invariant / an upstream mode
    visibly differs."""
    floor = pairs[control]
    out = {}
    for mode, pair in pairs.items():
        if mode == control:
            continue
        # params: each parameter's floor is the control's largest difference, at least one float32 spacing at the
        # parameter's own magnitude; bounded from above by the differences beyond one spacing over the control's, and
        # the others (each within its own spacing) at most 1x (a report without the field: the whole-model ratio)
        control_diff = max(floor["param_max_abs_diff"])
        ratios = {"params": _ratio(max(pair["param_max_abs_diff"]), control_diff)}
        if "param_diff_beyond_spacing" in pair:
            ratios["params"] = max(min(1.0, ratios["params"]), _ratio(max(pair["param_diff_beyond_spacing"]),
                                                                      control_diff))
        for name, diffs in pair["metrics"].items():
            # the floor: vanilla's difference, or the metric's float32 resolution where vanilla's is below it
            control = max(max(floor["metrics"].get(name, [0.0])), pair["float32_resolution"].get(name, 0.0))
            ratios[name] = _ratio(max(diffs), control)
        selection_identical = all(d == 0.0 for diffs in pair["selection_metrics"].values() for d in diffs)
        worst = max(ratios.values())
        if mode.endswith("_global"):
            ok = pair["same_rollouts"] and selection_identical and worst <= NOISE_FACTOR
        else:
            ok = ratios["params"] > NOISE_FACTOR  # upstream: expected to split
        out[mode] = {"ratios": ratios, "worst_ratio": worst, "selection_identical": selection_identical, "ok": ok}
    return out


def run_experiment(base: RunConfig, *, model_path: str, work_dir: str, dp: bool = False,
                   methods: Sequence[str] = ("kl_cov", "clip_cov"), progress=None, quiet: bool = False,
                   log_prob_follows_training: Sequence[str] = ()) -> dict:
    """All runs, their pairwise differences and the verdicts, as a JSON-ready dict (+ the runs).
    ``log_prob_follows_training``: see :func:`mbs_runs` (the DP runs train at micro-batch 4 with ``base``'s pass)."""
    modes = ["vanilla"] + [m for method in methods for m in METHODS[method]]
    started = time.perf_counter()
    runs = mbs_runs(base, modes, log_prob_follows_training)
    runs.append(next(r for r in runs if r.loss_mode == "vanilla" and r.micro_batch_size == MICRO_BATCH_SIZES[-1]))
    *results, again = run_local(runs, model_path=model_path, work_dir=work_dir, progress=progress)
    by_key = {(r.config.loss_mode, r.config.micro_batch_size): r for r in results}
    mbs_pairs = {m: compare_pair(by_key[(m, 1)], by_key[(m, 4)]) for m in modes}
    report = {"config": config_fields(base), "modes": modes, "micro_batch_sizes": list(MICRO_BATCH_SIZES),
              **({"log_prob_follows_training": list(log_prob_follows_training)} if log_prob_follows_training else {}),
              "noise_factor": NOISE_FACTOR, "repeat": repeat_check(by_key[("vanilla", MICRO_BATCH_SIZES[-1])], again),
              "mbs": {"pairs": mbs_pairs, "verdict": verdict(mbs_pairs)},
              "curves": {f"{r.config.loss_mode}/mbs{r.config.micro_batch_size}": _curves(r) for r in results}}
    if dp:
        runs = dp_runs(base, modes)
        if progress:
            progress("DP 1 vs 2 runs")
        one = run_local([r for r in runs if r.world_size == 1], model_path=model_path, work_dir=work_dir,
                        progress=progress)
        two = run_spawned([r for r in runs if r.world_size == 2], model_path=model_path, work_dir=work_dir,
                          quiet=quiet)
        dp_pairs = {a.config.loss_mode: compare_pair(a, b) for a, b in zip(one, two)}
        report["dp"] = {"pairs": dp_pairs, "verdict": verdict(dp_pairs)}
    report["seconds"] = time.perf_counter() - started
    report["ok"] = report["repeat"]["identical"] and all(
        v["ok"] for part in ("mbs", "dp") if part in report for v in report[part]["verdict"].values())
    return report


def _curves(result: RunResult) -> dict[str, list[float]]:
    """Every logged actor metric but timings, per step."""
    return {name: [m[name] for m in result.metrics] for name in sorted(result.metrics[0])
            if name.startswith("actor/") and not is_timing_metric(name)}


# -- text and picture -----------------------------------------------------------------------------------


def format_report(report: dict) -> str:
    repeat = report["repeat"]
    rollouts = "identical" if repeat["same_rollouts"] else "DIFFER"
    lines = [f"reproducible: {repeat['run']} run twice: rollouts {rollouts}, "
             f"{repeat['metrics_compared'] - len(repeat['metrics_differing'])}/{repeat['metrics_compared']} logged "
             f"metrics identical (timings not compared), max |Δθ| {repeat['param_max_abs_diff']:.1e}"]
    for part, title in (("mbs", "ppo_micro_batch_size_per_gpu 1 vs 4"), ("dp", "2 DP ranks vs 1")):
        if part not in report:
            continue
        lines.append(f"{title}: max over steps of |difference| (ratio to vanilla's)")
        pairs, verdicts = report[part]["pairs"], report[part]["verdict"]
        columns = ["params"] + list(ACTOR_METRICS)
        lines.append("mode".ljust(17) + "".join(c.replace("actor/", "").ljust(22) for c in columns) + "selection")
        for mode, pair in pairs.items():
            cells = [max(pair["param_max_abs_diff"])]
            cells += [max(pair["metrics"].get(c, [math.nan])) for c in columns[1:]]
            text = mode.ljust(17)
            for column, cell in zip(columns, cells):
                ratio = "" if mode == "vanilla" else f" ({verdicts[mode]['ratios'].get(column, math.nan):.3g}x)"
                text += f"{cell:.2e}{ratio}".ljust(22)
            if mode in verdicts and pair["selection_metrics"]:
                text += "counts identical" if verdicts[mode]["selection_identical"] else "counts DIFFERENT"
                if pair.get("threshold"):
                    text += f", |Δ cov_threshold| <= {max(pair['threshold']):.1e}"
            lines.append(text)
        for mode, v in verdicts.items():
            expect = (f"invariant (<= {NOISE_FACTOR:g}x vanilla)" if mode.endswith("_global")
                      else f"splits (> {NOISE_FACTOR:g}x)")
            lines.append(f"  {mode}: {'OK' if v['ok'] else 'FAIL'}, expected {expect}, worst {v['worst_ratio']:.3g}x")
    lines.append(f"verdict: {'every global mode is invariant' if report['ok'] else 'FAILED'} "
                 f"({report['seconds']:.1f} s)")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """PNG, one row per method. First column: the policy entropy per step of the four runs (upstream and
    global, micro-batch size 1 solid, 4 dashed). Other columns: the difference between micro-batch sizes
    1 and 4 per step, upstream vs global vs vanilla, log scale (an exact 0 is drawn at the bottom)."""
    plt = load_pyplot()

    pairs, curves = report["mbs"]["pairs"], report["curves"]
    small, large = report["micro_batch_sizes"]
    methods = [m for m in METHODS if METHODS[m][0] in pairs]
    columns = [("params", "max |Δθ| after the step"), ("actor/pg_loss", "|Δ pg_loss|"),
               ("actor/grad_norm", "|Δ grad_norm|"), ("actor/entropy", "|Δ entropy|")]
    floor_value = 1e-13
    n_steps = report["config"]["steps"]
    fig, axes = plt.subplots(len(methods), 1 + len(columns), figsize=(4.0 * (1 + len(columns)), 3.5 * len(methods)),
                             squeeze=False)
    colors = {"vanilla": "0.5"}
    for row, method in enumerate(methods):
        upstream, global_ = METHODS[method]
        colors.update({upstream: "tab:red", global_: "tab:blue"})
        labels = {"vanilla": "vanilla (noise floor)", upstream: f"{upstream} (upstream)",
                  global_: f"{global_} (plugin)"}
        ax = axes[row][0]
        for mode in (upstream, global_):
            for mbs, ls, marker in ((small, "-", "o"), (large, "--", "x")):
                ys = curves[f"{mode}/mbs{mbs}"]["actor/entropy"]
                ax.plot(range(1, len(ys) + 1), ys, color=colors[mode], ls=ls, marker=marker, ms=5,
                        label=f"{mode}, micro-batch {mbs}")
        ax.set_title(f"{method}: policy entropy", fontsize=10)
        ax.legend(fontsize=7)
        for col, (key, title) in enumerate(columns, start=1):
            ax = axes[row][col]
            for mode in ("vanilla", upstream, global_):
                ys = pairs[mode]["param_max_abs_diff"][1:] if key == "params" else pairs[mode]["metrics"].get(key)
                if ys is not None:
                    ax.plot(range(1, len(ys) + 1), [max(y, floor_value) for y in ys], color=colors[mode],
                            ls="--" if mode == "vanilla" else "-", marker="o", ms=4, label=labels[mode])
            ax.set_yscale("log")
            ax.set_ylim(bottom=floor_value / 3)
            ax.set_title(f"{method}: {title}, micro-batch {small} vs {large}", fontsize=10)
            if col == 1:
                ax.legend(fontsize=7)
        for ax in axes[row]:
            ax.set_xticks(range(1, n_steps + 1))
            ax.set_xlabel("trainer step")
            ax.grid(True, which="major", alpha=0.3)
    cfg = report["config"]
    fig.suptitle(
        f"Same GRPO run, ppo_micro_batch_size_per_gpu {small} vs {large}: upstream splits, the plugin does not "
        "(log scales; bottom = identical)\n"
        f"verl 0.9.1 trainer loop on CPU, tiny Qwen2, {cfg['prompts_per_step']}x{cfg['responses_per_prompt']} "
        f"sequences/step, {cfg['prompts_per_step'] // cfg['mini_batch_prompts']} minibatches x {cfg['ppo_epochs']} "
        f"epochs, {cfg['optimizer']} lr {cfg['lr']}, kl_cov_ratio {cfg['kl_cov_ratio']}, "
        f"clip_cov ratio {cfg['clip_cov_ratio']} "
        f"window ({cfg['clip_cov_lb']}, {cfg['clip_cov_ub']})", fontsize=11)
    save_figure(fig, path, dpi=100)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = new_parser("python -m experiments.trajectory", __doc__)
    add_output_arguments(parser)
    add_run_arguments(parser, steps_default=PICTURE_STEPS, jobs_default=None, seed_default=RunConfig.seed)
    parser.add_argument("--dp", action="store_true", help="also compare 2 data-parallel ranks with 1")
    parser.add_argument("--model", help="a local HF checkpoint (default: the tiny Qwen2, built locally)")
    args = parser.parse_args(argv)
    if args.from_json:
        return redraw_from_json(args, format_report, plot)
    if args.steps < 1:
        parser.error("--steps must be >= 1")

    from verl_klcov_global.lab.quiet import quiet_verl
    from verl_klcov_global.lab.tiny import build_tiny_model

    base = RunConfig(steps=args.steps, seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="trajectory_cpu_") as work_dir:
        model = args.model or build_tiny_model(os.path.join(work_dir, "model"))
        with quiet_verl():
            report = run_experiment(base, model_path=model, work_dir=work_dir, dp=args.dp, quiet=True,
                                    progress=lambda m: print(m, file=sys.__stderr__, flush=True))
    write_outputs(report, args, format_report, plot)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
