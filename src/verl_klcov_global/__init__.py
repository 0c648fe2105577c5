"""verl-klcov-global: KL-Cov whose token selection does not depend on memory settings.

Registers the verl policy-loss mode ``kl_cov_global``: one KL-Cov selection per
optimizer minibatch (and data-parallel group), computed by a no-grad prepass,
instead of one per micro-batch. Select it with
``actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov_global``.
"""

import verl  # noqa: F401  (loads verl's entry-point plugins first, this one included)

from .config import LOSS_MODE, MASK_KEY, KLCovGlobalPolicyLossConfig
from .loss import KLCovMaskUnavailableError, compute_policy_loss_kl_cov_global, provide_kl_cov_mask
from .plugin import install
from .selection import KLCovSelection, kl_cov_quota, select_kl_cov_tokens

__version__ = "0.1.0"

__all__ = [
    "LOSS_MODE",
    "MASK_KEY",
    "KLCovGlobalPolicyLossConfig",
    "KLCovMaskUnavailableError",
    "KLCovSelection",
    "compute_policy_loss_kl_cov_global",
    "install",
    "kl_cov_quota",
    "provide_kl_cov_mask",
    "select_kl_cov_tokens",
]
