"""Does the micro-batch size change a GRPO run of a real pretrained LM? SmolLM2-135M-Instruct, upstream vs global.

``python -m experiments.real_divergence --json docs/real_divergence.json --png docs/real_divergence.png``
trains SmolLM2-135M-Instruct (fp32, dequantized from the wheel's 4-bit GGUF; ``prepare-model smollm2``) with verl's
trainer loop in-process on CPU (:mod:`.local_trainer`), on responses it samples itself (:mod:`.chat_rollout`: chat
template, KV cache, temperature 1, each row stopped at EOS) for the prompts "Repeat this number: N", rewarded 1/0
by whether the response's last integer is N (the model gets about a third right at the start, so GRPO groups have
reward variance; it gets 3% of two-digit sums, docs/real_model_entropy.json). It is a divergence study, not a
learning result: a few steps, one seed. The entropy floor's evidence on SmolLM2 is a separate study on this
harness, :mod:`experiments.entropy_floor`.

The runs, each at ``ppo_micro_batch_size_per_gpu`` 1 and 4, with the same seed (same initial weights, prompts and
sampling seeds): ``vanilla``, upstream ``kl_cov`` and the plugin's ``kl_cov_global``.

Knobs, fixed before the runs (:data:`BASE`): 4 prompts x 4 responses a step, minibatches of 2 prompts (two
optimizer steps a step), one PPO epoch; prompts of at most 40 tokens (the chat template's system prompt included),
responses of at most 24; SGD, lr :data:`LR` (verl's grad clip 1.0; SGD as in the tiny-model studies, since AdamW's
1/sqrt(v) blows the float noise of near-zero gradients up to lr-sized differences, tests/support/noise_floor.py);
``kl_cov_ratio`` 0.02 (about 3 of a minibatch's ~160 tokens; upstream's max(1, int(n x ratio)) floor of 1 token
per micro-batch applies at both sizes), ``ppo_kl_coef`` 1. verl's log-prob pass runs at the training micro-batch
size (``log_prob_micro_batch_size_per_gpu`` = ``ppo_micro_batch_size_per_gpu``) in every run, so that each run's
pass is in its training micro-batches' company, as in tests/experiments/test_trajectory.py: KL-Cov's
|log pi - log pi_old| is then exactly 0 at each step's first optimizer step (measured on the tiny model with this
rollout), not the sign of float noise. verl's other optimizer defaults stay (weight decay 0.01). The figures are
this machine's (docs/EVIDENCE.md names it).

Reported per trainer step: verl's ``actor/entropy`` and the mean reward of each run; the tokens selected per
optimizer step (a global mode: its selection's count, and a digest of its mask; upstream: its per-micro-batch quota
summed, counted by a wrapper around verl's registered ``kl_cov`` loss); for each pair (micro-batch 1 vs 4): the
largest |delta theta| after every step and the entropy difference, as a ratio to vanilla's pair (the float noise
of a different summation order). A global pair passes when its rollouts and masks are identical and its
differences stay within :data:`NOISE_FACTOR` x vanilla's; an upstream pair is expected to part.

Resumable: the JSON is rewritten after every run, a rerun with the same ``--json`` skips the runs it holds, and
each run's weight versions wait in ``<json>.weights/`` (0.6 GB each, in fp32) until its pair is compared, then
are deleted. ``--from-json`` redraws without running.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import shutil
import sys
import time
from dataclasses import replace
from typing import Optional, Sequence

import torch

from .learning import float32_spacing
from .local_trainer import LatestWeights, RunConfig, config_fields, run_local
from .trajectory import _ratio
from .study_cli import (
    add_output_arguments, close_study, load_pyplot, new_parser, open_study, redraw_from_json, run_pending, save_figure,
)

#: SGD's learning rate: the tiny-model studies' lr, set before any run here (a 2-step pilot of the whole study checked
#: the code and changed no knob; the docstring says why SGD).
LR = 0.05
BASE = RunConfig(loss_mode="vanilla", prompts_per_step=4, responses_per_prompt=4, mini_batch_prompts=2, ppo_epochs=1,
                 max_prompt_length=40, max_response_length=24, optimizer="SGD", lr=LR, seed=1, kl_cov_ratio=0.02,
                 ppo_kl_coef=1.0)
MODES = ("vanilla", "kl_cov", "kl_cov_global")
MICRO_BATCH_SIZES = (1, 4)
#: A global pair may differ by at most this many times vanilla's pair.
NOISE_FACTOR = 10.0
DEFAULT_STEPS = 16
ENTROPY, REWARD = "actor/entropy", "critic/score/mean"
PER_STEP_METRICS = (ENTROPY, REWARD, "actor/pg_loss", "actor/grad_norm", "actor/ppo_kl")


def run_key(mode: str, size: int) -> str:
    return f"{mode}/mbs{size}"


def planned_runs(steps: int) -> list[dict]:
    """The study's runs: every mode at every micro-batch size, no entropy target."""
    return [dict(key=run_key(m, b), loss_mode=m, micro_batch_size=b, steps=steps, entropy_target=None)
            for m in MODES for b in MICRO_BATCH_SIZES]


