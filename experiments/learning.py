"""Learning runs where entropy really collapses: does each method still keep entropy up, and does the
micro-batch size change upstream's training outcome?

``python -m experiments.learning --png docs/learning_cpu.png --json out/learning.json`` trains the
tiny 64-token Qwen2 of :mod:`.learning_task` from scratch with verl's trainer loop in-process
(:mod:`.local_trainer`: ``RayPPOTrainer.fit``, verl's ``ActorRolloutRefWorker`` and FSDP2 engine,
the plugin's hook), on responses sampled from the policy being trained (:mod:`.policy_rollout`),
rewarded by the fraction of response tokens in a target set. GRPO, 8 prompts x 8 responses of 8
tokens per step, 2 minibatches x 2 PPO epochs (4 optimizer steps per trainer step: KL-Cov acts from
the second one on, off-policy), SGD lr 0.03, fp32, CPU. Every loss mode (vanilla, ``kl_cov``,
``kl_cov_global``, ``clip_cov``, ``clip_cov_global``, the authors' high-entropy rule per micro-batch
``high_entropy_per_micro_batch`` (the lab's comparator) and ``high_entropy_global``) at
``ppo_micro_batch_size_per_gpu`` 1 and 4.
At 1, each of upstream's loss calls sees one sequence, whose GRPO advantage is constant: every
covariance is 0 there.

Reported per run and step: verl's ``actor/entropy`` (mean policy entropy over the step's response
tokens, computed with the old log-probs) and ``critic/score/mean`` (mean reward), the rollout's
token covariance of log-prob and GRPO advantage (:class:`.policy_rollout.PolicyRollout`, every
mode), and the global modes' selection figures, the covariance figures among them
(``actor/<method>/cov_mean``, ``selected_cov_mean``, ``selected_cov_share``). Compared: each mode's
two micro-batch sizes, step by step, against vanilla's own difference (its float noise).
Knobs: ``kl_cov_ratio`` 0.1 and ``ppo_kl_coef`` 1 (the toy the issue quotes; the paper's 0.002 would
select 1 token of a 256-token minibatch: the quota floor), ``clip_cov_ratio`` 0.1 and the window
(0, 5) (verl's default lower bound 1 leaves no candidate while the policy is near uniform:
covariances start near 0), ``entropy_top_ratio`` 0.2 (the paper's).
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import replace
from typing import Optional, Sequence

from .local_trainer import LOSS_MODES, RunConfig, RunResult, config_fields, run_local
from .study_cli import (
    add_output_arguments, add_run_arguments, load_pyplot, new_parser, redraw_from_json,
    run_in_jobs, run_pending, save_figure, write_outputs,
)

MICRO_BATCH_SIZES = (1, 4)
#: A global mode's curves may differ between micro-batch sizes by at most this many times vanilla's difference.
NOISE_FACTOR = 10.0
ENTROPY, REWARD = "actor/entropy", "critic/score/mean"
PREFIXES = {"kl_cov_global": "actor/kl_cov/", "clip_cov_global": "actor/clip_cov/",
            "high_entropy_global": "actor/high_entropy/"}
COUNTS = ("quota", "selected", "clipped", "candidates", "valid_tokens", "nonfinite_tokens")
COVARIANCE = ("cov_mean", "selected_cov_mean", "selected_cov_share")
#: high_entropy_global's selection figures (minibatch-global, per optimizer step, logged like the covariance ones)
ENTROPY_FIGURES = ("entropy_threshold", "entropy_mean", "selected_entropy_mean", "selected_entropy_share")
#: The authors' per-micro-batch rule (the lab's comparator) logs the tokens it kept in each micro-batch.
COMPARATOR_SELECTED = "actor/high_entropy_per_micro_batch/selected_in_micro_batch"

BASE = RunConfig(
    steps=40, prompts_per_step=8, responses_per_prompt=8, mini_batch_prompts=4, ppo_epochs=2,
    max_prompt_length=16, max_response_length=8, optimizer="SGD", lr=0.03, seed=1,
    kl_cov_ratio=0.1, ppo_kl_coef=1.0, clip_cov_ratio=0.1, clip_cov_lb=0.0, clip_cov_ub=5.0,
)


class MakePolicyRollout:
    """``make_rollout`` for :func:`.local_trainer.run_trainer` (a class: it must pickle into a job process)."""

    def __init__(self, model_path: str):
        self.model_path = model_path

    def __call__(self, tokenizer, run: RunConfig, params: list):
        from .learning_task import target_fraction
        from .policy_rollout import PolicyRollout

        return PolicyRollout(tokenizer, model_path=self.model_path, params=params, reward=target_fraction,
                             seed=run.seed, max_prompt_length=run.max_prompt_length,
                             max_response_length=run.max_response_length)


def _run_one(run: RunConfig, *, model_path: str, work_dir: str, quiet: bool) -> RunResult:
    """One run in its own folder below ``work_dir``, timed (``result.seconds``)."""
    import contextlib

    from verl_klcov_global.lab.quiet import quiet_verl

    from .learning_task import write_dataset

    # no "=" in the name: the folder's paths go into Hydra overrides
    run_dir = os.path.join(work_dir, f"{run.loss_mode}-mbs{run.micro_batch_size}-dp{run.world_size}")
    os.makedirs(run_dir, exist_ok=True)
    with quiet_verl() if quiet else contextlib.nullcontext():
        started = time.perf_counter()
        (result,) = run_local([run], model_path=model_path, work_dir=run_dir,
                              make_rollout=MakePolicyRollout(model_path), dataset=write_dataset)
        result.seconds = time.perf_counter() - started
    return result


def run_cost(run: RunConfig) -> float:
    """A run's relative cost, to start the longest first: a loss call costs about the same at any
    micro-batch size here, so the number of micro-batches, plus a fixed part."""
    return run.mini_batch_prompts * run.responses_per_prompt / run.micro_batch_size + 8


def run_runs(runs: Sequence[RunConfig], *, model_path: str, work_dir: str, jobs: int = 1,
             quiet: bool = True) -> list[RunResult]:
    """The runs, in this process (``jobs`` 1) or spread over ``jobs`` spawned processes
    (:func:`.study_cli.run_in_jobs`, longest first); results in order. Every run seeds itself, so a
    result does not depend on the process that ran it."""
    def progress(index: int, result: RunResult) -> None:
        print(f"  {runs[index].label()}: {result.seconds:.0f} s", file=sys.__stderr__, flush=True)

    task = functools.partial(_run_one, model_path=model_path, work_dir=work_dir, quiet=quiet)
    return run_in_jobs(task, runs, jobs=jobs, cost=run_cost, on_result=progress)


# -- figures ----------------------------------------------------------------------------------------------


def curves(result: RunResult) -> dict[str, list[float]]:
    """Per step: entropy, reward, the rollout's token covariance, and a global mode's selection figures."""
    out = {"entropy": [m[ENTROPY] for m in result.metrics], "reward": [m[REWARD] for m in result.metrics],
           "rollout_token_cov": [f["token_cov"] for f in result.rollout_figures],
           "sample_entropy": [f["sample_entropy"] for f in result.rollout_figures]}
    prefix = PREFIXES.get(result.config.loss_mode)
    if prefix:
        for name in COUNTS + COVARIANCE + ENTROPY_FIGURES:
            if all(prefix + name in m for m in result.metrics):
                out[name] = [m[prefix + name] for m in result.metrics]
    if result.config.loss_mode == "clip_cov":
        out["pg_clipfrac"] = [m.get("actor/pg_clipfrac", math.nan) for m in result.metrics]
    if all(COMPARATOR_SELECTED in m for m in result.metrics):
        out["selected_in_micro_batch"] = [m[COMPARATOR_SELECTED] for m in result.metrics]
    return out


def float32_spacing(values: Sequence[float]) -> float:
    """The largest float32 spacing at these values: verl logs entropy from float32 tensors."""
    import numpy as np

    return max(float(np.spacing(np.float32(abs(v)))) for v in values)


def compare(a: dict, b: dict) -> dict:
    """Two runs' curves (micro-batch sizes 1 and 4 of one mode): max |difference| over steps."""
    out = {name: max(abs(x - y) for x, y in zip(a[name], b[name])) for name in ("entropy", "reward")}
    out["entropy_resolution"] = float32_spacing(a["entropy"] + b["entropy"])
    counts = [n for n in COUNTS if n in a and n in b]
    out["counts_identical"] = all(a[n] == b[n] for n in counts) if counts else None
    return out


