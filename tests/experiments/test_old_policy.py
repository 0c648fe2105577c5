"""The measurement of ``experiments.old_policy``, shortened: ``high_entropy_global`` with ``prepass_layout=old`` on
the learning miniature for :data:`STEPS` trainer steps of 4 optimizer steps (2 minibatches x 2 epochs).

* at the first optimizer step of every trainer step pi_old is the current policy, so the two masks must be the
  same (Jaccard exactly 1); every later step is measured (4 records per trainer step);
* the pi_old masks do not depend on the micro-batch size (1 and 4): the same selected counts at every optimizer
  step; the same masks bit for bit in the first trainer step, where pi_old's statistics are the same computation at
  both sizes; a later mask differs only at a near-tie of those statistics, which the test measures; and while the
  masks agree, so do the runs (rollouts identical, entropy curves within float noise).

Negative control that the test must catch: the measurement's current-policy selection made with another knob
(``entropy_top_ratio`` 0.1 for the 0.2 the step used). Its first-step Jaccard falls below 1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import numpy as np
import pytest
import torch

from experiments import old_policy
from experiments.learning import BASE as FIGURE_BASE
from experiments.learning import NOISE_FACTOR, float32_spacing
from experiments.learning_task import build_learning_model
from verl_klcov_global import modes

pytestmark = pytest.mark.slow  # verl's trainer loop on CPU

STEPS = 3
OPTIMIZER_STEPS = 4  # per trainer step: 2 minibatches x 2 epochs
BASE = replace(FIGURE_BASE, steps=STEPS, prompts_per_step=4, mini_batch_prompts=2, loss_mode="high_entropy_global",
               prepass_layout="old")


class PiOldSelections:
    """Records every selection a run makes from pi_old's statistics (``prepass_layout=old``; the measurement's own
    current-policy selection is left out): its mask, its quota, and the entropy it was made from (NaN off the mask's
    valid tokens), in the mask's layout."""

    def __init__(self):
        self.records: list[dict] = []

    def __enter__(self):
        self._original = original = modes.MODES["high_entropy_global"]

        def select(fields, settings, group):
            selection = original.select(fields, settings, group)
            if settings.prepass_layout == "old":
                mask = selection.mask.detach().cpu().clone()
                valid = fields.response_mask.detach().cpu().bool()[:, :mask.shape[1]]
                entropy = fields.entropy.detach().cpu().double()[:, :mask.shape[1]]
                self.records.append({"mask": mask, "quota": selection.quota,
                                     "entropy": torch.where(valid, entropy, torch.nan)})
            return selection

        modes.register_mode(dataclasses.replace(original, select=select))
        return self

    def __exit__(self, *exc):
        modes.register_mode(self._original)
        return False


def _run(tmp_path, model: str, micro_batch_size: int, trace: PiOldSelections = None, steps: int = STEPS) -> dict:
    run = replace(BASE, micro_batch_size=micro_batch_size, steps=steps)
    if trace is None:
        return old_policy._run_one(run, model_path=model, work_root=str(tmp_path))
    with trace:
        return old_policy._run_one(run, model_path=model, work_root=str(tmp_path))


def _distance_from_quota_boundary(record: dict, tokens: torch.Tensor) -> float:
    """The largest |entropy - the k-th largest valid entropy| over ``tokens`` (the boundary of the quota k)."""
    valid = record["entropy"][~record["entropy"].isnan()]
    boundary = torch.sort(valid, descending=True).values[record["quota"] - 1]
    return float((record["entropy"][tokens] - boundary).abs().max())


