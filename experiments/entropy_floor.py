"""The entropy target as a floor, on SmolLM2-135M-Instruct: KL-Cov's dose-response, then the floor law; 3 seeds.

``python -m experiments.entropy_floor --json docs/entropy_floor.json --png docs/entropy_floor.png`` runs, in the
harness of :mod:`.real_divergence` (the "Repeat this number" task, 4 x 4 responses a step, minibatches of 2
prompts, 16 steps, micro-batch 4, SGD lr 0.05, verl's trainer loop in-process on CPU), for seeds 1, 2 and 3
(initial sampling and data order; the weights are the model's):

1. **the dose-response** (``--phase dose``): ``vanilla``, and ``kl_cov_global`` at a fixed ``kl_cov_ratio`` of
   0.002 (the paper's 7B value), 0.02 and 0.05: 12 runs;
2. **the floor** (``--phase floor``, after the dose-response): ``kl_cov_global`` from the user's ratio 0.002 with
   ``entropy_target`` = :data:`TARGET_FACTOR` x the seed's own step-1 entropy (step 1 samples from the initial
   weights, so every run of a seed shares it) and the law's knobs :data:`FLOOR_LAW`, fixed before these runs: 3 runs.

Reported per run and trainer step: verl's ``actor/entropy``, the mean reward, verl's ``actor/grad_norm`` (the
gradient's norm before verl's clip at 1.0: the measurement behind the turnover, see :func:`summarize`); per run:
the lowest entropy over steps 4-16, the last entropy, the mean reward over the last 4 steps; per controlled run
the ratio in use per optimizer step and the steps whose entropy is below the target. The goal (issue text, not a
test): in every seed the floor run's lowest entropy over steps 4-16 is at least the fixed-0.002 run's minus 0.1
nats, and its mean reward over the last 4 steps, averaged over seeds, within 0.1 of the fixed-0.002 runs'.

Resumable as the other studies: the JSON is rewritten after every run and a rerun skips the runs it holds;
``--from-json`` redraws without running.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace
from typing import Optional, Sequence

from . import real_divergence as harness
from .study_cli import add_output_arguments, close_study, load_pyplot, new_parser, open_study, redraw_from_json, \
    run_pending, save_figure

SEEDS = (1, 2, 3)
FIXED_RATIOS = (0.002, 0.02, 0.05)
USER_RATIO = 0.002
TARGET_FACTOR = 0.7
MODE, SIZE = "kl_cov_global", 4
#: The floor law's knobs for the controlled runs, fixed before them: the product's defaults (fixed on the learning
#: miniature) and KL-Cov's bounds [1e-5, 0.02]. Set from the dose-response before any controlled run: 0.05 held a
#: lower minimum than 0.002 in seeds 1 and 2 (seed 3's run, done after this choice, a higher one); 0.02 a higher
#: one in seeds 1 and 2 and a lower one in seed 3, and on average; so 0.02 is the largest tested ratio not worse than
#: the paper's on average (no range was found where more KL-Cov meant more entropy in every seed: docs/EVIDENCE.md).
FLOOR_LAW = dict(entropy_control_min_ratio=1e-5, entropy_control_max_ratio=0.02, entropy_control_kp=10.0,
                 entropy_control_ki=1.0, entropy_control_horizon=8.0, entropy_control_window=4,
                 entropy_control_hysteresis=0.1)
FIRST_STEP_OF_MINIMUM = 4  # the lowest entropy is taken over steps 4-16
SOLVED = 15 / 16  # the reward over the last steps when, on average, 15 of a step's 16 responses are right
LAST_STEPS = 4
ENTROPY, REWARD, GRAD_NORM = harness.ENTROPY, harness.REWARD, "actor/grad_norm"


def dose_key(seed: int, ratio: Optional[float]) -> str:
    return f"seed{seed}/vanilla" if ratio is None else f"seed{seed}/{MODE}/{ratio:g}"


def floor_key(seed: int) -> str:
    return f"seed{seed}/{MODE}/floor"


def dose_items(steps: int) -> list[dict]:
    items = []
    for seed in SEEDS:
        items.append(dict(key=dose_key(seed, None), loss_mode="vanilla", seed=seed, kl_cov_ratio=USER_RATIO))
        items += [dict(key=dose_key(seed, r), loss_mode=MODE, seed=seed, kl_cov_ratio=r) for r in FIXED_RATIOS]
    return [dict(item, micro_batch_size=SIZE, steps=steps, entropy_target=None, paired=False, control={})
            for item in items]


def floor_items(study: dict, steps: int) -> list[dict]:
    """The controlled runs, each seed's target from its step-1 entropy: step 1 samples from the initial weights, so
    every run of a seed shares it (vanilla's, else the first of the seed's dose runs done)."""
    out = []
    for seed in SEEDS:
        done = [study["runs"][key] for key in (dose_key(seed, r) for r in (None,) + FIXED_RATIOS)
                if key in study["runs"]]
        if not done:
            continue
        target = TARGET_FACTOR * done[0]["metrics"][ENTROPY][0]
        out.append(dict(key=floor_key(seed), loss_mode=MODE, seed=seed, kl_cov_ratio=USER_RATIO,
                        micro_batch_size=SIZE, steps=steps, entropy_target=target, paired=False,
                        control=dict(FLOOR_LAW)))
    return out


def run_one(item: dict, *, model_path: str, weights_root: str, work_root: str) -> dict:
    base = replace(harness.BASE, seed=item["seed"], kl_cov_ratio=item["kl_cov_ratio"], **item["control"])
    record = harness.run_one(item, model_path=model_path, weights_root=weights_root, work_root=work_root, base=base)
    record.update(seed=item["seed"], kl_cov_ratio=item["kl_cov_ratio"], control=item["control"])
    return record


def settings(steps: int) -> dict:
    return {"base": harness.config_fields(replace(harness.BASE, steps=steps)), "seeds": list(SEEDS),
            "fixed_ratios": list(FIXED_RATIOS), "user_ratio": USER_RATIO, "target_factor": TARGET_FACTOR,
            "mode": MODE, "micro_batch_size": SIZE, "task": "repeat_number"}


# -- figures ------------------------------------------------------------------------------------------------


def run_figures(run: dict) -> dict:
    entropy, reward = run["metrics"][ENTROPY], run["metrics"][REWARD]
    grad = run["metrics"].get(GRAD_NORM, [])
    out = {"min_entropy": min(entropy[FIRST_STEP_OF_MINIMUM - 1:]), "last_entropy": entropy[-1],
           "reward_last": statistics.fmean(reward[-LAST_STEPS:]), "grad_norm_median": statistics.median(grad),
           "steps_clipped": sum(g > 1.0 for g in grad)}
    if run.get("entropy_target") is not None:
        target = run["entropy_target"]
        out.update(target=target, steps_below_target=sum(h < target for h in entropy),
                   ratio_in_use=[s["kl_cov_ratio_in_use"] for s in run.get("optimizer_steps", [])],
                   mean_abs_error=statistics.fmean(abs(h - target) for h in entropy[FIRST_STEP_OF_MINIMUM - 1:]))
    return out


def summarize(study: dict) -> dict:
    runs = study["runs"]
    figures = {key: run_figures(run) for key, run in runs.items()}
    goal = {}
    floors = [seed for seed in SEEDS if floor_key(seed) in runs and dose_key(seed, USER_RATIO) in runs]
    if floors:
        margin = {seed: figures[floor_key(seed)]["min_entropy"] - figures[dose_key(seed, USER_RATIO)]["min_entropy"]
                  for seed in floors}
        reward_gap = statistics.fmean(figures[floor_key(s)]["reward_last"] for s in floors) - statistics.fmean(
            figures[dose_key(s, USER_RATIO)]["reward_last"] for s in floors)
        goal = {"min_entropy_margin": margin, "never_worse": all(m >= -0.1 for m in margin.values()),
                "reward_gap": reward_gap, "reward_within": abs(reward_gap) <= 0.1}
    dose = {}
    for ratio in (None,) + FIXED_RATIOS:
        label = "vanilla" if ratio is None else f"{ratio:g}"
        cells = {seed: figures[dose_key(seed, ratio)] for seed in SEEDS if dose_key(seed, ratio) in runs}
        if cells:
            dose[label] = {name: {seed: f[name] for seed, f in cells.items()}
                           for name in ("min_entropy", "last_entropy", "reward_last", "grad_norm_median")}
    return {"runs": figures, "dose": dose, "goal": goal, "reward_vs_entropy": reward_vs_entropy(figures)}


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):  # ties share their mean rank
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def reward_vs_entropy(figures: dict) -> Optional[dict]:
    """The measurement behind the turnover: over every run, Spearman's rank correlation of the reward over the last
    steps with the lowest entropy, and the split at reward :data:`SOLVED`: the highest lowest-entropy of the runs
    at or above it, the lowest of the runs below it (a run that solves the task collapses its entropy, whatever
    its ratio)."""
    if len(figures) < 3:
        return None
    keys = sorted(figures)
    reward, entropy = ([figures[k][name] for k in keys] for name in ("reward_last", "min_entropy"))
    rr, re = _ranks(reward), _ranks(entropy)
    mean = (len(keys) - 1) / 2
    cov = sum((a - mean) * (b - mean) for a, b in zip(rr, re))
    var = (sum((a - mean) ** 2 for a in rr) * sum((b - mean) ** 2 for b in re)) ** 0.5
    solved = [e for r, e in zip(reward, entropy) if r >= SOLVED]
    unsolved = [e for r, e in zip(reward, entropy) if r < SOLVED]
    return {"spearman": cov / var if var else None, "runs": len(keys), "solved_runs": len(solved),
            "solved_max_min_entropy": max(solved) if solved else None,
            "unsolved_min_min_entropy": min(unsolved) if unsolved else None}


def format_report(study: dict) -> str:
    summary = study.get("summary") or summarize(study)
    lines = ["SmolLM2-135M-Instruct (fp32 from 4-bit), verl trainer loop on CPU, micro-batch 4; per run: lowest "
             f"entropy over steps {FIRST_STEP_OF_MINIMUM}-16, last entropy, reward over the last {LAST_STEPS} "
             "steps, median grad norm (before the clip at 1.0) and steps clipped:"]
    for key, f in summary["runs"].items():
        line = (f"  {key:<28} min H {f['min_entropy']:.3f}  last H {f['last_entropy']:.3f}  reward "
                f"{f['reward_last']:.2f}  grad norm {f['grad_norm_median']:.3g} ({f['steps_clipped']} clipped)")
        if "target" in f:
            line += (f"  target {f['target']:.3f}: {f['steps_below_target']} steps below, mean |H - target| "
                     f"{f['mean_abs_error']:.3f}")
        lines.append(line)
        if f.get("ratio_in_use"):
            lines.append("  " + " " * 28 + " ratio in use: " + " ".join(f"{r:.2g}" for r in f["ratio_in_use"]))
    dose = summary.get("dose") or {}
    if dose:
        lines.append("dose-response, lowest entropy over steps 4-16 per seed (last entropy; reward over the last steps):")
        for label, cells in dose.items():
            lines.append(f"  {label:<8} " + "  ".join(
                f"seed {s}: {cells['min_entropy'][s]:.2f} ({cells['last_entropy'][s]:.2f}; {cells['reward_last'][s]:.2f})"
                for s in cells["min_entropy"]))
    split = summary.get("reward_vs_entropy")
    if split:
        lines.append(f"reward over the last steps vs lowest entropy, {split['runs']} runs: Spearman "
                     f"{split['spearman']:+.2f}; the {split['solved_runs']} runs at reward >= {SOLVED} reached at most "
                     f"{split['solved_max_min_entropy']:.2f} nats, the others at least "
                     f"{split['unsolved_min_min_entropy']:.2f}")
    goal = summary.get("goal")
    if goal:
        lines.append("floor vs fixed 0.002, lowest entropy (steps 4-16) difference per seed: " + ", ".join(
            f"seed {s}: {m:+.3f}" for s, m in goal["min_entropy_margin"].items())
            + f" ({'met' if goal['never_worse'] else 'NOT met'}: >= -0.1); reward over the last steps "
            f"{goal['reward_gap']:+.3f} ({'within' if goal['reward_within'] else 'NOT within'} 0.1)")
    if "seconds" in study:
        lines.append(f"study time {study['seconds']:.0f} s with {study.get('jobs', '?')} job(s)")
    return "\n".join(lines)


def plot(study: dict, path: str) -> None:
    """One row per seed: entropy, reward and grad norm per trainer step of every run; the floor run's target
    dotted; and the floor run's ratio in use per optimizer step (log)."""
    plt = load_pyplot()
    runs = study["runs"]
    colors = {None: "0.45", 0.002: "tab:blue", 0.02: "tab:orange", 0.05: "tab:red", "floor": "tab:green"}
    fig, axes = plt.subplots(len(SEEDS), 4, figsize=(17, 3.6 * len(SEEDS)), squeeze=False)
    for row, seed in enumerate(SEEDS):
        entries = [(dose_key(seed, r), r, "vanilla" if r is None else f"{MODE} {r:g}") for r in (None,) + FIXED_RATIOS]
        entries.append((floor_key(seed), "floor", f"{MODE} floor from {USER_RATIO:g}"))
        for key, color_key, label in entries:
            run = runs.get(key)
            if run is None:
                continue
            for ax, name in zip(axes[row][:3], (ENTROPY, REWARD, GRAD_NORM)):
                ys = run["metrics"].get(name, [])
                ax.plot(range(1, len(ys) + 1), ys, color=colors[color_key], marker="o", ms=3, label=label)
            if run.get("entropy_target") is not None:
                axes[row][0].axhline(run["entropy_target"], color="tab:green", ls=":", lw=0.9, label="target")
                ratios = [s["kl_cov_ratio_in_use"] for s in run.get("optimizer_steps", [])]
                axes[row][3].plot(range(1, len(ratios) + 1), ratios, color="tab:green", marker="o", ms=3)
                axes[row][3].axhline(USER_RATIO, color="0.5", ls=":", lw=0.9)
                axes[row][3].set_yscale("log")
        axes[row][0].set_ylabel(f"seed {seed}")
        axes[row][2].axhline(1.0, color="0.5", ls=":", lw=0.9)
        axes[row][2].set_yscale("log")
    titles = ("verl's actor/entropy (nats per token)", "mean reward", "grad norm before the clip (1.0 dotted)",
              "floor run: kl_cov_ratio in use (user's dotted)")
    for ax, title in zip(axes[0], titles):
        ax.set_title(title, fontsize=9)
    axes[0][0].legend(fontsize=7)
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("trainer step (last panel: optimizer step)")
    fig.suptitle("SmolLM2-135M-Instruct, GRPO on 'Repeat this number', verl's trainer loop on CPU (fp32), micro-batch"
                 " 4, SGD lr 0.05: KL-Cov's dose-response and the entropy floor", fontsize=10)
    save_figure(fig, path, dpi=80)


