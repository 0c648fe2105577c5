"""Clip-Cov's row of the mode table, registered as a user's module registers its own (:func:`~verl_klcov_global.modes.register_mode`)."""

from __future__ import annotations

from ...layout import MinibatchFields
from ...modes import ModeSpec, Selection, register_mode
from .config import ClipCovGlobalPolicyLossConfig, read_clip_cov_settings
from .objective import ClipCovMaskUnavailableError, clip_cov_objective
from .selection import select_clip_cov_tokens

#: Other frameworks' units for this ratio (appended to the guardrails' units warning).
UNITS_NOTE = ("Other frameworks' units differ: PRIME-RL's k_percent is a percentage (k_percent=0.2 means 0.2%, i.e. "
              "0.002 here), SkyRL's kl_cov_frac is a fraction like this one (its default 0.2 selects 20%)")


def _select_clip_cov(fields: MinibatchFields, settings, group) -> Selection:
    token_ids, token_mask = fields.sequence["input_ids"]  # hashed for the reproducible draw
    return select_clip_cov_tokens(
        fields.response["advantages"], fields.log_probs, fields.response["old_log_probs"], fields.response_mask,
        token_ids, token_mask=token_mask,
        clip_cov_ratio=settings.clip_cov_ratio, clip_cov_lb=settings.clip_cov_lb, clip_cov_ub=settings.clip_cov_ub,
        clip_ratio_low=settings.clip_ratio_low, clip_ratio_high=settings.clip_ratio_high,
        seed=settings.clip_cov_seed, optimizer_step=settings.optimizer_step, group=group,
    )


def _count_clip_cov(num_valid: int, policy_loss, metrics: dict) -> int:
    clipfrac = metrics["actor/pg_clipfrac"]  # masked mean of clip_cov's zeroed-gradient indicator
    clipfrac = clipfrac.values[0] if hasattr(clipfrac, "values") else clipfrac
    return round(float(clipfrac) * num_valid)


CLIP_COV = register_mode(ModeSpec(
    name="clip_cov_global", upstream="clip_cov", metric_prefix="actor/clip_cov/",
    read_settings=read_clip_cov_settings,
    response_fields=("advantages", "old_log_probs"), sequence_fields=("input_ids",), select=_select_clip_cov,
    objective=clip_cov_objective, no_mask_error=ClipCovMaskUnavailableError,
    config_class=ClipCovGlobalPolicyLossConfig, count_upstream_selected=_count_clip_cov, draws_at_random=True,
    reads_optimizer_step=True,  # a fresh draw every optimizer step, as upstream draws on every call
    ratio_knob="clip_cov_ratio", paper_ratios=(("7B", 0.0002), ("32B", 0.0002)),
    entropy_sign=+1, selection_reach=lambda selection: selection.num_candidates,  # at most every candidate is cut
    ratio_units_note=UNITS_NOTE,
    knobs_text=lambda v: (f"clip_cov ratio {v['clip_cov_ratio']}, window ({v['clip_cov_lb']}, {v['clip_cov_ub']}), "
                          f"seed {v['clip_cov_seed']}"),  # diagnose's knob line
))