def test_agreement_is_exact_where_pi_old_is_the_policy_and_a_wrong_comparison_is_caught(tmp_path, monkeypatch):
    model = build_learning_model(str(tmp_path / "model"))
    traces = {1: PiOldSelections(), 4: PiOldSelections()}
    one, four = _run(tmp_path / "one", model, 1, traces[1]), _run(tmp_path / "four", model, 4, traces[4])
    for run in (one, four):
        assert len(run["agreement"]) == STEPS and all(len(step) == OPTIMIZER_STEPS for step in run["agreement"])
        assert [step[0]["jaccard"] for step in run["agreement"]] == [1.0] * STEPS
        assert all(0.0 <= r["jaccard"] <= 1.0 and r["selected_old"] > 0 for step in run["agreement"] for r in step)
        assert run["prepass_seconds"] == [0.0] * STEPS  # no prepass: the measurement's forward is not the run's
    assert [[r["selected_old"] for r in s] for s in one["agreement"]] == \
        [[r["selected_old"] for r in s] for s in four["agreement"]]  # the quota: token counts only

    # Micro-batch 1 vs 4. Premises:
    # * until the first update both runs are the same computation (the same weights, rollouts and log-prob pass at
    #   micro-batch 4, RunConfig's default): pi_old's statistics, hence every mask of trainer step 1 (all read pi_old)
    #   and the first logged entropy, are the same bit for bit on any CPU;
    # * the updates of identical masks differ by float re-association (and, on CPUs whose rows' last bits follow
    #   their micro-batch company, by that): the parameters stay float noise apart, so the next passes' entropy
    #   differs in the last bits. The rollouts then stay identical (a token flips only when its uniform draw lands
    #   within that noise of a CDF boundary: tests/experiments/test_learning.py) and the logged entropy stays within
    #   NOISE_FACTOR float32 spacings (the learning study's floor, at its least: no vanilla runs here);
    # * with statistics that differ in the last bits, a token at the quota's boundary can change sides (the 8
    #   responses of a prompt share their first position's entropy: ties are common; the emulator of
    #   tests/support/company_noise.py flips one in trainer step 2). Where the masks first differ, every token
    #   selected in one run and not the other must lie within 2x the two runs' largest entropy difference of the
    #   boundary (the k-th largest entropy) in both runs -- a near-tie, measured -- and that difference must be
    #   float noise. From that update on the runs part legitimately: nothing more is compared.
    masks_one, masks_four = traces[1].records, traces[4].records
    assert len(masks_one) == len(masks_four) == STEPS * OPTIMIZER_STEPS
    parted = next((i for i, (a, b) in enumerate(zip(masks_one, masks_four)) if not torch.equal(a["mask"], b["mask"])),
                  None)
    assert parted is None or parted >= OPTIMIZER_STEPS, f"a mask of trainer step 1 differs (optimizer step {parted})"
    agreed = STEPS if parted is None else parted // OPTIMIZER_STEPS  # trainer steps whose masks all agreed
    compared = min(agreed, STEPS - 1) + 1  # logged values from parameters after those steps' updates only
    assert one["entropy"][0] == four["entropy"][0]  # the same computation
    assert one["rollout_digest"][:compared] == four["rollout_digest"][:compared], agreed
    tolerance = NOISE_FACTOR * float32_spacing(one["entropy"] + four["entropy"])
    differences = [abs(a - b) for a, b in zip(one["entropy"][:compared], four["entropy"][:compared])]
    assert max(differences) <= tolerance, (differences, tolerance)
    if parted is not None:
        a, b = masks_one[parted], masks_four[parted]
        noise = float(np.nanmax((a["entropy"] - b["entropy"]).abs().numpy()))
        spacing = float(np.spacing(np.float32(np.nanmax(a["entropy"].abs().numpy()))))
        assert noise <= NOISE_FACTOR * spacing, (parted, noise, spacing)  # the statistics: float noise apart
        flipped = a["mask"] ^ b["mask"]
        distances = [_distance_from_quota_boundary(record, flipped) for record in (a, b)]
        assert max(distances) <= 2 * noise, (parted, distances, noise)  # a near-tie at the boundary
    print(f"\nmicro-batch 1 vs 4: masks {'identical' if parted is None else f'part at optimizer step {parted}'}, "
          f"entropy within {max(differences):.1e} over the first {compared} trainer steps")

    real_replace = old_policy.replace

    def other_knob(settings, **changes):  # the negative control: the current policy's selection with ratio 0.1
        return real_replace(settings, **changes, entropy_top_ratio=0.1)

    monkeypatch.setattr(old_policy, "replace", other_knob)
    wrong = _run(tmp_path / "wrong", model, 4, steps=1)  # one trainer step shows it
    assert len(wrong["agreement"]) == 1 and wrong["agreement"][0][0]["jaccard"] < 1.0  # caught
    later = [r["jaccard"] for step in four["agreement"] for r in step[1:]]
    print(f"high_entropy_global, old: Jaccard at optimizer steps 1-3 {min(later):.3f}..{max(later):.3f}; "
          f"with the wrong knob, step 0: {[round(step[0]['jaccard'], 3) for step in wrong['agreement']]}")
