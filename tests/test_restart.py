"""A restart loses nothing: a ``kl_cov_global`` run with the entropy controller on (or a ``high_entropy_global``
run) killed during step 3 and resumed from verl's checkpoint equals one uninterrupted run, bit for bit (CPU, fp32).

The runs (``trainer_support/restart.py``) are verl 0.9.1's ``RayPPOTrainer.fit`` (legacy trainer)
with verl's real worker and FSDP2 engine in a child process each, GRPO, 4 prompts x 4 responses
per step, 2 minibatches x 2 PPO epochs (4 optimizer steps per trainer step), AdamW (lr 1e-3: its
moments must come back from the checkpoint too), a checkpoint after every step
(``trainer.save_freq=1``):

* uninterrupted: 4 steps;
* killed: the same, in its own process group, which gets SIGKILL once step 2's checkpoint is
  complete (verl writes ``latest_checkpointed_iteration.txt`` last) and the run is inside step 3
  (it has made step 3's first optimizer step and waits there: known by construction, not by time);
* resumed: the same command with ``trainer.resume_mode=auto`` in the killed run's directory: verl
  loads step 2's checkpoint (model, optimizer, extra state, dataloader) and runs steps 3 and 4.

Required: steps 1-2 of the killed run and 3-4 of the resumed run log exactly the metrics of the
uninterrupted run's steps 1-4 (every metric but timings, throughput and memory: selection counts,
pg_loss, grad_norm, entropy included), and the resumed run's parameters after the load and at
the end equal the uninterrupted run's at step 2 and step 4. In every step, the resumed run's first
included, the first optimizer step reuses verl's own log-prob pass (``prepass_reused`` 0.25).

The controlled run's ratio moves every step (the controller's state, carried in the optimizer's state dict,
must come back from the checkpoint: a controller started afresh at step 3 would start again from the user's
``kl_cov_ratio`` and log another ``kl_cov_ratio_in_use``): its floor lies above the entropy, so it strengthens
KL-Cov from the user's 0.01 at every optimizer step. It runs with a prediction horizon (4 optimizer steps over a window of 4), so the
state's history of measured entropies must come back too: the prediction acts from step 2 on. Each uninterrupted run also logs every step through verl's real console and
tensorboard loggers (``trainer_support/restart.py --tracking``): every figure of the mode (the controller's
included) is printed on the console and read back from the tensorboard event file, with the logged values.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from .trainer_support import restart
from .trainer_support.env import REPO_ROOT, subprocess_env

STEPS = 4
OPTIMIZER_STEPS_PER_STEP = 4  # RunConfig defaults: 4 prompts / 2 per minibatch x 2 epochs
PREFIX = {"kl_cov_global": "actor/kl_cov/", "high_entropy_global": "actor/high_entropy/"}
#: kl_cov_global's run has the entropy floor on (the plugin's gains) from kl_cov_ratio 0.01: the tiny model starts
#: at about 6.22 nats, near ln(vocab size) = 6.238; a floor just below ln(vocab size) lies above it throughout.
ENTROPY_TARGET = {"kl_cov_global": 6.235, "high_entropy_global": None}
USER_RATIO = 0.01
#: ... with a prediction horizon over a window of 4 optimizer steps: the trend's history (the last 4 measured
#: entropies, in the optimizer's state dict) must come back from step 2's checkpoint too.
HORIZON = dict(entropy_control_horizon=4.0, entropy_control_window=4)
#: The selection (and controller) figures every step must log, besides verl's own (per mode)
FIGURES = {"kl_cov_global": ("selected", "quota", "entropy_target", "entropy_measured", "entropy_predicted",
                             "kl_cov_ratio_in_use"),
           "high_entropy_global": ("selected", "quota", "valid_tokens", "nonfinite_tokens", "entropy_threshold",
                                   "entropy_mean", "selected_entropy_mean", "selected_entropy_share")}
VERLS = ("actor/pg_loss", "actor/grad_norm", "actor/entropy")


def _deterministic(key: str) -> bool:
    return not (key.startswith(("timing_s/", "timing_per_token_ms/", "perf/")) or key.endswith(("_seconds", "_share"))
                or "memory" in key)


def _compare(a: dict, b: dict) -> list[str]:
    keys = sorted(k for k in set(a) | set(b) if _deterministic(k))
    return [f"{k}: {a.get(k)!r} != {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


@pytest.mark.slow
@pytest.mark.parametrize("loss_mode", ["kl_cov_global", "high_entropy_global"])
def test_a_run_killed_during_step_3_and_resumed_equals_an_uninterrupted_run(tiny_model_path, tmp_path, loss_mode):
    started = time.monotonic()
    env = subprocess_env()
    prefix = PREFIX[loss_mode]
    required = tuple(prefix + name for name in FIGURES[loss_mode]) + VERLS
    common = dict(model=tiny_model_path, steps=STEPS, loss_mode=loss_mode, cwd=REPO_ROOT, env=env,
                  entropy_target=ENTROPY_TARGET[loss_mode],
                  **(dict(HORIZON, kl_cov_ratio=USER_RATIO) if ENTROPY_TARGET[loss_mode] else {}))
    # the uninterrupted run and the run to be killed side by side (one thread each)
    tracking = str(tmp_path / "tensorboard")
    whole = restart.start(work_dir=str(tmp_path / "whole"), out=str(tmp_path / "whole-out"), resume_mode="disable",
                          tracking=tracking, **common)
    killed_dir, killed_out = str(tmp_path / "killed"), str(tmp_path / "killed-out")
    killed = restart.start(work_dir=killed_dir, out=killed_out, resume_mode="disable",
                           block_after_optimizer_steps=2 * OPTIMIZER_STEPS_PER_STEP + 1, **common)
    try:
        restart.wait_until(lambda: os.path.exists(os.path.join(killed_out, restart.BLOCKED_FILE)), killed,
                           "step 3's first optimizer step")
        assert restart.checkpointed_step(killed_dir) == 2  # step 2's checkpoint is complete, step 3's not begun
        assert not os.path.exists(os.path.join(killed_dir, restart.CHECKPOINT_DIR, "global_step_3"))
        assert restart.kill_group(killed) == -9
    finally:
        if killed.poll() is None:
            restart.kill_group(killed)
    killed_metrics = restart.read_metrics(killed_out)
    assert [m["step"] for m in killed_metrics] == [1, 2]

    resumed_out = str(tmp_path / "resumed-out")
    resumed = restart.start(work_dir=killed_dir, out=resumed_out, resume_mode="auto", **common)
    assert resumed.wait(timeout=600) == 0, open(os.path.join(resumed_out, "log.txt")).read()[-4000:]
    assert whole.wait(timeout=600) == 0, open(str(tmp_path / "whole-out" / "log.txt")).read()[-4000:]
    seconds = time.monotonic() - started

    reference = torch.load(str(tmp_path / "whole-out" / restart.RESULT_FILE))
    after = torch.load(os.path.join(resumed_out, restart.RESULT_FILE))
    assert [m["step"] for m in after["metrics"]] == [3, 4]
    stitched = killed_metrics + after["metrics"]
    differences = {m["step"]: _compare(m, r) for m, r in zip(stitched, reference["metrics"])}
    assert not any(differences.values()), differences
    for m in stitched:
        assert all(k in m for k in required), sorted(m)
        assert m[prefix + "selected"] >= 1  # the selection acted in every step: not a vacuous comparison
        # the first of the step's 4 optimizer steps took verl's log-prob pass's statistics (engine/reuse.py),
        # in the resumed run's first step too: verl loads the checkpoint before that step's log-prob pass
        assert m[prefix + "prepass_reused"] == 0.25, (m["step"], m[prefix + "prepass_reused"])
    if ENTROPY_TARGET[loss_mode] is not None:  # the controller moved the ratio every step: its state mattered
        in_use = [m[prefix + "kl_cov_ratio_in_use"] for m in stitched]
        assert all(USER_RATIO < a < b for a, b in zip(in_use, in_use[1:])), in_use
        assert all(m[prefix + "entropy_target"] == ENTROPY_TARGET[loss_mode] > m[prefix + "entropy_measured"]
                   for m in stitched)
        # the prediction: H itself over step 1's 4 optimizer steps (fewer than the window measured), a trend
        # from step 2 on, the resumed step 3 included (its history came back from the checkpoint)
        predicted = [m[prefix + "entropy_predicted"] - m[prefix + "entropy_measured"] for m in stitched]
        assert predicted[0] == 0 and all(d != 0 for d in predicted[1:]), predicted
    compared = sum(1 for k in stitched[0] if _deterministic(k))
    assert after["rollout_digest"] == reference["rollout_digest"][2:]
    assert torch.equal(after["params"][0], reference["params"][2])   # the checkpoint loaded exactly
    assert torch.equal(after["params"][-1], reference["params"][-1])  # and training went on exactly
    moved = (reference["params"][-1] - reference["params"][2]).abs().max().item()
    assert moved > 0
    print(f"\nrestart: {compared} metrics per step equal in steps 1-4 (killed 1-2 + resumed 3-4 vs uninterrupted); "
          f"parameters equal after the load (step 2) and at step 4 (max |change| over steps 3-4: {moved:.3g}); "
          + "; ".join(f"step {m['step']}: selected {m[prefix + 'selected']:g}, pg_loss {m['actor/pg_loss']:.6g}, "
                      f"grad_norm {m['actor/grad_norm']:.6g}, entropy {m['actor/entropy']:.6g}"
                      + (f", kl_cov_ratio in use {m[prefix + 'kl_cov_ratio_in_use']:.6g}"
                         if prefix + "kl_cov_ratio_in_use" in m else "") for m in stitched)
          + f"; {seconds:.0f} s")
    if tracking:
        _assert_logged_by_verls_console_and_tensorboard(str(tmp_path / "whole-out" / "log.txt"), tracking,
                                                        reference["metrics"], required)


def _assert_logged_by_verls_console_and_tensorboard(log_file: str, tensorboard_dir: str, metrics: list[dict],
                                                    required: tuple[str, ...]) -> None:
    """Every required metric of every step is on verl's console lines and in the tensorboard event file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    console = [line for line in open(log_file).read().splitlines() if line.startswith("step:")]
    assert len(console) == len(metrics), console
    for line, m in zip(console, metrics):
        assert line.startswith(f"step:{m['step']} "), line
        for key in required:
            assert f" - {key}:" in line, (key, line)
    events = EventAccumulator(tensorboard_dir, size_guidance={"scalars": 0})
    events.Reload()
    for key in required:
        logged = [(event.step, event.value) for event in events.Scalars(key)]
        # tensorboard stores float32
        assert logged == [(m["step"], pytest.approx(m[key], rel=1e-6)) for m in metrics], (key, logged)
