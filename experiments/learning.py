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
``high_entropy_per_micro_batch`` (the lab's comparator), ``high_entropy_global`` and ``stare_global``, once with
its default gate target and once with the gate open at every step) at ``ppo_micro_batch_size_per_gpu`` 1 and 4.
At 1, each of upstream's loss calls sees one sequence, whose GRPO advantage is constant: every
covariance is 0 there.

Reported per run and step: verl's ``actor/entropy`` (mean policy entropy over the step's response
tokens, computed with the old log-probs) and ``critic/score/mean`` (mean reward), the rollout's
token covariance of log-prob and GRPO advantage (:class:`.policy_rollout.PolicyRollout`, every
mode), and the global modes' selection figures, the covariance figures among them
(``actor/<method>/cov_mean``, ``selected_cov_mean``, ``selected_cov_share``). Compared: each mode's
two micro-batch sizes, step by step, against vanilla's own difference (its float noise).
Knobs: ``kl_cov_ratio`` 0.1 and ``ppo_kl_coef`` 1 (the paper's 0.002 would
select 1 token of a 256-token minibatch: the quota floor), ``clip_cov_ratio`` 0.1 and the window
(0, 5) (verl's default lower bound 1 leaves no candidate while the policy is near uniform:
covariances start near 0), ``entropy_top_ratio`` 0.2 (the paper's), STARE's knobs its config class's defaults
(:data:`STARE_KNOBS`, the paper's; :data:`STARE_TARGETS`).
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

from .local_trainer import LOSS_MODES, RunConfig, RunResult, compose_config, run_local, trainer_overrides
from .local_trainer import config_fields as trainer_config_fields
from .study_cli import (
    add_output_arguments, add_run_arguments, load_pyplot, new_parser, redraw_from_json,
    run_in_jobs, run_pending, save_figure, write_outputs,
)

MICRO_BATCH_SIZES = (1, 4)
#: A global mode's curves may differ between micro-batch sizes by at most this many times vanilla's difference.
NOISE_FACTOR = 10.0
ENTROPY, REWARD = "actor/entropy", "critic/score/mean"
PREFIXES = {"kl_cov_global": "actor/kl_cov/", "clip_cov_global": "actor/clip_cov/",
            "high_entropy_global": "actor/high_entropy/", "stare_global": "actor/stare/",
            "lp_reg_global": "actor/lp_reg/"}
COUNTS = ("quota", "selected", "clipped", "candidates", "valid_tokens", "nonfinite_tokens",
          "selected_positive", "selected_negative", "candidates_positive", "candidates_negative")
COVARIANCE = ("cov_mean", "selected_cov_mean", "selected_cov_share")
#: high_entropy_global's selection figures (minibatch-global, per optimizer step, logged like the covariance ones)
ENTROPY_FIGURES = ("entropy_threshold", "entropy_mean", "selected_entropy_mean", "selected_entropy_share")
#: The authors' per-micro-batch rule (the lab's comparator) logs the tokens it kept in each micro-batch.
COMPARATOR_SELECTED = "actor/high_entropy_per_micro_batch/selected_in_micro_batch"

STARE = "stare_global"
#: stare_global's knobs, fixed before its runs: ``StareGlobalPolicyLossConfig``'s defaults (the paper's), no schedule.
STARE_KNOBS = {"stare_top_ratio": 0.1, "stare_reweight_w": 1.1, "stare_reweight_m": 0.9, "stare_variant": "O1",
               "stare_adaptive": False}
#: The gate's target of the plain ``stare_global`` row: the config class's default (the paper's 0.3 nats).
STARE_DEFAULT_TARGET = 0.3
#: The second STARE row's target: above ln 64 = 4.159, the largest entropy a policy over 64 ids can have, so the gate
#: is open at every step (STARE's reweighting without its gate). A row of its own, named :func:`row_of` says.
STARE_OPEN_TARGET = 4.2
STARE_TARGETS = (STARE_DEFAULT_TARGET, STARE_OPEN_TARGET)
#: stare_global's figures beside its counts: the rule's (per trainer step) and the selection's (per optimizer step)
STARE_FIGURES = ("gate_on", "batch_entropy", "reweight_w_in_use", "reweight_m_in_use", "target_entropy",
                 "surprisal_mean", "selected_surprisal_share")
LP_REG = "lp_reg_global"
#: lp_reg_global's knobs, fixed before its runs: the authors' kappa 0.02 and beta 1 (lp_reg_kl_coef, its default),
#: rho- 0.05: a minibatch of the miniature holds about 128 negative-advantage tokens, where the authors' 0.01 gives a
#: quota of 1
LP_REG_KNOBS = {"lp_reg_neg_ratio": 0.05, "lp_reg_pos_ratio": 0.0, "lp_reg_min_p": 0.02}
#: lp_reg_global's figures beside its counts (per optimizer step)
LP_REG_FIGURES = ("regularised", "selected_in_support_share", "kl_mean", "per_call_switched_off")


def config_fields(run: RunConfig) -> dict:
    """:func:`.local_trainer.config_fields` without STARE's knobs: the report's ``config`` is the runs' shared
    settings, as before STARE's rows (their knobs go under the report's ``stare``)."""
    fields = trainer_config_fields(run)
    fields.pop("stare_knobs", None)
    fields.pop("lp_reg_knobs", None)
    return fields


def learning_run(base: RunConfig, mode: str, micro_batch_size: int, *, stare_target: Optional[float] = None,
                 **changes) -> RunConfig:
    """``base`` as ``mode`` at ``micro_batch_size``; a ``stare_global`` run gets :data:`STARE_KNOBS` and the gate's
    target ``stare_target`` (default :data:`STARE_DEFAULT_TARGET`)."""
    if mode != STARE:
        if stare_target is not None:
            raise ValueError(f"stare_target is stare_global's knob, not {mode}'s")
        if mode == LP_REG:
            changes.setdefault("lp_reg_knobs", tuple(LP_REG_KNOBS.items()))
        return replace(base, loss_mode=mode, micro_batch_size=micro_batch_size, **changes)
    target = STARE_DEFAULT_TARGET if stare_target is None else stare_target
    knobs = tuple(STARE_KNOBS.items()) + (("stare_target_entropy", target),)
    return replace(base, loss_mode=mode, micro_batch_size=micro_batch_size, stare_knobs=knobs, **changes)


def stare_target_of(run: RunConfig) -> Optional[float]:
    """The gate's target of a ``stare_global`` run (None: another mode)."""
    return dict(run.stare_knobs).get("stare_target_entropy", STARE_DEFAULT_TARGET) if run.loss_mode == STARE else None


def row_of(run: RunConfig) -> str:
    """The report's row of a run: its loss mode; a STARE run at another target than the default also names it."""
    target = stare_target_of(run)
    if target is None or target == STARE_DEFAULT_TARGET:
        return run.loss_mode
    return f"{STARE} target={target:g}"


def mode_of_row(row: str) -> str:
    return row.split(" ", 1)[0]


def compose_run_config(run: RunConfig, *, model_path: str, train_file: str, out_dir: str):
    """verl's config of ``run`` as :func:`.local_trainer.run_trainer` composes it (for the tests)."""
    return compose_config(trainer_overrides(run, model_path=model_path, train_file=train_file, out_dir=out_dir))


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
    row = row_of(run).replace(" target=", "-target")
    run_dir = os.path.join(work_dir, f"{row}-mbs{run.micro_batch_size}-dp{run.world_size}")
    os.makedirs(run_dir, exist_ok=True)
    with quiet_verl() if quiet else contextlib.nullcontext():
        started = time.perf_counter()
        (result,) = run_local([run], model_path=model_path, work_dir=run_dir,
                              make_rollout=MakePolicyRollout(model_path), dataset=write_dataset)
        result.seconds = time.perf_counter() - started
    result.config = run
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
        for name in COUNTS + COVARIANCE + ENTROPY_FIGURES + STARE_FIGURES + LP_REG_FIGURES:
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


def row_order(row: str) -> tuple:
    """Rows in :data:`.local_trainer.LOSS_MODES`' order; a mode's STARE rows by target."""
    mode = mode_of_row(row)
    target = float(row.split("target=", 1)[1]) if "target=" in row else (
        STARE_DEFAULT_TARGET if mode == STARE else 0.0)
    return LOSS_MODES.index(mode), target


def summarize(results: Sequence[RunResult]) -> dict:
    """Everything the picture, the docs and the test read, JSON-ready."""
    runs = {f"{row_of(r.config)}/mbs{r.config.micro_batch_size}": r for r in results}
    curve = {key: curves(r) for key, r in runs.items()}
    modes = sorted({row_of(r.config) for r in results}, key=row_order)
    sizes = sorted({r.config.micro_batch_size for r in results})
    small, large = sizes[0], sizes[-1]
    per_run = {}
    for key, r in runs.items():
        c = curve[key]
        per_run[key] = {"entropy_start": c["entropy"][0], "entropy_end": c["entropy"][-1],
                        "reward_start": c["reward"][0], "reward_end": c["reward"][-1],
                        "seconds": getattr(r, "seconds", None)}
        for name in COVARIANCE + ENTROPY_FIGURES + STARE_FIGURES + LP_REG_FIGURES:
            if name in c:
                per_run[key][f"{name}_mean_over_steps"] = sum(c[name]) / len(c[name])
        if "gate_on" in c:
            per_run[key]["gate_open_steps"] = [step + 1 for step, on in enumerate(c["gate_on"]) if on > 0]
    pairs = {}
    for mode in modes:
        a, b = runs[f"{mode}/mbs{small}"], runs[f"{mode}/mbs{large}"]
        pair = compare(curve[f"{mode}/mbs{small}"], curve[f"{mode}/mbs{large}"])
        pair["same_rollouts"] = a.rollout_digest == b.rollout_digest
        pair["first_differing_rollout_step"] = next(
            (i + 1 for i, (x, y) in enumerate(zip(a.rollout_digest, b.rollout_digest)) if x != y), None)
        pair["param_max_abs_diff"] = max(float((x - y).abs().max()) for x, y in zip(a.params, b.params))
        pairs[mode] = pair
    report = {
        "config": config_fields(results[0].config) | {"loss_mode": None, "micro_batch_size": None},
        "modes": modes, "micro_batch_sizes": sizes, "noise_factor": NOISE_FACTOR, "curves": curve,
        "runs": per_run, "pairs": pairs}
    if any(mode_of_row(m) == LP_REG for m in modes):
        report["lp_reg"] = {"knobs": dict(LP_REG_KNOBS)}
    if any(mode_of_row(m) == STARE for m in modes):
        report["stare"] = {"knobs": dict(STARE_KNOBS), "targets": sorted(
            {stare_target_of(r.config) for r in results if r.config.loss_mode == STARE})}
    return add_comparable_reward(add_verdict(report))


def add_verdict(report: dict) -> dict:
    """The pairs' ratios to vanilla's difference and the verdict, from the report's rows (in place; returned)."""
    pairs, per_run = report["pairs"], report["runs"]
    large = report["micro_batch_sizes"][-1]
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
        for mode in report["modes"]:
            if mode_of_row(mode).endswith("_global"):
                p = pairs[mode]
                verdict[f"{mode}_invariant"] = bool(p["counts_identical"]) and max(p["ratio_to_vanilla"].values()) \
                    <= NOISE_FACTOR
            elif mode != "vanilla":
                verdict[f"{mode}_splits"] = pairs[mode]["ratio_to_vanilla"]["entropy"] > NOISE_FACTOR
        # the paper's claim, as measured: end entropy relative to vanilla's, with the end reward next to it
        verdict["end_entropy_over_vanilla"] = {
            key: per_run[key]["entropy_end"] / per_run[f"vanilla/mbs{key.split('mbs')[1]}"]["entropy_end"]
            for key in per_run}
    report["verdict"] = verdict
    return report


def merge_reports(earlier: dict, new: dict) -> dict:
    """``earlier`` with ``new``'s rows added (a row both hold: ``new``'s), the verdict and the comparable-reward
    figures recomputed. Every run seeds itself and depends on no other, so rows of two invocations may stand in
    one report, provided they are the same computation: the same settings, and vanilla's runs (which ``new`` must
    hold: its floor) bit for bit the same curves, rollouts and parameter difference. Otherwise ValueError. The
    merged report keeps ``earlier``'s ``config``, ``seconds`` and ``jobs``; ``added`` lists each merge's rows and time."""
    defaults = config_fields(RunConfig())
    # a setting one report lacks (RunConfig gained it later) must be at its default, which the other's runs used
    settings_differ = any(earlier["config"].get(key, defaults.get(key)) != new["config"].get(key, defaults.get(key))
                          for key in set(earlier["config"]) | set(new["config"]))
    if settings_differ or earlier["micro_batch_sizes"] != new["micro_batch_sizes"]:
        raise ValueError("the reports' settings differ: "
                         f"{earlier['config']}, sizes {earlier['micro_batch_sizes']} vs "
                         f"{new['config']}, sizes {new['micro_batch_sizes']}")
    keys = [f"vanilla/mbs{size}" for size in new["micro_batch_sizes"]]
    same = "vanilla" in new["pairs"] and all(earlier["curves"][k] == new["curves"][k] for k in keys) and all(
        earlier["pairs"]["vanilla"][name] == new["pairs"]["vanilla"][name]
        for name in ("entropy", "reward", "same_rollouts", "param_max_abs_diff"))
    if not same:
        raise ValueError("vanilla's runs are not bit for bit the earlier report's: the rows are not one "
                         "computation; run the whole study instead")
    merged = json.loads(json.dumps(earlier))
    for mode in new["modes"]:
        if mode == "vanilla":
            continue
        merged["pairs"][mode] = new["pairs"][mode]
        for size in new["micro_batch_sizes"]:
            key = f"{mode}/mbs{size}"
            merged["curves"][key], merged["runs"][key] = new["curves"][key], new["runs"][key]
    merged["modes"] = sorted(set(earlier["modes"]) | set(new["modes"]), key=row_order)
    order = [f"{mode}/mbs{size}" for mode in merged["modes"] for size in merged["micro_batch_sizes"]]
    merged["curves"] = {key: merged["curves"][key] for key in order}
    merged["runs"] = {key: merged["runs"][key] for key in order}
    merged["pairs"] = {mode: merged["pairs"][mode] for mode in merged["modes"]}
    if "stare" in new:
        merged["stare"] = new["stare"]
    if "lp_reg" in new:
        merged["lp_reg"] = new["lp_reg"]
    added = [row for row in new["modes"] if row != "vanilla"]
    merged.setdefault("added", []).append({"rows": added, "seconds": new.get("seconds"), "jobs": new.get("jobs")})
    return add_comparable_reward(add_verdict(merged))


def _step_ranges(steps: Sequence[int]) -> str:
    """[1, 2, 3, 7] -> "(1-3, 7)"; none -> "(none)"."""
    spans: list[list[int]] = []
    for step in steps:
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return "(" + (", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans) or "none") + ")"


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
        cov = {n: r.get(f"{n}_mean_over_steps") for n in COVARIANCE + ENTROPY_FIGURES + STARE_FIGURES
               if f"{n}_mean_over_steps" in r}
        if cov:
            lines.append(f"  {key}: mean over steps " + ", ".join(f"{n} {v:.4f}" for n, v in cov.items()))
        if "gate_open_steps" in r:
            lines.append(f"  {key}: STARE's gate open at {len(r['gate_open_steps'])} of "
                         f"{len(report['curves'][key]['entropy'])} steps {_step_ranges(r['gate_open_steps'])}")
    if "stare" in report:
        lines.append(f"stare_global's knobs: {report['stare']['knobs']}, targets {report['stare']['targets']}")
    if "lp_reg" in report:
        lines.append(f"lp_reg_global's knobs: {report['lp_reg']['knobs']}")
    lines.append("verdict: " + json.dumps({k: v for k, v in report["verdict"].items()
                                           if k != "end_entropy_over_vanilla"}))
    return "\n".join(lines)


COLORS = {"vanilla": "0.45", "kl_cov": "tab:red", "kl_cov_global": "tab:blue", "clip_cov": "tab:orange",
          "clip_cov_global": "tab:green", "high_entropy_per_micro_batch": "tab:purple",
          "high_entropy_global": "tab:cyan", STARE: "tab:brown", f"{STARE} target={STARE_OPEN_TARGET:g}": "tab:pink",
          LP_REG: "tab:olive"}


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
        color = COLORS.get(mode, "black")
        ax_h.plot(steps, c["entropy"], color=color, ls=ls, lw=1.6, label=label)
        ax_r.plot(steps, c["reward"], color=color, ls=ls, lw=1.6, label=label)
        dh = [b - a for a, b in zip(c["entropy"], c["entropy"][1:])]
        ax_c.scatter(c["rollout_token_cov"][:-1], dh, s=14, color=color,
                     marker="o" if mbs == small else "x", label=label, alpha=0.8)
        if "selected_cov_share" in c:
            ax_s.plot(steps, c["selected_cov_share"], color=color, ls=ls, lw=2.2,
                      label=f"{label}: selected share")
            ax_s.plot(steps, c["cov_mean"], color=color, ls=ls, lw=0.8, alpha=0.6,
                      label=f"{label}: cov_mean")
        if "selected_entropy_share" in c:  # high_entropy_global: the selected tokens' share of the entropy
            ax_s.plot(steps, c["selected_entropy_share"], color=color, ls=ls, lw=2.2,
                      label=f"{label}: selected entropy share")
        if "selected_surprisal_share" in c:  # stare_global: the selected tokens' share of the surprisal
            ax_s.plot(steps, c["selected_surprisal_share"], color=color, ls=ls, lw=2.2,
                      label=f"{label}: selected surprisal share")
        if "selected_in_support_share" in c:  # lp_reg_global: the selected tokens' share inside the proxy's support
            ax_s.plot(steps, c["selected_in_support_share"], color=color, ls=ls, lw=2.2,
                      label=f"{label}: selected share in the min-p support")
    if "stare" in report:
        for target in report["stare"]["targets"]:
            if target < 4.16:  # a target above ln 64 opens the gate everywhere: nothing to draw
                ax_h.axhline(target, color="tab:brown", lw=0.8, ls=":", label=f"STARE's gate target {target:g}")
    ax_h.set_title("policy entropy (actor/entropy)")
    ax_r.set_title("mean reward (critic/score/mean; 0-1: share of target tokens)")
    ax_c.set_title("entropy change H(t+1) - H(t) vs the step's token Cov(log-prob, advantage)\n"
                   "(rollout, every mode; first order: dH = -eta Cov)")
    ax_c.axhline(0, color="0.7", lw=0.8)
    ax_c.axvline(0, color="0.7", lw=0.8)
    ax_c.set_xlabel("token covariance of the step's batch")
    ax_c.set_ylabel("entropy change")
    ax_s.set_title("global modes' figures (step means): thick: the selected tokens' share of\n"
                   "covariance / entropy / surprisal / in Lp-Reg's support; thin: cov_mean")
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
        + (f", entropy_top_ratio {cfg['entropy_top_ratio']}" if "entropy_top_ratio" in cfg else "")
        + (f"\nstare_global: top ratio {report['stare']['knobs']['stare_top_ratio']}, W "
           f"{report['stare']['knobs']['stare_reweight_w']}, variant {report['stare']['knobs']['stare_variant']}, "
           f"gate targets {', '.join(f'{t:g}' for t in report['stare']['targets'])}" if "stare" in report else ""),
        fontsize=11)
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
    parser.add_argument("--modes", default=",".join(LOSS_MODES), help="comma-separated (default: all nine)")
    parser.add_argument("--stare-targets", default=",".join(f"{t:g}" for t in STARE_TARGETS),
                        help="stare_global's gate targets, one row each (default %(default)s: the default and a "
                             "target above ln 64, where the gate is open at every step)")
    parser.add_argument("--add-to", metavar="JSON",
                        help="add the rows of the runs (or of --from-json's report) to this earlier report: the "
                             "same settings, vanilla's runs bit for bit (so --modes must hold vanilla)")
    args = parser.parse_args(argv)
    if args.from_json and args.add_to:  # two earlier reports into one, no runs
        with open(args.add_to) as earlier, open(args.from_json) as rows:
            write_outputs(merge_reports(json.load(earlier), json.load(rows)), args, format_report, plot)
        return 0
    if args.from_json:
        return redraw_from_json(args, format_report, plot, prepare=add_comparable_reward)
    modes = args.modes.split(",")
    if args.steps < 2 or any(m not in LOSS_MODES for m in modes) or "vanilla" not in modes:
        parser.error(f"--steps >= 2; --modes from {LOSS_MODES}, vanilla included")
    targets = [float(t) for t in args.stare_targets.split(",")] if STARE in modes else []

    from .learning_task import build_learning_model

    base = replace(BASE, steps=args.steps, seed=args.seed)
    runs = [learning_run(base, m, b, stare_target=t) for m in modes for t in (targets if m == STARE else [None])
            for b in MICRO_BATCH_SIZES]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="learning_cpu_") as work_dir:
        model = build_learning_model(os.path.join(work_dir, "model"))
        results = run_runs(runs, model_path=model, work_dir=work_dir, jobs=args.jobs)
    report = summarize(results)
    report["seconds"] = time.perf_counter() - started
    report["jobs"] = args.jobs
    if args.add_to:
        with open(args.add_to) as f:
            report = merge_reports(json.load(f), report)
    write_outputs(report, args, format_report, plot)
    seconds = report["added"][-1]["seconds"] if args.add_to else report["seconds"]
    print(f"total {seconds:.0f} s with {args.jobs} job(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
