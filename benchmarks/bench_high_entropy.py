"""``high_entropy_global``'s prepass vs verl's ``compute_log_prob`` with entropy, and its step time (CPU).

Same engine and minibatch as ``bench_step.py``: the tiny local Qwen2, 64 sequences x (16 prompt + 128
response) tokens, seed 0, the engine's log-prob inference layout (16 sequences per forward), padded
and packed (``use_remove_padding``).

* **prepass / compute_log_prob**: the prepass's forward with entropy
  (``engine.prepass.compute_prepass_log_probs_and_entropy``, ``prepass_layout=infer``), alone and with
  the selection (``HIGH_ENTROPY.select_minibatch``), against what verl's ``compute_log_prob`` runs for
  the old log-probs on the same minibatch: ``engine.infer_batch`` in eval mode with
  ``calculate_entropy=True``, ``compute_loss=False`` and the same inference micro-batching, then the
  padded log-probs and entropy. Interleaved: each round runs each once, in a rotated order.
* **step**: one ``engine.train_batch`` (8 static micro-batches of 8) of ``high_entropy_global`` vs
  ``vanilla``, interleaved the same way (``bench_step.py``'s method).
* **memory** (``--memory``): CPU has no allocator statistics like ``torch.cuda.max_memory_allocated``;
  this measures the growth of the process's resident set (RSS, sampled every 0.2 ms by a thread)
  during one call, over the RSS just before it, in a fresh process per (case, function) with glibc's
  mmap threshold fixed at 128 KiB (``MALLOC_MMAP_THRESHOLD_``) so that large tensors are returned to
  the OS when freed and the RSS follows live memory. The first call of each function is a warm-up.

Run: ``.venv/bin/python -m benchmarks.bench_high_entropy [--reps N] [--memory] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional

from ._common import load_average, median, quiet

CASES = {"padded": False, "packed": True}
BATCH, PROMPT, RESPONSE, MICRO_BATCHES, SEED = 64, 16, 128, 8, 0
MODE = "high_entropy_global"


def _setup(model_dir: str, case: str, strategy: str = "fsdp"):
    from verl_klcov_global.lab.experiment import EngineSpec, frozen_minibatch, static_layouts

    spec = EngineSpec(model_dir, strategy=strategy, use_remove_padding=CASES[case])
    batch = frozen_minibatch(spec, SEED, batch_size=BATCH, prompt_len=PROMPT, response_len=RESPONSE)
    batch = static_layouts(BATCH, MICRO_BATCHES)[1].apply(batch)
    return spec, batch, spec.build()


def _actor_config(mode: str):
    from verl_klcov_global.config import HighEntropyGlobalPolicyLossConfig
    from verl_klcov_global.lab import tiny as _tiny

    if mode == MODE:
        return _tiny.make_actor_config(policy_loss=HighEntropyGlobalPolicyLossConfig(entropy_top_ratio=0.2))
    return _tiny.make_actor_config(loss_mode=mode)


def functions(engine, batch) -> dict[str, Callable[[], Any]]:
    """The timed calls: ``prepass``, ``prepass+selection``, ``compute_log_prob`` (verl's, with entropy)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    from verl_klcov_global.engine.prepass import compute_prepass_log_probs_and_entropy
    from verl_klcov_global.methods.high_entropy.row import HIGH_ENTROPY

    settings = HIGH_ENTROPY.read_settings(_actor_config(MODE))
    config = engine.engine_config

    def prepass():
        return compute_prepass_log_probs_and_entropy(engine, batch, "infer")

    def prepass_and_selection():
        log_probs, entropy = prepass()
        return HIGH_ENTROPY.select_minibatch(log_probs, batch, settings, None, entropy)

    def compute_log_prob():
        data = batch.copy()
        tu.assign_non_tensor(data, calculate_entropy=True, compute_loss=False,
                             micro_batch_size_per_gpu=config.infer_micro_batch_size_per_gpu,
                             max_token_len_per_gpu=config.infer_max_token_len_per_gpu)
        with engine.eval_mode():
            output = engine.infer_batch(data, loss_function=None)["model_output"]
        return (no_padding_2_padding(output["log_probs"], data), no_padding_2_padding(output["entropy"], data))

    return {"prepass": prepass, "prepass+selection": prepass_and_selection, "compute_log_prob": compute_log_prob}


def _interleaved(calls: dict[str, Callable[[], Any]], reps: int, warmup: int,
                 cpu: Optional[dict] = None) -> dict[str, list[float]]:
    """Wall seconds per call, rounds in rotated order; ``cpu`` (if given) gets the process CPU seconds too."""
    names = list(calls)
    for _ in range(warmup):
        for name in names:
            calls[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            c0, t0 = time.process_time(), time.perf_counter()
            calls[name]()
            samples[name].append(time.perf_counter() - t0)
            if cpu is not None:
                cpu.setdefault(name, []).append(time.process_time() - c0)
    return samples


def run_case(model_dir: str, case: str, *, reps: int, warmup: int, progress=print, step: bool = True) -> dict[str, Any]:
    """Prepass vs compute_log_prob, and the step of ``high_entropy_global`` vs ``vanilla``, on one engine."""
    import functools

    from verl.workers.utils.losses import ppo_loss

    spec, batch, engine = _setup(model_dir, case)
    progress(f"[{case}] prepass vs compute_log_prob, {reps} rounds")
    cpu: dict[str, list[float]] = {}
    with engine.train_mode():  # the prepass runs inside verl's train step; it switches to eval itself
        forward = _interleaved(functions(engine, batch), reps, warmup, cpu)
    per_round = [p / c for p, c in zip(forward["prepass"], forward["compute_log_prob"])]
    figures = {
        "samples": dict(forward), "cpu_samples": cpu,
        "median_seconds": {name: median(values) for name, values in forward.items()},
        "prepass_over_compute_log_prob": median(forward["prepass"]) / median(forward["compute_log_prob"]),
        "prepass_over_compute_log_prob_paired": median(per_round),
        "prepass_over_compute_log_prob_per_round": per_round,
        "prepass_over_compute_log_prob_cpu": median(cpu["prepass"]) / median(cpu["compute_log_prob"]),
        "prepass_and_selection_over_compute_log_prob": median(forward["prepass+selection"])
        / median(forward["compute_log_prob"]),
    }
    if not step:
        return figures
    progress(f"[{case}] train_batch: {MODE} vs vanilla, {reps} rounds")
    losses = {mode: functools.partial(ppo_loss, config=_actor_config(mode)) for mode in ("vanilla", MODE)}

    def one_step(mode):
        def call():
            with engine.train_mode():
                engine.train_batch(batch.copy(), loss_function=losses[mode])
        return call

    step_cpu: dict[str, list[float]] = {}
    steps = _interleaved({mode: one_step(mode) for mode in losses}, reps, warmup, step_cpu)
    figures["samples"].update(steps)
    figures["cpu_samples"].update(step_cpu)
    figures["median_seconds"].update({name: median(values) for name, values in steps.items()})
    figures["step_over_vanilla"] = median(steps[MODE]) / median(steps["vanilla"])
    figures["step_over_vanilla_paired"] = median([a / b for a, b in zip(steps[MODE], steps["vanilla"])])
    figures["step_over_vanilla_cpu"] = median(step_cpu[MODE]) / median(step_cpu["vanilla"])
    return figures


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_growth(call: Callable[[], Any], interval: float = 0.0002) -> int:
    """Largest RSS during ``call()`` minus the RSS just before it, in bytes (a sampling thread)."""
    baseline, peak, done = _rss_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(interval)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        result = call()
    finally:
        done.set()
        thread.join()
    peak[0] = max(peak[0], _rss_bytes())
    del result
    return peak[0] - baseline


def _memory_child(model_dir: str, case: str, name: str) -> None:
    quiet()
    import verl_klcov_global  # noqa: F401

    _, batch, engine = _setup(model_dir, case)
    with engine.train_mode():
        call = functions(engine, batch)[name]
        call()  # warm-up
        growth = peak_rss_growth(call)
    print(json.dumps({"case": case, "function": name, "peak_rss_growth_bytes": growth}))


def measure_memory(model_dir: str, cases=tuple(CASES), progress=print) -> dict[str, dict[str, int]]:
    """``{case: {function: peak RSS growth in bytes}}``, one fresh process each."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    result: dict[str, dict[str, int]] = {}
    for case in cases:
        for name in ("prepass", "compute_log_prob"):
            progress(f"[{case}] memory of {name} (fresh process)")
            proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_high_entropy", "--memory-child", case,
                                   name, "--model", model_dir], capture_output=True, text=True, env=env,
                                  timeout=900, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr[-3000:])
            line = [x for x in proc.stdout.splitlines() if x.startswith("{")][-1]
            result.setdefault(case, {})[name] = json.loads(line)["peak_rss_growth_bytes"]
    return result


def report(payload: dict) -> str:
    lines = [f"high_entropy_global on CPU: {BATCH} x ({PROMPT} + {RESPONSE}) tokens, tiny Qwen2, fp32, "
             f"{payload.get('threads')} thread(s); load average before {payload['load_before']}, after "
             f"{payload['load_after']}",
             "case     prepass/compute_log_prob: medians, paired, cpu  (+selection)  step/vanilla: medians, paired, cpu"]
    nan = float("nan")
    for case, f in payload["cases"].items():
        lines.append(f"{case:<8} {f['prepass_over_compute_log_prob']:>6.3f} {f['prepass_over_compute_log_prob_paired']:>6.3f} "
                     f"{f['prepass_over_compute_log_prob_cpu']:>6.3f}                  "
                     f"{f['prepass_and_selection_over_compute_log_prob']:>6.3f}        "
                     f"{f.get('step_over_vanilla', nan):>6.3f} {f.get('step_over_vanilla_paired', nan):>6.3f} "
                     f"{f.get('step_over_vanilla_cpu', nan):>6.3f}")
    for case, memory in payload.get("memory", {}).items():
        lines.append(f"{case:<8} peak RSS growth: prepass {memory['prepass'] / 2**20:.1f} MiB, "
                     f"compute_log_prob {memory['compute_log_prob'] / 2**20:.1f} MiB")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cases", default="padded,packed")
    parser.add_argument("--memory", action="store_true", help="also measure the peak RSS growth (fresh processes)")
    parser.add_argument("--no-step", action="store_true", help="only the prepass vs compute_log_prob")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--model", help="the tiny model folder (default: built in a temporary folder)")
    parser.add_argument("--memory-child", nargs=2, metavar=("CASE", "FUNCTION"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quiet()
    if args.memory_child:
        _memory_child(args.model, *args.memory_child)
        return 0
    import torch

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    import verl_klcov_global  # noqa: F401
    from verl_klcov_global.lab.tiny import build_tiny_model

    cases = [c for c in args.cases.split(",") if c]
    with tempfile.TemporaryDirectory(prefix="bench_high_entropy_") as scratch:
        model_dir = args.model or build_tiny_model(os.path.join(scratch, "tiny"), seed=0)
        payload: dict[str, Any] = {"load_before": load_average(), "reps": args.reps, "cases": {},
                                   "threads": torch.get_num_threads()}
        for case in cases:
            payload["cases"][case] = run_case(model_dir, case, reps=args.reps, warmup=args.warmup,
                                              progress=lambda m: print(m, file=sys.stderr, flush=True),
                                              step=not args.no_step)
        if args.memory:
            payload["memory"] = measure_memory(model_dir, tuple(cases),
                                               progress=lambda m: print(m, file=sys.stderr, flush=True))
        payload["load_after"] = load_average()
    print(report(payload))
    if args.json_path:
        with open(args.json_path, "w") as handle:
            json.dump(payload, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
