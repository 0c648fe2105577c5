"""Kill a trainer run hard during a step and resume it from verl's checkpoint (``tests/test_restart.py``).

Each run is a child process (``python -m tests.trainer_support.restart ...``) of the in-process
trainer of :mod:`experiments.local_trainer`: verl 0.9.1's ``RayPPOTrainer.fit`` with
verl's real ``ActorRolloutRefWorker`` / FSDP2 engine on CPU, fp32, world size 1; AdamW by default
(so the optimizer's state has to come back too); ``trainer.save_freq=1`` (verl's
``_save_checkpoint`` after every step: the actor's model, optimizer and extra state through its
FSDP checkpoint manager, the dataloader's state, ``latest_checkpointed_iteration.txt`` last) and
the given ``trainer.resume_mode``.

A child writes, as they happen:

* ``metrics.jsonl``: every step's logged metrics, one line per step, flushed and fsynced as verl
  logs them (a SIGKILL loses nothing already logged);
* ``blocked``: with ``--block-after-optimizer-steps N``, after its N-th optimizer step (a global
  ``torch.optim`` step hook) the child writes this marker and waits forever inside that step,
  so whoever kills it knows by construction which step it is in;
* ``result.pt`` when the run ends: the per-weight-version parameters and the metrics;
* with ``--tracking DIR``: every step's metrics also go through a real ``verl.utils.tracking.Tracking``
  with the ``console`` and ``tensorboard`` backends (the logger ``fit`` would use with
  ``trainer.logger=[console,tensorboard]``; ``TENSORBOARD_DIR=DIR``): the console lines land in
  ``log.txt``, the event file in ``DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import Optional, Sequence

METRICS_FILE, BLOCKED_FILE, RESULT_FILE = "metrics.jsonl", "blocked", "result.pt"
CHECKPOINT_DIR = "checkpoints"  # local_trainer.trainer_overrides: <work_dir>/checkpoints
LATEST = "latest_checkpointed_iteration.txt"


def overrides(resume_mode: str) -> list[str]:
    return ["trainer.save_freq=1", f"trainer.resume_mode={resume_mode}"]


def _child(args) -> None:
    import torch

    from verl_klcov_global.lab import cpu as _cpu
    from experiments import local_trainer

    os.makedirs(args.out, exist_ok=True)
    metrics_path = os.path.join(args.out, METRICS_FILE)
    log = local_trainer.MetricsRecorder.log

    def log_and_persist(self, data, step):
        log(self, data, step)
        with open(metrics_path, "a") as f:
            f.write(json.dumps(local_trainer.MetricsRecorder.records[-1], default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())

    local_trainer.MetricsRecorder.log = log_and_persist
    tracking = _real_tracking(args.tracking) if args.tracking else None
    if tracking is not None:
        persist = local_trainer.MetricsRecorder.log

        def log_persist_and_track(self, data, step):
            persist(self, data, step)
            tracking.log(data=data, step=step)

        local_trainer.MetricsRecorder.log = log_persist_and_track

    if args.block_after_optimizer_steps:
        count = [0]

        def block(optimizer, *_):
            count[0] += 1
            if count[0] == args.block_after_optimizer_steps:
                with open(os.path.join(args.out, BLOCKED_FILE), "w") as f:
                    f.write(str(count[0]))
                while True:  # inside the step: the parent kills the whole process group now
                    time.sleep(3600)

        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(block)

    run = local_trainer.RunConfig(loss_mode=args.loss_mode, steps=args.steps, optimizer=args.optimizer, lr=args.lr,
                                  entropy_target=args.entropy_target,
                                  entropy_control_horizon=args.entropy_control_horizon,
                                  entropy_control_window=args.entropy_control_window,
                                  **({} if args.kl_cov_ratio is None else {"kl_cov_ratio": args.kl_cov_ratio}))
    _cpu.install_cpu_platform()
    _cpu.init_process_group_cpu(0, 1)  # a free port
    torch.set_num_threads(1)
    result = local_trainer.run_trainer(run, model_path=args.model, work_dir=args.work_dir,
                                       extra_overrides=overrides(args.resume_mode))
    if tracking is not None:
        tracking.finish()  # closes the event file
    torch.save({"params": result.params, "metrics": result.metrics, "rollout_digest": result.rollout_digest},
               os.path.join(args.out, RESULT_FILE))


def _real_tracking(directory: str):
    """verl's own Tracking with the console and tensorboard backends (made before local_trainer swaps the class)."""
    from verl.utils.tracking import Tracking

    os.environ["TENSORBOARD_DIR"] = directory
    return Tracking(project_name="restart", experiment_name="whole", default_backend=["console", "tensorboard"])


