"""What an actor update costs over upstream once verl's own log-prob pass stands in for the prepass (CPU).

verl's real ``TrainingWorker`` (FSDP1, world size 1, fp32, sdpa, SGD), the tiny local Qwen2, the minibatch of
``bench_step.py`` (64 sequences x (16 prompt + 128 response) tokens, seed 0), training micro-batches of 8
sequences, log-prob micro-batches of 16, padded and packed (``use_remove_padding``). One *round* is what
verl's trainer makes the actor do per step, for every variant in a rotated order:

* the **log-prob pass**: ``TrainingWorker.infer_batch`` with ``calculate_entropy=True``, ``compute_loss=False``
  (``compute_log_prob``); its log-probs become the batch's ``old_log_probs``, as in the trainer;
* the **update**: ``TrainingWorker.train_mini_batch`` (``update_actor``) with ``ppo_mini_batch_size`` 64
  (1 minibatch, 1 epoch: on-policy) or 16 (4 minibatches, 1 epoch).

Variants: ``kl_cov`` / ``kl_cov_global``, ``clip_cov`` / ``clip_cov_global``, ``vanilla`` /
``high_entropy_global`` (the 80/20 mode's upstream is verl's ``vanilla`` loss), and each global mode with
reuse switched off (``[prepass]``: what 0.4.1 ran, a prepass every optimizer step), and each global mode with
``prepass_layout=old`` (``[old]``: pi_old's statistics at every optimizer step, no prepass). Figures: medians of the
update's and the pass's wall seconds, the update over its upstream's (ratio of medians and median of the
per-round ratios), the same for pass + update (the actor's share of a trainer step), and the kept bytes.
``--memory``: peak resident-set growth of one pass + update per variant (on-policy setup), each in a fresh
process (glibc's mmap threshold at 128 KiB, so freed tensors leave the resident set).

Run: ``.venv/bin/python -m benchmarks.bench_reuse [--reps N] [--threads N] [--memory] [--json PATH]``.
Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from ._common import load_average, machine, median, quiet, table

CASES = {"padded": False, "packed": True}
SETUPS = {"1 minibatch x 1 epoch": (64, 1), "4 minibatches x 1 epoch": (16, 1)}
BATCH, PROMPT, RESPONSE, SEED = 64, 16, 128, 0
#: global mode -> its upstream (what the ratio divides by)
PAIRS = {"kl_cov_global": "kl_cov", "clip_cov_global": "clip_cov", "high_entropy_global": "vanilla"}
NO_REUSE = "[prepass]"
#: the opt-in ``prepass_layout=old``: pi_old's statistics at every optimizer step, no prepass
OLD_POLICY = "[old]"
VARIANTS = tuple(v for g, u in PAIRS.items() for v in (u, g, g + NO_REUSE, g + OLD_POLICY))
#: trainer-only keys the worker injects itself
WORKER_KEYS = ("use_dynamic_bsz", "micro_batch_size_per_gpu", "max_token_len_per_gpu", "global_token_num",
               "update_lr_scheduler", "disable_auto_offload", "compute_loss", "calculate_entropy")


def _actor_config(variant: str, mini_batch: int, epochs: int):
    from verl_klcov_global.config import (
        ClipCovGlobalPolicyLossConfig, HighEntropyGlobalPolicyLossConfig, KLCovGlobalPolicyLossConfig,
    )
    from verl_klcov_global.lab import tiny as _tiny

    mode = variant.replace(NO_REUSE, "").replace(OLD_POLICY, "")
    layout = "old" if variant.endswith(OLD_POLICY) else "infer"
    common = dict(ppo_mini_batch_size=mini_batch, ppo_epochs=epochs)
    if mode == "clip_cov_global":
        return _tiny.make_actor_config(policy_loss=ClipCovGlobalPolicyLossConfig(clip_cov_ratio=0.0002,
                                                                                 prepass_layout=layout), **common)
    if mode == "high_entropy_global":
        return _tiny.make_actor_config(policy_loss=HighEntropyGlobalPolicyLossConfig(entropy_top_ratio=0.2,
                                                                                     prepass_layout=layout), **common)
    if mode == "kl_cov_global":
        return _tiny.make_actor_config(policy_loss=KLCovGlobalPolicyLossConfig(kl_cov_ratio=0.0002, ppo_kl_coef=1.0,
                                                                               prepass_layout=layout), **common)
    return _tiny.make_actor_config(loss_mode=mode, kl_cov_ratio=0.0002, ppo_kl_coef=1.0, **common)


def _worker(model_dir: str, packed: bool):
    """verl's TrainingWorker as ``tests.support.workers.build_training_worker`` builds it, padded or packed
    (verl applies its remove-padding patch when the model is built: the flag goes into the model config)."""
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker

    from verl_klcov_global.lab import cpu as _cpu

    _cpu.install_cpu_platform()
    _cpu.init_process_group_cpu()
    configs = _cpu.fsdp_engine_configs(model_dir, lr=0.02, clip_grad=0.05, use_remove_padding=packed,
                                       micro_batch_size_per_gpu=8, infer_micro_batch_size_per_gpu=16)
    worker = TrainingWorker(config=TrainingWorkerConfig(model_type="language_model", **configs))
    worker.reset()
    return worker


def _batch(packed: bool):
    from verl_klcov_global.lab import tiny as _tiny

    td = _tiny.make_minibatch(batch_size=BATCH, prompt_len=PROMPT, response_len=RESPONSE, seed=SEED,
                              use_remove_padding=packed)
    for key in WORKER_KEYS:
        if key in td.keys():
            del td[key]
    return td


def _trainer_step(worker, batch, variant: str, mini_batch: int, epochs: int) -> dict[str, float]:
    """One log-prob pass and one update, as verl's trainer asks them of the actor; seconds of each, kept bytes."""
    import contextlib

    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import response_from_nested

    from verl_klcov_global.engine import kept_pass, reuse

    worker.set_loss_fn(functools.partial(ppo_loss, config=_actor_config(variant, mini_batch, epochs)))
    reuse.forget(worker.engine)  # nothing of the previous variant's pass (a held [old] one stays until replaced)
    data = batch.copy()
    switch = kept_pass.disabled() if variant.endswith(NO_REUSE) else contextlib.nullcontext()
    with switch:
        pass_data = data.copy()
        tu.assign_non_tensor(pass_data, calculate_entropy=True, compute_loss=False)
        c0, t0 = time.process_time(), time.perf_counter()
        output = worker.infer_batch(pass_data)
        c1, t1 = time.process_time(), time.perf_counter()
        kept = reuse.kept_nbytes(worker.engine)
        data["old_log_probs"] = response_from_nested(tu.get(output, "log_probs"), data["response_mask"])
        tu.assign_non_tensor(data, mini_batch_size=mini_batch, global_batch_size=mini_batch, epochs=epochs, seed=1,
                             dataloader_kwargs={"shuffle": False}, calculate_entropy=False, compute_loss=True,
                             distillation_use_topk=False, distillation_only=False)
        c2, t2 = time.process_time(), time.perf_counter()
        metrics = tu.get(worker.train_mini_batch(data), "metrics")
        c3, t3 = time.process_time(), time.perf_counter()
    reused = [float(v) for key, values in metrics.items() if key.endswith("prepass_reused") for v in values]
    # the plugin's own seconds inside the update (prepass + selection, per optimizer step): an in-process account of
    # what it adds to verl's train_batch, free of the machine's noise between calls
    plugin = [float(v) for key, values in metrics.items()
              if key.endswith(("prepass_seconds", "selection_seconds")) for v in values]
    return {"pass": t1 - t0, "update": t3 - t2, "pass_cpu": c1 - c0, "update_cpu": c3 - c2, "kept_bytes": kept,
            "reused": sum(reused), "plugin_seconds": sum(plugin)}


