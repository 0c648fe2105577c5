"""``stare_global``'s optimizer-step time against the authors' per-call rule and ``vanilla`` (CPU).

The engine and minibatch of ``bench_step.py``: the tiny local Qwen2, fp32, 64 sequences x (16 prompt + 128
response) tokens, seed 0, 8 static micro-batches of 8, padded. The modes share the engine and are timed
interleaved (``bench_step.py``'s method): warm-up rounds, then ``reps`` rounds, each running every mode once in a
rotated order. Each sample is one ``engine.train_batch`` call:

* ``vanilla``: verl's PPO-clip loss;
* ``stare_per_micro_batch``: the authors' rule, its top-P% per sign inside each loss call (the lab's comparator);
* ``stare_global``: the gate's agreement (:mod:`verl_klcov_global.engine.batch_entropy`, one all-reduce; here one
  process), the prepass (a no-grad forward of the minibatch in the log-prob inference layout: reuse of verl's pass
  is switched off, so every step pays it, as every optimizer step after an update's first does), the selection
  (two exact top-k searches, one per advantage sign) and verl's step.

Before every ``stare_global`` step the log-prob pass verl's trainer runs once per trainer step is run, untimed
(``lab.experiment.hold_old_policy_pass``): each timed step is then an update's first, where the rule moves. The gate
is held open (``stare_target_entropy`` 100), variant C2, P 0.1.

Run: ``.venv/bin/python -m benchmarks.bench_stare [--reps N] [--threads N] [--json PATH]``. It asserts nothing
about time.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time
from typing import Any

from ._common import median, quiet, table

MODES = ("vanilla", "stare_per_micro_batch", "stare_global")
BATCH, PROMPT, RESPONSE, MICRO_BATCHES, SEED = 64, 16, 128, 8, 0
KNOBS = dict(stare_top_ratio=0.1, stare_variant="C2", stare_target_entropy=100.0)


def _actor_config(mode: str):
    from verl_klcov_global.config import StareGlobalPolicyLossConfig
    from verl_klcov_global.lab import tiny as _tiny
    from verl_klcov_global.methods.stare.authors import StarePerMicroBatchPolicyLossConfig

    if mode == "stare_global":
        return _tiny.make_actor_config(policy_loss=StareGlobalPolicyLossConfig(**KNOBS))
    if mode == "stare_per_micro_batch":
        return _tiny.make_actor_config(policy_loss=StarePerMicroBatchPolicyLossConfig(**KNOBS))
    return _tiny.make_actor_config(loss_mode=mode)


def run(*, reps: int, warmup: int, model_dir: str) -> dict[str, Any]:
    from verl.workers.utils.losses import ppo_loss

    from verl_klcov_global.engine import kept_pass
    from verl_klcov_global.lab import per_micro_batch
    from verl_klcov_global.lab.experiment import EngineSpec, frozen_minibatch, hold_old_policy_pass, static_layouts
    from verl_klcov_global.methods.stare.authors import COMPARATOR

    per_micro_batch.register(COMPARATOR)
    spec = EngineSpec(model_dir)
    batch = frozen_minibatch(spec, SEED, batch_size=BATCH, prompt_len=PROMPT, response_len=RESPONSE)
    batch = static_layouts(BATCH, MICRO_BATCHES)[1].apply(batch)
    engine = spec.build()
    configs = {mode: _actor_config(mode) for mode in MODES}
    losses = {mode: functools.partial(ppo_loss, config=config) for mode, config in configs.items()}
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    selection_ms: list[float] = []

    def step(mode: str, record: bool) -> None:
        data = batch.copy()
        if mode == "stare_global":
            hold_old_policy_pass(engine, data, configs[mode])  # verl's pass of the trainer step: untimed
        started = time.perf_counter()
        with engine.train_mode():
            output = engine.train_batch(data, loss_function=losses[mode])
        seconds = time.perf_counter() - started
        if record:
            samples[mode].append(seconds)
            if mode == "stare_global":
                value = output["metrics"]["actor/stare/selection_seconds"]
                selection_ms.append(1e3 * float(value.aggregate() if hasattr(value, "aggregate") else value))

    with kept_pass.disabled():
        for _ in range(warmup):
            for mode in MODES:
                step(mode, record=False)
        for rep in range(reps):
            for mode in MODES[rep % len(MODES):] + MODES[: rep % len(MODES)]:
                step(mode, record=True)
            print(f"  round {rep + 1}/{reps} " + " ".join(f"{m}={samples[m][-1]:.3f}s" for m in MODES), flush=True)
    med = {mode: median(values) for mode, values in samples.items()}
    paired = {other: median(g / o for g, o in zip(samples["stare_global"], samples[other]))
              for other in ("vanilla", "stare_per_micro_batch")}
    return {"config": {"model": "tiny Qwen2 (hidden 64, 2 layers, vocab 512), fp32, sdpa, fsdp, padded",
                       "minibatch": f"{BATCH} x ({PROMPT} + {RESPONSE}), {MICRO_BATCHES} static micro-batches",
                       "knobs": KNOBS, "reps": reps, "warmup": warmup, "reuse": "off"},
            "samples_seconds": samples, "median_seconds": med, "median_paired_ratio_of_stare_global": paired,
            "median_selection_ms": median(selection_ms)}


def report(result: dict[str, Any]) -> str:
    med, paired = result["median_seconds"], result["median_paired_ratio_of_stare_global"]
    rows = [[mode, len(result["samples_seconds"][mode]), med[mode], med[mode] / med["vanilla"],
             "" if mode == "stare_global" else f"{paired[mode]:.2f}"] for mode in MODES]
    return (table(["mode", "rounds", "step s (median)", "/vanilla", "stare_global / this, paired"], rows)
            + f"\nstare_global's selection (both signs, exact): {result['median_selection_ms']:.1f} ms (median)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_stare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    quiet()
    import torch

    from verl_klcov_global.lab import cpu as _cpu
    from verl_klcov_global.lab import tiny as _tiny

    if args.threads:
        torch.set_num_threads(args.threads)
    _cpu.install_cpu_platform()
    _cpu.init_process_group_cpu()
    quiet()
    with tempfile.TemporaryDirectory(prefix="stare_bench_") as tmp:
        result = run(reps=args.reps, warmup=args.warmup, model_dir=_tiny.build_tiny_model(os.path.join(tmp, "tiny")))
    result["config"]["threads"] = torch.get_num_threads()
    print(report(result))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