def start(*, model: str, work_dir: str, out: str, steps: int, loss_mode: str, resume_mode: str,
          optimizer: str = "AdamW", lr: float = 1e-3, block_after_optimizer_steps: int = 0, cwd: str,
          env: Optional[dict] = None, tracking: str = "", entropy_target: Optional[float] = None,
          entropy_control_horizon: float = 0.0, entropy_control_window: int = 8,
          kl_cov_ratio: Optional[float] = None) -> subprocess.Popen:
    """Start one child run in its own process group (session); stdout+stderr go to ``out/log.txt``.

    ``tracking``: a directory for the tensorboard event file of verl's real console+tensorboard logger;
    ``entropy_target``: the mode's entropy controller on, with this target (and the prediction's horizon and
    window)."""
    os.makedirs(out, exist_ok=True)
    argv = [sys.executable, "-m", "tests.trainer_support.restart", "--model", model, "--work-dir", work_dir,
            "--out", out, "--steps", str(steps), "--loss-mode", loss_mode, "--resume-mode", resume_mode,
            "--optimizer", optimizer, "--lr", repr(lr),
            "--block-after-optimizer-steps", str(block_after_optimizer_steps), "--tracking", tracking]
    if entropy_target is not None:
        argv += ["--entropy-target", repr(entropy_target), "--entropy-control-horizon", repr(entropy_control_horizon),
                 "--entropy-control-window", str(entropy_control_window)]
    if kl_cov_ratio is not None:
        argv += ["--kl-cov-ratio", repr(kl_cov_ratio)]
    log = open(os.path.join(out, "log.txt"), "w")
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def checkpointed_step(work_dir: str) -> Optional[int]:
    """The step of verl's latest complete checkpoint: ``_save_checkpoint`` writes the tracker file last."""
    try:
        with open(os.path.join(work_dir, CHECKPOINT_DIR, LATEST)) as f:
            return int(f.read().strip())
    except (FileNotFoundError, ValueError):
        return None


def wait_until(condition, proc: subprocess.Popen, what: str, timeout: float = 600.0) -> None:
    """Poll ``condition()`` until true; fail if ``proc`` exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise RuntimeError(f"the run exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout} s")
        time.sleep(0.05)


def kill_group(proc: subprocess.Popen) -> int:
    """SIGKILL the child's whole process group; its exit status (-9)."""
    os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait(timeout=60)


def read_metrics(out: str) -> list[dict]:
    path = os.path.join(out, METRICS_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--loss-mode", required=True)
    parser.add_argument("--resume-mode", default="disable")
    parser.add_argument("--optimizer", default="AdamW")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--block-after-optimizer-steps", type=int, default=0)
    parser.add_argument("--tracking", default="")
    parser.add_argument("--entropy-target", type=float, default=None)
    parser.add_argument("--entropy-control-horizon", type=float, default=0.0)
    parser.add_argument("--entropy-control-window", type=int, default=8)
    parser.add_argument("--kl-cov-ratio", type=float, default=None, help="the RunConfig's default when not given")
    _child(parser.parse_args(argv))


if __name__ == "__main__":
    main()