def run_case(model_dir: str, case: str, *, reps: int, warmup: int, progress=print,
             variants: tuple = VARIANTS) -> dict[str, Any]:
    packed = CASES[case]
    worker, batch = _worker(model_dir, packed), _batch(packed)
    tokens = int(batch["response_mask"].values().sum())
    out: dict[str, Any] = {"case": case, "response_tokens": tokens, "setups": {}}
    for setup, (mini_batch, epochs) in SETUPS.items():
        samples: dict[str, list[dict]] = {v: [] for v in variants}
        for _ in range(warmup):
            for variant in variants:
                _trainer_step(worker, batch, variant, mini_batch, epochs)
        for rep in range(reps):
            order = variants[rep % len(variants):] + variants[: rep % len(variants)]
            for variant in order:
                samples[variant].append(_trainer_step(worker, batch, variant, mini_batch, epochs))
            progress(f"  {case} / {setup}: round {rep + 1}/{reps} " + " ".join(
                f"{v}={samples[v][-1]['update']:.2f}s" for v in variants))
        out["setups"][setup] = summarise(samples, mini_batch, epochs, tokens)
    return out


def summarise(samples: dict[str, list[dict]], mini_batch: int, epochs: int, tokens: int) -> dict[str, Any]:
    def med(variant: str, key: str) -> float:
        return median(s[key] for s in samples[variant])

    figures: dict[str, Any] = {
        "optimizer_steps": BATCH // mini_batch * epochs,
        "median_update_seconds": {v: med(v, "update") for v in samples},
        "median_pass_seconds": {v: med(v, "pass") for v in samples},
        "samples": samples,
        "modes": {},
    }
    for mode, upstream in PAIRS.items():
        row = {}
        if upstream not in samples:
            continue
        for variant in (v for v in (mode, mode + NO_REUSE, mode + OLD_POLICY) if v in samples):
            ours, theirs = samples[variant], samples[upstream]
            row[variant] = {
                "update_over_upstream": med(variant, "update") / med(upstream, "update"),
                "update_over_upstream_paired": median(a["update"] / b["update"] for a, b in zip(ours, theirs)),
                # process CPU time (all threads): with 1 torch thread it hardly depends on the machine's other load
                "update_over_upstream_cpu": med(variant, "update_cpu") / med(upstream, "update_cpu"),
                "step_over_upstream": median(a["pass"] + a["update"] for a in ours)
                / median(b["pass"] + b["update"] for b in theirs),
                "pass_over_upstream_pass": med(variant, "pass") / med(upstream, "pass"),
                "reused_per_update": med(variant, "reused"),
                "kept_bytes": med(variant, "kept_bytes"),
                "kept_bytes_per_response_token": med(variant, "kept_bytes") / tokens,
                # the update over the update without the plugin's own seconds (prepass + selection), per round
                "update_over_update_without_plugin": median(a["update"] / (a["update"] - a["plugin_seconds"])
                                                            for a in ours),
            }
        figures["modes"][mode] = row
    return figures


