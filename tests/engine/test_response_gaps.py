"""Responses with masked spans inside them (multi-turn tool output), through verl's real FSDP engine (CPU).

verl's agent loop sets ``response_mask`` to 0 on the tokens a tool wrote, between tokens the policy wrote. A mask
shifted by such a gap (a count of valid tokens taken as a position) would still pass every test whose masked tokens
are a suffix. Here every response has a gap inside it: no mode of the table may select a masked token, and every
mode's selection and update must not depend on the micro-batching (masks bit for bit, the update within the
penalty-free control's noise floor).
"""

from __future__ import annotations

import pytest
import torch

from verl_klcov_global.config import (
    ClipCovGlobalPolicyLossConfig, HighEntropyGlobalPolicyLossConfig, KLCovGlobalPolicyLossConfig,
    LpRegGlobalPolicyLossConfig, StareGlobalPolicyLossConfig,
)
from verl_klcov_global.lab import tiny as _tiny
from verl_klcov_global.lab.experiment import EngineSpec, frozen_minibatch, max_abs_diff, one_update, static_layouts
from verl_klcov_global.layout import fit_width
from verl_klcov_global.modes import MODES

pytestmark = pytest.mark.slow  # verl's real engine on CPU: the slow tier

BATCH, PROMPT, RESPONSE = 32, 8, 48
NOISE_FACTOR = 10
#: Each mode with knobs that select a visible share of this minibatch's tokens and act on them. Lp-Reg's proxy keeps
#: only the tokens with p >= 0.45 max p: the tiny model's distributions are near uniform, so with the authors' 0.02
#: the proxy is pi_old itself at the first step and nothing is regularised.
POLICY_LOSSES = {
    "kl_cov_global": lambda: KLCovGlobalPolicyLossConfig(kl_cov_ratio=0.02),
    "clip_cov_global": lambda: ClipCovGlobalPolicyLossConfig(clip_cov_ratio=0.02, clip_cov_lb=0.0),
    "high_entropy_global": lambda: HighEntropyGlobalPolicyLossConfig(entropy_top_ratio=0.2),
    "stare_global": lambda: StareGlobalPolicyLossConfig(stare_top_ratio=0.2, stare_target_entropy=100.0),
    "lp_reg_global": lambda: LpRegGlobalPolicyLossConfig(lp_reg_neg_ratio=0.05, lp_reg_pos_ratio=0.02,
                                                                lp_reg_min_p=0.45),
}


def tokens_with_tool_spans(seed: int) -> tuple[dict, list[tuple[int, int]]]:
    """Padded rollout fields whose every response has one masked span [start, stop) strictly inside it."""
    from verl_klcov_global.lab.tiny import _padded_sample

    tokens = _padded_sample(batch_size=BATCH, prompt_len=PROMPT, response_len=RESPONSE, vary_lengths=True, seed=seed,
                            vocab_size=512, pad_token_id=0, group_size=8, advantage_noise=0.1,
                            min_response_len=RESPONSE // 2)
    spans = []
    for row in range(BATCH):
        length = int(tokens["response_mask"][row].sum())
        start = 3 + row % 5
        stop = min(start + 4 + row % 3, length - 3)
        tokens["response_mask"][row, start:stop] = 0
        spans.append((start, stop))
    return tokens, spans


def test_the_table_covers_every_mode():
    assert sorted(POLICY_LOSSES) == sorted(MODES)


def test_no_mode_selects_a_masked_token_and_none_depends_on_the_micro_batches(tiny_model_path):
    spec = EngineSpec(tiny_model_path)
    tokens, spans = tokens_with_tool_spans(seed=3)
    response_mask = tokens["response_mask"].bool()
    batch = frozen_minibatch(spec, 3, layout="legacy", tokens=tokens, micro_batch_size_per_gpu=BATCH // 4)
    layouts = static_layouts(BATCH, 4)

    def updates(actor_config):
        return [one_update(spec, batch, actor_config, layout) for layout in layouts]

    control = updates(_tiny.make_actor_config(loss_mode="vanilla"))
    floor = max_abs_diff(control[0].params, control[1].params)
    assert floor > 0, "no noise floor: the two layouts did not differ at all, the comparison proves nothing"
    for mode, policy_loss in POLICY_LOSSES.items():
        first, second = updates(_tiny.make_actor_config(policy_loss=policy_loss()))
        assert first.masks and len(first.masks) == len(second.masks), mode
        for one, other in zip(first.masks, second.masks, strict=True):
            assert torch.equal(one, other), f"{mode}: the selection depends on the micro-batches"
            mask = fit_width(one, RESPONSE).bool()
            assert mask.any(), f"{mode} selected nothing: the test would prove nothing"
            assert not (mask & ~response_mask).any(), f"{mode} selected a masked (tool or padding) token"
            after_gap = torch.stack([mask[row, stop:].any() for row, (_, stop) in enumerate(spans)])
            assert after_gap.any(), f"{mode} selected nothing after a gap: a shifted mask would go unseen"
        diff = max_abs_diff(first.params, second.params)
        assert diff <= NOISE_FACTOR * floor, (mode, diff, floor)
