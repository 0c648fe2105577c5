"""``prepass_layout=old``: an optimizer step's statistics from the old policy pi_old, with no prepass at all.

pi_old is the actor as it was at verl's log-prob pass (``compute_log_prob``), before the update's first
optimizer step. With this opt-in, every optimizer step of the update selects from pi_old's statistics of its
own minibatch, where the other layouts select from the current policy's (a prepass, or verl's pass reused
where it was made with the step's very parameters, :mod:`.reuse`):

* **log-probs**: the minibatch's ``old_log_probs``, the field verl hands every update (its log-prob pass's
  output). So KL-Cov's covariance reads log pi_old, and Clip-Cov's PPO-clip exclusion sees the ratio
  pi/pi_old = 1: no token is excluded as already clipped;
* **entropy** (the 80/20 rule, or any mode with the entropy controller on: ``ModeSpec.reads_entropy``): the
  entropy verl's log-prob pass computed for these rows (``calculate_entropy=True``), kept on this rank by
  PATCH ``log_prob_pass_keep`` and held for the whole update (:func:`.reuse.held_entropy`, rows matched by a
  digest of their content). verl does not hand it to the update itself (the legacy trainer pops it).

No forward runs: the mask is a pure function of the batch verl hands the actor (and the configured seed),
so it is independent of the micro-batch size, dynamic batching, the DP size and the sample order, at
upstream's cost. The papers' rules read the current policy instead; how far the two masks part within a
trainer step is measured in docs/PREPASS.md (``experiments.old_policy``).

Where pi_old's statistics do not exist the driver refuses the setting before Ray starts
(:mod:`verl_klcov_global.guardrails`: ``bypass_mode``, whose old log-probs are the rollout engine's and which
runs no actor log-prob pass; entropy read on a trainer whose log-prob pass the plugin does not keep). If the
held entropy is still missing in a worker, every rank raises :class:`OldPolicyStatisticsError` together
(the decision is agreed first, so no rank waits in a collective): never a silent prepass.
"""

from __future__ import annotations

from typing import Optional

import torch
from tensordict import TensorDict

from ..mode_config import OLD_POLICY_LAYOUT
from ..layout import padded
from . import reuse

__all__ = ["OLD_POLICY_RECORD_NAME", "OldPolicyStatisticsError", "old_policy_statistics"]

#: ``torch.profiler.record_function`` name of the look-up of pi_old's statistics.
OLD_POLICY_RECORD_NAME = "verl_klcov_global.old_policy"


class OldPolicyStatisticsError(RuntimeError):
    """``prepass_layout=old`` could not find pi_old's statistics for an optimizer step."""


def old_policy_statistics(engine, data: TensorDict, *, mode_name: str,
                          needs_entropy: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """pi_old's (log-probs, entropy or None) of ``data``'s response tokens, each (batch, response width) on the
    engine's device. Collective when ``needs_entropy`` (one all-reduce of one integer over the default process
    group, as :func:`.reuse.take`): every rank returns, or every rank raises :class:`OldPolicyStatisticsError`."""
    from verl.utils.device import get_device_id

    with torch.profiler.record_function(OLD_POLICY_RECORD_NAME):
        if "old_log_probs" not in data.keys():
            # the same batch keys on every rank: every rank raises here, none waits in a collective
            raise OldPolicyStatisticsError(
                f"loss_mode={mode_name} with prepass_layout={OLD_POLICY_LAYOUT} selects from verl's old_log_probs, "
                f"but the minibatch has none (keys: {sorted(data.keys())}); set "
                "actor_rollout_ref.actor.policy_loss.prepass_layout=infer")
        log_probs = padded(data["old_log_probs"]).to(get_device_id())
        if not needs_entropy:
            return log_probs, None
        entropy, missing = reuse.held_on_every_rank(reuse.held_entropy, engine, data)
        if missing is not None:
            raise OldPolicyStatisticsError(
                f"loss_mode={mode_name} with prepass_layout={OLD_POLICY_LAYOUT} reads pi_old's entropy (the mode's "
                f"selection or the entropy controller), kept from verl's log-prob pass, and {missing}. The plugin keeps that pass where the actor's compute_log_prob runs through verl's engine "
                "TrainingWorker with calculate_entropy; set actor_rollout_ref.actor.policy_loss.prepass_layout=infer "
                "to select from the current policy instead")
        return log_probs, entropy