def run_config(item: dict, base: RunConfig = BASE) -> RunConfig:
    return replace(base, loss_mode=item["loss_mode"], micro_batch_size=item["micro_batch_size"], steps=item["steps"],
                   entropy_target=item["entropy_target"], log_prob_micro_batch_size=item["micro_batch_size"])


def study_settings(steps: int) -> dict:
    return {"base": config_fields(replace(BASE, steps=steps)), "modes": list(MODES),
            "micro_batch_sizes": list(MICRO_BATCH_SIZES), "log_prob_follows_training": True,
            "task": "repeat_number", "noise_factor": NOISE_FACTOR}


# -- one run (in a job process) ---------------------------------------------------------------------------


class OptimizerStepRecorder:
    """Per optimizer step, what the selection took: for a global mode, its figures and a digest of its mask (wraps
    ``engine.step.run_prepass_and_select``); for upstream ``kl_cov``, its quota max(1, int(n x ratio)) per loss call
    (a micro-batch) from a wrapper around verl's registered loss, summed per optimizer step by the caller."""

    def __init__(self):
        self.steps: list[dict] = []
        self.upstream_calls: list[int] = []
        self._undo = []

    def __enter__(self):
        from verl.trainer.ppo import core_algos

        from verl_klcov_global.engine import step as engine_step

        real_run = engine_step.run_prepass_and_select

        def run(engine, data, settings, mode):
            result = real_run(engine, data, settings, mode)
            mask = result.selection.mask.detach().cpu().contiguous()
            self.steps.append({**{k: float(v) for k, v in result.figures().items()},
                               "mask_sha": hashlib.sha256(mask.numpy().tobytes()).hexdigest()[:16]})
            return result

        real_loss = core_algos.POLICY_LOSS_REGISTRY["kl_cov"]

        def kl_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                   rollout_is_weights=None):
            n = int((response_mask > 0).sum())
            self.upstream_calls.append(max(1, int(n * config.policy_loss.kl_cov_ratio)) if n else 0)
            return real_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                             rollout_is_weights)

        engine_step.run_prepass_and_select = run
        core_algos.POLICY_LOSS_REGISTRY["kl_cov"] = kl_cov
        self._undo = [(engine_step, "run_prepass_and_select", real_run)]
        self._registry = (core_algos.POLICY_LOSS_REGISTRY, real_loss)
        return self

    def __exit__(self, *exc):
        for module, name, value in self._undo:
            setattr(module, name, value)
        registry, real_loss = self._registry
        registry["kl_cov"] = real_loss
        return False


def _save_version(folder: str, index: int, flat: torch.Tensor) -> None:
    torch.save(flat.clone(), os.path.join(folder, f"v{index}.pt"))


