"""What the prepass moves with ``optimizer_offload=True``, per trainer step, and what the actor update costs (CPU).

verl's real FSDP engine (FSDP1, world size 1, fp32, sdpa, AdamW with ``optimizer_offload=True``), the tiny local
Qwen2, a minibatch of 64 sequences x (16 prompt + 128 response) tokens, dynamic batch sizes with a training budget
of 2,304 tokens (16 sequences). One *trainer step* is what verl's ``update_actor`` makes the engine do: one
train-mode context (verl loads the offloaded states once) around ``STEPS`` ``train_batch`` calls, one per
optimizer step (the 80/20 recipe makes 16). Variants:

* ``vanilla``: no prepass;
* ``kl_cov_global``, inference budget 4,608 tokens (twice the training one): the prepass may hold more than a
  training micro-batch, so it moves the states to the host and back around its forward;
* ``kl_cov_global``, inference budget = training budget (the authors' recipes): nothing moves.

Moves and bytes are counted at verl's ``engine.to(..., optimizer=True)``: verl's own train-mode context makes two
per trainer step (in and out), the prepass two per optimizer step where it moves; bytes are this rank's AdamW
state tensors at that moment. On a CPU the host is the device, so a move copies nothing: the
times show the engine's work, and the bytes are what a GPU would copy. Figures: medians over rounds (variants in
rotated order), each variant's trainer step over ``vanilla``'s.

Run: ``.venv/bin/python -m benchmarks.bench_offload [--reps N] [--steps N] [--json PATH]``. Nothing asserts a time.
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time

from ._common import load_average, machine, median, quiet, table

BATCH, PROMPT, RESPONSE, SEED = 64, 16, 128, 0
TRAIN_BUDGET = 16 * (PROMPT + RESPONSE)
VARIANTS = {
    "vanilla": None,
    "kl_cov_global, infer budget 2x training": 2 * TRAIN_BUDGET,
    "kl_cov_global, infer budget = training": TRAIN_BUDGET,
}


def _engine(model_path: str, infer_budget: int):
    from verl_klcov_global.lab import cpu as _cpu

    return _cpu.build_fsdp_engine(model_path, optimizer="AdamW", lr=1e-4, use_dynamic_bsz=True,
                                  max_token_len_per_gpu=TRAIN_BUDGET, infer_max_token_len_per_gpu=infer_budget,
                                  optimizer_offload=True)


def _state_bytes(engine) -> int:
    return sum(v.numel() * v.element_size() for state in engine.optimizer.state.values()
               for v in state.values() if hasattr(v, "numel"))


def trainer_step(engine, batch, actor_config, steps: int) -> dict:
    """One ``update_actor``'s engine work: ``steps`` optimizer steps in one train-mode context; moves, bytes, s."""
    from verl.workers.utils.losses import ppo_loss

    moves, moved_bytes = 0, 0
    real_to = engine.to

    def counting_to(device, model=True, optimizer=True, grad=True):
        nonlocal moves, moved_bytes
        if optimizer:  # verl's train-mode context (in and out) and the prepass's
            moves += 1
            moved_bytes += _state_bytes(engine)
        return real_to(device=device, model=model, optimizer=optimizer, grad=grad)

    engine.to = counting_to
    loss_function = functools.partial(ppo_loss, config=actor_config)
    start = time.perf_counter()
    with engine.train_mode():
        for _ in range(steps):
            engine.train_batch(batch.copy(), loss_function=loss_function)
    seconds = time.perf_counter() - start
    engine.to = real_to
    return dict(seconds=seconds, moves=moves, moved_bytes=moved_bytes)


def run(reps: int, steps: int) -> dict:
    quiet()
    from verl_klcov_global.lab import tiny as _tiny
    from verl_klcov_global.lab.experiment import EngineSpec, frozen_minibatch

    model_path = _tiny.build_tiny_model(tempfile.mkdtemp(prefix="bench-offload-") + "/model")
    batch = frozen_minibatch(EngineSpec(model_path), SEED, batch_size=BATCH, prompt_len=PROMPT,
                             response_len=RESPONSE)
    batch = _tiny.set_micro_batching(batch, use_dynamic_bsz=True, max_token_len_per_gpu=TRAIN_BUDGET)
    engines, configs = {}, {}
    for name, budget in VARIANTS.items():
        engines[name] = _engine(model_path, budget or TRAIN_BUDGET)
        configs[name] = _tiny.make_actor_config(loss_mode="vanilla") if budget is None else _tiny.make_actor_config(
            loss_mode="kl_cov_global", kl_cov_ratio=0.002)
        trainer_step(engines[name], batch, configs[name], 1)  # warm-up; the AdamW states exist from here on
    rounds = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            rounds[name].append(trainer_step(engines[name], batch, configs[name], steps))
    base = median(r["seconds"] for r in rounds["vanilla"])
    results = {name: dict(seconds=median(r["seconds"] for r in runs), moves=runs[-1]["moves"],
                          moved_bytes=runs[-1]["moved_bytes"], over_vanilla=median(r["seconds"] for r in runs) / base,
                          state_bytes=_state_bytes(engines[name]))
               for name, runs in rounds.items()}
    return dict(machine=machine(), load_after=load_average(), reps=reps, optimizer_steps=steps, results=results)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps per trainer step (the 80/20 recipe's)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    report = run(args.reps, args.steps)
    rows = [(name, f"{r['moves']}", f"{r['moved_bytes'] / 1e6:.2f} MB", f"{r['seconds']:.2f} s",
             f"{r['over_vanilla']:.3f}x") for name, r in report["results"].items()]
    print(table(("variant", "optimizer-state moves / trainer step", "bytes moved", "trainer step", "over vanilla"), rows))
    print(f"AdamW states of this rank: {report['results']['vanilla']['state_bytes'] / 1e6:.2f} MB; "
          f"{report['optimizer_steps']} optimizer steps per trainer step, {report['reps']} rounds; {report['machine']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
