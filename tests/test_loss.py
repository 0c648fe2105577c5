"""The registered kl_cov_global loss: verl's kl_cov objective on a provided mask, and its channel."""

from __future__ import annotations

import unittest.mock

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn
from verl.workers.config import ActorConfig, PolicyLossConfig

from verl_klcov_global import (
    KLCovMaskUnavailableError,
    provide_selection_mask,
    select_kl_cov_tokens,
)

from .support.batches import boundary_gap, random_minibatch

_COMMON_AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]


def _verls_agg_modes() -> list[str]:
    """The aggregation modes the installed verl's ``agg_loss`` accepts: verl 0.9 added "token-sum"."""
    from verl.trainer.ppo.core_algos import agg_loss

    accepted = []
    for mode in _COMMON_AGG_MODES + ["token-sum"]:
        try:
            agg_loss(loss_mat=torch.ones(1, 2), loss_mask=torch.ones(1, 2), loss_agg_mode=mode)
        except ValueError as error:
            assert "Invalid loss_agg_mode" in str(error), error
            continue
        accepted.append(mode)
    assert accepted[: len(_COMMON_AGG_MODES)] == _COMMON_AGG_MODES  # in every supported verl
    return accepted


#: Compared against verl's kl_cov / clip_cov in every mode verl offers.
LOSS_AGG_MODES = _verls_agg_modes()


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


def test_every_mode_of_the_table_is_registered_as_its_own_loss():
    """The registry holds the table's functions, not some other object under the same names."""
    from verl_klcov_global.modes import MODES

    assert {"kl_cov_global", "clip_cov_global"} <= set(MODES)
    for name, mode in MODES.items():
        assert POLICY_LOSS_REGISTRY[name] is mode.policy_loss
        assert mode.policy_loss.__name__ == f"compute_policy_loss_{name}"


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
    with provide_selection_mask(selection.mask, selection.figures()):
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
    with provide_selection_mask(wrong), pytest.raises(ValueError, match="does not belong to this micro-batch"):
        get_policy_loss_fn("kl_cov_global")(**inputs, config=actor_config("kl_cov_global"))
    outside = ~inputs["response_mask"]
    if outside.any():
        with provide_selection_mask(outside), pytest.raises(ValueError, match="outside response_mask"):
            get_policy_loss_fn("kl_cov_global")(**inputs, config=actor_config("kl_cov_global"))


def test_channel_is_scoped_to_the_block():
    inputs = loss_inputs(1)
    with provide_selection_mask(torch.zeros_like(inputs["response_mask"])):
        get_policy_loss_fn("kl_cov_global")(**inputs, config=actor_config("kl_cov_global"))
    with pytest.raises(KLCovMaskUnavailableError):
        get_policy_loss_fn("kl_cov_global")(**inputs, config=actor_config("kl_cov_global"))


def test_missing_mask_error_names_why_the_hook_did_not_install(monkeypatch):
    from verl_klcov_global import loss

    monkeypatch.setattr(loss, "_HOOK_INSTALL_ERROR", RuntimeError("BaseEngine.train_batch moved"))
    with pytest.raises(KLCovMaskUnavailableError, match="hook failed to install in this process.*train_batch moved"):
        get_policy_loss_fn("kl_cov_global")(**loss_inputs(0), config=actor_config("kl_cov_global"))


def test_plugin_install_records_a_hook_failure(monkeypatch):
    from verl_klcov_global import loss, plugin
    from verl_klcov_global.engine import patches

    import dataclasses

    def broken():
        raise RuntimeError("verl changed")

    catalogue = tuple(dataclasses.replace(entry, install=broken) if entry.name == "train_batch_prepass" else entry
                      for entry in patches.PATCHES)
    monkeypatch.setattr(patches, "PATCHES", catalogue)
    monkeypatch.setattr(loss, "_HOOK_INSTALL_ERROR", None)
    with pytest.raises(RuntimeError, match="verl changed"):
        plugin.install()
    assert "verl changed" in repr(loss._HOOK_INSTALL_ERROR)


