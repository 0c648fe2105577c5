"""KL-Cov's row of the mode table, registered as a user's module registers its own (:func:`~verl_klcov_global.modes.register_mode`)."""

from __future__ import annotations

from ...layout import MinibatchFields
from ...modes import ModeSpec, Selection, register_mode
from .config import KLCovGlobalPolicyLossConfig, read_kl_cov_settings
from .objective import KLCovMaskUnavailableError, kl_cov_objective
from .selection import kl_cov_quota, select_kl_cov_tokens

#: Other frameworks' units for this ratio (appended to the guardrails' units warning).
UNITS_NOTE = ("Other frameworks' units differ: PRIME-RL's k_percent is a percentage (k_percent=0.2 means 0.2%, i.e. "
              "0.002 here), SkyRL's kl_cov_frac is a fraction like this one (its default 0.2 selects 20%)")

def _select_kl_cov(fields: MinibatchFields, settings, group) -> Selection:
    return select_kl_cov_tokens(fields.response["advantages"], fields.log_probs, fields.response_mask,
                                settings.kl_cov_ratio, group=group)


def _count_kl_cov(num_valid: int, policy_loss, metrics: dict) -> int:
    return kl_cov_quota(num_valid, policy_loss.kl_cov_ratio)  # upstream selects exactly its quota


KL_COV = register_mode(ModeSpec(
    name="kl_cov_global", upstream="kl_cov", metric_prefix="actor/kl_cov/",
    read_settings=read_kl_cov_settings,
    response_fields=("advantages",), select=_select_kl_cov, objective=kl_cov_objective,
    no_mask_error=KLCovMaskUnavailableError, config_class=KLCovGlobalPolicyLossConfig,
    count_upstream_selected=_count_kl_cov, diagnose_train_layout=True,
    # Cui et al. 2025 (arXiv:2505.22617) and its recipe/entropy/{7b,32b}_kl_cov.sh
    ratio_knob="kl_cov_ratio", paper_ratios=(("7B", 0.002), ("32B", 0.0002)), penalises_log_ratio=True,
    entropy_sign=+1,  # more tokens with the |log-ratio| penalty hold entropy up (the paper's Fig. 9-10)
    ratio_units_note=UNITS_NOTE,
))