REWARD_LEVELS = (0.5, 0.8, 0.9)


def entropy_at_reward(curve: dict, level: float) -> Optional[dict]:
    """The first step whose mean reward reaches ``level``, and the entropy there (None if never): the
    entropy of two methods compared at comparable reward, not at the same step."""
    step = next((i for i, r in enumerate(curve["reward"]) if r >= level), None)
    return None if step is None else {"step": step + 1, "entropy": curve["entropy"][step]}


def add_comparable_reward(report: dict) -> dict:
    """Per run and reward level: :func:`entropy_at_reward`, and its ratio to vanilla's at the same level."""
    out = {}
    for key, curve in report["curves"].items():
        vanilla = report["curves"].get(f"vanilla/mbs{key.split('mbs')[1]}")
        levels = {}
        for level in REWARD_LEVELS:
            here = entropy_at_reward(curve, level)
            base = entropy_at_reward(vanilla, level) if vanilla else None
            if here is not None and base is not None:
                here["over_vanilla"] = here["entropy"] / base["entropy"]
            levels[str(level)] = here
        out[key] = levels
    report["entropy_at_reward"] = out
    return report


def summarize(results: Sequence[RunResult]) -> dict:
    """Everything the picture, the docs and the test read, JSON-ready."""
    runs = {f"{r.config.loss_mode}/mbs{r.config.micro_batch_size}": r for r in results}
    curve = {key: curves(r) for key, r in runs.items()}
    modes = sorted({r.config.loss_mode for r in results}, key=LOSS_MODES.index)
    sizes = sorted({r.config.micro_batch_size for r in results})
    small, large = sizes[0], sizes[-1]
    per_run = {}
    for key, r in runs.items():
        c = curve[key]
        per_run[key] = {"entropy_start": c["entropy"][0], "entropy_end": c["entropy"][-1],
                        "reward_start": c["reward"][0], "reward_end": c["reward"][-1],
                        "seconds": getattr(r, "seconds", None)}
        for name in COVARIANCE + ENTROPY_FIGURES:
            if name in c:
                per_run[key][f"{name}_mean_over_steps"] = sum(c[name]) / len(c[name])
    pairs = {}
    for mode in modes:
        a, b = runs[f"{mode}/mbs{small}"], runs[f"{mode}/mbs{large}"]
        pair = compare(curve[f"{mode}/mbs{small}"], curve[f"{mode}/mbs{large}"])
        pair["same_rollouts"] = a.rollout_digest == b.rollout_digest
        pair["first_differing_rollout_step"] = next(
            (i + 1 for i, (x, y) in enumerate(zip(a.rollout_digest, b.rollout_digest)) if x != y), None)
        pair["param_max_abs_diff"] = max(float((x - y).abs().max()) for x, y in zip(a.params, b.params))
        pairs[mode] = pair
    verdict = {}
    if "vanilla" in pairs:
        floor = {n: max(pairs["vanilla"][n], pairs["vanilla"]["entropy_resolution"] if n == "entropy" else 0.0)
                 for n in ("entropy", "reward")}
        for mode, pair in pairs.items():
            ratios = {n: (0.0 if pair[n] == 0 else (math.inf if floor[n] == 0 else pair[n] / floor[n]))
                      for n in ("entropy", "reward")}
            pair["ratio_to_vanilla"] = ratios
        van = per_run[f"vanilla/mbs{large}"]
        verdict["vanilla_reward_rise"] = van["reward_end"] - van["reward_start"]
        verdict["vanilla_entropy_end_over_start"] = van["entropy_end"] / van["entropy_start"]
        verdict["vanilla_learns"] = verdict["vanilla_reward_rise"] >= 0.5
        verdict["vanilla_entropy_collapses"] = verdict["vanilla_entropy_end_over_start"] <= 0.2
        for mode in modes:
            if mode.endswith("_global"):
                p = pairs[mode]
                verdict[f"{mode}_invariant"] = bool(p["counts_identical"]) and max(p["ratio_to_vanilla"].values()) \
                    <= NOISE_FACTOR
            elif mode != "vanilla":
                verdict[f"{mode}_splits"] = pairs[mode]["ratio_to_vanilla"]["entropy"] > NOISE_FACTOR
        # the paper's claim, as measured: end entropy relative to vanilla's, with the end reward next to it
        verdict["end_entropy_over_vanilla"] = {
            key: per_run[key]["entropy_end"] / per_run[f"vanilla/mbs{key.split('mbs')[1]}"]["entropy_end"]
            for key in per_run}
    return add_comparable_reward({
        "config": config_fields(results[0].config) | {"loss_mode": None, "micro_batch_size": None},
        "modes": modes, "micro_batch_sizes": sizes, "noise_factor": NOISE_FACTOR, "curves": curve,
        "runs": per_run, "pairs": pairs, "verdict": verdict})


