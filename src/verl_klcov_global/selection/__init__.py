"""Pure-torch token selections, one module per method, over a minibatch and a data-parallel group.

* :mod:`.kl_cov` -- KL-Cov: the top ``kl_cov_ratio`` fraction of tokens by covariance.
* :mod:`.clip_cov` -- Clip-Cov: a reproducible uniform sample of the tokens whose covariance
  lies in a window, at most ``clip_cov_ratio`` of them.
* :mod:`.high_entropy` -- the 80/20 method: the top ``entropy_top_ratio`` fraction of tokens by
  current-policy entropy.
* :mod:`.stare` -- STARE: the top ``stare_top_ratio`` fraction of each advantage sign's tokens by surprisal
  ``-log pi``.
* :mod:`.lp_reg` -- Lp-Reg: the ``lp_reg_neg_ratio`` (``lp_reg_pos_ratio``) fraction of the negative-advantage
  (positive-advantage) tokens with the lowest log-prob.
* :mod:`.covariance` -- the covariance figures every covariance selection logs (``cov_mean``, ...).
* :mod:`.collectives` -- what every selection shares: exact group-wide means and the
  agreement on the k largest keys, with an exchange that does not grow with k or N.
* :mod:`.keys` -- sampling keys hashed from (seed, sequence tokens, position).
* :mod:`.knobs` -- strict reading of numeric knobs (no bool or string coercion) and the ratio quota.

Nothing here imports verl.
"""

from .clip_cov import (
    ClipCovSelection,
    clip_cov_quota,
    select_clip_cov_tokens,
    validate_clip_cov_ratio,
    validate_clip_cov_seed,
    validate_clip_cov_window,
    validate_clip_ratio,
)
from .high_entropy import (
    HighEntropySelection,
    high_entropy_quota,
    select_high_entropy_tokens,
    validate_entropy_top_ratio,
)
from .kl_cov import KLCovSelection, kl_cov_quota, select_kl_cov_tokens, validate_kl_cov_ratio
from .lp_reg import LpRegSelection, lp_reg_quota, select_lp_reg_tokens, validate_lp_reg_ratio
from .stare import StareSelection, select_stare_tokens, stare_quota, validate_stare_top_ratio

__all__ = [
    "ClipCovSelection",
    "HighEntropySelection",
    "KLCovSelection",
    "LpRegSelection",
    "StareSelection",
    "clip_cov_quota",
    "high_entropy_quota",
    "kl_cov_quota",
    "lp_reg_quota",
    "select_clip_cov_tokens",
    "select_high_entropy_tokens",
    "select_kl_cov_tokens",
    "select_lp_reg_tokens",
    "select_stare_tokens",
    "stare_quota",
    "validate_clip_cov_ratio",
    "validate_clip_cov_seed",
    "validate_clip_cov_window",
    "validate_clip_ratio",
    "validate_entropy_top_ratio",
    "validate_kl_cov_ratio",
    "validate_lp_reg_ratio",
    "validate_stare_top_ratio",
]