# ---------------------------------------------------------------------------------------------
# clip_cov_global: verl's clip_cov objective on a provided mask


def clip_cov_config(loss_mode, ratio=0.5, lb=0.2, ub=3.0, global_batch_info=None, low=0.2, high=0.28):
    config = ActorConfig(
        strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
        clip_ratio_low=low, clip_ratio_high=high,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode, clip_cov_ratio=ratio, clip_cov_lb=lb, clip_cov_ub=ub),
    )
    config.global_batch_info.update(global_batch_info or {})
    return config


def clip_cov_selection(inputs, ratio, lb=0.2, ub=3.0, seed=0):
    from verl_klcov_global import select_clip_cov_tokens

    token_ids = torch.arange(inputs["advantages"].numel()).reshape(inputs["advantages"].shape)
    return select_clip_cov_tokens(inputs["advantages"], inputs["log_prob"].detach(), inputs["old_log_prob"],
                                  inputs["response_mask"], token_ids, clip_cov_ratio=ratio, clip_cov_lb=lb,
                                  clip_cov_ub=ub, clip_ratio_low=0.2, clip_ratio_high=0.28, seed=seed)


def upstream_draws(selected: torch.Tensor, candidates: torch.Tensor):
    """A stand-in for torch.randperm that makes upstream clip_cov pick exactly ``selected`` first."""
    order = torch.nonzero(candidates.reshape(-1)).flatten().tolist()
    chosen = set(torch.nonzero(selected.reshape(-1)).flatten().tolist())
    first = [i for i, flat in enumerate(order) if flat in chosen]
    perm = torch.tensor(first + [i for i in range(len(order)) if i not in set(first)], dtype=torch.long)

    def randperm(n, *args, **kwargs):
        assert n == len(order), (n, len(order))
        return perm

    return randperm


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), agg_mode=st.sampled_from(LOSS_AGG_MODES), with_is=st.booleans(),
       ratio=st.sampled_from([0.01, 0.05, 0.5]),
       global_info=st.sampled_from([{}, {"dp_size": 1, "batch_num_tokens": 500, "global_batch_size": 12}]))
def test_clip_cov_global_equals_verl_clip_cov_drawing_the_same_tokens(seed, agg_mode, with_is, ratio, global_info):
    """Upstream's draw (torch.randperm) steered to our tokens: loss, gradient and metrics are verl's, bit for bit."""
    from verl_klcov_global.methods.clip_cov.selection import clip_cov_quota

    from .support.batches import reference_candidates

    inputs = loss_inputs(seed, with_is_weights=with_is)
    selection = clip_cov_selection(inputs, ratio)
    ref_inputs = dict(advantages=inputs["advantages"], log_probs=inputs["log_prob"].detach(),
                      old_log_probs=inputs["old_log_prob"], response_mask=inputs["response_mask"])
    candidates = reference_candidates(ref_inputs, 0.2, 3.0, 0.2, 0.28)[0]
    assume(int(candidates.sum()) == selection.num_candidates)  # no token on the window's float32 edge
    assert selection.quota == clip_cov_quota(int(inputs["response_mask"].sum()), ratio)
    with unittest.mock.patch.object(torch, "randperm", upstream_draws(selection.mask, candidates)):
        ref_loss, ref_grad, ref_metrics = loss_and_grad("clip_cov", inputs, agg_mode,
                                                        clip_cov_config("clip_cov", ratio, global_batch_info=global_info))
    with provide_selection_mask(selection.mask, selection.figures()):
        loss, grad, metrics = loss_and_grad("clip_cov_global", inputs, agg_mode,
                                            clip_cov_config("clip_cov_global", ratio, global_batch_info=global_info))
    assert torch.equal(loss, ref_loss)
    assert torch.equal(grad, ref_grad)
    assert not grad[selection.mask].any()  # corr = 0: no gradient through the selected tokens
    assert metrics["actor/pg_clipfrac"] == ref_metrics["actor/pg_clipfrac"]
    assert metrics["actor/ppo_kl"] == ref_metrics["actor/ppo_kl"]
    assert metrics["actor/clip_cov/clipped"] == selection.num_selected
    assert metrics["actor/clip_cov/selected_in_micro_batch"] == selection.mask.sum().item()
    for name in ("quota", "candidates", "valid_tokens", "nonfinite_tokens", "ppo_clipped"):
        assert f"actor/clip_cov/{name}" in metrics


