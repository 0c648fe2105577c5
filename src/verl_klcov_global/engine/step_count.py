"""The count of an engine's optimizer steps under a global mode: what a per-step draw is seeded with.

A mode whose row sets ``reads_optimizer_step`` (``clip_cov_global``'s seeded draw) gets, at every optimizer step,
the number of global-mode optimizer steps this engine made before it (0 at the first), in its settings'
``optimizer_step``. Where it lives: the entry :data:`STEP_COUNT_KEY` of the engine's optimizer's first parameter
group, as the entropy controller's state (:mod:`.control`). So:

* it is the same on every rank: every rank makes every optimizer step (``train_batch`` is collective), and the
  selection agrees it over the data-parallel group with its knobs (ranks that disagree all raise);
* it does not depend on micro-batching, the DP split or the sample order: one count per optimizer step;
* it is saved and loaded with the optimizer by verl's checkpoint manager, so a resumed run continues the count.
  Without the optimizer in ``checkpoint.save_contents`` / ``load_contents`` a resumed run counts from 0 again: its
  draws are then those of the first run's first steps, each still a valid draw.
"""

from __future__ import annotations

from verl.workers.engine.base import BaseEngine

from .control import first_param_group

__all__ = ["STEP_COUNT_KEY", "next_optimizer_step"]

#: The optimizer parameter-group entry that counts the engine's global-mode optimizer steps.
STEP_COUNT_KEY = "verl_klcov_global_optimizer_steps"


def next_optimizer_step(engine: BaseEngine) -> int:
    """The number of this optimizer step (the count so far, 0 at the first), counted on in the engine's optimizer."""
    param_group = first_param_group(engine)
    step = int(param_group.get(STEP_COUNT_KEY, 0))
    param_group[STEP_COUNT_KEY] = step + 1
    return step
