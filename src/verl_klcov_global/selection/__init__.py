"""Pure-torch token selections, one module per method, over a minibatch and a data-parallel group.

* :mod:`.kl_cov` -- KL-Cov: the top ``kl_cov_ratio`` fraction of tokens by covariance.
* :mod:`.collectives` -- what every selection shares: exact group-wide means and the
  agreement on the k largest keys, with an exchange that does not grow with k or N.

Nothing here imports verl.
"""

from .kl_cov import KLCovSelection, kl_cov_quota, select_kl_cov_tokens, validate_kl_cov_ratio

__all__ = ["KLCovSelection", "kl_cov_quota", "select_kl_cov_tokens", "validate_kl_cov_ratio"]