def test_clip_cov_global_selected_tokens_still_count_in_the_denominator():
    inputs = loss_inputs(4)
    mask = inputs["response_mask"].clone()
    mask[:, 1:] = False  # first token of every sequence
    mask &= inputs["response_mask"]
    config = clip_cov_config("clip_cov_global")
    with provide_selection_mask(torch.zeros_like(mask)):
        full, _, _ = loss_and_grad("clip_cov_global", inputs, "token-mean", config)
    with provide_selection_mask(mask):
        cut, _, metrics = loss_and_grad("clip_cov_global", inputs, "token-mean", config)
    r = torch.exp(inputs["log_prob"].detach() - inputs["old_log_prob"])
    a = inputs["advantages"]
    per_token = torch.maximum(-a * r, -a * torch.clamp(r, 0.8, 1.28))
    n = inputs["response_mask"].sum()
    torch.testing.assert_close(cut, (per_token * (inputs["response_mask"] & ~mask)).sum() / n)
    torch.testing.assert_close(full, (per_token * inputs["response_mask"]).sum() / n)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(float(mask.sum() / n))


def test_clip_cov_global_without_a_mask_raises_with_the_fix():
    from verl_klcov_global import ClipCovMaskUnavailableError, SelectionMaskUnavailableError

    with pytest.raises(ClipCovMaskUnavailableError, match="loss_mode=clip_cov_global .*prepass hook is not active"):
        get_policy_loss_fn("clip_cov_global")(**loss_inputs(0), config=clip_cov_config("clip_cov_global"))
    assert issubclass(KLCovMaskUnavailableError, SelectionMaskUnavailableError)



# ---------------------------------------------------------------------------------------------
# high_entropy_global: verl's vanilla on the selected tokens' advantages, aggregated over all tokens


def vanilla_config(loss_mode, global_batch_info=None, low=0.2, high=0.28, clip_ratio_c=3.0):
    config = ActorConfig(
        strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
        clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=clip_ratio_c,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode),
    )
    config.global_batch_info.update(global_batch_info or {})
    return config


def high_entropy_inputs(seed, with_is_weights, ratio):
    """Loss inputs with log-ratios large enough for both clips and the dual clip, and a high-entropy selection."""
    from verl_klcov_global import select_high_entropy_tokens

    inputs = loss_inputs(seed, with_is_weights=with_is_weights)
    gen = torch.Generator().manual_seed(seed + 2)
    inputs["old_log_prob"] = inputs["log_prob"].detach() + 1.0 * torch.randn(inputs["log_prob"].shape, generator=gen)
    entropy = torch.rand(inputs["log_prob"].shape, generator=gen) * 2
    return inputs, select_high_entropy_tokens(entropy, inputs["response_mask"], ratio)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), agg_mode=st.sampled_from(LOSS_AGG_MODES), with_is=st.booleans(),
       ratio=st.sampled_from([0.05, 0.2, 1.0]), clip=st.sampled_from([(0.2, 0.28, 3.0), (0.1, 0.5, 1.5)]),
       global_info=st.sampled_from([{}, {"dp_size": 1, "batch_num_tokens": 500, "global_batch_size": 12}]))
