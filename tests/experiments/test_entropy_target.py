"""The premise of ``experiments.entropy_target``, shortened: the controller on the learning miniature.

``kl_cov_global`` with a target (3.8 nats) below the miniature's start (ln 64 = 4.16), at micro-batch sizes 1
and 4 for :data:`STEPS` trainer steps (the study's settings, :data:`experiments.entropy_target.CONTROL`, with
the horizon 0; a
target near the start keeps the ratio in use above the quota floor of the test's 128-token minibatches, where
the integral would rightly stop):

* the controlled ratio moves the way the KL-Cov paper says it must (down: the entropy is above the target and
  a larger ``kl_cov_ratio`` keeps entropy higher), written out here, not read from the mode table;
* both sizes agree: identical rollouts and selection counts, the ratio's trajectories equal to far below its
  movement.

Premise of the agreement, on every CPU: each run's log-prob pass (verl's ``log_prob_micro_batch_size_per_gpu``;
the infer-layout prepass, which measures the controller's entropy, too) runs at its training micro-batch size.
At the first optimizer step of a trainer step pi = pi_old, and KL-Cov's penalty gradient is
coef * sign(log pi - log pi_old) * grad log pi: with the pass in the training micro-batch's company the
difference is exactly 0; with a pass at 4 and training at 1 it is float noise on CPUs whose rows' last bits
follow their micro-batch company (AMD EPYC; tests/support/company_noise.py), a full-size gradient, and the
rollouts part from step 3. The two sizes' measured entropies then differ by float noise only (1.5e-8 at most
in the mean here, emulator on), which the law (kp 10) turns into ln-ratio differences of a few 1e-8 (3.5e-8
measured): the bound 1e-6 x the movement (~1e-6) is 27x that.

Negative control that the test must catch: the same run with the mode's ``entropy_sign`` flipped in the table
(a controller that pushes the wrong way). Its ratio moves up, and :func:`ratio_moves_down` says so.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace

import pytest

from experiments import entropy_target
from experiments.learning import BASE as FIGURE_BASE
from experiments.learning_task import build_learning_model
from verl_klcov_global import modes

pytestmark = pytest.mark.slow  # verl's trainer loop on CPU

STEPS = 4
TARGET = 3.8
#: The study's gains and bounds, without its prediction: the premise is the sign of the law's response to the
#: measured entropy (the prediction's sign is tested on plain numbers in tests/test_entropy_control.py).
BASE = replace(FIGURE_BASE, steps=STEPS, prompts_per_step=4, mini_batch_prompts=2,
               **{**entropy_target.CONTROL, "entropy_control_horizon": 0.0})


def ratio_moves_down(run: dict) -> bool:
    """The premise: every step's ratio in use below the one before, and the start above the end."""
    ratios = run["ratio_in_use"]
    return all(b < a for a, b in zip(ratios, ratios[1:])) and ratios[-1] < BASE.kl_cov_ratio


def _run(tmp_path, model: str, micro_batch_size: int, steps: int = STEPS) -> dict:
    run = replace(BASE, loss_mode="kl_cov_global", entropy_target=TARGET, micro_batch_size=micro_batch_size,
                  log_prob_micro_batch_size=micro_batch_size, steps=steps)
    return entropy_target._run_one(run, model_path=model, work_root=str(tmp_path))


def test_the_ratio_moves_down_at_both_sizes_identically_and_a_flipped_sign_is_caught(tmp_path):
    model = build_learning_model(str(tmp_path / "model"))
    one, four = _run(tmp_path / "one", model, 1), _run(tmp_path / "four", model, 4)
    for run in (one, four):
        assert all(h > TARGET for h in run["entropy_measured"])  # the error keeps its sign: one direction expected
        assert ratio_moves_down(run), run["ratio_in_use"]
    assert one["rollout_digest"] == four["rollout_digest"] and one["selected"] == four["selected"]
    movement = math.log(BASE.kl_cov_ratio) - math.log(one["ratio_in_use"][-1])
    gap = max(abs(math.log(a) - math.log(b)) for a, b in zip(one["ratio_in_use"], four["ratio_in_use"]))
    assert movement > 0.1 and gap <= 1e-6 * movement, (gap, movement)

    original = modes.MODES["kl_cov_global"]
    modes.register_mode(dataclasses.replace(original, entropy_sign=-original.entropy_sign))
    try:
        flipped = _run(tmp_path / "flipped", model, 4, steps=2)  # two steps show the direction
    finally:
        modes.register_mode(original)
    assert not ratio_moves_down(flipped), flipped["ratio_in_use"]  # the negative control is caught
    assert flipped["ratio_in_use"][-1] > BASE.kl_cov_ratio
    print(f"\nkl_cov_global, target {TARGET}: kl_cov_ratio in use {one['ratio_in_use']} (micro-batch 1 and 4 within "
          f"{gap:.1e} in ln); with the sign flipped {flipped['ratio_in_use']}")
