"""Optimizer-step time of ``vanilla``, ``kl_cov`` and ``kl_cov_global`` on verl's real FSDP engine (CPU).

One engine per case (padded / packed), the tiny local Qwen2, the seed minibatch of
the engine tests (64 sequences x (16 prompt + 128 response) tokens, seed 0,
``old_log_probs`` = current + N(0, 0.05)), 8 static micro-batches of 8 sequences.
The modes share the engine and are timed interleaved: warm-up steps, then
``reps`` rounds, each running every mode once in a rotated order (so no mode is
always first after another). Each sample is one ``engine.train_batch`` call (zero_grad,
forward/backward of 8 micro-batches, optimizer step; for ``kl_cov_global`` also the
prepass and the selection), timed with ``time.perf_counter`` and ``time.process_time`` inside
``engine.train_mode()``.
The weights keep moving (SGD, lr 0.02): restoring them is not needed for timing.

``prepass_seconds`` and ``selection_seconds`` are read from the metrics the hook
returns (``actor/kl_cov/prepass_seconds``, ``actor/kl_cov/selection_seconds``,
verl ``Metric`` objects); the prepass figure includes its layout conversions.
"""

from __future__ import annotations

import functools
import os
import tempfile
import time
from typing import Any, Optional

MODES = ("vanilla", "kl_cov", "kl_cov_global")
#: Extra mode (full runs): kl_cov_global whose prepass uses the training micro-batches
#: (``policy_loss.prepass_layout=train``) instead of the default log-prob inference layout.
TRAIN_LAYOUT = "kl_cov_global[prepass=train]"
CASES = {"padded": False, "packed": True}  # case name -> use_remove_padding
BATCH, PROMPT, RESPONSE, MICRO_BATCHES, SEED = 64, 16, 128, 8, 0
PREFIX = "actor/kl_cov/"


def _metric(metrics: dict, name: str) -> Optional[float]:
    value = metrics.get(PREFIX + name)
    if value is None:
        return None
    return float(value.aggregate() if hasattr(value, "aggregate") else value)


def _actor_config(mode: str, ratio: float):
    from verl_klcov_global.lab import tiny as _tiny
    from verl_klcov_global.config import KLCovGlobalPolicyLossConfig

    if mode == TRAIN_LAYOUT:
        policy_loss = KLCovGlobalPolicyLossConfig(kl_cov_ratio=ratio, ppo_kl_coef=1.0, prepass_layout="train")
        return _tiny.make_actor_config(policy_loss=policy_loss)
    return _tiny.make_actor_config(loss_mode=mode, kl_cov_ratio=ratio, ppo_kl_coef=1.0)


def run_case(model_dir: str, case: str, *, reps: int, warmup: int, ratio: float, strategy: str,
             modes=MODES, progress=print) -> dict[str, Any]:
    """Time every mode on one engine; returns raw samples and summary figures."""
    from verl.workers.utils.losses import ppo_loss

    from verl_klcov_global.lab.experiment import EngineSpec, frozen_minibatch, static_layouts

    spec = EngineSpec(model_dir, strategy=strategy, use_remove_padding=CASES[case])
    started = time.perf_counter()
    batch = frozen_minibatch(spec, SEED, batch_size=BATCH, prompt_len=PROMPT, response_len=RESPONSE)
    batch = static_layouts(BATCH, MICRO_BATCHES)[1].apply(batch)
    engine = spec.build()
    setup_seconds = time.perf_counter() - started
    modes = tuple(modes)
    losses = {mode: functools.partial(ppo_loss, config=_actor_config(mode, ratio)) for mode in modes}
    samples: dict[str, list[float]] = {mode: [] for mode in modes}
    cpu_samples: dict[str, list[float]] = {mode: [] for mode in modes}
    prepass: dict[str, list[float]] = {mode: [] for mode in modes if mode.startswith("kl_cov_global")}
    selection: dict[str, list[float]] = {mode: [] for mode in prepass}

    def step(mode: str, record: bool) -> None:
        data = batch.copy()  # shallow: the hook adds and removes its mask field on the copy
        c0, t0 = time.process_time(), time.perf_counter()
        output = engine.train_batch(data, loss_function=losses[mode])
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
        if not record:
            return
        samples[mode].append(seconds)
        cpu_samples[mode].append(cpu_seconds)
        if mode in prepass:
            metrics = output["metrics"]
            prepass_seconds, selection_seconds = _metric(metrics, "prepass_seconds"), _metric(metrics, "selection_seconds")
            if prepass_seconds is None or selection_seconds is None:
                raise RuntimeError("kl_cov_global step returned no prepass/selection timing: is the hook installed?")
            prepass[mode].append(prepass_seconds)
            selection[mode].append(selection_seconds)

    with engine.train_mode():
        for _ in range(warmup):
            for mode in modes:
                step(mode, record=False)
        for rep in range(reps):
            order = modes[rep % len(modes):] + modes[: rep % len(modes)]
            for mode in order:
                step(mode, record=True)
            progress(f"  {case}: round {rep + 1}/{reps} " + " ".join(f"{m}={samples[m][-1]:.3f}s" for m in modes))
    return summarise(case, samples, cpu_samples, prepass, selection, setup_seconds)


