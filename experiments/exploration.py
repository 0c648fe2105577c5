"""Where exploration pays: a multi-seed study on a deceptive reward, upstream vs minibatch-global, all three modes.

``python -m experiments.exploration --png docs/exploration_cpu.png --json docs/exploration_cpu.json``
trains the 64-id tiny Qwen2 from scratch on the deceptive task of :mod:`.exploration_task` (an easy
set E worth 0.5, a rare first-token pattern P worth 1 more) with verl's trainer loop in-process
(:mod:`.local_trainer`, responses sampled from the policy being trained, :mod:`.policy_rollout`), the
learning figure's sizes and knobs (:data:`experiments.learning.BASE`, fixed before these runs), once
per configuration and seed:

* ``vanilla``;
* upstream ``kl_cov``, ``clip_cov`` and the authors' 80/20 rule (``high_entropy_per_micro_batch``, the
  lab's comparator) at ``ppo_micro_batch_size_per_gpu`` 1 and 4;
* ``kl_cov_global``, ``clip_cov_global``, ``high_entropy_global`` at 4 -- and, on :data:`SPOT_CHECK_SEEDS`,
  at 1 too: a global mode's run does not depend on the size (``tests/experiments/test_learning.py``).

A seed fixes the initial model (its weights' ``torch.manual_seed``), the prompt order (``data.seed``) and
the rollout's sampling seed; seeds are paired across configurations. Per run and step it records the
mean reward, verl's ``actor/entropy``, E's share of the response tokens, the share of responses showing
P and P's exact probability under the weights that sampled the step (from the log-probs).

Resumable: the JSON is rewritten after every finished run, and a rerun with the same ``--json`` skips
the runs it holds. ``--from-json`` redraws and reports without running anything.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from dataclasses import asdict, replace
from typing import Optional, Sequence

from .learning import BASE as LEARNING_BASE
from .exploration_task import TASK, DeceptiveTask
from .local_trainer import RunConfig, RunResult, config_fields
from .policy_rollout import PolicyRollout
from .study_cli import (
    add_output_arguments, close_study, load_pyplot, new_parser, open_study, redraw_from_json, resumed_from, run_pending, save_figure,
)

#: Seeds 1..8: paired across configurations.
SEEDS = tuple(range(1, 9))
#: Upstream's two sizes: 1, where each of upstream's loss calls sees one sequence (its GRPO advantage is
#: constant, every covariance 0), and 4, the learning figure's other size; the minibatch is 32 sequences.
MICRO_BATCH_SIZES = (1, 4)
#: The global modes run at this size on every seed; on the spot-check seeds at the other size too.
GLOBAL_SIZE = 4
SPOT_CHECK_SEEDS = (1, 2)
UPSTREAM_MODES = ("kl_cov", "clip_cov", "high_entropy_per_micro_batch")
GLOBAL_MODES = ("kl_cov_global", "clip_cov_global", "high_entropy_global")
#: The study's knobs: the learning figure's (its module docstring says why each), fixed before these runs.
BASE = replace(LEARNING_BASE, seed=SEEDS[0])
#: Final reward = mean of the last this many steps.
FINAL_STEPS = 5
BOOTSTRAP_RESAMPLES = 10_000
ENTROPY, REWARD = "actor/entropy", "critic/score/mean"
SELECTION_PREFIXES = {"kl_cov_global": "actor/kl_cov/", "clip_cov_global": "actor/clip_cov/",
                      "high_entropy_global": "actor/high_entropy/"}
SELECTION_COUNTS = ("quota", "selected", "clipped", "candidates", "valid_tokens", "nonfinite_tokens")


def configurations() -> list[tuple[str, str, int]]:
    """(name, loss mode, micro-batch size) of every configuration the study reports, in report order."""
    out = [("vanilla", "vanilla", GLOBAL_SIZE)]
    for mode in UPSTREAM_MODES:
        out += [(f"{mode}/mbs{size}", mode, size) for size in MICRO_BATCH_SIZES]
    out += [(mode, mode, GLOBAL_SIZE) for mode in GLOBAL_MODES]
    return out


def spot_checks() -> list[tuple[str, str, int]]:
    """The global modes at the other size, run on :data:`SPOT_CHECK_SEEDS` only."""
    other = [size for size in MICRO_BATCH_SIZES if size != GLOBAL_SIZE]
    return [(f"{mode}/mbs{size}", mode, size) for mode in GLOBAL_MODES for size in other]


def planned_runs(seeds: Sequence[int], steps: int) -> list[dict]:
    """Every run of the study: its key (``<configuration>/seed<s>``), configuration, mode, size and seed."""
    runs = []
    for seed in seeds:
        for name, mode, size in configurations():
            runs.append(dict(key=f"{name}/seed{seed}", configuration=name, loss_mode=mode, micro_batch_size=size,
                             seed=seed, steps=steps))
        if seed in SPOT_CHECK_SEEDS:
            for name, mode, size in spot_checks():
                runs.append(dict(key=f"{name}/seed{seed}", configuration=name, loss_mode=mode,
                                 micro_batch_size=size, seed=seed, steps=steps))
    return runs


def study_settings(base: RunConfig, task: DeceptiveTask = TASK) -> dict:
    """What every run of a study shares (JSON-ready); a resumed study must match it."""
    return {"run_config": config_fields(base) | {"loss_mode": None, "micro_batch_size": None, "seed": None},
            "task": asdict(task),
            "final_steps": FINAL_STEPS, "global_size": GLOBAL_SIZE, "micro_batch_sizes": list(MICRO_BATCH_SIZES),
            "spot_check_seeds": list(SPOT_CHECK_SEEDS)}


# -- one run ----------------------------------------------------------------------------------------------


class ExplorationRollout(PolicyRollout):
    """:class:`.policy_rollout.PolicyRollout` scored by ``task``; records per step (call) E's share of the
    response tokens, the share of responses showing P, and P's exact probability under the sampling weights
    (mean over the step's prompts, each counted once per response)."""

    def __init__(self, tokenizer, *, task: DeceptiveTask, **kwargs):
        super().__init__(tokenizer, reward=task.reward, **kwargs)
        self.task = task

    def respond(self, prompts):
        rows = super().respond(prompts)  # loads params[-1] into the sampler, samples, scores
        figures = self.figures[-1]
        responses = [tokens for tokens, _ in rows]
        figures["easy_share"] = sum(self.task.easy_share(r) * len(r) for r in responses) / sum(map(len, responses))
        figures["pattern_share"] = sum(self.task.shows_pattern(r) for r in responses) / len(responses)
        exact = self.task.pattern_probability(self.sampler.model, prompts)
        figures["pattern_probability"] = sum(exact) / len(exact)
        return rows


class MakeExplorationRollout:
    """``make_rollout`` for :func:`.local_trainer.run_trainer` (a class: it must pickle into a job process)."""

    def __init__(self, model_path: str, task: DeceptiveTask = TASK):
        self.model_path = model_path
        self.task = task

    def __call__(self, tokenizer, run: RunConfig, params: list):
        return ExplorationRollout(tokenizer, task=self.task, model_path=self.model_path, params=params,
                                  seed=run.seed, max_prompt_length=run.max_prompt_length,
                                  max_response_length=run.max_response_length)


def model_path_for(models_dir: str, seed: int) -> str:
    """The seed's initial model (weights from ``torch.manual_seed(seed)``), built once."""
    from .learning_task import build_learning_model

    return build_learning_model(os.path.join(models_dir, f"seed{seed}"), seed=seed)


def run_one(plan: dict, models_dir: str, work_root: str, base: RunConfig = BASE, task: DeceptiveTask = TASK,
            quiet: bool = True) -> dict:
    """Train one planned run (``base`` with the plan's mode, size, seed and steps, and its
    ``log_prob_micro_batch_size`` where the plan has one) on ``task``; its per-step record (JSON-ready)."""
    import contextlib

    from verl_klcov_global.lab.quiet import quiet_verl

    from .learning_task import write_dataset
    from .local_trainer import run_local

    run = replace(base, loss_mode=plan["loss_mode"], micro_batch_size=plan["micro_batch_size"], seed=plan["seed"],
                  steps=plan["steps"],
                  log_prob_micro_batch_size=plan.get("log_prob_micro_batch_size", base.log_prob_micro_batch_size))
    model = model_path_for(models_dir, plan["seed"])
    work_dir = os.path.join(work_root, f"pid{os.getpid()}")
    os.makedirs(work_dir, exist_ok=True)
    started = time.perf_counter()
    with quiet_verl() if quiet else contextlib.nullcontext():
        (result,) = run_local([run], model_path=model, work_dir=work_dir, make_rollout=MakeExplorationRollout(model, task),
                              dataset=write_dataset)
    return record(plan, result, time.perf_counter() - started)


def record(plan: dict, result: RunResult, seconds: float) -> dict:
    """A run's per-step curves, selection counts (global modes) and rollout digests."""
    figures = result.rollout_figures
    out = dict(plan)
    out["seconds"] = seconds
    out["curves"] = {
        "reward": [m[REWARD] for m in result.metrics],
        "entropy": [m[ENTROPY] for m in result.metrics],
        "easy_share": [f["easy_share"] for f in figures],
        "pattern_share": [f["pattern_share"] for f in figures],
        "pattern_probability": [f["pattern_probability"] for f in figures],
        "sample_entropy": [f["sample_entropy"] for f in figures],
    }
    prefix = SELECTION_PREFIXES.get(plan["loss_mode"])
    if prefix:
        out["selection_counts"] = {name: [m[prefix + name] for m in result.metrics]
                                   for name in SELECTION_COUNTS if all(prefix + name in m for m in result.metrics)}
    out["rollout_digest"] = list(result.rollout_digest)
    return out


# -- statistics -------------------------------------------------------------------------------------------


def wilson_interval(successes: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The 95% Wilson score interval of a binomial proportion (n > 0)."""
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap_interval(values: Sequence[float], *, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean of ``values`` (resampled with replacement,
    :data:`BOOTSTRAP_RESAMPLES` times, numpy's generator seeded by ``seed``: reproducible)."""
    import numpy as np

    x = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(BOOTSTRAP_RESAMPLES, len(x)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def first_step(values: Sequence[float], level: float) -> Optional[int]:
    """The first step (1-based) whose value reaches ``level``; None if none does."""
    return next((i + 1 for i, v in enumerate(values) if v >= level), None)


def run_outcome(run: dict, task: dict, final_steps: int) -> dict:
    c = run["curves"]
    found = first_step(c["pattern_share"], task["found_share"])
    collapsed = first_step(c["easy_share"], task["collapse_share"])
    return {"final_reward": sum(c["reward"][-final_steps:]) / final_steps, "found_step": found,
            "collapse_step": collapsed, "collapsed_before_found": collapsed is not None and (found is None or
                                                                                            collapsed < found),
            "entropy_end": c["entropy"][-1], "pattern_probability_start": c["pattern_probability"][0],
            "pattern_probability_end": c["pattern_probability"][-1],
            "pattern_probability_min": min(c["pattern_probability"]), "easy_share_end": c["easy_share"][-1]}


def summarize(study: dict) -> dict:
    """Per configuration over seeds: found-P share (Wilson), final reward (bootstrap), median found step, end
    entropy; paired differences to vanilla (bootstrap over seeds); upstream's two sizes; spot-checks; premise."""
    import statistics

    settings, runs = study["settings"], study["runs"]
    task, final_steps = settings["task"], settings["final_steps"]
    outcomes = {key: run_outcome(run, task, final_steps) for key, run in runs.items()}
    seeds = study["seeds"]
    table = {}
    for name, _, _ in configurations():
        keys = [f"{name}/seed{s}" for s in seeds if f"{name}/seed{s}" in outcomes]
        if not keys:
            continue
        o = [outcomes[k] for k in keys]
        found = [x["found_step"] for x in o if x["found_step"] is not None]
        rewards = [x["final_reward"] for x in o]
        row = {"seeds": len(o), "found": len(found), "found_share": len(found) / len(o),
               "found_share_interval": wilson_interval(len(found), len(o)),
               "final_reward_mean": sum(rewards) / len(rewards), "final_reward_interval": bootstrap_interval(rewards),
               "median_found_step": statistics.median(found) if found else None,
               "entropy_end_mean": sum(x["entropy_end"] for x in o) / len(o),
               "collapsed_before_found": sum(x["collapsed_before_found"] for x in o),
               # descriptive, not a criterion stated before the runs: where P's exact probability ended
               "pattern_probability_end_median": statistics.median(x["pattern_probability_end"] for x in o),
               "pattern_probability_rose": sum(x["pattern_probability_end"] > x["pattern_probability_start"] for x in o)}
        table[name] = row
    differences = {}
    for name in table:
        pairs = [(outcomes[f"{name}/seed{s}"], outcomes[f"vanilla/seed{s}"]) for s in seeds
                 if f"{name}/seed{s}" in outcomes and f"vanilla/seed{s}" in outcomes]
        if name == "vanilla" or not pairs:
            continue
        reward = [a["final_reward"] - b["final_reward"] for a, b in pairs]
        found = [float(a["found_step"] is not None) - float(b["found_step"] is not None) for a, b in pairs]
        exact = [a["pattern_probability_end"] - b["pattern_probability_end"] for a, b in pairs]
        differences[name] = {"final_reward": sum(reward) / len(reward), "final_reward_interval": bootstrap_interval(reward),
                             "found_share": sum(found) / len(found), "found_share_interval": bootstrap_interval(found),
                             "pattern_probability_end": sum(exact) / len(exact),
                             "pattern_probability_end_interval": bootstrap_interval(exact)}
    sizes = {}
    for mode in UPSTREAM_MODES:
        small, large = (f"{mode}/mbs{size}" for size in MICRO_BATCH_SIZES)
        pairs = [(outcomes[f"{small}/seed{s}"], outcomes[f"{large}/seed{s}"]) for s in seeds
                 if f"{small}/seed{s}" in outcomes and f"{large}/seed{s}" in outcomes]
        if pairs:
            reward = [a["final_reward"] - b["final_reward"] for a, b in pairs]
            entropy = [a["entropy_end"] - b["entropy_end"] for a, b in pairs]
            sizes[mode] = {"final_reward": sum(reward) / len(reward), "final_reward_interval": bootstrap_interval(reward),
                           "entropy_end": sum(entropy) / len(entropy), "entropy_end_interval": bootstrap_interval(entropy)}
    return {"table": table, "differences_to_vanilla": differences, "upstream_small_minus_large": sizes,
            "spot_checks": spot_check_report(runs), "premise": premise(runs, outcomes, seeds), "outcomes": outcomes}


def spot_check_report(runs: dict) -> dict:
    """Each spot-check run against the same global mode and seed at :data:`GLOBAL_SIZE`: identical selection
    counts and rollouts, or the first step where they part."""
    out = {}
    for name, mode, size in spot_checks():
        for key in [k for k in runs if k.startswith(f"{name}/seed")]:
            seed = key.rsplit("/seed", 1)[1]
            other = runs.get(f"{mode}/seed{seed}")
            if other is None:
                continue
            a, b = runs[key], other
            first_rollout = next((i + 1 for i, (x, y) in enumerate(zip(a["rollout_digest"], b["rollout_digest"]))
                                  if x != y), None)
            counts_a, counts_b = a.get("selection_counts", {}), b.get("selection_counts", {})
            first_count = next((i + 1 for i in range(len(a["curves"]["reward"]))
                                if any(counts_a[n][i] != counts_b[n][i] for n in counts_a if n in counts_b)), None)
            same = (first_rollout or len(a["curves"]["entropy"]) + 1) - 1  # steps before the rollouts part
            out[f"{mode}/seed{seed}"] = {
                "sizes": [size, GLOBAL_SIZE], "rollouts_identical": first_rollout is None,
                "first_differing_rollout_step": first_rollout, "selection_counts_identical": first_count is None,
                "first_differing_count_step": first_count,
                "reward_max_abs_diff": max(abs(x - y) for x, y in zip(a["curves"]["reward"], b["curves"]["reward"])),
                "entropy_max_abs_diff": max(abs(x - y) for x, y in zip(a["curves"]["entropy"],
                                                                        b["curves"]["entropy"])),
                "entropy_max_abs_diff_while_rollouts_identical": max(
                    (abs(x - y) for x, y in zip(a["curves"]["entropy"][:same], b["curves"]["entropy"][:same])),
                    default=0.0)}
    return out


def vanilla_premise(curves: dict, tail: int = 3) -> dict:
    """The task's premise on one vanilla run: E's share rises (the mean of the last ``tail`` steps above the
    first step's) and P's exact probability falls below its start (the last step's below the first step's,
    the initial weights')."""
    easy, exact = curves["easy_share"], curves["pattern_probability"]
    out = {"easy_share_start": easy[0], "easy_share_tail": sum(easy[-tail:]) / tail,
           "pattern_probability_start": exact[0], "pattern_probability_end": exact[-1]}
    out["easy_share_rises"] = out["easy_share_tail"] > out["easy_share_start"]
    out["pattern_probability_falls"] = out["pattern_probability_end"] < out["pattern_probability_start"]
    out["holds"] = out["easy_share_rises"] and out["pattern_probability_falls"]
    return out


def premise(runs: dict, outcomes: dict, seeds: Sequence[int]) -> dict:
    """The task's premise, per seed: P's exact probability under the initial policy (vanilla's first step:
    the initial weights), and under vanilla whether E took over before P was found."""
    per_seed = {}
    for s in seeds:
        key = f"vanilla/seed{s}"
        if key not in runs:
            continue
        o = outcomes[key]
        per_seed[str(s)] = {"pattern_probability_start": o["pattern_probability_start"],
                            "pattern_probability_end": o["pattern_probability_end"],
                            "easy_share_start": runs[key]["curves"]["easy_share"][0],
                            "easy_share_end": o["easy_share_end"], "collapse_step": o["collapse_step"],
                            "found_step": o["found_step"], "collapsed_before_found": o["collapsed_before_found"],
                            "premise_holds": vanilla_premise(runs[key]["curves"])["holds"]}
    starts = [v["pattern_probability_start"] for v in per_seed.values()]
    n = len(per_seed)
    collapsed = sum(v["collapsed_before_found"] for v in per_seed.values())
    return {"per_seed": per_seed, "pattern_probability_start_range": [min(starts), max(starts)] if starts else None,
            "in_band_2_to_10_percent": all(0.02 <= p <= 0.10 for p in starts) if starts else None,
            "vanilla_collapsed_before_found": collapsed, "seeds": n,
            "premise_holds_on": sum(v["premise_holds"] for v in per_seed.values()),
            "vanilla_collapsed_before_found_interval": wilson_interval(collapsed, n) if n else None}


# -- report and picture -----------------------------------------------------------------------------------


def _interval(pair) -> str:
    return f"[{pair[0]:+.3f}, {pair[1]:+.3f}]"


def format_report(study: dict) -> str:
    summary = study["summary"]
    p = summary["premise"]
    lines = [f"seeds {study['seeds']}; steps {study['settings']['run_config']['steps']}; "
             f"final reward = mean of the last {study['settings']['final_steps']} steps"]
    if p["seeds"]:
        lo, hi = p["pattern_probability_start_range"]
        lines.append(f"premise: P's exact probability under the initial policy {100 * lo:.2f}-{100 * hi:.2f}% "
                     f"(2-10% band: {'yes' if p['in_band_2_to_10_percent'] else 'NO'}); vanilla collapsed onto E "
                     f"before finding P on {p['vanilla_collapsed_before_found']}/{p['seeds']} seeds "
                     f"(Wilson {p['vanilla_collapsed_before_found_interval'][0]:.2f}-"
                     f"{p['vanilla_collapsed_before_found_interval'][1]:.2f})")
    lines.append("configuration                     found P (Wilson 95%)      final reward (bootstrap 95%)  "
                 "median found step  end entropy")
    for name, row in summary["table"].items():
        lo, hi = row["found_share_interval"]
        rlo, rhi = row["final_reward_interval"]
        step = "-" if row["median_found_step"] is None else f"{row['median_found_step']:g}"
        lines.append(f"{name:33s} {row['found']}/{row['seeds']} = {row['found_share']:.2f} [{lo:.2f}, {hi:.2f}]   "
                     f"{row['final_reward_mean']:.3f} [{rlo:.3f}, {rhi:.3f}]        {step:>6s}          "
                     f"{row['entropy_end_mean']:.3f}")
    lines.append("P's exact probability at the last step (descriptive, not a criterion fixed before the runs): "
                 "median over seeds; seeds where it ended above its start")
    for name, row in summary["table"].items():
        lines.append(f"  {name:33s} {row['pattern_probability_end_median']:.3f}; {row['pattern_probability_rose']}/"
                     f"{row['seeds']}")
    lines.append("paired difference to vanilla (mean over seeds, bootstrap 95%): final reward | found-P share | "
                 "P's exact probability at the last step")
    for name, d in summary["differences_to_vanilla"].items():
        lines.append(f"  {name:33s} {d['final_reward']:+.3f} {_interval(d['final_reward_interval'])} | "
                     f"{d['found_share']:+.3f} {_interval(d['found_share_interval'])} | "
                     f"{d['pattern_probability_end']:+.3f} {_interval(d['pattern_probability_end_interval'])}")
    sizes = study["settings"]["micro_batch_sizes"]
    lines.append(f"upstream, micro-batch {sizes[0]} minus {sizes[-1]} (paired): final reward | end entropy")
    for mode, d in summary["upstream_small_minus_large"].items():
        lines.append(f"  {mode:33s} {d['final_reward']:+.3f} {_interval(d['final_reward_interval'])} | "
                     f"{d['entropy_end']:+.3f} {_interval(d['entropy_end_interval'])}")
    lines.append("global modes, spot-check at both micro-batch sizes:")
    for key, s in summary["spot_checks"].items():
        counts = ("selection counts identical" if s["selection_counts_identical"]
                  else f"selection counts part at step {s['first_differing_count_step']}")
        if s["rollouts_identical"]:
            what = f"rollouts identical, {counts}; max |entropy diff| {s['entropy_max_abs_diff']:.2e}"
        else:
            what = (f"rollouts part at step {s['first_differing_rollout_step']} (max |entropy diff| before: "
                    f"{s['entropy_max_abs_diff_while_rollouts_identical']:.2e}), {counts}; over the run max |entropy "
                    f"diff| {s['entropy_max_abs_diff']:.2e}, |reward diff| {s['reward_max_abs_diff']:.2e}")
        lines.append(f"  {key:33s} {what}")
    return "\n".join(lines)


COLORS = {"vanilla": "0.3", "kl_cov": "tab:red", "kl_cov_global": "tab:blue", "clip_cov": "tab:orange",
          "clip_cov_global": "tab:green", "high_entropy_per_micro_batch": "tab:purple",
          "high_entropy_global": "tab:cyan"}


def plot(study: dict, path: str) -> None:
    """One PNG. Per step, every configuration's mean over seeds with the seeds' interquartile range as a band:
    reward, entropy, P's exact probability, E's share. Per configuration: the share of seeds that found P
    with its Wilson interval, and the final reward with its bootstrap interval."""
    import numpy as np

    plt = load_pyplot()
    runs, seeds = study["runs"], study["seeds"]
    table = study["summary"]["table"]
    fig, axes = plt.subplots(2, 3, figsize=(20, 10.5))
    panels = (("reward", axes[0][0], "mean reward (0.5 x E share + 1 x [P])"),
              ("entropy", axes[0][1], "policy entropy (actor/entropy)"),
              ("pattern_probability", axes[1][0], "P's exact probability under the sampling policy (log scale)"),
              ("easy_share", axes[1][1], "E's share of the response tokens"))
    for name, mode, size in configurations():
        curves = [runs[f"{name}/seed{s}"]["curves"] for s in seeds if f"{name}/seed{s}" in runs]
        if not curves:
            continue
        ls = ":" if "/mbs1" in name else ("--" if "/mbs" in name else "-")
        for metric, ax, _ in panels:
            y = np.array([c[metric] for c in curves])
            steps = np.arange(1, y.shape[1] + 1)
            ax.plot(steps, y.mean(axis=0), color=COLORS[mode], ls=ls, lw=1.6, label=name)
            q1, q3 = np.percentile(y, [25, 75], axis=0)
            ax.fill_between(steps, q1, q3, color=COLORS[mode], alpha=0.08, lw=0)
    for metric, ax, title in panels:
        ax.set_title(title)
        ax.set_xlabel("trainer step")
        ax.grid(True, alpha=0.3)
    axes[1][0].set_yscale("log")
    axes[0][0].legend(fontsize=7, ncol=2)
    names = list(table)
    colors = [COLORS[n.split("/")[0]] for n in names]
    for ax, value, interval, title, limit in (
            (axes[0][2], "found_share", "found_share_interval", "share of seeds that found P (Wilson 95%)", (0, 1)),
            (axes[1][2], "final_reward_mean", "final_reward_interval",
             "final reward, mean of the last steps (bootstrap 95% over seeds)", None)):
        centre = [table[n][value] for n in names]
        error = [[max(0.0, c - table[n][interval][0]) for c, n in zip(centre, names)],  # 0, not -1 ulp
                 [max(0.0, table[n][interval][1] - c) for c, n in zip(centre, names)]]
        ax.barh(range(len(names)), centre, xerr=error, color=colors, alpha=0.8, capsize=3)
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=8)
        ax.invert_yaxis()
        if limit:
            ax.set_xlim(*limit)
        ax.set_title(title)
        ax.grid(True, axis="x", alpha=0.3)
    cfg = study["settings"]["run_config"]
    fig.suptitle(
        f"Deceptive reward, {len(seeds)} paired seeds, policy-sampled GRPO on verl's trainer loop (CPU, fp32, "
        f"tiny Qwen2, 64 ids): mean over seeds, band = interquartile range; upstream micro-batch 1 dotted, 4 dashed\n"
        f"{cfg['prompts_per_step']}x{cfg['responses_per_prompt']} responses of {cfg['max_response_length']} tokens "
        f"per step, {cfg['steps']} steps, {cfg['optimizer']} lr {cfg['lr']}, kl_cov_ratio {cfg['kl_cov_ratio']} "
        f"coef {cfg['ppo_kl_coef']}, clip_cov_ratio {cfg['clip_cov_ratio']} window ({cfg['clip_cov_lb']}, "
        f"{cfg['clip_cov_ub']}), entropy_top_ratio {cfg['entropy_top_ratio']}", fontsize=10)
    save_figure(fig, path, dpi=90)


# -- the study --------------------------------------------------------------------------------------------


def _cost(plan: dict) -> float:
    """Relative cost of a run: a loss call costs about the same at any micro-batch size here."""
    return plan["steps"] * (32 / plan["micro_batch_size"] + 8)


def run_study(plans: Sequence[dict], study: dict, *, jobs: int, json_path: Optional[str] = None, progress=print,
              base: RunConfig = BASE, task: DeceptiveTask = TASK) -> dict:
    """The plans not yet in ``study['runs']`` (:func:`.study_cli.run_pending`), each seed's model built once."""
    def work(work_root: str, todo: list) -> functools.partial:
        models_dir = os.path.join(work_root, "models")
        for seed in sorted({p["seed"] for p in todo}):
            model_path_for(models_dir, seed)
        return functools.partial(run_one, models_dir=models_dir, work_root=work_root, base=base, task=task)

    def describe(run: dict) -> str:
        o = run_outcome(run, study["settings"]["task"], study["settings"]["final_steps"])
        found = f"found at step {o['found_step']}" if o["found_step"] else "not found"
        return f"final reward {o['final_reward']:.3f}, P {found}, end entropy {o['entropy_end']:.2f}"

    return run_pending(plans, study, key_of=lambda plan: plan["key"], cost=_cost, work=work, describe=describe,
                       jobs=jobs, json_path=json_path, progress=progress, prefix="exploration_cpu_")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = new_parser("python -m experiments.exploration", __doc__)
    add_output_arguments(parser)  # --png, --json (here also what a rerun resumes from), --from-json
    parser.add_argument("--steps", type=int, default=BASE.steps, help="GRPO steps per run (default %(default)s)")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="comma-separated (default %(default)s)")
    parser.add_argument("--jobs", type=int, default=2, help="processes running runs in parallel (default %(default)s)")
    parser.add_argument("--configurations", help="comma-separated subset of the configurations (default: all)")
    args = parser.parse_args(argv)
    if args.from_json:  # the summary is recomputed from the runs: a redraw needs nothing else
        return redraw_from_json(args, format_report, plot, prepare=lambda study: study.update(summary=summarize(study)))
    seeds = [int(s) for s in args.seeds.split(",")]
    names = {name for name, _, _ in configurations() + spot_checks()}
    plans = planned_runs(seeds, args.steps)
    if args.configurations:
        wanted = set(args.configurations.split(","))
        if wanted - names:
            parser.error(f"unknown configurations {sorted(wanted - names)}; choose from {sorted(names)}")
        plans = [p for p in plans if p["configuration"] in wanted]
    if args.steps < FINAL_STEPS:
        parser.error(f"--steps must be at least {FINAL_STEPS}")
    settings = study_settings(replace(BASE, steps=args.steps))
    earlier = resumed_from(args.json, settings)
    study = open_study(settings, args.json,  # resumed: the seeds of both invocations
                       seeds=seeds if earlier is None else sorted(set(earlier.get("seeds", [])) | set(seeds)))
    started = time.perf_counter()
    print(f"exploration study: {len(plans)} runs, seeds {seeds}, {args.steps} steps", flush=True)
    run_study(plans, study, jobs=args.jobs, json_path=args.json, progress=lambda m: print(m, flush=True))
    close_study(study, args, started, summarize, format_report, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
