"""What ``lp_reg_global``'s proxy adds to verl's log-prob pass (CPU): time per token and bytes kept.

The proxy (``engine/proxy.py``) is computed inside verl's own log-prob pass (``compute_log_prob``: the engine's
``infer_batch`` with ``calculate_entropy=True``, here through ``lab.experiment.log_prob_pass``), from the logits verl
already has. Two operations on one engine and minibatch, timed interleaved (warm-up rounds, then ``reps`` rounds in
alternating order):

* ``pass``: verl's log-prob pass, as the trainer runs it for any loss;
* ``pass + proxy``: the same pass with the proxy requested (PATCH ``proxy_log_prob_in_pass``: the min-p support and a
  masked logsumexp over the vocabulary per position, fp32 chunks of 256 positions) and kept on the host (PATCH
  ``log_prob_pass_keep``: per-row digests, 4 bytes per response token, with the pass's log-probs).

Reported: the medians, the paired ratio, the added time per token, the bytes kept per response token. Models: the
embedded tiny Qwen2 (vocabulary 512) by default; ``--model smollm2`` (or a folder) for a real vocabulary (49,152).

Run: ``.venv/bin/python -m benchmarks.bench_lp_reg [--model smollm2] [--reps N] [--threads N] [--json PATH]``. It
asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

from ._common import median, quiet, table

OPERATIONS = ("pass", "pass + proxy")
BATCH, PROMPT, RESPONSE, SEED, MIN_P = 16, 16, 128, 0, 0.02


def run(*, reps: int, warmup: int, model_dir: str, model_name: str) -> dict[str, Any]:
    import torch

    from verl_klcov_global.engine import kept_pass, reuse
    from verl_klcov_global.engine.proxy import CHUNK_ROWS, PROXY_REQUEST_KEY
    from verl_klcov_global.lab.experiment import EngineSpec, frozen_minibatch, log_prob_pass

    spec = EngineSpec(model_dir, infer_micro_batch_size_per_gpu=BATCH)
    engine = spec.build()
    from transformers import AutoConfig

    vocab = int(AutoConfig.from_pretrained(model_dir).vocab_size)
    batch = frozen_minibatch(spec, SEED, batch_size=BATCH, prompt_len=PROMPT, response_len=RESPONSE, vocab_size=vocab)
    tokens = int(batch["input_ids"].offsets().diff().sum())
    response_tokens = int(batch["response_mask"].values().sum()) if batch["response_mask"].is_nested else int(
        batch["response_mask"].sum())
    samples: dict[str, list[float]] = {name: [] for name in OPERATIONS}
    kept = []

    def once(name: str, record: bool) -> None:
        started = time.perf_counter()
        if name == "pass":
            log_prob_pass(engine, batch)
        else:
            log_prob_pass(engine, batch, kept_pass.log_prob_pass(engine, keep_entropy=False, keep_proxy=True),
                          extra={PROXY_REQUEST_KEY: MIN_P})
        seconds = time.perf_counter() - started
        if record:
            samples[name].append(seconds)
            if name != "pass":
                kept.append(reuse.kept_nbytes(engine))
            reuse.forget(engine)

    with torch.no_grad():
        for _ in range(warmup):
            for name in OPERATIONS:
                once(name, record=False)
        for rep in range(reps):
            for name in (OPERATIONS if rep % 2 == 0 else OPERATIONS[::-1]):
                once(name, record=True)
            print(f"  round {rep + 1}/{reps} " + " ".join(f"{n}={samples[n][-1]:.3f}s" for n in OPERATIONS),
                  flush=True)
    med = {name: median(values) for name, values in samples.items()}
    paired = median(p / b for p, b in zip(samples["pass + proxy"], samples["pass"]))
    added = median(p - b for p, b in zip(samples["pass + proxy"], samples["pass"]))
    return {"config": {"model": model_name, "vocab": vocab, "minibatch": f"{BATCH} x ({PROMPT} + {RESPONSE})",
                       "tokens": tokens, "response_tokens": response_tokens, "min_p": MIN_P, "reps": reps,
                       "warmup": warmup, "chunk_rows": CHUNK_ROWS},
            "samples_seconds": samples, "median_seconds": med, "median_paired_ratio": paired,
            "added_microseconds_per_token": 1e6 * added / tokens,
            "kept_bytes": median(kept), "kept_bytes_per_response_token": median(kept) / response_tokens,
            "chunk_bytes": None if vocab is None else 9 * CHUNK_ROWS * vocab}


def report(result: dict[str, Any]) -> str:
    config, med = result["config"], result["median_seconds"]
    rows = [[name, len(result["samples_seconds"][name]), med[name], med[name] / med["pass"]] for name in OPERATIONS]
    return (f"{config['model']} (vocabulary {config['vocab']}), {config['minibatch']}: {config['tokens']} tokens\n"
            + table(["operation", "rounds", "seconds (median)", "/pass"], rows)
            + f"\npaired ratio (pass + proxy) / pass: {result['median_paired_ratio']:.3f}; added "
              f"{result['added_microseconds_per_token']:.2f} us per token; kept {result['kept_bytes']:,.0f} bytes "
              f"({result['kept_bytes_per_response_token']:.1f} per response token: log-prob + proxy + digests); "
              f"chunk work space about {(result['chunk_bytes'] or 0) / 2**20:.1f} MiB")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_lp_reg", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="smollm2 or a local HF folder (default: the embedded tiny Qwen2)")
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
    with tempfile.TemporaryDirectory(prefix="lp_reg_bench_") as tmp:
        if args.model:
            from verl_klcov_global.lab.real_model import prepare

            model_dir = prepare() if args.model == "smollm2" and not os.path.isdir(args.model) else args.model
            name = "SmolLM2-135M-Instruct (fp32, padded)" if args.model == "smollm2" else args.model
        else:
            model_dir, name = _tiny.build_tiny_model(os.path.join(tmp, "tiny")), "tiny Qwen2 (fp32, padded)"
        result = run(reps=args.reps, warmup=args.warmup, model_dir=model_dir, model_name=name)
    result["config"]["threads"] = torch.get_num_threads()
    print(report(result))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