def summarise(case: str, samples: dict[str, list[float]], cpu_samples: dict[str, list[float]],
              prepass: dict[str, list[float]], selection: dict[str, list[float]], setup_seconds: float) -> dict[str, Any]:
    from ._common import median

    med = {mode: median(values) for mode, values in samples.items()}
    cpu_med = {mode: median(values) for mode, values in cpu_samples.items()}
    result: dict[str, Any] = {
        "case": case,
        "samples_seconds": samples,
        # process CPU time of each step (all threads): with 1 torch thread it hardly depends on other load
        "samples_cpu_seconds": cpu_samples,
        "median_cpu_seconds": cpu_med,
        "prepass_seconds": prepass,
        "selection_seconds": selection,
        "median_seconds": med,
        "ratio_kl_cov_over_vanilla": med["kl_cov"] / med["vanilla"],
        "setup_seconds": setup_seconds,
        "global_modes": {},
    }
    for mode in prepass:
        steps, pre, sel = samples[mode], prepass[mode], selection[mode]
        result["global_modes"][mode] = {
            "ratio_over_kl_cov": med[mode] / med["kl_cov"],
            "ratio_over_vanilla": med[mode] / med["vanilla"],
            # per round: this step over the same round's kl_cov step (robust to drifts in machine load)
            "median_paired_ratio_over_kl_cov": median(t / k for t, k in zip(steps, samples["kl_cov"])),
            "cpu_ratio_over_kl_cov": cpu_med[mode] / cpu_med["kl_cov"],
            "median_prepass_seconds": median(pre),
            "median_selection_seconds": median(sel),
            # share of each step spent in the prepass (no-grad forward + layout) / in the selection
            "prepass_share": median(p / t for p, t in zip(pre, steps)),
            "selection_share": median(s / t for s, t in zip(sel, steps)),
            # the step without prepass and selection, against kl_cov's whole step
            "ratio_rest_over_kl_cov": median(t - p - s for t, p, s in zip(steps, pre, sel)) / med["kl_cov"],
        }
    main = result["global_modes"]["kl_cov_global"]
    result["ratio_kl_cov_global_over_kl_cov"] = main["ratio_over_kl_cov"]
    result["ratio_kl_cov_global_over_vanilla"] = main["ratio_over_vanilla"]
    result["prepass_share"] = main["prepass_share"]
    return result


def run(*, quick: bool, cases=tuple(CASES), model_dir: Optional[str] = None, reps: Optional[int] = None,
        warmup: Optional[int] = None, ratio: float = 0.0002, strategy: str = "fsdp", modes=None,
        progress=print) -> dict[str, Any]:
    from verl_klcov_global.lab import tiny as _tiny

    modes = tuple(modes or (MODES if quick else MODES + (TRAIN_LAYOUT,)))
    reps = reps if reps is not None else (2 if quick else 7)
    warmup = warmup if warmup is not None else 1
    with tempfile.TemporaryDirectory(prefix="klcov_bench_") as tmp:
        path = _tiny.build_tiny_model(model_dir or os.path.join(tmp, "tiny"))
        results = []
        for case in cases:
            progress(f"[step] {case}: building engine, {warmup} warm-up round(s), {reps} timed round(s)")
            results.append(run_case(path, case, reps=reps, warmup=warmup, ratio=ratio, strategy=strategy,
                                    modes=modes, progress=progress))
    return {
        "config": {
            "model": "tiny Qwen2 (hidden 64, 2 layers, vocab 512), fp32, sdpa", "strategy": strategy,
            "world_size": 1, "minibatch": f"{BATCH} x ({PROMPT} prompt + {RESPONSE} response), seed {SEED}",
            "micro_batches": f"{MICRO_BATCHES} static x {BATCH // MICRO_BATCHES} sequences",
            "kl_cov_ratio": ratio, "prepass_layout": "infer (default; infer_micro_batch_size_per_gpu=16)",
            "modes": list(modes), "reps": reps, "warmup_rounds": warmup, "optimizer": "SGD lr 0.02, clip 0.05",
        },
        "cases": results,
    }


def report(result: dict[str, Any]) -> str:
    from ._common import table

    rows = []
    for c in result["cases"]:
        med = c["median_seconds"]
        rounds = len(c["samples_seconds"]["vanilla"])
        cpu = c["median_cpu_seconds"]
        rows.append([c["case"], "vanilla", rounds, med["vanilla"], cpu["vanilla"]] + [""] * 8)
        rows.append([c["case"], "kl_cov", rounds, med["kl_cov"], cpu["kl_cov"]] + [""] * 8)
        for mode, g in c["global_modes"].items():
            rows.append([
                c["case"], mode, rounds, med[mode], cpu[mode], f"{g['ratio_over_kl_cov']:.2f}",
                f"{g['median_paired_ratio_over_kl_cov']:.2f}", f"{g['cpu_ratio_over_kl_cov']:.2f}",
                f"{g['ratio_over_vanilla']:.2f}", g["median_prepass_seconds"], f"{100 * g['prepass_share']:.1f}%",
                g["median_selection_seconds"] * 1e3, f"{g['ratio_rest_over_kl_cov']:.2f}",
            ])
    return table(["case", "mode", "rounds", "step s", "cpu s", "/kl_cov", "/kl_cov paired", "/kl_cov cpu",
                  "/vanilla", "prepass s", "prepass share", "selection ms", "rest/kl_cov"], rows)
