"""STARE's per-loss-call rule, the lab's comparator of ``stare_global`` (``methods/stare/authors.py``, ``stare_per_micro_batch``).

Fast, no engine: one loss call against the authors' formula transcribed independently (``tests/test_loss_stare.py``'s
``fork_pg_losses``: their ``torch.topk`` per advantage sign, ``k = max(1, int(n * P + 0.999999))`` at most ``n``,
W on L+, M on L- for C2) aggregated with their ``agg_loss``, value and gradient; the quota taken per call (two
halves of a minibatch are not the whole); ties in (row, position) order; the step settings of a
``provide_selection_mask`` block (gate, W, M) and the configured ones otherwise; bad knobs refused.
Only the lab registers it: ``tests/lab/test_per_micro_batch.py``'s fresh-interpreter test covers both comparators.
The diagnose row (verl's engine): ``tests/diagnose/test_diagnose_stare.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from verl.trainer.ppo.core_algos import agg_loss

from verl_klcov_global.lab import per_micro_batch as lab
from verl_klcov_global.methods.stare import authors as pmb
from verl_klcov_global.lab.tiny import make_actor_config
from verl_klcov_global.loss import provide_selection_mask

from ..support.batches import random_minibatch
from ..test_loss_stare import fork_pg_losses


def _actor(**knobs):
    return make_actor_config(policy_loss=pmb.StarePerMicroBatchPolicyLossConfig(**knobs))


def _inputs(seed, batch=12, length=16):
    advantages, log_probs, mask = random_minibatch(seed, batch=batch, length=length)
    gen = torch.Generator().manual_seed(100 + seed)
    old = log_probs + 0.3 * torch.randn(log_probs.shape, generator=gen)  # ratios beyond both clips
    return old, log_probs, advantages, mask


def _fork_quota(n, ratio):
    """The fork's l.1156-1161, written out: 0 for no candidate, else ceil(n * P) (at least 1), at most n."""
    return 0 if n == 0 else min(n, max(1, int(n * ratio + 0.999999)))


def _call(old, log_prob, advantages, mask, config):
    log_prob = log_prob.clone().requires_grad_(True)
    loss, metrics = pmb.compute_policy_loss_stare_per_micro_batch(
        old_log_prob=old, log_prob=log_prob, advantages=advantages, response_mask=mask, loss_agg_mode="token-mean",
        config=config)
    loss.backward()
    return loss.detach(), log_prob.grad, metrics


def _fork_call(old, log_prob, advantages, mask, **fork):
    log_prob = log_prob.clone().requires_grad_(True)
    loss = agg_loss(loss_mat=fork_pg_losses(old, log_prob, advantages, mask, **fork), loss_mask=mask,
                    loss_agg_mode="token-mean")  # the fork's agg_loss, global_batch_info empty (its dp_actor path)
    loss.backward()
    return loss.detach(), log_prob.grad


