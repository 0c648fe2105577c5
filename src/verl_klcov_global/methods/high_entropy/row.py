"""The 80/20 rule's row of the mode table, registered as a user's module registers its own (:func:`~verl_klcov_global.modes.register_mode`)."""

from __future__ import annotations

from ...layout import MinibatchFields
from ...modes import ModeSpec, Selection, register_mode
from .config import HighEntropyGlobalPolicyLossConfig, read_high_entropy_settings
from .objective import HighEntropyMaskUnavailableError, high_entropy_objective
from .selection import select_high_entropy_tokens


def _select_high_entropy(fields: MinibatchFields, settings, group) -> Selection:
    return select_high_entropy_tokens(fields.entropy, fields.response_mask, settings.entropy_top_ratio, group=group)


HIGH_ENTROPY = register_mode(ModeSpec(
    name="high_entropy_global", upstream="high_entropy_per_micro_batch", metric_prefix="actor/high_entropy/",
    read_settings=read_high_entropy_settings, response_fields=(), select=_select_high_entropy,
    objective=high_entropy_objective, no_mask_error=HighEntropyMaskUnavailableError,
    config_class=HighEntropyGlobalPolicyLossConfig, prepass_reads_entropy=True,
    # Wang et al. 2025 (arXiv:2506.01939): rho = 0.2 for Qwen3-14B and -32B (their fork's entropy_top_ratio=0.2)
    ratio_knob="entropy_top_ratio", paper_ratios=(("14B", 0.2), ("32B", 0.2)),
    # 0.2 is the paper's value, so no units warning; rho = 1 keeps every token: vanilla plus a prepass
    ratio_warning=None, ratio_one_is_vanilla=True,
    entropy_sign=-1,  # a larger rho trains more low-entropy tokens: entropy falls faster (rho = 1 is vanilla)
    comparator=f"{__package__}.authors",  # the authors' per-loss-call rule, for the lab only
))
