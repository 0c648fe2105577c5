"""The measurement of ``experiments.old_policy``, shortened: ``high_entropy_global`` with ``prepass_layout=old`` on
the learning miniature for :data:`STEPS` trainer steps of 4 optimizer steps (2 minibatches x 2 epochs).

* at the first optimizer step of every trainer step pi_old is the current policy, so the two masks must be the
  same (Jaccard exactly 1); every later step is measured (4 records per trainer step);
* the pi_old masks do not depend on the micro-batch size (1 and 4: the same rollouts, the same selected counts
  at every optimizer step), and neither do the runs' entropy curves, bit for bit here.

Negative control that the test must catch: the measurement's current-policy selection made with another knob
(``entropy_top_ratio`` 0.1 for the 0.2 the step used). Its first-step Jaccard falls below 1.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from experiments import old_policy
from experiments.learning import BASE as FIGURE_BASE
from experiments.learning_task import build_learning_model

pytestmark = pytest.mark.slow  # verl's trainer loop on CPU

STEPS = 3
BASE = replace(FIGURE_BASE, steps=STEPS, prompts_per_step=4, mini_batch_prompts=2, loss_mode="high_entropy_global",
               prepass_layout="old")


def _run(tmp_path, model: str, micro_batch_size: int) -> dict:
    return old_policy._run_one(replace(BASE, micro_batch_size=micro_batch_size), model_path=model,
                               work_root=str(tmp_path))


def test_agreement_is_exact_where_pi_old_is_the_policy_and_a_wrong_comparison_is_caught(tmp_path, monkeypatch):
    model = build_learning_model(str(tmp_path / "model"))
    one, four = _run(tmp_path / "one", model, 1), _run(tmp_path / "four", model, 4)
    for run in (one, four):
        assert len(run["agreement"]) == STEPS and all(len(step) == 4 for step in run["agreement"])
        assert [step[0]["jaccard"] for step in run["agreement"]] == [1.0] * STEPS
        assert all(0.0 <= r["jaccard"] <= 1.0 and r["selected_old"] > 0 for step in run["agreement"] for r in step)
        assert run["prepass_seconds"] == [0.0] * STEPS  # no prepass: the measurement's forward is not the run's
    assert one["rollout_digest"] == four["rollout_digest"] and one["entropy"] == four["entropy"]
    assert [[r["selected_old"] for r in s] for s in one["agreement"]] == \
        [[r["selected_old"] for r in s] for s in four["agreement"]]

    real_replace = old_policy.replace

    def other_knob(settings, **changes):  # the negative control: the current policy's selection with ratio 0.1
        return real_replace(settings, **changes, entropy_top_ratio=0.1)

    monkeypatch.setattr(old_policy, "replace", other_knob)
    wrong = _run(tmp_path / "wrong", model, 4)
    assert all(step[0]["jaccard"] < 1.0 for step in wrong["agreement"])  # caught
    later = [r["jaccard"] for step in four["agreement"] for r in step[1:]]
    print(f"\nhigh_entropy_global, old: Jaccard at optimizer steps 1-3 {min(later):.3f}..{max(later):.3f}; "
          f"with the wrong knob, step 0: {[round(step[0]['jaccard'], 3) for step in wrong['agreement']]}")