# -- memory: one fresh process per (case, setup, variant) ----------------------------------------------------


def _memory_child(model_dir: str, case: str, setup: str, variant: str) -> None:
    quiet()
    import verl_klcov_global  # noqa: F401

    from .bench_high_entropy import peak_rss_growth

    packed = CASES[case]
    worker, batch = _worker(model_dir, packed), _batch(packed)
    mini_batch, epochs = SETUPS[setup]
    _trainer_step(worker, batch, variant, mini_batch, epochs)  # warm-up
    growth = peak_rss_growth(lambda: _trainer_step(worker, batch, variant, mini_batch, epochs))
    print(json.dumps({"peak_rss_growth_bytes": growth}))


def measure_memory(model_dir: str, cases, setups, progress=print) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result: dict = {}
    for case in cases:
        for setup in setups:
            for variant in VARIANTS:
                progress(f"[memory] {case} / {setup} / {variant} (fresh process)")
                proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_reuse", "--memory-child", case, setup,
                                       variant, "--model", model_dir], capture_output=True, text=True, env=env,
                                      timeout=900, cwd=root)
                if proc.returncode != 0:
                    raise RuntimeError(proc.stderr[-3000:])
                line = [x for x in proc.stdout.splitlines() if x.startswith("{")][-1]
                result.setdefault(case, {}).setdefault(setup, {})[variant] = json.loads(line)["peak_rss_growth_bytes"]
    return result