def format_report(report: dict) -> str:
    small, large = report["micro_batch_sizes"][0], report["micro_batch_sizes"][-1]
    lines = ["run                      entropy start -> end      reward start -> end   end entropy / vanilla's   s"]
    for key, r in report["runs"].items():
        rel = report["verdict"].get("end_entropy_over_vanilla", {}).get(key, math.nan)
        seconds = r["seconds"] if r["seconds"] is not None else math.nan
        lines.append(f"{key:24s} {r['entropy_start']:.3f} -> {r['entropy_end']:.3f}          "
                     f"{r['reward_start']:.3f} -> {r['reward_end']:.3f}        {rel:6.2f}              {seconds:.0f}")
    if "entropy_at_reward" in report:
        lines.append("entropy at the first step reaching a mean reward (step, ratio to vanilla's there): "
                     + ", ".join(str(level) for level in REWARD_LEVELS))
        for key, levels in report["entropy_at_reward"].items():
            cells = [("never" if v is None else f"{v['entropy']:.3f} (step {v['step']}, "
                      f"{v.get('over_vanilla', math.nan):.2f}x)") for v in levels.values()]
            lines.append(f"  {key:22s} " + " | ".join(cells))
    lines.append(f"micro-batch {small} vs {large}: max over steps |difference| (ratio to vanilla's)")
    for mode, p in report["pairs"].items():
        ratio = p.get("ratio_to_vanilla", {})
        rollouts = "identical" if p["same_rollouts"] else f"differ from step {p['first_differing_rollout_step']}"
        lines.append(f"  {mode:16s} entropy {p['entropy']:.2e} ({ratio.get('entropy', math.nan):.3g}x)  "
                     f"reward {p['reward']:.2e} ({ratio.get('reward', math.nan):.3g}x)  rollouts {rollouts}"
                     + ("" if p["counts_identical"] is None else
                        f", selection counts {'identical' if p['counts_identical'] else 'DIFFER'}"))
    for key, r in report["runs"].items():
        cov = {n: r.get(f"{n}_mean_over_steps") for n in COVARIANCE + ENTROPY_FIGURES if f"{n}_mean_over_steps" in r}
        if cov:
            lines.append(f"  {key}: mean over steps " + ", ".join(f"{n} {v:.4f}" for n, v in cov.items()))
    lines.append("verdict: " + json.dumps({k: v for k, v in report["verdict"].items()
                                           if k != "end_entropy_over_vanilla"}))
    return "\n".join(lines)


