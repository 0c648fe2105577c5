"""The entropy floor on the learning miniature: the controller's law, for each mode, before any real model.

``python -m experiments.entropy_target --png docs/entropy_target_cpu.png --json docs/entropy_target_cpu.json``
runs the learning miniature of :mod:`.learning` (verl's trainer loop in-process, policy-sampled GRPO on a
64-id tiny Qwen2 that learns from scratch, CPU, fp32, 40 steps of 4 optimizer steps) for each global mode
with the entropy floor on, at two targets and at micro-batch sizes 1 and 4, plus ``vanilla`` at both
sizes (its float noise between the sizes is the floor the controlled pairs are compared with). The
fixed-knob runs of the same miniature (:mod:`.learning`, ``docs/learning_cpu.json``: the same code path
with the controller off) are drawn beside them, and so is the knob's authority: KL-Cov and Clip-Cov with the
ratio fixed at the controller's upper bound from the first step (micro-batch size 4), the strongest the
controller could run them.

Settings (:data:`CONTROL`), fixed before the runs: the targets 1.5 and 3.0 nats (the miniature starts at
ln 64 = 4.16 and vanilla collapses to about 0.2); the product's floor-law defaults (``kp`` 10, ``ki`` 1, a
horizon of 8 optimizer steps over a window of 4, hysteresis 0.1); bounds [0.001, 1] for every mode, since the
miniature's knobs live at its own scale (a minibatch of 256 tokens: its fixed-knob runs use ratio 0.1, and
1/256 = 0.004 is the quota floor); the users' ratios, where the floor law starts and which it never goes below,
are the fixed-knob runs' knobs (``kl_cov_ratio`` 0.1, ``clip_cov_ratio`` 0.1 with the window (0, 5),
``entropy_top_ratio`` 0.2). The defaults were set here, before the SmolLM2 study (:mod:`.entropy_floor`).

Earlier attempts, with 0.8.0's two-sided law (it also weakened the method while the entropy was above the
target): ``docs/entropy_target_cpu_attempt1.json`` (``ki`` 0.05, ``kp`` 2), ``..._attempt2.json`` (``ki`` 0.1,
``kp`` 10) and ``..._attempt3.json`` (``ki`` 0.1, ``kp`` 10, a horizon of 40 over a window of 8).

Reported per mode x target x micro-batch size: the mean |entropy - target| over the last 10 steps, the first
step from which the entropy stays within 0.2 nats of the target (or never), the final reward (mean of the last
5 steps) next to the fixed-knob run's and vanilla's, the controlled ratio's trajectory (per trainer step, the
ratio in use at its last optimizer step), and whether the two sizes' curves agree within 10x vanilla's own
difference (else the first step where they part). Resumable: the JSON is rewritten after every run and a
rerun with the same ``--json`` skips the runs it holds; ``--from-json`` redraws without running.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import replace
from typing import Optional, Sequence

from .learning import BASE, ENTROPY, NOISE_FACTOR, PREFIXES, REWARD, MakePolicyRollout, float32_spacing, \
    run_on_the_learning_model
from .local_trainer import RunConfig, RunResult, config_fields, run_local
from .study_cli import (
    load_pyplot, resumable_main, save_figure,
)

MODES = ("kl_cov_global", "clip_cov_global", "high_entropy_global")
TARGETS = (1.5, 3.0)
MICRO_BATCH_SIZES = (1, 4)
#: The controller's settings of every controlled run (module docstring: why these).
CONTROL = dict(entropy_control_ki=1.0, entropy_control_kp=10.0, entropy_control_min_ratio=0.001,
               entropy_control_max_ratio=1.0, entropy_control_horizon=8.0, entropy_control_window=4,
               entropy_control_hysteresis=0.1)
KNOBS = {"kl_cov_global": "kl_cov_ratio", "clip_cov_global": "clip_cov_ratio",
         "high_entropy_global": "entropy_top_ratio"}
LAST_STEPS, BAND, FINAL_STEPS = 10, 0.2, 5
#: The knob's authority: KL-Cov and Clip-Cov with their ratio fixed at the controller's upper bound from the first
#: step (the strongest the controller could run them), micro-batch size 4 only (a measurement of the plant, not an
#: invariance claim). The 80/20 rule needs none: its fixed rho = 0.2 already holds 4.08 nats (docs/learning_cpu.json).
AUTHORITY_MODES = ("kl_cov_global", "clip_cov_global")
AUTHORITY_MICRO_BATCH_SIZE = 4
FIXED_KNOB_JSON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                               "learning_cpu.json")


def run_key(mode: str, target: Optional[float], micro_batch_size: int) -> str:
    return f"{mode}/target{target:g}/mbs{micro_batch_size}" if target is not None else f"{mode}/mbs{micro_batch_size}"


def authority_key(mode: str, micro_batch_size: int) -> str:
    """The JSON key of an authority run (the ratio fixed at the controller's upper bound)."""
    return f"{mode}/upper_bound/mbs{micro_batch_size}"


def key_of(run: RunConfig) -> str:
    """A run's key in the JSON: :func:`run_key`, or :func:`authority_key` for an authority run."""
    if run.entropy_target is None and run.loss_mode in AUTHORITY_MODES:
        return authority_key(run.loss_mode, run.micro_batch_size)
    return run_key(run.loss_mode, run.entropy_target, run.micro_batch_size)


def planned_runs(steps: int) -> list[RunConfig]:
    """vanilla at both sizes, then every mode x target x size with the controller on."""
    base = replace(BASE, steps=steps, **CONTROL)
    runs = [replace(base, loss_mode="vanilla", micro_batch_size=b) for b in MICRO_BATCH_SIZES]
    runs += [replace(base, loss_mode=m, entropy_target=t, micro_batch_size=b)
             for m in MODES for t in TARGETS for b in MICRO_BATCH_SIZES]
    upper = CONTROL["entropy_control_max_ratio"]
    runs += [replace(base, loss_mode=m, micro_batch_size=AUTHORITY_MICRO_BATCH_SIZE, **{KNOBS[m]: upper})
             for m in AUTHORITY_MODES]
    return runs


def study_settings(steps: int) -> dict:
    """What every run of the study shares (JSON-ready); a resumed study must match it."""
    return {"base": config_fields(replace(BASE, steps=steps)), "control": CONTROL, "targets": list(TARGETS),
            "modes": list(MODES), "micro_batch_sizes": list(MICRO_BATCH_SIZES)}


def _run_one(run: RunConfig, *, model_path: str, work_root: str) -> dict:
    """One run in its own folder; its JSON-ready record (curves per trainer step)."""
    from verl_klcov_global.lab.quiet import quiet_verl

    from .learning_task import write_dataset

    key = key_of(run)
    run_dir = os.path.join(work_root, key.replace("/", "-"))  # no "=": the paths go into Hydra overrides
    os.makedirs(run_dir, exist_ok=True)
    with quiet_verl():
        started = time.perf_counter()
        (result,) = run_local([run], model_path=model_path, work_dir=run_dir,
                              make_rollout=MakePolicyRollout(model_path), dataset=write_dataset)
        seconds = time.perf_counter() - started
    return record(result, key, seconds)


def record(result: RunResult, key: str, seconds: float) -> dict:
    """A run's record: entropy, reward and (controlled) the controller's figures per trainer step."""
    run = result.config
    out = {"key": key, "mode": run.loss_mode, "target": run.entropy_target, "fixed_ratio": (
               getattr(run, KNOBS[run.loss_mode]) if run.entropy_target is None and run.loss_mode in KNOBS else None),
           "micro_batch_size": run.micro_batch_size, "seconds": seconds,
           "entropy": [m[ENTROPY] for m in result.metrics], "reward": [m[REWARD] for m in result.metrics],
           "rollout_digest": list(result.rollout_digest)}
    if run.entropy_target is not None:
        prefix = PREFIXES[run.loss_mode]
        out["ratio_in_use"] = [m[f"{prefix}{KNOBS[run.loss_mode]}_in_use"] for m in result.metrics]
        out["entropy_measured"] = [m[f"{prefix}entropy_measured"] for m in result.metrics]
        if run.entropy_control_horizon:
            out["entropy_predicted"] = [m[f"{prefix}entropy_predicted"] for m in result.metrics]
        out["selected"] = [m.get(f"{prefix}selected", m.get(f"{prefix}clipped")) for m in result.metrics]
    return out


# -- the report -------------------------------------------------------------------------------------------


def settling_step(entropy: Sequence[float], target: float, band: float = BAND) -> Optional[int]:
    """The first trainer step (1-based) from which every later step's entropy is within ``band`` of ``target``."""
    for i in range(len(entropy)):
        if all(abs(h - target) <= band for h in entropy[i:]):
            return i + 1
    return None


def parting_step(a: Sequence[float], b: Sequence[float], tolerance: float) -> Optional[int]:
    """The first trainer step (1-based) where two curves differ by more than ``tolerance``, or None."""
    return next((i + 1 for i, (x, y) in enumerate(zip(a, b)) if abs(x - y) > tolerance), None)


def _final(values: Sequence[float]) -> float:
    return sum(values[-FINAL_STEPS:]) / len(values[-FINAL_STEPS:])


def fixed_knob_runs(path: str = FIXED_KNOB_JSON) -> dict:
    """The learning study's curves (``{"<mode>/mbs<b>": {"entropy": ..., "reward": ...}}``), or {} if absent."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f).get("curves", {})


def summarize(study: dict) -> dict:
    """Per controlled run its figures, per controlled pair the comparison with vanilla's floor."""
    runs, fixed = study["runs"], study.get("fixed_knob", {})
    small, large = MICRO_BATCH_SIZES
    floor = {}
    if all(run_key("vanilla", None, b) in runs for b in MICRO_BATCH_SIZES):
        a, b = (runs[run_key("vanilla", None, s)] for s in MICRO_BATCH_SIZES)
        for name in ("entropy", "reward"):
            floor[name] = max(abs(x - y) for x, y in zip(a[name], b[name]))
        floor["entropy"] = max(floor["entropy"], float32_spacing(a["entropy"] + b["entropy"]))
    vanilla_final = {s: _final(runs[run_key("vanilla", None, s)]["reward"])
                     for s in MICRO_BATCH_SIZES if run_key("vanilla", None, s) in runs}
    per_run, pairs = {}, {}
    for mode in MODES:
        for target in TARGETS:
            for size in MICRO_BATCH_SIZES:
                run = runs.get(run_key(mode, target, size))
                if run is None:
                    continue
                tail = run["entropy"][-LAST_STEPS:]
                fixed_curve = fixed.get(f"{mode}/mbs{size}")
                per_run[run["key"]] = {
                    "mean_abs_error_last_10": sum(abs(h - target) for h in tail) / len(tail),
                    "settling_step": settling_step(run["entropy"], target),
                    "entropy_end": run["entropy"][-1], "final_reward": _final(run["reward"]),
                    "fixed_knob_final_reward": _final(fixed_curve["reward"]) if fixed_curve else None,
                    "fixed_knob_entropy_end": fixed_curve["entropy"][-1] if fixed_curve else None,
                    "vanilla_final_reward": vanilla_final.get(size),
                    "ratio_start": run["ratio_in_use"][0], "ratio_end": run["ratio_in_use"][-1],
                    "ratio_min": min(run["ratio_in_use"]), "ratio_max": max(run["ratio_in_use"]),
                    "seconds": run["seconds"]}
            a, b = (runs.get(run_key(mode, target, s)) for s in MICRO_BATCH_SIZES)
            if a is None or b is None:
                continue
            pair = {name: max(abs(x - y) for x, y in zip(a[name], b[name])) for name in ("entropy", "reward")}
            pair["ratio_in_use"] = max(abs(math.log(x) - math.log(y)) for x, y in zip(a["ratio_in_use"], b["ratio_in_use"]))
            pair["same_rollouts"] = a["rollout_digest"] == b["rollout_digest"]
            pair["first_differing_rollout_step"] = next(
                (i + 1 for i, (x, y) in enumerate(zip(a["rollout_digest"], b["rollout_digest"])) if x != y), None)
            if floor:
                pair["ratio_to_vanilla"] = {n: (0.0 if pair[n] == 0 else math.inf if floor[n] == 0 else pair[n] / floor[n])
                                            for n in ("entropy", "reward")}
                pair["within_noise"] = max(pair["ratio_to_vanilla"].values()) <= NOISE_FACTOR
                pair["parts_at_step"] = parting_step(a["entropy"], b["entropy"], NOISE_FACTOR * floor["entropy"])
            pairs[f"{mode}/target{target:g}"] = pair
    authority = {}
    for mode in AUTHORITY_MODES:
        run = runs.get(authority_key(mode, AUTHORITY_MICRO_BATCH_SIZE))
        if run is None:
            continue
        entropy = run["entropy"]
        authority[run["key"]] = {
            "fixed_ratio": run["fixed_ratio"], "entropy_end": entropy[-1],
            "fall_last_10": entropy[-LAST_STEPS - 1] - entropy[-1],
            "first_step_below": {f"{t:g}": next((i + 1 for i, h in enumerate(entropy) if h < t), None)
                                 for t in TARGETS},
            "final_reward": _final(run["reward"]), "seconds": run["seconds"]}
    return {"floor": floor, "runs": per_run, "pairs": pairs, "authority": authority}


def _cell(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_report(study: dict) -> str:
    summary = study["summary"]
    lines = [f"controller: {study['settings']['control']}; vanilla's float noise between micro-batch sizes 1 and 4: "
             f"entropy {summary['floor'].get('entropy', math.nan):.2e}, reward {summary['floor'].get('reward', math.nan):.2e}",
             "run                                 |H-target| last 10  within 0.2 from  end H   final reward (fixed knob, "
             "vanilla)   ratio start -> end [min, max]"]
    for key, r in summary["runs"].items():
        settle = f"step {r['settling_step']}" if r["settling_step"] else "never"
        lines.append(f"{key:36s} {r['mean_abs_error_last_10']:8.3f}           {settle:10s}  {r['entropy_end']:.3f}   "
                     f"{r['final_reward']:.3f} ({_cell(r['fixed_knob_final_reward'], '.3f')}, "
                     f"{_cell(r['vanilla_final_reward'], '.3f')})      {r['ratio_start']:.4g} -> {r['ratio_end']:.4g} "
                     f"[{r['ratio_min']:.4g}, {r['ratio_max']:.4g}]")
    lines.append("micro-batch 1 vs 4: max over steps |difference| (ratio to vanilla's)")
    for key, p in summary["pairs"].items():
        ratio = p.get("ratio_to_vanilla", {})
        rollouts = "identical" if p["same_rollouts"] else f"differ from step {p['first_differing_rollout_step']}"
        parted = "" if p.get("parts_at_step") is None else f", parts at step {p['parts_at_step']}"
        lines.append(f"  {key:28s} entropy {p['entropy']:.2e} ({ratio.get('entropy', math.nan):.3g}x)  reward "
                     f"{p['reward']:.2e} ({ratio.get('reward', math.nan):.3g}x)  ln(ratio) {p['ratio_in_use']:.2e}  "
                     f"rollouts {rollouts}{parted}")
    if summary.get("authority"):
        lines.append("the knob's authority: the ratio fixed at the controller's upper bound from step 1")
    for key, a in summary.get("authority", {}).items():
        below = ", ".join(f"below {t} from step {s if s else '-'}" for t, s in a["first_step_below"].items())
        lines.append(f"  {key:36s} ratio {a['fixed_ratio']:g}: end H {a['entropy_end']:.3f}, fell {a['fall_last_10']:.3f} "
                     f"over the last {LAST_STEPS} steps, {below}; final reward {a['final_reward']:.3f}")
    return "\n".join(lines)


COLORS = {"kl_cov_global": "tab:blue", "clip_cov_global": "tab:green", "high_entropy_global": "tab:cyan"}
TARGET_COLORS = {1.5: "tab:red", 3.0: "tab:purple"}


def plot(study: dict, path: str) -> None:
    """One row per mode: entropy against the targets (with the fixed-knob run and vanilla), the controlled
    ratio's trajectory, the reward; micro-batch size 1 solid, 4 dashed."""
    plt = load_pyplot()
    runs, fixed = study["runs"], study.get("fixed_knob", {})
    fig, axes = plt.subplots(len(MODES), 3, figsize=(16, 4.2 * len(MODES)), squeeze=False)
    styles = {MICRO_BATCH_SIZES[0]: "-", MICRO_BATCH_SIZES[1]: "--"}
    for row, mode in zip(axes, MODES):
        ax_h, ax_k, ax_r = row
        for size, ls in styles.items():
            vanilla = runs.get(run_key("vanilla", None, size))
            if vanilla:
                steps = range(1, len(vanilla["entropy"]) + 1)
                ax_h.plot(steps, vanilla["entropy"], color="0.55", ls=ls, lw=1.0, label=f"vanilla, mbs {size}")
                ax_r.plot(steps, vanilla["reward"], color="0.55", ls=ls, lw=1.0, label=f"vanilla, mbs {size}")
            curve = fixed.get(f"{mode}/mbs{size}")
            if curve:
                steps = range(1, len(curve["entropy"]) + 1)
                ax_h.plot(steps, curve["entropy"], color="0.2", ls=ls, lw=1.0, label=f"fixed knob, mbs {size}")
                ax_r.plot(steps, curve["reward"], color="0.2", ls=ls, lw=1.0, label=f"fixed knob, mbs {size}")
            strongest = runs.get(authority_key(mode, size))
            if strongest:
                steps = range(1, len(strongest["entropy"]) + 1)
                label = f"{KNOBS[mode]} fixed at {strongest['fixed_ratio']:g}, mbs {size}"
                ax_h.plot(steps, strongest["entropy"], color="tab:orange", ls=":", lw=1.6, label=label)
                ax_r.plot(steps, strongest["reward"], color="tab:orange", ls=":", lw=1.6, label=label)
            for target in TARGETS:
                run = runs.get(run_key(mode, target, size))
                if not run:
                    continue
                steps = range(1, len(run["entropy"]) + 1)
                color = TARGET_COLORS[target]
                label = f"target {target:g}, mbs {size}"
                ax_h.plot(steps, run["entropy"], color=color, ls=ls, lw=1.8, label=label)
                ax_k.plot(steps, run["ratio_in_use"], color=color, ls=ls, lw=1.8, label=label)
                ax_r.plot(steps, run["reward"], color=color, ls=ls, lw=1.8, label=label)
        for target in TARGETS:
            ax_h.axhline(target, color=TARGET_COLORS[target], lw=0.8, alpha=0.5)
            ax_h.axhspan(target - BAND, target + BAND, color=TARGET_COLORS[target], alpha=0.08)
        ax_h.set_title(f"{mode}: entropy vs targets (+-{BAND})", fontsize=10)
        ax_k.set_title(f"{KNOBS[mode]} in use (step mean)", fontsize=10)
        ax_k.set_yscale("log")
        ax_r.set_title("mean reward (share of target tokens)", fontsize=10)
        for ax in row:
            ax.set_xlabel("trainer step")
            ax.grid(True, alpha=0.3)
        ax_h.legend(fontsize=7, ncol=2)
        ax_k.legend(fontsize=7)
    cfg, control = study["settings"]["base"], study["settings"]["control"]
    fig.suptitle(
        "Entropy controller on the learning miniature (verl 0.9.1 trainer loop, policy-sampled GRPO, CPU fp32, tiny "
        f"Qwen2 of 64 ids): micro-batch 1 solid, 4 dashed\n{cfg['prompts_per_step']}x{cfg['responses_per_prompt']} "
        f"responses per step, {cfg['prompts_per_step'] // cfg['mini_batch_prompts']} minibatches x {cfg['ppo_epochs']} "
        f"epochs, {cfg['optimizer']} lr {cfg['lr']}; ki {control['entropy_control_ki']}, kp "
        f"{control['entropy_control_kp']}, bounds [{control['entropy_control_min_ratio']}, "
        f"{control['entropy_control_max_ratio']}],\nhorizon {control.get('entropy_control_horizon', 0):g} over a "
        f"window of {control.get('entropy_control_window', 1)} optimizer steps; starts: kl_cov_ratio {cfg['kl_cov_ratio']}, clip_cov_ratio "
        f"{cfg['clip_cov_ratio']}, entropy_top_ratio {cfg['entropy_top_ratio']}", fontsize=11)
    save_figure(fig, path, dpi=80)


# -- the study --------------------------------------------------------------------------------------------


def _cost(run: RunConfig) -> float:
    return run.steps * (run.mini_batch_prompts * run.responses_per_prompt / run.micro_batch_size + 8)


def run_study(runs: Sequence[RunConfig], study: dict, *, jobs: int, json_path: Optional[str] = None,
              progress=print) -> dict:
    """The runs not yet in ``study['runs']``, on one learning model (:func:`.learning.run_on_the_learning_model`)."""
    return run_on_the_learning_model(_run_one, runs, study, key_of=key_of, cost=_cost, final_steps=FINAL_STEPS,
                                     jobs=jobs, json_path=json_path, progress=progress, prefix="entropy_target_cpu_")


def _prepare(study: dict) -> None:
    study.setdefault("fixed_knob", fixed_knob_runs())
    study["summary"] = summarize(study)


def _add_fixed_knob(study: dict, steps: int) -> None:
    if steps == BASE.steps:  # the fixed-knob curves are the learning study's 40 steps
        study["fixed_knob"] = fixed_knob_runs()


def main(argv: Optional[Sequence[str]] = None) -> int:
    return resumable_main(argv, prog="python -m experiments.entropy_target", doc=__doc__, default_steps=BASE.steps,
                          min_steps=LAST_STEPS, settings=study_settings, planned_runs=planned_runs, run_study=run_study,
                          summarize=summarize, format_report=format_report, plot=plot, prepare=_prepare,
                          finish=_add_fixed_knob)


if __name__ == "__main__":
    sys.exit(main())