# -- the command --------------------------------------------------------------------------------------------


def _work(model_path: str):
    def work(work_root: str, todo: list):
        import functools

        return functools.partial(run_one, model_path=model_path, weights_root=work_root, work_root=work_root)
    return work


def _cost(item: dict) -> float:
    return 1.0 if item["loss_mode"] == "vanilla" else 1.4


def _describe(run: dict) -> str:
    f = run_figures(run)
    return f"min H {f['min_entropy']:.3f}, last H {f['last_entropy']:.3f}, reward {f['reward_last']:.2f}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = new_parser("python -m experiments.entropy_floor", __doc__)
    add_output_arguments(parser)
    parser.add_argument("--steps", type=int, default=harness.DEFAULT_STEPS, help="GRPO steps per run (default "
                                                                                 "%(default)s)")
    parser.add_argument("--jobs", type=int, default=2, help="processes running runs in parallel (default %(default)s)")
    parser.add_argument("--phase", choices=("dose", "floor", "all"), default="all",
                        help="dose: the 12 fixed runs; floor: the 3 controlled runs (needs the dose runs' vanilla); "
                             "all: both (default)")
    parser.add_argument("--model", default="smollm2", help="smollm2 (the prepared cache) or an HF chat model folder")
    args = parser.parse_args(argv)
    if args.from_json:
        return redraw_from_json(args, format_report, plot)
    if args.steps < FIRST_STEP_OF_MINIMUM:
        parser.error(f"--steps must be at least {FIRST_STEP_OF_MINIMUM}")
    from verl_klcov_global.lab.real_model import resolve_model_argument

    model_path = resolve_model_argument(args.model)
    study = open_study(settings(args.steps), args.json)
    started = time.perf_counter()
    common = dict(key_of=lambda item: item["key"], cost=_cost, work=_work(model_path), describe=_describe,
                  jobs=args.jobs, json_path=args.json, progress=lambda message: print(message, flush=True),
                  prefix="entropy_floor_")
    if args.phase in ("dose", "all"):
        run_pending(dose_items(args.steps), study, **common)
    if args.phase in ("floor", "all"):
        items = floor_items(study, args.steps)
        if not items:
            parser.error("the floor runs need a dose run of each seed in the JSON (run --phase dose first)")
        run_pending(items, study, **common)
    close_study(study, args, started, summarize, format_report, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
