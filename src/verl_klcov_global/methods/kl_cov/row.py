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

#: Why the driver warns when the entropy floor is on (docs/EVIDENCE.md, the entropy floor on SmolLM2).
FLOOR_CAVEAT = ("on SmolLM2-135M (GRPO, 3 seeds) a larger kl_cov_ratio did not reliably hold more entropy: 0.02 and "
                "0.05 each held a higher lowest entropy than the paper's 0.002 in some seeds and a lower one in the "
                "others, and the floor from 0.002 (up to 0.02) held a lower one than the fixed 0.002 in all 3 seeds, "
                "by 0.15-0.46 nats (docs/EVIDENCE.md); the floor strengthens KL-Cov up to entropy_control_max_ratio "
                "and may not hold the target")


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
    ratio_units_note=UNITS_NOTE, floor_caveat=FLOOR_CAVEAT,
))