COLORS = {"vanilla": "0.45", "kl_cov": "tab:red", "kl_cov_global": "tab:blue", "clip_cov": "tab:orange",
          "clip_cov_global": "tab:green", "high_entropy_per_micro_batch": "tab:purple",
          "high_entropy_global": "tab:cyan"}


def plot(report: dict, path: str) -> None:
    """One PNG: entropy and reward vs step (every mode, micro-batch 1 solid, 4 dashed), per-step entropy
    change against the rollout's token covariance, and the global modes' selected share of positive covariance."""
    plt = load_pyplot()

    small, large = report["micro_batch_sizes"][0], report["micro_batch_sizes"][-1]
    styles = {small: ("-", None), large: ("--", None)}
    fig, axes = plt.subplots(2, 2, figsize=(14, 10))
    (ax_h, ax_r), (ax_c, ax_s) = axes
    for key, c in report["curves"].items():
        mode, mbs = key.split("/mbs")
        mbs = int(mbs)
        steps = range(1, len(c["entropy"]) + 1)
        ls = styles[mbs][0]
        label = f"{mode}, micro-batch {mbs}"
        ax_h.plot(steps, c["entropy"], color=COLORS[mode], ls=ls, lw=1.6, label=label)
        ax_r.plot(steps, c["reward"], color=COLORS[mode], ls=ls, lw=1.6, label=label)
        dh = [b - a for a, b in zip(c["entropy"], c["entropy"][1:])]
        ax_c.scatter(c["rollout_token_cov"][:-1], dh, s=14, color=COLORS[mode],
                     marker="o" if mbs == small else "x", label=label, alpha=0.8)
        if "selected_cov_share" in c:
            ax_s.plot(steps, c["selected_cov_share"], color=COLORS[mode], ls=ls, lw=2.2,
                      label=f"{label}: selected share")
            ax_s.plot(steps, c["cov_mean"], color=COLORS[mode], ls=ls, lw=0.8, alpha=0.6,
                      label=f"{label}: cov_mean")
        if "selected_entropy_share" in c:  # high_entropy_global: the selected tokens' share of the entropy
            ax_s.plot(steps, c["selected_entropy_share"], color=COLORS[mode], ls=ls, lw=2.2,
                      label=f"{label}: selected entropy share")
    ax_h.set_title("policy entropy (actor/entropy)")
    ax_r.set_title("mean reward (critic/score/mean; 0-1: share of target tokens)")
    ax_c.set_title("entropy change H(t+1) - H(t) vs the step's token Cov(log-prob, advantage)\n"
                   "(rollout, every mode; first order: dH = -eta Cov)")
    ax_c.axhline(0, color="0.7", lw=0.8)
    ax_c.axvline(0, color="0.7", lw=0.8)
    ax_c.set_xlabel("token covariance of the step's batch")
    ax_c.set_ylabel("entropy change")
    ax_s.set_title("global modes' logged figures (means of the step's optimizer steps):\n"
                   "selected_cov_share / selected_entropy_share (thick), cov_mean (thin)")
    for ax in (ax_h, ax_r, ax_s):
        ax.set_xlabel("trainer step")
        ax.grid(True, alpha=0.3)
    ax_c.grid(True, alpha=0.3)
    ax_h.legend(fontsize=7, ncol=2)
    ax_s.legend(fontsize=6, ncol=2)
    cfg = report["config"]
    fig.suptitle(
        f"Learning from scratch, policy-sampled GRPO on verl 0.9.1's trainer loop (CPU, fp32, tiny Qwen2, 64 ids): "
        f"micro-batch {small} solid, {large} dashed\n"
        f"{cfg['prompts_per_step']}x{cfg['responses_per_prompt']} responses of {cfg['max_response_length']} tokens "
        f"per step, {cfg['prompts_per_step'] // cfg['mini_batch_prompts']} minibatches x {cfg['ppo_epochs']} epochs, "
        f"{cfg['optimizer']} lr {cfg['lr']}, kl_cov_ratio {cfg['kl_cov_ratio']} coef {cfg['ppo_kl_coef']}, "
        f"clip_cov_ratio {cfg['clip_cov_ratio']} window ({cfg['clip_cov_lb']}, {cfg['clip_cov_ub']})"
        + (f", entropy_top_ratio {cfg['entropy_top_ratio']}" if "entropy_top_ratio" in cfg else ""), fontsize=11)
    save_figure(fig, path, dpi=90)


