"""What ``prepass_layout=old`` trades: masks from pi_old's statistics against the current policy's, on the learning miniature.

``python -m experiments.old_policy --png docs/old_policy_cpu.png --json docs/old_policy_cpu.json`` runs the
learning miniature of :mod:`.learning` (verl's trainer loop in-process, policy-sampled GRPO on a 64-id tiny Qwen2
that learns from scratch, CPU, fp32; 8 prompts x 8 responses a step, 2 minibatches x 2 PPO epochs: 4 optimizer
steps per trainer step) for each global mode with the fixed knobs of the learning study (``kl_cov_ratio`` 0.1,
``ppo_kl_coef`` 1; ``clip_cov_ratio`` 0.1 in the window (0, 5); ``entropy_top_ratio`` 0.2), once as the papers'
rules read (``prepass_layout=infer``: the current policy's statistics) and once with ``prepass_layout=old``, each
at micro-batch sizes 1 and 4, plus ``vanilla`` at both sizes (its float noise between the sizes is the floor the
pairs are compared with). Settings fixed before the runs: the learning study's, unchanged (:data:`BASE`).

Reported:

* **agreement**, in every ``old`` run: at every optimizer step, the mask the step used (pi_old's) and the mask
  the current policy's statistics give on the same minibatch with the same knobs (a prepass forward made for the
  measurement only: eval mode, no grad, RNG restored, so the run trains as without it), as Jaccard |A n B| /
  |A u B| (1 when both are empty), per optimizer step index within the trainer step (0: the first minibatch,
  made with pi_old itself; 1: the second minibatch, one step later; 2, 3: the second epoch): mean, min over the
  trainer steps;
* **whole runs**: entropy and reward per trainer step of both variants; the final reward (mean of the last 5
  steps) and the end entropy; whether each variant's two micro-batch sizes agree within 10x vanilla's float
  noise (else the first step where they part).

Resumable: the JSON is rewritten after every run and a rerun with the same ``--json`` skips the runs it holds;
``--from-json`` redraws without running.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import replace
from typing import Optional, Sequence

from .entropy_target import parting_step
from .learning import BASE, ENTROPY, NOISE_FACTOR, PREFIXES, REWARD, MakePolicyRollout, float32_spacing, \
    run_on_the_learning_model
from .local_trainer import RunConfig, config_fields, run_local
from .study_cli import (
    load_pyplot, resumable_main, save_figure,
)

MODES = ("kl_cov_global", "clip_cov_global", "high_entropy_global")
LAYOUTS = ("infer", "old")
MICRO_BATCH_SIZES = (1, 4)
FINAL_STEPS = 5


def optimizer_steps_per_trainer_step(run: RunConfig) -> int:
    return (run.prompts_per_step // run.mini_batch_prompts) * run.ppo_epochs


def run_key(mode: str, layout: Optional[str], micro_batch_size: int) -> str:
    return f"{mode}/mbs{micro_batch_size}" if layout is None else f"{mode}/{layout}/mbs{micro_batch_size}"


def planned_runs(steps: int) -> list[RunConfig]:
    """vanilla at both sizes, then every mode x layout x size."""
    base = replace(BASE, steps=steps)
    runs = [replace(base, loss_mode="vanilla", micro_batch_size=b) for b in MICRO_BATCH_SIZES]
    runs += [replace(base, loss_mode=m, prepass_layout=layout, micro_batch_size=b)
             for m in MODES for layout in LAYOUTS for b in MICRO_BATCH_SIZES]
    return runs


def study_settings(steps: int) -> dict:
    """What every run of the study shares (JSON-ready); a resumed study must match it."""
    return {"base": config_fields(replace(BASE, steps=steps)), "modes": list(MODES), "layouts": list(LAYOUTS),
            "micro_batch_sizes": list(MICRO_BATCH_SIZES)}


# -- the agreement measurement (inside a run's process) ---------------------------------------------------


def jaccard(a, b) -> float:
    """|a n b| / |a u b| of two bool masks of one shape; 1.0 when both are empty."""
    union = int((a | b).sum())
    return 1.0 if union == 0 else int((a & b).sum()) / union


class AgreementRecorder:
    """Wraps the plugin's ``run_prepass_and_select`` in this process: after every ``prepass_layout=old`` step, the
    selection the current policy's statistics give on the same minibatch (``prepass_layout=infer``, the same
    knobs; the prepass restores RNG and module mode), and the Jaccard of the two masks. Controller off only."""

    def __init__(self):
        self.per_step: list[dict] = []

    def __enter__(self):
        from verl_klcov_global.engine import step as engine_step

        self._step = engine_step
        self._real = real = engine_step.run_prepass_and_select

        def run(engine, data, settings, mode):
            result = real(engine, data, settings, mode)
            if settings.prepass_layout == "old":
                if getattr(settings, "entropy_control", None) is not None:
                    raise ValueError("the agreement measurement needs the entropy controller off")
                current = real(engine, data, replace(settings, prepass_layout="infer"), mode)
                old_mask, current_mask = result.selection.mask, current.selection.mask
                self.per_step.append({"jaccard": jaccard(old_mask, current_mask),
                                      "selected_old": int(old_mask.sum()), "selected_current": int(current_mask.sum()),
                                      "valid": int(result.selection.num_valid)})
            return result

        engine_step.run_prepass_and_select = run
        return self

    def __exit__(self, *exc):
        self._step.run_prepass_and_select = self._real
        return False


def _run_one(run: RunConfig, *, model_path: str, work_root: str) -> dict:
    """One run in its own folder; its JSON-ready record (curves per trainer step, agreement per optimizer step)."""
    from verl_klcov_global.lab.quiet import quiet_verl

    from .learning_task import write_dataset

    layout = None if run.loss_mode == "vanilla" else run.prepass_layout
    key = run_key(run.loss_mode, layout, run.micro_batch_size)
    run_dir = os.path.join(work_root, key.replace("/", "-"))  # no "=": the paths go into Hydra overrides
    os.makedirs(run_dir, exist_ok=True)
    with quiet_verl(), AgreementRecorder() as recorder:
        started = time.perf_counter()
        (result,) = run_local([run], model_path=model_path, work_dir=run_dir,
                              make_rollout=MakePolicyRollout(model_path), dataset=write_dataset)
        seconds = time.perf_counter() - started
    out = {"key": key, "mode": run.loss_mode, "layout": layout, "micro_batch_size": run.micro_batch_size,
           "seconds": seconds, "entropy": [m[ENTROPY] for m in result.metrics],
           "reward": [m[REWARD] for m in result.metrics], "rollout_digest": list(result.rollout_digest)}
    if run.loss_mode in PREFIXES:
        prefix = PREFIXES[run.loss_mode]
        out["prepass_seconds"] = [m[prefix + "prepass_seconds"] for m in result.metrics]
    if recorder.per_step:
        per_update = optimizer_steps_per_trainer_step(run)
        if len(recorder.per_step) != per_update * len(result.metrics):
            raise RuntimeError(f"{key}: {len(recorder.per_step)} optimizer steps recorded, expected "
                               f"{per_update} x {len(result.metrics)}")
        out["agreement"] = [recorder.per_step[i:i + per_update] for i in range(0, len(recorder.per_step), per_update)]
    return out


# -- the report -------------------------------------------------------------------------------------------


def _final(values: Sequence[float]) -> float:
    return sum(values[-FINAL_STEPS:]) / len(values[-FINAL_STEPS:])


def summarize(study: dict) -> dict:
    runs = study["runs"]
    floor = {}
    if all(run_key("vanilla", None, b) in runs for b in MICRO_BATCH_SIZES):
        a, b = (runs[run_key("vanilla", None, s)] for s in MICRO_BATCH_SIZES)
        for name in ("entropy", "reward"):
            floor[name] = max(abs(x - y) for x, y in zip(a[name], b[name]))
        floor["entropy"] = max(floor["entropy"], float32_spacing(a["entropy"] + b["entropy"]))
    agreement, per_run, pairs = {}, {}, {}
    planned = [run_key(m, None if m == "vanilla" else layout, b) for m in ("vanilla", *MODES) for layout in LAYOUTS
               for b in MICRO_BATCH_SIZES]
    for key in sorted(runs, key=lambda k: planned.index(k) if k in planned else len(planned)):
        run = runs[key]
        per_run[key] = {"entropy_end": run["entropy"][-1], "final_reward": _final(run["reward"]),
                        "seconds": run["seconds"]}
        if "prepass_seconds" in run:
            per_run[key]["prepass_seconds_mean"] = sum(run["prepass_seconds"]) / len(run["prepass_seconds"])
        if "agreement" in run:
            by_index = list(zip(*run["agreement"]))  # per optimizer step index: its record in every trainer step
            agreement[key] = [{"mean": sum(r["jaccard"] for r in steps) / len(steps),
                               "min": min(r["jaccard"] for r in steps),
                               "selected_old_mean": sum(r["selected_old"] for r in steps) / len(steps),
                               "selected_current_mean": sum(r["selected_current"] for r in steps) / len(steps)}
                              for steps in by_index]
    for mode in MODES:
        for layout in LAYOUTS:
            a, b = (runs.get(run_key(mode, layout, s)) for s in MICRO_BATCH_SIZES)
            if a is None or b is None:
                continue
            pair = {name: max(abs(x - y) for x, y in zip(a[name], b[name])) for name in ("entropy", "reward")}
            pair["same_rollouts"] = a["rollout_digest"] == b["rollout_digest"]
            if floor:
                pair["ratio_to_vanilla"] = {n: (0.0 if pair[n] == 0 else math.inf if floor[n] == 0 else pair[n] / floor[n])
                                            for n in ("entropy", "reward")}
                pair["within_noise"] = max(pair["ratio_to_vanilla"].values()) <= NOISE_FACTOR
                pair["parts_at_step"] = parting_step(a["entropy"], b["entropy"], NOISE_FACTOR * floor["entropy"])
            pairs[f"{mode}/{layout}"] = pair
    return {"floor": floor, "agreement": agreement, "runs": per_run, "pairs": pairs}


def format_report(study: dict) -> str:
    summary = study["summary"]
    floor = summary["floor"]
    lines = ["agreement (Jaccard) of the pi_old mask with the current policy's, per optimizer step index within a "
             "trainer step: mean [min] over the trainer steps"]
    for key, per_index in summary["agreement"].items():
        cells = "  ".join(f"{i}: {a['mean']:.3f} [{a['min']:.3f}]" for i, a in enumerate(per_index))
        lines.append(f"  {key:32s} {cells}")
    lines.append(f"whole runs (vanilla's float noise between micro-batch sizes 1 and 4: entropy "
                 f"{floor.get('entropy', math.nan):.2e}, reward {floor.get('reward', math.nan):.2e})")
    lines.append("  run                              end entropy  final reward (last 5)  prepass s/step")
    for key, r in summary["runs"].items():
        prepass = "-" if "prepass_seconds_mean" not in r else f"{r['prepass_seconds_mean']:.4f}"
        lines.append(f"  {key:32s} {r['entropy_end']:10.3f}  {r['final_reward']:12.3f}           {prepass}")
    lines.append("micro-batch 1 vs 4: max over steps |difference| (ratio to vanilla's)")
    for key, p in summary["pairs"].items():
        ratio = p.get("ratio_to_vanilla", {})
        parted = "" if p.get("parts_at_step") is None else f", parts at step {p['parts_at_step']}"
        lines.append(f"  {key:28s} entropy {p['entropy']:.2e} ({ratio.get('entropy', math.nan):.3g}x)  reward "
                     f"{p['reward']:.2e} ({ratio.get('reward', math.nan):.3g}x)  rollouts "
                     f"{'identical' if p['same_rollouts'] else 'differ'}{parted}")
    return "\n".join(lines)


COLORS = {"infer": "tab:blue", "old": "tab:orange"}
INDEX_COLORS = ("tab:green", "tab:blue", "tab:purple", "tab:red")


def plot(study: dict, path: str) -> None:
    """One row per mode: entropy and reward of both variants (micro-batch 1 solid, 4 dashed; vanilla grey), and
    the Jaccard of the two masks per optimizer step index over the trainer steps (the ``old`` run at size 4)."""
    plt = load_pyplot()
    runs = study["runs"]
    fig, axes = plt.subplots(len(MODES), 3, figsize=(16, 4.0 * len(MODES)), squeeze=False)
    styles = {MICRO_BATCH_SIZES[0]: "-", MICRO_BATCH_SIZES[1]: "--"}
    for row, mode in zip(axes, MODES):
        ax_h, ax_r, ax_j = row
        for size, ls in styles.items():
            vanilla = runs.get(run_key("vanilla", None, size))
            if vanilla:
                steps = range(1, len(vanilla["entropy"]) + 1)
                ax_h.plot(steps, vanilla["entropy"], color="0.55", ls=ls, lw=1.0, label=f"vanilla, mbs {size}")
                ax_r.plot(steps, vanilla["reward"], color="0.55", ls=ls, lw=1.0, label=f"vanilla, mbs {size}")
            for layout in LAYOUTS:
                run = runs.get(run_key(mode, layout, size))
                if not run:
                    continue
                steps = range(1, len(run["entropy"]) + 1)
                label = f"{'current policy (infer)' if layout == 'infer' else 'pi_old (old)'}, mbs {size}"
                ax_h.plot(steps, run["entropy"], color=COLORS[layout], ls=ls, lw=1.6, label=label)
                ax_r.plot(steps, run["reward"], color=COLORS[layout], ls=ls, lw=1.6, label=label)
        old = runs.get(run_key(mode, "old", MICRO_BATCH_SIZES[-1]))
        if old and "agreement" in old:
            for index in range(len(old["agreement"][0])):
                values = [step[index]["jaccard"] for step in old["agreement"]]
                ax_j.plot(range(1, len(values) + 1), values, color=INDEX_COLORS[index % len(INDEX_COLORS)], lw=1.4,
                          marker=".", label=f"optimizer step {index}")
        ax_h.set_title(f"{mode}: entropy", fontsize=10)
        ax_r.set_title("mean reward (share of target tokens)", fontsize=10)
        ax_j.set_title(f"Jaccard(pi_old mask, current-policy mask), old run, mbs {MICRO_BATCH_SIZES[-1]}", fontsize=10)
        ax_j.set_ylim(-0.02, 1.02)
        for ax in row:
            ax.set_xlabel("trainer step")
            ax.grid(True, alpha=0.3)
        ax_h.legend(fontsize=7, ncol=2)
        ax_j.legend(fontsize=7)
    cfg = study["settings"]["base"]
    fig.suptitle(
        "prepass_layout=old (pi_old's statistics, no prepass) vs infer (the current policy's) on the learning miniature "
        "(verl 0.9.1 trainer loop, policy-sampled GRPO, CPU fp32, tiny Qwen2 of 64 ids)\n"
        f"{cfg['prompts_per_step']}x{cfg['responses_per_prompt']} responses per step, "
        f"{cfg['prompts_per_step'] // cfg['mini_batch_prompts']} minibatches x {cfg['ppo_epochs']} epochs, "
        f"{cfg['optimizer']} lr {cfg['lr']}; kl_cov_ratio {cfg['kl_cov_ratio']}, ppo_kl_coef {cfg['ppo_kl_coef']}, "
        f"clip_cov_ratio {cfg['clip_cov_ratio']} in ({cfg['clip_cov_lb']}, {cfg['clip_cov_ub']}), entropy_top_ratio "
        f"{cfg['entropy_top_ratio']}", fontsize=11)
    save_figure(fig, path, dpi=80)


# -- the study --------------------------------------------------------------------------------------------


def _cost(run: RunConfig) -> float:
    extra = 1.5 if run.prepass_layout == "old" else 1.0  # the measurement's own forward
    return extra * run.steps * (run.mini_batch_prompts * run.responses_per_prompt / run.micro_batch_size + 8)


def _key_of(run: RunConfig) -> str:
    return run_key(run.loss_mode, None if run.loss_mode == "vanilla" else run.prepass_layout, run.micro_batch_size)


def run_study(runs: Sequence[RunConfig], study: dict, *, jobs: int, json_path: Optional[str] = None,
              progress=print) -> dict:
    """The runs not yet in ``study['runs']``, on one learning model (:func:`.learning.run_on_the_learning_model`)."""
    return run_on_the_learning_model(_run_one, runs, study, key_of=_key_of, cost=_cost, final_steps=FINAL_STEPS,
                                     jobs=jobs, json_path=json_path, progress=progress, prefix="old_policy_cpu_")


def _prepare(study: dict) -> None:
    study["summary"] = summarize(study)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return resumable_main(argv, prog="python -m experiments.old_policy", doc=__doc__, default_steps=BASE.steps,
                          min_steps=FINAL_STEPS, settings=study_settings, planned_runs=planned_runs, run_study=run_study,
                          summarize=summarize, format_report=format_report, plot=plot, prepare=_prepare)


if __name__ == "__main__":
    sys.exit(main())
