"""The config classes users select with ``actor_rollout_ref.actor.policy_loss._target_=verl_klcov_global.config.<Class>``.

This module re-exports each built-in method's class, settings reader and defaults from its folder
(``verl_klcov_global.methods.<name>.config``), and the shared names of :mod:`verl_klcov_global.mode_config`, so that
users' ``_target_`` lines and imports keep working wherever a definition lives.
"""

from .mode_config import *  # noqa: F401,F403  (the shared names, e.g. MASK_FIELD, PREPASS_LAYOUTS, loss_mode_of)
from .mode_config import __all__ as _shared
from .methods.clip_cov.config import (
    DEFAULT_CLIP_COV_SEED,
    ClipCovGlobalPolicyLossConfig,
    ClipCovGlobalSettings,
    read_clip_cov_settings,
)
from .methods.high_entropy.config import (
    DEFAULT_ENTROPY_TOP_RATIO,
    DEFAULT_HIGH_ENTROPY_CONTROL_BOUNDS,
    HighEntropyGlobalPolicyLossConfig,
    HighEntropyGlobalSettings,
    read_high_entropy_settings,
)
from .methods.kl_cov.config import (
    KLCovGlobalPolicyLossConfig,
    KLCovGlobalSettings,
    read_kl_cov_settings,
    validate_ppo_kl_coef,
)
from .methods.lp_reg.config import (
    DEFAULT_LP_REG_KL_COEF,
    DEFAULT_LP_REG_MIN_P,
    DEFAULT_LP_REG_NEG_RATIO,
    DEFAULT_LP_REG_POS_RATIO,
    LpRegGlobalPolicyLossConfig,
    LpRegGlobalSettings,
    read_lp_reg_settings,
    validate_lp_reg_knobs,
)
from .methods.stare.config import (
    DEFAULT_STARE_ALPHA,
    DEFAULT_STARE_M_MIN,
    DEFAULT_STARE_REWEIGHT_M,
    DEFAULT_STARE_REWEIGHT_W,
    DEFAULT_STARE_TARGET_ENTROPY,
    DEFAULT_STARE_TOP_RATIO,
    DEFAULT_STARE_VARIANT,
    DEFAULT_STARE_W_MAX,
    STARE_AGG_MODES,
    STARE_VARIANTS,
    StareGlobalPolicyLossConfig,
    StareGlobalSettings,
    read_stare_settings,
    validate_stare_knobs,
)

__all__ = [*_shared,
           "ClipCovGlobalPolicyLossConfig", "ClipCovGlobalSettings", "DEFAULT_CLIP_COV_SEED", "read_clip_cov_settings",
           "DEFAULT_ENTROPY_TOP_RATIO", "DEFAULT_HIGH_ENTROPY_CONTROL_BOUNDS", "HighEntropyGlobalPolicyLossConfig",
           "HighEntropyGlobalSettings", "read_high_entropy_settings",
           "KLCovGlobalPolicyLossConfig", "KLCovGlobalSettings", "read_kl_cov_settings", "validate_ppo_kl_coef",
           "DEFAULT_LP_REG_KL_COEF", "DEFAULT_LP_REG_MIN_P", "DEFAULT_LP_REG_NEG_RATIO", "DEFAULT_LP_REG_POS_RATIO",
           "LpRegGlobalPolicyLossConfig", "LpRegGlobalSettings", "read_lp_reg_settings", "validate_lp_reg_knobs",
           "DEFAULT_STARE_ALPHA", "DEFAULT_STARE_M_MIN", "DEFAULT_STARE_REWEIGHT_M", "DEFAULT_STARE_REWEIGHT_W",
           "DEFAULT_STARE_TARGET_ENTROPY", "DEFAULT_STARE_TOP_RATIO", "DEFAULT_STARE_VARIANT", "DEFAULT_STARE_W_MAX",
           "STARE_AGG_MODES", "STARE_VARIANTS", "StareGlobalPolicyLossConfig", "StareGlobalSettings",
           "read_stare_settings", "validate_stare_knobs"]
