"""The covariance figures of both selections against a direct float64 computation.

(Bit-identity over 2 gloo ranks: ``tests/selection/test_distributed.py`` compares every figure of
a sharded selection with the single-process one, these included.)
"""

from __future__ import annotations

import math

import pytest
import torch

from verl_klcov_global.methods.clip_cov.selection import select_clip_cov_tokens
from verl_klcov_global.methods.kl_cov.selection import select_kl_cov_tokens
from verl_klcov_global.selection.covariance import CovarianceFigures

from ..support.batches import CLIP_COV_KNOBS, clip_cov_inputs, random_minibatch

# The sums are 64-bit fixed point on a grid of 2**-e with e = floor(62 - log2(bound * N)): each term
# is off by at most half a grid step, so a sum of N terms by N/2 steps, ~2**-62 of bound * N^2 -- far
# below 1e-12 of these figures' size (bound <= 4 max|A| max|logp|, N < 10^3 here).
REL = 1e-12


def _direct(a, lp, mask, selected):
    valid = mask.bool() & torch.isfinite(a) & torch.isfinite(lp)
    a64, lp64 = a.double(), lp.double()
    cov = (a64 - a64[valid].mean()) * (lp64 - lp64[valid].mean())
    positive = cov[valid].clamp_min(0).sum()
    return {
        "cov_mean": float(cov[valid].mean()),
        "selected_cov_mean": float(cov[selected].mean()) if selected.any() else math.nan,
        "selected_cov_share": float(cov[selected].clamp_min(0).sum() / positive) if positive > 0 else math.nan,
    }


def _close(figures, direct):
    for name, value in direct.items():
        if math.isnan(value):
            assert name not in figures, name
        else:
            scale = max(abs(value), 1e-3)
            assert abs(figures[name] - value) <= REL * scale, (name, figures[name], value)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("ratio", [0.0002, 0.05, 0.3, 1.0])
def test_kl_cov_figures_equal_the_direct_computation(seed, ratio):
    a, lp, m = random_minibatch(seed, batch=9, length=13)
    result = select_kl_cov_tokens(a, lp, m, ratio)
    _close(result.figures(), _direct(a, lp, m, result.mask))
    if ratio == 1.0:  # everything selected: all of the positive covariance, the mean equals the global one
        assert result.figures()["selected_cov_share"] == 1.0
        assert math.isclose(result.figures()["selected_cov_mean"], result.figures()["cov_mean"], rel_tol=REL,
                            abs_tol=1e-15)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("ratio", [0.002, 0.05, 0.5])
def test_clip_cov_figures_equal_the_direct_computation_with_and_without_a_draw(seed, ratio):
    inputs = clip_cov_inputs(seed, 10, 14)
    knobs = {**CLIP_COV_KNOBS, "clip_cov_ratio": ratio, "clip_cov_lb": 0.0, "seed": seed}
    result = select_clip_cov_tokens(**inputs, **knobs)
    valid = inputs["response_mask"].bool()
    for key in ("advantages", "log_probs", "old_log_probs"):
        valid &= torch.isfinite(inputs[key])
    _close(result.figures(), _direct(inputs["advantages"], inputs["log_probs"], valid, result.mask))


def test_figures_cover_both_branches_of_clip_cov():
    """Not vacuous: the cases above include draws (quota < candidates) and no-draw selections."""
    drew, kept_all = 0, 0
    for seed in range(12):
        for ratio in (0.002, 0.05, 0.5):
            inputs = clip_cov_inputs(seed, 10, 14)
            r = select_clip_cov_tokens(**inputs, **{**CLIP_COV_KNOBS, "clip_cov_ratio": ratio, "clip_cov_lb": 0.0,
                                                     "seed": seed})
            drew += r.num_selected < r.num_candidates
            kept_all += 0 < r.num_selected == r.num_candidates
    assert drew >= 5 and kept_all >= 3, (drew, kept_all)


def test_undefined_figures_are_left_out_never_nan():
    # no valid token: no covariance figure at all
    a, lp, m = random_minibatch(1, batch=3, length=5)
    empty = select_kl_cov_tokens(a, lp, torch.zeros_like(m), 0.1)
    assert not {"cov_mean", "selected_cov_mean", "selected_cov_share"} & set(empty.figures())
    # a constant advantage (one GRPO group of one micro-batch): every covariance is 0, no positive part
    const = select_kl_cov_tokens(torch.full((4, 6), 0.7), -torch.rand(4, 6), torch.ones(4, 6, dtype=torch.bool), 0.25)
    figures = const.figures()
    assert figures["cov_mean"] == 0.0 and figures["selected_cov_mean"] == 0.0
    assert "selected_cov_share" not in figures
    assert all(not math.isnan(v) for v in figures.values())
    assert CovarianceFigures().figures() == {}


def test_figures_do_not_depend_on_row_order_or_padding_width():
    """Fixed-point sums: the same tokens in another order or with extra padding give the same bits."""
    a, lp, m = random_minibatch(5, batch=8, length=11)
    base = select_kl_cov_tokens(a, lp, m, 0.1).figures()
    order = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    shuffled = select_kl_cov_tokens(a[order], lp[order], m[order], 0.1).figures()
    pad = lambda x, v: torch.cat([x, torch.full((8, 5), v, dtype=x.dtype)], dim=1)  # noqa: E731
    padded = select_kl_cov_tokens(pad(a, 3.0), pad(lp, -9.0), pad(m, False), 0.1).figures()
    for name in ("cov_mean", "selected_cov_share", "selected_cov_mean"):
        assert shuffled[name] == base[name] == padded[name], name
