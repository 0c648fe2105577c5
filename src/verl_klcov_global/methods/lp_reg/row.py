"""Lp-Reg's row of the mode table, registered as a user's module registers its own (:func:`~verl_klcov_global.modes.register_mode`)."""

from __future__ import annotations

from ...layout import MinibatchFields
from ...modes import ModeSpec, Selection, register_mode
from .config import LpRegGlobalPolicyLossConfig, read_lp_reg_settings
from .objective import LP_REG_TALLIES, LpRegMaskUnavailableError, lp_reg_objective, lp_reg_tally_figures
from .selection import select_lp_reg_tokens


def _select_lp_reg(fields: MinibatchFields, settings, group) -> Selection:
    return select_lp_reg_tokens(fields.log_probs, fields.response["advantages"], fields.response_mask,
                                settings.neg_ratio, settings.pos_ratio, group=group)


LP_REG = register_mode(ModeSpec(
    name="lp_reg_global", upstream="lp_reg_per_micro_batch", metric_prefix="actor/lp_reg/",
    read_settings=read_lp_reg_settings, response_fields=("advantages",), select=_select_lp_reg,
    objective=lp_reg_objective, no_mask_error=LpRegMaskUnavailableError, config_class=LpRegGlobalPolicyLossConfig,
    # Huang et al. 2025 (arXiv:2510.03222), recipe/lp_reg/*.sh: rho- 0.01 (0.005 for Qwen2.5-32B)
    ratio_knob="lp_reg_neg_ratio", paper_ratios=(("7B", 0.01), ("32B", 0.005)), ratio_warning=None,
    ratio_of="each optimizer minibatch's negative-advantage valid response tokens",
    proxy_min_p=lambda settings: settings.min_p,  # no entropy controller (entropy_sign 0)
    loss_tallies=LP_REG_TALLIES, tally_figures=lp_reg_tally_figures,
    comparator=f"{__package__}.authors",  # the authors' per-loss-call rule, for the lab only
    knobs_text=lambda v: (f"lp_reg rho- {v['lp_reg_neg_ratio']}, rho+ {v['lp_reg_pos_ratio']}, "  # diagnose's knob line
                          f"min_p {v['lp_reg_min_p']}"),
))