def run_on_the_learning_model(run_one, runs: Sequence[RunConfig], study: dict, *, key_of, cost, final_steps: int,
                               jobs: int, json_path: Optional[str], progress, prefix: str) -> dict:
    """A resumable study's pending runs on one learning model built in its work folder
    (:func:`.study_cli.run_pending`): ``run_one(run, model_path=..., work_root=...)`` makes one run's dict."""
    def work(work_root: str, todo: list) -> functools.partial:
        from .learning_task import build_learning_model

        return functools.partial(run_one, model_path=build_learning_model(os.path.join(work_root, "model")),
                                 work_root=work_root)

    def describe(run: dict) -> str:
        final = run["reward"][-final_steps:]
        return f"end entropy {run['entropy'][-1]:.2f}, final reward {sum(final) / len(final):.3f}"

    return run_pending(runs, study, key_of=key_of, cost=cost, work=work, describe=describe, jobs=jobs,
                       json_path=json_path, progress=progress, prefix=prefix)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = new_parser("python -m experiments.learning", __doc__)
    add_output_arguments(parser)
    add_run_arguments(parser, steps_default=BASE.steps, jobs_default=2, seed_default=BASE.seed)
    parser.add_argument("--modes", default=",".join(LOSS_MODES), help="comma-separated (default: all seven)")
    args = parser.parse_args(argv)
    if args.from_json:
        return redraw_from_json(args, format_report, plot, prepare=add_comparable_reward)
    modes = args.modes.split(",")
    if args.steps < 2 or any(m not in LOSS_MODES for m in modes) or "vanilla" not in modes:
        parser.error(f"--steps >= 2; --modes from {LOSS_MODES}, vanilla included")

    from .learning_task import build_learning_model

    base = replace(BASE, steps=args.steps, seed=args.seed)
    runs = [replace(base, loss_mode=m, micro_batch_size=b) for m in modes for b in MICRO_BATCH_SIZES]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="learning_cpu_") as work_dir:
        model = build_learning_model(os.path.join(work_dir, "model"))
        results = run_runs(runs, model_path=model, work_dir=work_dir, jobs=args.jobs)
    report = summarize(results)
    report["seconds"] = time.perf_counter() - started
    report["jobs"] = args.jobs
    write_outputs(report, args, format_report, plot)
    print(f"total {report['seconds']:.0f} s with {args.jobs} job(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