@pytest.mark.parametrize("variant", ["O1", "C2"])
@pytest.mark.parametrize("seed", range(4))
def test_one_loss_call_is_the_forks_per_call_rule(variant, seed):
    old, log_prob, advantages, mask = _inputs(seed)
    ratio, w, m = 0.2, 1.3, 0.7
    loss, grad, metrics = _call(old, log_prob, advantages, mask, _actor(
        stare_top_ratio=ratio, stare_reweight_w=w, stare_reweight_m=m, stare_variant=variant))
    theirs, their_grad = _fork_call(old, log_prob, advantages, mask, top_ratio=ratio, variant=variant, w=w, m=m,
                                    gate_on=True)
    # random surprisals: no ties, so torch.topk's order and ours pick the same tokens
    assert torch.equal(loss, theirs) and torch.equal(grad, their_grad)
    valid = mask.bool()
    expected = _fork_quota(int((valid & (advantages > 0)).sum()), ratio)
    if variant == "C2":
        expected += _fork_quota(int((valid & (advantages < 0)).sum()), ratio)
    assert metrics[pmb.SELECTED_METRIC] == expected > 0
    assert metrics[pmb.GATE_METRIC] == 1.0  # no step settings: the configured W and M, the gate open
    assert {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"} <= set(metrics)


def test_the_quota_and_ranking_are_per_call_so_two_halves_are_not_the_whole():
    """The fault stare_global fixes: with the most surprising tokens all in the first half, the whole minibatch's
    top 20% lies there, while each half's call takes its own 20% (its own ceiling), so the second half gets W on
    tokens the whole would not weight."""
    old, log_prob, advantages, mask = _inputs(7, batch=8, length=10)
    advantages = advantages.abs() + 0.1  # one sign: L+ only
    log_prob[:4] -= 20.0  # the first half is far more surprising
    config = _actor(stare_top_ratio=0.2, stare_reweight_w=1.5)
    whole = pmb.per_micro_batch_stare_mask(log_prob, advantages, mask, 0.2, False)
    halves = [pmb.per_micro_batch_stare_mask(log_prob[rows], advantages[rows], mask[rows], 0.2, False)
              for rows in (slice(0, 4), slice(4, 8))]
    assert not bool(whole.mask[4:].any()) and bool(halves[1].mask.any())
    counts = [int(mask[rows].sum()) for rows in (slice(0, 4), slice(4, 8))]
    assert [h.num_selected for h in halves] == [_fork_quota(n, 0.2) for n in counts]
    assert sum(h.num_selected for h in halves) >= whole.num_selected == _fork_quota(sum(counts), 0.2)
    for rows, half in zip((slice(0, 4), slice(4, 8)), halves):  # each call is the fork's rule on its own rows
        loss, _, metrics = _call(old[rows], log_prob[rows], advantages[rows], mask[rows], config)
        theirs, _ = _fork_call(old[rows], log_prob[rows], advantages[rows], mask[rows], top_ratio=0.2, variant="O1",
                               w=1.5, m=0.9, gate_on=True)
        assert torch.equal(loss, theirs) and metrics[pmb.SELECTED_METRIC] == half.num_selected


def test_ties_at_the_kth_surprisal_go_by_row_then_position():
    """The fork's torch.topk leaves the order of equal surprisals unspecified; the comparator takes (row, position)
    within its micro-batch, the order every mode uses: exactly k tokens, the first ones."""
    log_prob = torch.full((3, 5), -1.25)
    advantages = torch.ones(3, 5)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[0, :2] = False  # padding is never a candidate
    chosen = pmb.per_micro_batch_stare_mask(log_prob, advantages, mask, 0.3, False)
    expected = torch.zeros(3, 5, dtype=torch.bool)
    expected[0, 2:] = True
    expected[1, :1] = True  # 13 candidates, k = ceil(3.9) = 4: the three of row 0, then row 1's first
    assert torch.equal(chosen.mask, expected)


def test_a_provided_step_settings_gate_w_and_m_apply_else_the_configured_ones_with_the_gate_open():
    old, log_prob, advantages, mask = _inputs(3)
    config = _actor(stare_top_ratio=0.1, stare_reweight_w=1.1, stare_reweight_m=0.9, stare_variant="C2",
                    stare_target_entropy=0.0)  # the target is not read: no batch entropy in a loss call
    configured, _, metrics = _call(old, log_prob, advantages, mask, config)
    fork = dict(top_ratio=0.1, variant="C2")
    assert torch.equal(configured, _fork_call(old, log_prob, advantages, mask, w=1.1, m=0.9, gate_on=True, **fork)[0])
    ignored_mask = torch.zeros_like(mask)  # stare_global's mask slice: the comparator selects on its own
    with provide_selection_mask(ignored_mask, settings=SimpleNamespace(gate_on=True, reweight_w=1.4, reweight_m=0.6)):
        moved, _, _ = _call(old, log_prob, advantages, mask, config)
    assert torch.equal(moved, _fork_call(old, log_prob, advantages, mask, w=1.4, m=0.6, gate_on=True, **fork)[0])
    with provide_selection_mask(ignored_mask, settings=SimpleNamespace(gate_on=False, reweight_w=1.4, reweight_m=0.6)):
        shut, _, metrics = _call(old, log_prob, advantages, mask, config)
    assert torch.equal(shut, _fork_call(old, log_prob, advantages, mask, w=1.4, m=0.6, gate_on=False, **fork)[0])
    assert metrics[pmb.GATE_METRIC] == 0.0 and metrics[pmb.SELECTED_METRIC] > 0  # selected, weight 1
    assert not torch.equal(configured, shut) and not torch.equal(configured, moved)


@pytest.mark.parametrize("knobs, match", [
    (dict(stare_top_ratio=1.5), "stare_top_ratio must be finite and in"),
    (dict(stare_reweight_w=0.5), "stare_reweight_w must be finite and >= 1"),
    (dict(stare_variant="C3"), "stare_variant must be one of"),
])
def test_bad_knobs_are_refused_naming_the_key(knobs, match):
    with pytest.raises(ValueError, match=match):
        pmb.StarePerMicroBatchPolicyLossConfig(**knobs)


def test_an_aggregation_whose_entropy_is_a_sum_is_refused_naming_the_comparator():
    old, log_prob, advantages, mask = _inputs(0)
    config = make_actor_config(policy_loss=pmb.StarePerMicroBatchPolicyLossConfig(), loss_agg_mode="token-sum")
    with pytest.raises(ValueError, match="stare_per_micro_batch: .*loss_agg_mode='token-sum'"):
        _call(old, log_prob, advantages, mask, config)


def test_registering_it_is_idempotent_and_names_it():
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    assert lab.register(pmb.COMPARATOR) == lab.register(pmb.COMPARATOR) == "stare_per_micro_batch"
    assert POLICY_LOSS_REGISTRY["stare_per_micro_batch"] is pmb.compute_policy_loss_stare_per_micro_batch
    assert pmb.StarePerMicroBatchPolicyLossConfig().loss_mode == pmb.NAME
    assert pmb.SELECTED_METRIC in lab.selected_metrics()
