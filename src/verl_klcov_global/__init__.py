"""verl-klcov-global: KL-Cov, Clip-Cov, the 80/20 rule, STARE and Lp-Reg, whose token selection does not depend on
memory settings.

Registers the verl policy-loss modes of the mode table (:data:`verl_klcov_global.modes.MODES`: ``kl_cov_global``,
``clip_cov_global``, ``high_entropy_global``, ``stare_global`` and ``lp_reg_global``, one folder each under
:mod:`verl_klcov_global.methods`): one selection per optimizer minibatch (and data-parallel group), computed by a
no-grad prepass, instead of one per micro-batch. Select one with
``actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov_global`` (or another ``*_global``).
"""

from importlib import metadata as _metadata

from .quiet_start import quiet_verl_import as _quiet_verl_import

# In the plugin's own command (not --verbose) verl's import-time warnings stay hidden until _quiet.close() below.
_quiet = _quiet_verl_import()

import verl  # noqa: E402,F401  (loads verl's entry-point plugins first, this one included)

from . import seams as _seams  # noqa: E402

try:
    _seams.check_seams()  # a moved verl seam fails here, by name, before anything is patched or registered
except _seams.VerlSeamError as _error:
    # verl's entry-point loader would log this at DEBUG only: stderr now, and the same error from every later
    # lookup of a global mode in this process (registry, validate_config). See seams.make_seam_error_visible.
    _seams.make_seam_error_visible(_error)
    raise

from .config import (
    MASK_FIELD,
    ClipCovGlobalPolicyLossConfig,
    HighEntropyGlobalPolicyLossConfig,
    KLCovGlobalPolicyLossConfig,
    LpRegGlobalPolicyLossConfig,
    StareGlobalPolicyLossConfig,
)
from .loss import SelectionMaskUnavailableError, provide_selection_mask
from .modes import MODES, ModeSpec, register_mode
from .methods import register_built_in_modes as _register_built_in_modes

_register_built_in_modes()  # each built-in method's row joins the mode table, as a user's module's row does

from .methods.clip_cov.objective import ClipCovMaskUnavailableError  # noqa: E402
from .methods.clip_cov.selection import ClipCovSelection, clip_cov_quota, select_clip_cov_tokens  # noqa: E402
from .methods.high_entropy.objective import HighEntropyMaskUnavailableError  # noqa: E402
from .methods.high_entropy.selection import (  # noqa: E402
    HighEntropySelection,
    high_entropy_quota,
    select_high_entropy_tokens,
)
from .methods.kl_cov.objective import KLCovMaskUnavailableError  # noqa: E402
from .methods.kl_cov.selection import KLCovSelection, kl_cov_quota, select_kl_cov_tokens  # noqa: E402
from .methods.lp_reg.selection import LpRegSelection, select_lp_reg_tokens  # noqa: E402
from .methods.stare.selection import StareSelection, select_stare_tokens  # noqa: E402
from .plugin import install  # noqa: E402

_quiet.close()

try:  # the one version string is pyproject.toml's, read from the installed metadata
    __version__ = _metadata.version("verl-klcov-global")
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "unknown (not installed)"

__all__ = [
    "MASK_FIELD",
    "MODES",
    "ClipCovGlobalPolicyLossConfig",
    "ClipCovMaskUnavailableError",
    "ClipCovSelection",
    "HighEntropyGlobalPolicyLossConfig",
    "HighEntropyMaskUnavailableError",
    "HighEntropySelection",
    "KLCovGlobalPolicyLossConfig",
    "KLCovMaskUnavailableError",
    "KLCovSelection",
    "LpRegGlobalPolicyLossConfig",
    "LpRegSelection",
    "ModeSpec",
    "SelectionMaskUnavailableError",
    "StareGlobalPolicyLossConfig",
    "StareSelection",
    "clip_cov_quota",
    "high_entropy_quota",
    "install",
    "kl_cov_quota",
    "provide_selection_mask",
    "register_mode",
    "select_clip_cov_tokens",
    "select_high_entropy_tokens",
    "select_kl_cov_tokens",
    "select_lp_reg_tokens",
    "select_stare_tokens",
]