def run_one(item: dict, *, model_path: str, weights_root: str, work_root: str, base: RunConfig = BASE) -> dict:
    """One run (``base``'s sizes and knobs, the item's mode, size, steps and target); its weight versions written
    to ``weights_root/<key>/v<i>.pt`` (fp32); its JSON-ready record."""
    from verl_klcov_global.lab.quiet import quiet_verl

    from .chat_rollout import MakeChatRollout, write_repeat_dataset

    run = run_config(item, base)
    name = item["key"].replace("/", "-")
    folder = os.path.join(weights_root, name)
    shutil.rmtree(folder, ignore_errors=True)
    if item.get("paired", True):
        os.makedirs(folder)
    run_dir = os.path.join(work_root, name)
    os.makedirs(run_dir, exist_ok=True)
    # only a run with a pair keeps its versions on disk (for compare_pairs)
    weights = LatestWeights(on_version=functools.partial(_save_version, folder) if item.get("paired", True) else None)
    started = time.perf_counter()
    with quiet_verl(), OptimizerStepRecorder() as recorder:
        (result,) = run_local([run], model_path=model_path, work_dir=run_dir, make_rollout=MakeChatRollout(model_path),
                              dataset=write_repeat_dataset, weights=weights)
    seconds = time.perf_counter() - started
    record = {"key": item["key"], "loss_mode": run.loss_mode, "micro_batch_size": run.micro_batch_size,
              "entropy_target": run.entropy_target, "seconds": seconds, "weight_versions": len(weights),
              "rollout_digest": list(result.rollout_digest), "rollout": result.rollout_figures,
              "metrics": {name: [m.get(name, math.nan) for m in result.metrics] for name in PER_STEP_METRICS}}
    optimizer_steps = run.steps * (run.prompts_per_step // run.mini_batch_prompts) * run.ppo_epochs
    if recorder.steps:
        record["optimizer_steps"] = recorder.steps
    if recorder.upstream_calls:
        calls = len(recorder.upstream_calls) // optimizer_steps
        record["upstream_selected"] = [sum(recorder.upstream_calls[i * calls:(i + 1) * calls])
                                       for i in range(optimizer_steps)]
    return record


# -- pairs ------------------------------------------------------------------------------------------------


def _load(weights_root: str, key: str, index: int) -> torch.Tensor:
    return torch.load(os.path.join(weights_root, key.replace("/", "-"), f"v{index}.pt"))


def compare_versions(a: torch.Tensor, b: torch.Tensor) -> dict:
    """max |a - b|, ||a - b||_2, and the largest |a - b| among parameters differing by more than one float32 spacing
    at their own magnitude (0.0 when none does)."""
    import numpy as np

    diff = (a - b).abs()
    spacing = torch.from_numpy(np.spacing(torch.maximum(a.abs(), b.abs()).numpy()))
    beyond = diff[diff > spacing]
    return {"max_abs": float(diff.max()), "l2": float(diff.double().norm()),
            "beyond_spacing": float(beyond.max()) if beyond.numel() else 0.0}


def compare_pairs(study: dict, weights_root: str, progress=print) -> None:
    """For each mode whose two runs are done and whose pair is not yet compared: per weight version the parameter
    differences, per step the entropy and reward differences; the pair's weight files are deleted after."""
    pairs = study.setdefault("pairs", {})
    for mode in MODES:
        keys = [run_key(mode, b) for b in MICRO_BATCH_SIZES]
        if mode in pairs or not all(k in study["runs"] for k in keys):
            continue
        a, b = (study["runs"][k] for k in keys)
        versions = min(a["weight_versions"], b["weight_versions"])
        params = [compare_versions(_load(weights_root, keys[0], i), _load(weights_root, keys[1], i))
                  for i in range(versions)]
        pairs[mode] = {
            "param_max_abs": [p["max_abs"] for p in params], "param_l2": [p["l2"] for p in params],
            "param_beyond_spacing": [p["beyond_spacing"] for p in params],
            "entropy": [abs(x - y) for x, y in zip(a["metrics"][ENTROPY], b["metrics"][ENTROPY])],
            "reward": [abs(x - y) for x, y in zip(a["metrics"][REWARD], b["metrics"][REWARD])],
            "same_rollouts": [x == y for x, y in zip(a["rollout_digest"], b["rollout_digest"])],
        }
        if "optimizer_steps" in a:
            pairs[mode]["same_masks"] = [x["mask_sha"] == y["mask_sha"]
                                         for x, y in zip(a["optimizer_steps"], b["optimizer_steps"])]
            pairs[mode]["same_counts"] = [x["selected"] == y["selected"]
                                          for x, y in zip(a["optimizer_steps"], b["optimizer_steps"])]
        for key in keys:
            shutil.rmtree(os.path.join(weights_root, key.replace("/", "-")), ignore_errors=True)
        progress(f"compared {mode}'s pair; its weight files deleted")


def verdicts(study: dict) -> dict:
    """Per non-vanilla pair: the ratios of its largest parameter and entropy differences to vanilla's pair (the
    entropy's floor at least one float32 spacing of the logged entropy) and whether it behaves as expected."""
    pairs, out = study.get("pairs", {}), {}
    if "vanilla" not in pairs:
        return out
    floor = pairs["vanilla"]
    runs = study["runs"]
    spacing = float32_spacing([h for k in runs for h in runs[k]["metrics"][ENTROPY]])
    for mode, pair in pairs.items():
        if mode == "vanilla":
            continue
        params = max(min(1.0, _ratio(max(pair["param_max_abs"]), max(floor["param_max_abs"]))),
                     _ratio(max(pair["param_beyond_spacing"]), max(floor["param_max_abs"])))
        entropy = _ratio(max(pair["entropy"]), max(max(floor["entropy"]), spacing))
        out_mode = {"params_ratio": params, "entropy_ratio": entropy}
        if mode.endswith("_global"):
            identical = all(pair["same_rollouts"]) and all(pair.get("same_masks", [False]))
            out_mode["ok"] = identical and max(params, entropy) <= NOISE_FACTOR
            out_mode["expected"] = f"masks and rollouts identical, within {NOISE_FACTOR:g}x vanilla's pair"
        else:
            out_mode["ok"] = params > NOISE_FACTOR
            out_mode["expected"] = f"parts: parameters > {NOISE_FACTOR:g}x vanilla's pair"
        parted = next((i for i, (x, y) in enumerate(zip(pair["param_max_abs"], floor["param_max_abs"]))
                       if x > NOISE_FACTOR * max(y, 1e-30)), None)
        out_mode["first_version_beyond_floor"] = parted
        out[mode] = out_mode
    return out


def summarize(study: dict) -> dict:
    return {"verdicts": verdicts(study)}


# -- the report ---------------------------------------------------------------------------------------------


def _selected(run: dict) -> str:
    if "optimizer_steps" in run:
        return ",".join(f"{s['selected']:g}" for s in run["optimizer_steps"])
    if "upstream_selected" in run:
        return ",".join(str(n) for n in run["upstream_selected"])
    return "-"


def format_report(study: dict) -> str:
    runs, summary = study["runs"], study.get("summary") or summarize(study)
    lines = ["SmolLM2-135M-Instruct (fp32 from 4-bit), verl trainer loop on CPU; per trainer step:"]
    for key, run in runs.items():
        entropy = " ".join(f"{h:.3f}" for h in run["metrics"][ENTROPY])
        reward = " ".join(f"{r:.2f}" for r in run["metrics"][REWARD])
        lines.append(f"  {key:<28} entropy {entropy} | reward {reward} | {run['seconds']:.0f} s")
        lines.append(f"  {'':<28} tokens selected per optimizer step: {_selected(run)}")
    pairs = study.get("pairs", {})
    if pairs:
        lines.append("micro-batch 1 vs 4, per weight version after each step: max |delta theta|; per step |delta H|:")
    for mode, pair in pairs.items():
        params = " ".join(f"{x:.1e}" for x in pair["param_max_abs"][1:])
        entropy = " ".join(f"{x:.1e}" for x in pair["entropy"])
        masks = "" if "same_masks" not in pair else (
            f", masks {'identical' if all(pair['same_masks']) else 'DIFFER'} at "
            f"{sum(pair['same_masks'])}/{len(pair['same_masks'])} optimizer steps")
        lines.append(f"  {mode:<14} params {params} | entropy {entropy} | rollouts identical at "
                     f"{sum(pair['same_rollouts'])}/{len(pair['same_rollouts'])} steps{masks}")
    for mode, v in summary["verdicts"].items():
        lines.append(f"  {mode}: {'OK' if v['ok'] else 'NOT AS EXPECTED'} ({v['expected']}): parameters "
                     f"{v['params_ratio']:.3g}x, entropy {v['entropy_ratio']:.3g}x vanilla's pair")
    if "seconds" in study:
        lines.append(f"study time {study['seconds']:.0f} s with {study.get('jobs', '?')} job(s)")
    return "\n".join(lines)


def plot(study: dict, path: str) -> None:
    """2 x 2: entropy and reward per step of every run (micro-batch 1 solid, 4 dashed), each pair's max |delta theta|
    per step (log; vanilla's pair is the floor), the tokens each KL-Cov run selects per optimizer step."""
    plt = load_pyplot()
    runs, pairs = study["runs"], study.get("pairs", {})
    colors = {"vanilla": "0.45", "kl_cov": "tab:red", "kl_cov_global": "tab:blue"}
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    for key, run in runs.items():
        style, marker = ("-", "o") if run["micro_batch_size"] == 1 else ("--", "x")
        label = f"{run['loss_mode']}, micro-batch {run['micro_batch_size']}"
        for ax, name in ((axes[0][0], ENTROPY), (axes[0][1], REWARD)):
            ys = run["metrics"][name]
            ax.plot(range(1, len(ys) + 1), ys, color=colors[run["loss_mode"]], ls=style, marker=marker, ms=4,
                    label=label)
        ys = [step["selected"] for step in run["optimizer_steps"]] if "optimizer_steps" in run else \
            run.get("upstream_selected")
        if ys:
            axes[1][1].plot(range(1, len(ys) + 1), ys, color=colors[run["loss_mode"]], ls=style, marker=marker, ms=4,
                            label=label)
    axes[0][0].set_title("verl's actor/entropy (nats per response token)")
    axes[0][1].set_title("mean reward (1 = the number repeated)")
    axes[0][0].legend(fontsize=7)
    ax = axes[1][0]
    for mode, pair in pairs.items():
        ys = [max(y, 1e-12) for y in pair["param_max_abs"][1:]]
        ax.plot(range(1, len(ys) + 1), ys, color=colors[mode], ls="--" if mode == "vanilla" else "-", marker="o",
                ms=4, label=f"{mode}" + (" (float noise floor)" if mode == "vanilla" else ""))
    ax.set_yscale("log")
    ax.set_title("micro-batch 1 vs 4: max |delta theta| after each step")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    ax.set_title("tokens selected per optimizer step\n(kl_cov: its quota per micro-batch, summed)", fontsize=10)
    ax.set_xlabel("optimizer step")
    if ax.lines:
        ax.legend(fontsize=8)
    for a in (axes[0][0], axes[0][1], axes[1][0]):
        a.set_xlabel("trainer step")
    for a in axes.flat:
        a.grid(True, alpha=0.3)
    cfg = study["settings"]["base"]
    fig.suptitle(f"SmolLM2-135M-Instruct (fp32, dequantized from 4 bits), verl's trainer loop on CPU\nGRPO on "
                 f"'Repeat this number', {cfg['prompts_per_step']}x{cfg['responses_per_prompt']} responses a step, "
                 f"{cfg['optimizer']} lr {cfg['lr']}, kl_cov_ratio {cfg['kl_cov_ratio']}", fontsize=10)
    save_figure(fig, path, dpi=90)


# -- the command --------------------------------------------------------------------------------------------


def _work(weights_root: str, model_path: str):
    def work(work_root: str, todo: list):
        return functools.partial(run_one, model_path=model_path, weights_root=weights_root, work_root=work_root)
    return work


def _cost(item: dict) -> float:
    return (3.0 if item["micro_batch_size"] == 1 else 2.0) + (0.5 if item["loss_mode"].endswith("global") else 0.0)


def _describe(run: dict) -> str:
    return f"entropy {run['metrics'][ENTROPY][0]:.3f} -> {run['metrics'][ENTROPY][-1]:.3f}, " \
           f"reward {run['metrics'][REWARD][0]:.2f} -> {run['metrics'][REWARD][-1]:.2f}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = new_parser("python -m experiments.real_divergence", __doc__)
    add_output_arguments(parser)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="GRPO steps per run (default %(default)s)")
    parser.add_argument("--jobs", type=int, default=2, help="processes running runs in parallel (default %(default)s)")
    parser.add_argument("--model", default="smollm2",
                        help="smollm2 (the prepared cache, `python -m verl_klcov_global prepare-model smollm2`) or an "
                             "HF folder of a chat model (default %(default)s)")
    parser.add_argument("--weights-dir", help="where each run's weight versions wait for its pair's comparison "
                                              "(default: <--json>.weights, or ./real_divergence.weights)")
    args = parser.parse_args(argv)
    if args.from_json:
        return redraw_from_json(args, format_report, plot)
    if args.steps < 2:
        parser.error("--steps must be at least 2")
    from verl_klcov_global.lab.real_model import resolve_model_argument

    model_path = resolve_model_argument(args.model)
    weights_root = args.weights_dir or ((args.json + ".weights") if args.json else os.path.abspath(
        "real_divergence.weights"))
    os.makedirs(weights_root, exist_ok=True)
    study = open_study(study_settings(args.steps), args.json)
    started = time.perf_counter()
    run_pending(planned_runs(args.steps), study, key_of=lambda item: item["key"], cost=_cost,
                work=_work(weights_root, model_path), describe=_describe, jobs=args.jobs, json_path=args.json,
                progress=lambda message: print(message, flush=True), prefix="real_divergence_")
    compare_pairs(study, weights_root)
    if not os.listdir(weights_root):
        os.rmdir(weights_root)
    close_study(study, args, started, summarize, format_report, plot)
    return 0 if all(v["ok"] for v in study["summary"]["verdicts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
