"""The shared core of every token selection: pure torch, over a minibatch and a data-parallel group.

Each method's own selection lives in its folder (``verl_klcov_global.methods.<name>.selection``); what they share is
here:

* :mod:`.covariance` -- the covariance figures every covariance selection logs (``cov_mean``, ...).
* :mod:`.collectives` -- exact group-wide means and the agreement on the k largest keys, with an exchange that
  does not grow with k or N.
* :mod:`.keys` -- sampling keys hashed from (seed, sequence tokens, position).
* :mod:`.knobs` -- strict reading of numeric knobs (no bool or string coercion) and the ratio quota.

Nothing here imports verl.
"""
