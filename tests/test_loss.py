"""The registered kl_cov_global loss: verl's kl_cov objective on a provided mask, and its channel."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn
from verl.workers.config import ActorConfig, PolicyLossConfig

from verl_klcov_global import KLCovMaskUnavailableError, provide_kl_cov_mask, select_kl_cov_tokens

from .batches import boundary_gap, random_minibatch

LOSS_AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]


def actor_config(loss_mode, ratio=0.05, coef=1.0, global_batch_info=None):
    config = ActorConfig(
        strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode, kl_cov_ratio=ratio, ppo_kl_coef=coef),
    )
    config.global_batch_info.update(global_batch_info or {})
    return config


def loss_inputs(seed, batch=12, length=20, with_is_weights=False):
    advantages, current, response_mask = random_minibatch(seed, batch, length)
    gen = torch.Generator().manual_seed(seed + 1)
    old_log_prob = current + 0.05 * torch.randn(current.shape, generator=gen)
    log_prob = current.clone().requires_grad_(True)
    weights = torch.rand(current.shape, generator=gen) + 0.5 if with_is_weights else None
    return dict(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                response_mask=response_mask, rollout_is_weights=weights)


def loss_and_grad(loss_mode, inputs, agg_mode, config):
    log_prob = inputs["log_prob"].detach().clone().requires_grad_(True)
    loss, metrics = get_policy_loss_fn(loss_mode)(
        **{**inputs, "log_prob": log_prob}, loss_agg_mode=agg_mode, config=config
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.detach(), grad, metrics


def test_registered_through_the_entry_point():
    assert "kl_cov_global" in POLICY_LOSS_REGISTRY


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), agg_mode=st.sampled_from(LOSS_AGG_MODES), with_is=st.booleans(),
       ratio=st.sampled_from([0.002, 0.05, 0.5]),
       global_info=st.sampled_from([{}, {"dp_size": 1, "batch_num_tokens": 500, "global_batch_size": 12}]))
def test_equals_verl_kl_cov_on_the_whole_minibatch(seed, agg_mode, with_is, ratio, global_info):
    inputs = loss_inputs(seed, with_is_weights=with_is)
    # upstream's topk breaks boundary ties arbitrarily: compare only where the boundary is clear
    assume(boundary_gap(inputs["advantages"], inputs["log_prob"].detach(), inputs["response_mask"], ratio) > 1e-5)
    selection = select_kl_cov_tokens(inputs["advantages"], inputs["log_prob"], inputs["response_mask"], ratio)

    ref_loss, ref_grad, ref_metrics = loss_and_grad("kl_cov", inputs, agg_mode, actor_config("kl_cov", ratio, 1.0, global_info))
    _, no_penalty_grad, _ = loss_and_grad("kl_cov", inputs, agg_mode, actor_config("kl_cov", ratio, 0.0, global_info))
    with provide_kl_cov_mask(selection.mask, selection.figures()):
        loss, grad, metrics = loss_and_grad(
            "kl_cov_global", inputs, agg_mode, actor_config("kl_cov_global", ratio, 1.0, global_info)
        )

    # tokens kl_cov penalised = where its gradient differs from the penalty-free one
    upstream_selected = (ref_grad - no_penalty_grad) != 0
    assert torch.equal(upstream_selected, selection.mask)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-9)
    assert metrics["actor/ppo_kl"] == pytest.approx(ref_metrics["actor/ppo_kl"])
    assert metrics["actor/kl_cov/quota"] == selection.quota
    assert metrics["actor/kl_cov/selected_in_micro_batch"] == selection.mask.sum().item()


def test_without_a_mask_raises_with_the_fix():
    inputs = loss_inputs(0)
    with pytest.raises(KLCovMaskUnavailableError, match="prepass hook is not active"):
        get_policy_loss_fn("kl_cov_global")(**inputs, loss_agg_mode="token-mean", config=actor_config("kl_cov_global"))


def test_mask_of_another_micro_batch_is_rejected():
    inputs = loss_inputs(0)
    wrong = torch.zeros(3, 3, dtype=torch.bool)
    with provide_kl_cov_mask(wrong), pytest.raises(ValueError, match="does not belong to this micro-batch"):
        get_policy_loss_fn("kl_cov_global")(**inputs, config=actor_config("kl_cov_global"))
    outside = ~inputs["response_mask"]
    if outside.any():
        with provide_kl_cov_mask(outside), pytest.raises(ValueError, match="outside response_mask"):
            get_policy_loss_fn("kl_cov_global")(**inputs, config=actor_config("kl_cov_global"))


def test_channel_is_scoped_to_the_block():
    inputs = loss_inputs(1)
    with provide_kl_cov_mask(torch.zeros_like(inputs["response_mask"])):
        get_policy_loss_fn("kl_cov_global")(**inputs, config=actor_config("kl_cov_global"))
    with pytest.raises(KLCovMaskUnavailableError):
        get_policy_loss_fn("kl_cov_global")(**inputs, config=actor_config("kl_cov_global"))


def test_missing_mask_error_names_why_the_hook_did_not_install(monkeypatch):
    from verl_klcov_global import loss

    monkeypatch.setattr(loss, "_HOOK_INSTALL_ERROR", RuntimeError("BaseEngine.train_batch moved"))
    with pytest.raises(KLCovMaskUnavailableError, match="hook failed to install in this process.*train_batch moved"):
        get_policy_loss_fn("kl_cov_global")(**loss_inputs(0), config=actor_config("kl_cov_global"))


def test_plugin_install_records_a_hook_failure(monkeypatch):
    from verl_klcov_global import hook, loss, plugin

    def broken():
        raise RuntimeError("verl changed")

    monkeypatch.setattr(hook, "install_hook", broken)
    monkeypatch.setattr(loss, "_HOOK_INSTALL_ERROR", None)
    with pytest.raises(RuntimeError, match="verl changed"):
        plugin.install()
    assert "verl changed" in repr(loss._HOOK_INSTALL_ERROR)