def test_high_entropy_global_is_verl_vanilla_on_the_masked_advantages(seed, agg_mode, with_is, ratio, clip,
                                                                      global_info):
    """Loss, gradient and metrics = verl's own vanilla on ``A * mask`` with the unchanged response_mask, bit for bit
    (rollout IS weights, clip_ratio_low/high and the dual clip clip_ratio_c included); rho = 1 is vanilla itself."""
    inputs, selection = high_entropy_inputs(seed, with_is, ratio)
    low, high, c = clip
    reference = {**inputs, "advantages": inputs["advantages"] * selection.mask}
    ref_loss, ref_grad, ref_metrics = loss_and_grad("vanilla", reference, agg_mode,
                                                    vanilla_config("vanilla", global_info, low, high, c))
    with provide_selection_mask(selection.mask, selection.figures()):
        loss, grad, metrics = loss_and_grad("high_entropy_global", inputs, agg_mode,
                                            vanilla_config("high_entropy_global", global_info, low, high, c))
    assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad)
    for name in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert metrics[name] == ref_metrics[name], name
    assert not grad[~selection.mask].any()  # unselected tokens: exactly no gradient
    assert metrics["actor/high_entropy/selected_in_micro_batch"] == selection.mask.sum().item() == selection.quota
    for name, value in selection.figures().items():
        assert metrics[f"actor/high_entropy/{name}"] == value
    if ratio == 1.0:  # every valid token selected: verl's vanilla on the plain advantages
        plain_loss, plain_grad, _ = loss_and_grad("vanilla", inputs, agg_mode,
                                                  vanilla_config("vanilla", global_info, low, high, c))
        assert torch.equal(loss, plain_loss) and torch.equal(grad, plain_grad)


def test_high_entropy_global_exercises_both_clips_and_the_dual_clip():
    """The inputs of the comparison above do reach every branch of vanilla (else it proves little)."""
    inputs, selection = high_entropy_inputs(0, False, 1.0)
    with provide_selection_mask(selection.mask):
        _, _, metrics = loss_and_grad("high_entropy_global", inputs, "token-mean", vanilla_config("high_entropy_global"))
    assert metrics["actor/pg_clipfrac"] > 0.05 and metrics["actor/pg_clipfrac_lower"] > 0


def test_high_entropy_global_normalises_by_all_tokens_and_ignores_unselected_nonfinite_advantages():
    """token-mean: sum over selected tokens / all valid tokens (the paper's 1/sum|o_i|), not / selected tokens;
    an unselected token with a NaN advantage contributes exactly 0."""
    inputs, selection = high_entropy_inputs(3, False, 0.2)
    unselected = (inputs["response_mask"] & ~selection.mask).nonzero()[0]
    inputs["advantages"] = inputs["advantages"].clone()
    inputs["advantages"][tuple(unselected)] = float("nan")
    with provide_selection_mask(selection.mask):
        loss, grad, _ = loss_and_grad("high_entropy_global", inputs, "token-mean", vanilla_config("high_entropy_global"))
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    r = torch.exp(torch.clamp(inputs["log_prob"].detach() - inputs["old_log_prob"], -20, 20))
    a = torch.where(selection.mask, inputs["advantages"], 0.0)
    per_token = torch.maximum(-a * r, -a * torch.clamp(r, 0.8, 1.28))
    per_token = torch.where(a < 0, torch.minimum(per_token, -a * 3.0), per_token)
    torch.testing.assert_close(loss, per_token[selection.mask].sum() / inputs["response_mask"].sum())


def test_high_entropy_global_without_a_mask_raises_with_the_fix():
    from verl_klcov_global import HighEntropyMaskUnavailableError

    with pytest.raises(HighEntropyMaskUnavailableError, match="loss_mode=high_entropy_global .*prepass hook"):
        get_policy_loss_fn("high_entropy_global")(**loss_inputs(0), config=vanilla_config("high_entropy_global"))