def report(payload: dict) -> str:
    rows = []
    for case in payload["cases"]:
        for setup, figures in case["setups"].items():
            med = figures["median_update_seconds"]
            for mode, upstream in PAIRS.items():
                for variant in figures["modes"].get(mode, {}):
                    f = figures["modes"][mode][variant]
                    memory = payload.get("memory", {}).get(case["case"], {}).get(setup, {})
                    rows.append([case["case"], setup, variant, upstream, f"{med[variant]:.2f}",
                                 f"{med[upstream]:.2f}", f"{f['update_over_upstream']:.2f}",
                                 f"{f['update_over_upstream_paired']:.2f}", f"{f['update_over_upstream_cpu']:.2f}",
                                 f"{f['update_over_update_without_plugin']:.3f}", f"{f['step_over_upstream']:.2f}",
                                 f"{f['pass_over_upstream_pass']:.2f}", f"{f['reused_per_update']:g}",
                                 f"{f['kept_bytes_per_response_token']:.2f}",
                                 _mib(memory.get(variant)) + " / " + _mib(memory.get(upstream))])
    return table(["case", "setup", "variant", "upstream", "update s", "upstream s", "update/upstream", "paired",
                  "cpu", "update/(update-plugin)", "pass+update/upstream", "pass/upstream pass", "reused/update", "kept B/token",
                  "peak RSS growth MiB (ours / upstream)"], rows)


def _mib(value) -> str:
    return "n/a" if value is None else f"{value / 2**20:.1f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--cases", default="padded,packed")
    parser.add_argument("--variants", default="all",
                        help="'all', 'old' (each upstream and its [old] variant only) or a comma-separated list of "
                             f"{list(VARIANTS)}")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--memory", action="store_true", help="also the peak RSS growth (fresh processes)")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--model", help="the tiny model folder (default: built in a temporary folder)")
    parser.add_argument("--memory-child", nargs=3, metavar=("CASE", "SETUP", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quiet()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        _memory_child(args.model, *args.memory_child)
        return 0
    import verl_klcov_global  # noqa: F401
    from verl_klcov_global.lab.tiny import build_tiny_model

    cases = [c for c in args.cases.split(",") if c]
    if args.variants == "all":
        variants = VARIANTS
    elif args.variants == "old":
        variants = tuple(v for g, u in PAIRS.items() for v in (u, g + OLD_POLICY))
    else:
        variants = tuple(v for v in args.variants.split(",") if v)
        unknown = sorted(set(variants) - set(VARIANTS))
        if unknown:
            parser.error(f"--variants: unknown {unknown}; known: {list(VARIANTS)}")
    progress = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_reuse_") as scratch:
        model_dir = args.model or build_tiny_model(os.path.join(scratch, "tiny"), seed=0)
        payload: dict[str, Any] = {"machine": machine(), "reps": args.reps, "threads": torch.get_num_threads(),
                                   "cases": []}
        payload["machine"]["command"] = " ".join(["python", "-m", "benchmarks.bench_reuse", *(argv or sys.argv[1:])])
        for case in cases:
            progress(f"[{case}] {len(variants)} variants x {len(SETUPS)} setups, {args.reps} rounds")
            payload["cases"].append(run_case(model_dir, case, reps=args.reps, warmup=args.warmup, progress=progress,
                                             variants=variants))
        if args.memory:
            # the on-policy setup, where reuse leaves no prepass at all: what the kept data does to the peak
            payload["memory"] = measure_memory(model_dir, cases, list(SETUPS)[:1], progress=progress)
    payload["seconds"] = time.perf_counter() - started
    payload["machine"]["load_average_end"] = load_average()
    print(report(payload))
    print(f"\nload average start {payload['machine']['load_average_start']}, end {payload['machine']['load_average_end']}; "
          f"{payload['seconds']:.0f} s")
    if args.json_path:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_path)), exist_ok=True)
        with open(args.json_path, "w") as handle:
            json.dump(payload, handle, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
