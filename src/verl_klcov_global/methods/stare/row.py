"""STARE's row of the mode table, registered as a user's module registers its own (:func:`~verl_klcov_global.modes.register_mode`)."""

from __future__ import annotations

from ...layout import MinibatchFields
from ...modes import ModeSpec, Selection, register_mode
from .config import DEFAULT_STARE_REWEIGHT_M, StareGlobalPolicyLossConfig, read_stare_settings
from .objective import StareMaskUnavailableError, stare_objective
from .schedule import stare_update_rule
from .selection import select_stare_tokens


def _select_stare(fields: MinibatchFields, settings, group) -> Selection:
    return select_stare_tokens(fields.log_probs, fields.response["advantages"], fields.response_mask,
                               settings.stare_top_ratio, with_negative=settings.with_negative, group=group)


def _stare_setting_warnings(settings) -> list[tuple[str, str, str, str]]:
    """STARE settings that make the mode a no-op, or carry a knob it does not use."""
    found = []
    weights = [settings.reweight_w] + ([settings.reweight_m] if settings.with_negative else [])
    if all(w == 1.0 for w in weights) and not (settings.adaptive and settings.alpha > 0):
        found.append(("stare-weights-one", "stare_reweight_w",
                      "every STARE weight is 1 (stare_reweight_w=1" + (", stare_reweight_m=1" if settings.with_negative
                                                                       else "; variant O1 uses no M")
                      + ", no schedule): the loss is verl's vanilla plus a prepass",
                      "Set stare_reweight_w > 1 (the paper's 1.1), or use loss_mode=vanilla"))
    if settings.stare_top_ratio == 0.0:
        found.append(("stare-selects-nothing", "stare_top_ratio",
                      "stare_top_ratio=0 selects no token: the loss is verl's vanilla plus a prepass",
                      "Set stare_top_ratio to a fraction > 0 (the paper's 0.1), or use loss_mode=vanilla"))
    if settings.target_entropy <= 0.0:
        found.append(("stare-gate-never-opens", "stare_target_entropy",
                      f"stare_target_entropy={settings.target_entropy:g}: the batch's mean entropy is never below it, "
                      "so the gate never opens and the loss is verl's vanilla plus a prepass (the authors' GRPO "
                      "baseline script sets this)",
                      "Set stare_target_entropy > 0 (the paper's 0.3), or use loss_mode=vanilla"))
    # the default M (0.9, the paper's C2 value) ships with O1 too: warn only for an M someone chose for O1
    if not settings.with_negative and settings.reweight_m not in (1.0, DEFAULT_STARE_REWEIGHT_M):
        found.append(("stare-m-unused", "stare_reweight_m",
                      f"stare_reweight_m={settings.reweight_m:g} is not used by stare_variant=O1, which weights only "
                      "the surprising A > 0 tokens (W); M weights the surprising A < 0 tokens under variant C2",
                      "Set stare_variant=C2 to use M, or drop stare_reweight_m"))
    return found


STARE = register_mode(ModeSpec(
    name="stare_global", upstream="stare_per_micro_batch", metric_prefix="actor/stare/",
    read_settings=read_stare_settings, response_fields=("advantages",), select=_select_stare,
    objective=stare_objective, no_mask_error=StareMaskUnavailableError, config_class=StareGlobalPolicyLossConfig,
    # Luo et al. 2026 (arXiv:2606.19236): the 10% most surprising tokens of each advantage sign
    ratio_knob="stare_top_ratio", paper_ratios=(("7B", 0.1),), ratio_warning=None, ratio_may_be_zero=True,
    ratio_of="each advantage sign's valid response tokens of the optimizer minibatch",
    # no entropy controller (entropy_sign 0): STARE's gate and schedule are its own entropy feedback
    update_rule=stare_update_rule, setting_warnings=_stare_setting_warnings,
    comparator=f"{__package__}.authors",  # the authors' per-loss-call rule, for the lab only
    knobs_text=lambda v: (f"stare top_ratio {v['stare_top_ratio']}, W {v['stare_reweight_w']}"  # diagnose's knob line
                          + (f", M {v['stare_reweight_m']}" if v["stare_variant"] == "C2" else "")
                          + f", {v['stare_variant']}, target entropy {v['stare_target_entropy']:g}"
                          + (f", adaptive (alpha {v['stare_alpha']})" if v["stare_adaptive"] else "")),
))
