"""Two global loss modes of your own, in your own module: no file of verl-klcov-global is edited.

* ``rare_token_kl_global``: KL-Cov's penalty ``ppo_kl_coef * |log pi - log pi_old|`` on the ``kl_cov_ratio``
  fraction of valid tokens that are rarest under the current policy (lowest prepass log-prob), chosen once per
  optimizer minibatch over the data-parallel group. verl's own knobs only, so no config class.
* ``rare_token_capped_kl_global``: the same, among the tokens whose probability is at most
  ``rare_token_max_prob``, a knob verl does not have: it needs a config class.

Load it in every process with ``VERL_USE_EXTERNAL_MODULES=my_modes`` (docs/ADDING_A_MODE.md, part 1).
"""

import math
from dataclasses import dataclass

import torch

from verl_klcov_global import plugin
from verl_klcov_global.config import KLCovGlobalPolicyLossConfig, read_kl_cov_settings
from verl_klcov_global.methods.kl_cov.objective import kl_cov_objective
from verl_klcov_global.modes import ModeSpec, register_mode
from verl_klcov_global.selection.collectives import agree_and_mean, float_order_keys, select_largest_keys
from verl_klcov_global.selection.knobs import ratio_quota


@dataclass(frozen=True)
class RareTokens:
    """What the engine needs of a selection: a bool mask over this rank's minibatch, and figures to log."""

    mask: torch.Tensor  # (batch, response_len) bool
    quota: int
    num_selected: int
    num_valid: int

    def figures(self) -> dict:
        return {"quota": float(self.quota), "selected": float(self.num_selected), "valid_tokens": float(self.num_valid)}


def select_rare_tokens(fields, settings, group, max_log_prob=0.0):
    """The ``kl_cov_ratio`` fraction of valid tokens with the lowest prepass log-prob (at most ``max_log_prob``)."""
    log_probs = fields.log_probs.detach().double()
    candidates = fields.response_mask.bool() & (log_probs <= max_log_prob)
    means = agree_and_mean((log_probs,), candidates, {"kl_cov_ratio": settings.kl_cov_ratio}, group)
    quota = ratio_quota(means.num_valid, settings.kl_cov_ratio)
    rarest = select_largest_keys(float_order_keys(-means.values[0]), means.valid, quota, means.num_valid, group)
    return RareTokens(mask=rarest.mask, quota=quota, num_selected=quota, num_valid=means.num_valid)


register_mode(ModeSpec(
    name="rare_token_kl_global", upstream=None, metric_prefix="actor/rare_token/",
    knobs=("kl_cov_ratio", "ppo_kl_coef"), plugin_knobs=(), read_settings=read_kl_cov_settings,
    response_fields=(), select=select_rare_tokens, objective=kl_cov_objective,
))


# A knob of your own: a config class (its loss_mode defaults to the mode's name), a settings reader that
# validates it and names the key, and the knob in ModeSpec.knobs.
@dataclass
class RareTokenCappedPolicyLossConfig(KLCovGlobalPolicyLossConfig):
    loss_mode: str = "rare_token_capped_kl_global"
    rare_token_max_prob: float = 0.5


@dataclass(frozen=True)
class RareTokenCappedSettings:
    kl_cov_ratio: float
    ppo_kl_coef: float
    prepass_layout: str
    max_log_prob: float
    entropy_control: object = None


def read_rare_token_capped_settings(actor_config):
    kl_cov = read_kl_cov_settings(actor_config)
    cap = getattr(actor_config.policy_loss, "rare_token_max_prob", 0.5)
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0.0 < cap <= 1.0:
        raise ValueError(f"rare_token_max_prob must be a probability in (0, 1], got {cap!r}; set "
                         "actor_rollout_ref.actor.policy_loss.rare_token_max_prob=0.5")
    return RareTokenCappedSettings(kl_cov.kl_cov_ratio, kl_cov.ppo_kl_coef, kl_cov.prepass_layout, math.log(cap))


register_mode(ModeSpec(
    name="rare_token_capped_kl_global", upstream=None, metric_prefix="actor/rare_token_capped/",
    knobs=("kl_cov_ratio", "ppo_kl_coef", "rare_token_max_prob", "prepass_layout"),
    plugin_knobs=("rare_token_max_prob", "prepass_layout"), read_settings=read_rare_token_capped_settings,
    response_fields=(), objective=kl_cov_objective, config_class=RareTokenCappedPolicyLossConfig,
    select=lambda fields, settings, group: select_rare_tokens(fields, settings, group, settings.max_log_prob),
))

plugin.install()  # registers the table's new modes in verl's policy-loss registry
