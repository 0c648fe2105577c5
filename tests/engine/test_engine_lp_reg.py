"""lp_reg_global in verl's real FSDP engine (CPU, fp32): the quota, the proxy, the objective.

* Invariance: 1 vs 8 training micro-batches (dynamic; static fsdp2 packed): masks and the selection's figures bit for
  bit, parameters within ``NOISE_FACTOR`` x the ``vanilla`` control's difference.
* The proxy held from verl's log-prob pass equals an independent full-vocabulary computation: the model's logits
  from a plain Hugging Face forward, the authors' ``apply_min_p`` transcribed (``tests/engine/test_proxy.py``).
* On one micro-batch holding the whole minibatch (quota > 1), the loss verl aggregates is the authors' formula
  (``compute_policy_loss_lp_reg`` transcribed) on the loss call's own tensors.
* DP 2 on gloo gives the single process's mask and figures bit for bit.
* The proxy is held for the whole update: 2 minibatches read it after the first optimizer step; a missing proxy
  raises on every rank, never a silent unregularised step.
"""

from __future__ import annotations

import pytest
import torch
from verl.trainer.ppo.core_algos import agg_loss, kl_penalty

from verl_klcov_global import loss as plugin_loss
from verl_klcov_global.config import LpRegGlobalPolicyLossConfig
from verl_klcov_global.engine import reuse
from verl_klcov_global.engine.step import ProxyUnavailableError
from verl_klcov_global.lab import tiny as _tiny
from verl_klcov_global.lab.experiment import (
    EngineSpec, MicroBatchLayout, dynamic_layouts, frozen_minibatch, one_update, run_block, static_layouts,
)
from verl_klcov_global.layout import padded
from verl_klcov_global.methods.lp_reg.row import LP_REG

from ..support.gloo import spawn_gloo
from ..support.selections import recorded_selections
from .test_proxy import authors_proxy

pytestmark = pytest.mark.slow  # verl's real engine on CPU: the slow tier

BATCH, PROMPT, RESPONSE = 32, 8, 48
SEQ = PROMPT + RESPONSE
NOISE_FACTOR = 10
MODES = ("vanilla", "lp_reg_global")
#: 5% of the A < 0 tokens, 2% of the A > 0 ones. kappa 0.01 on the peaked tiny model (``peaked_model_path``) cuts a
#: tail whose mass is well above float noise, with some selected tokens inside the support: those are regularised
LP_REG_KNOBS = dict(lp_reg_neg_ratio=0.05, lp_reg_pos_ratio=0.02, lp_reg_min_p=0.01)
#: the tiny model's output weights times this: its next-token distribution is near-uniform (max / median p about
#: 1.6, so any kappa <= 0.5 keeps every token), and the random response tokens lie far below any min-p threshold
PEAK = 6.0


@pytest.fixture(scope="module")
def peaked_model_path(tiny_model_path, tmp_path_factory):
    """The tiny model with its LM head scaled by :data:`PEAK` (max / median p about 18): a min-p filter that cuts."""
    import shutil

    from transformers import AutoModelForCausalLM

    path = str(tmp_path_factory.mktemp("peaked") / "model")
    shutil.copytree(tiny_model_path, path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(PEAK)
    model.save_pretrained(path)
    return path


def actor_config_for(mode, **kwargs):
    if mode == "lp_reg_global":
        return _tiny.make_actor_config(policy_loss=LpRegGlobalPolicyLossConfig(**LP_REG_KNOBS), **kwargs)
    return _tiny.make_actor_config(loss_mode=mode, **kwargs)


def _batch(spec, seed):
    return frozen_minibatch(spec, seed, batch_size=BATCH, prompt_len=PROMPT, response_len=RESPONSE, vary_lengths=True)


def _scalar(value):
    values = getattr(value, "values", None)
    return float(values[0]) if values is not None else float(value[0] if isinstance(value, list) else value)


def _step_figures(spec, batch, layout):
    outcome = one_update(spec, batch, actor_config_for("lp_reg_global"), layout)
    per_step = [k for k in outcome.metrics if k.startswith(LP_REG.metric_prefix) and not k.endswith(
        ("_seconds", "prepass_share", "selected_in_micro_batch", "per_call_switched_off"))]
    return outcome, {k: _scalar(outcome.metrics[k]) for k in per_step}


@pytest.mark.parametrize("kind", ["dynamic", "static-fsdp2-packed"])
def test_masks_and_figures_do_not_depend_on_the_micro_batches(peaked_model_path, kind, capsys):
    spec = EngineSpec(peaked_model_path) if kind == "dynamic" else EngineSpec(peaked_model_path, strategy="fsdp2",
                                                                              use_remove_padding=True)
    batch = _batch(spec, 0 if kind == "dynamic" else 1)
    layouts = dynamic_layouts(BATCH, SEQ, 8) if kind == "dynamic" else static_layouts(BATCH, 8)
    results = run_block(spec, batch, layouts, actor_config_for, modes=MODES)
    control, ours = results["vanilla"], results["lp_reg_global"]
    assert ours.masks_identical is True
    assert ours.selected_per_layout[0] == ours.selected_per_layout[1] > 0
    assert control.max_param_diff > 0, "no noise floor: the two layouts gave the same control update"
    assert ours.max_param_diff <= NOISE_FACTOR * control.max_param_diff, (ours.max_param_diff, control.max_param_diff)
    (_, one), (_, eight) = (_step_figures(spec, batch, layout) for layout in layouts)
    prefix = LP_REG.metric_prefix
    # every figure bit for bit (the selection's, and the regularised count: the support test's margins here are far
    # above float noise), except kl_mean, a float sum of the training forward's values, whose last bits follow the
    # micro-batch company on some CPUs (docs/DEVELOPING.md): within float32 rounding of its terms
    kl = prefix + "kl_mean"
    assert {k: v for k, v in one.items() if k != kl} == {k: v for k, v in eight.items() if k != kl}
    assert abs(one[kl] - eight[kl]) <= 1e-5 * abs(one[kl])
    assert one[f"{prefix}selected_negative"] > 1 and one[f"{prefix}selected_positive"] > 0
    assert one[f"{prefix}regularised"] > 0 and one[f"{prefix}kl_mean"] > 0
    with capsys.disabled():
        print(f"\n[lp_reg_global {kind} 1 vs 8] max|dtheta| / control "
              f"{ours.max_param_diff / control.max_param_diff:.2f}; figures {one}; 8 micro-batches {eight}")


def _capture_held_proxy(monkeypatch):
    """Every ``reuse.held_proxy`` answer the step reads: (data, proxy)."""
    captured = []
    real = reuse.held_proxy

    def held(engine, data):
        proxy, why = real(engine, data)
        captured.append((data, proxy))
        return proxy, why

    monkeypatch.setattr(reuse, "held_proxy", held)
    return captured


@pytest.mark.parametrize("packed", [False, True])
def test_the_held_proxy_is_an_independent_full_vocabulary_computation(peaked_model_path, monkeypatch, packed):
    """The proxy from verl's log-prob pass (padded and remove-padding forwards, temperature 0.7) against a plain
    Hugging Face forward of every row and the authors' apply_min_p transcribed."""
    from transformers import AutoModelForCausalLM

    spec = EngineSpec(peaked_model_path, strategy="fsdp2", use_remove_padding=True) if packed else \
        EngineSpec(peaked_model_path)
    batch = frozen_minibatch(spec, 4, batch_size=16, prompt_len=PROMPT, response_len=RESPONSE, vary_lengths=True,
                             temperature=0.7)
    captured = _capture_held_proxy(monkeypatch)
    layout = MicroBatchLayout("static 4", use_dynamic_bsz=False, micro_batch_size_per_gpu=4)
    one_update(spec, batch, actor_config_for("lp_reg_global"), layout)
    ((data, proxy),) = captured
    model = AutoModelForCausalLM.from_pretrained(peaked_model_path, torch_dtype=torch.float32).eval()
    prompt_lens = data["prompts"].offsets().diff().tolist()
    response_lens = data["responses"].offsets().diff().tolist()
    inside, outside = 0, 0
    for row, ids in enumerate(data["input_ids"].unbind()):
        p, r = prompt_lens[row], response_lens[row]
        with torch.no_grad():
            logits = model(ids.unsqueeze(0)).logits[0]
        theirs, in_support = authors_proxy(logits[p - 1:p + r - 1], ids[p:p + r], 0.7, LP_REG_KNOBS["lp_reg_min_p"])
        ours = proxy[row, :r].cpu()
        assert torch.equal(torch.isfinite(ours), in_support), row
        torch.testing.assert_close(ours[in_support].double(), theirs[in_support], rtol=0, atol=1e-5)
        inside, outside = inside + int(in_support.sum()), outside + int((~in_support).sum())
    assert inside > 0 and outside > 0


def _authors_pg_losses(old_log_prob, log_prob, proxy, advantages, response_mask, *, neg, pos, coef, low, high):
    """Lp-Reg-dev ``compute_policy_loss_lp_reg`` (core_algos.py l.648-745 at 33b27e2) transcribed: per-token losses
    before agg_loss, the same proxy for both signs (``minp_old_log_prob``)."""
    ratio = torch.exp(log_prob - old_log_prob)
    losses = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - low, 1 + high))
    valid = (response_mask > 0).reshape(-1).nonzero(as_tuple=True)[0]
    width = advantages.shape[1]
    for indices, percent in ((valid[advantages.reshape(-1)[valid] > 0], pos), (valid[advantages.reshape(-1)[valid] < 0], neg)):
        if len(indices) == 0:
            continue
        k = max(1, int(len(indices) * percent))
        if k <= 1:
            continue
        _, order = log_prob.reshape(-1)[indices].detach().topk(k=k, largest=False)
        target = indices[order]
        b, s = target // width, target % width
        keep = log_prob[b, s].detach() < proxy[b, s]
        b, s = b[keep], s[keep]
        losses[b, s] = -advantages[b, s] * ratio[b, s] + coef * kl_penalty(log_prob[b, s], proxy[b, s], "low_var_kl")
    return losses


def test_one_micro_batch_gives_the_authors_loss(peaked_model_path, monkeypatch):
    """On one micro-batch holding the whole minibatch (quotas > 1), the authors' per-call selection is the global one:
    the loss verl gets equals agg_loss of their per-token formula on the same tensors. At the first optimizer step
    the ratio is 1, below clip_ratio_c, where verl's dual-clip surrogate and their plain clip agree."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    spec = EngineSpec(peaked_model_path)
    batch = _batch(spec, 5)
    calls = []

    def recorded(**kwargs):
        provided = plugin_loss.provided_selection()
        loss, metrics = LP_REG.policy_loss(**kwargs)
        calls.append((kwargs, provided.token_fields["proxy_log_prob"].clone(), loss.detach().clone(), metrics))
        return loss, metrics

    monkeypatch.setitem(POLICY_LOSS_REGISTRY, "lp_reg_global", recorded)
    layout = MicroBatchLayout("static 1", use_dynamic_bsz=False, micro_batch_size_per_gpu=BATCH)
    with recorded_selections() as records:
        one_update(spec, batch, actor_config_for("lp_reg_global"), layout)
    ((inputs, proxy, loss, metrics),) = calls
    assert records[0].result.selection.negative_quota > 1 and records[0].result.selection.positive_quota > 1
    config = inputs["config"]
    theirs = _authors_pg_losses(inputs["old_log_prob"], inputs["log_prob"], proxy, inputs["advantages"],
                                inputs["response_mask"], neg=LP_REG_KNOBS["lp_reg_neg_ratio"],
                                pos=LP_REG_KNOBS["lp_reg_pos_ratio"], coef=config.policy_loss.lp_reg_kl_coef,
                                low=config.clip_ratio_low, high=config.clip_ratio_high)
    expected = agg_loss(loss_mat=theirs, loss_mask=inputs["response_mask"], loss_agg_mode="token-mean",
                        **config.global_batch_info)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    assert metrics[f"{LP_REG.metric_prefix}regularised_in_micro_batch"] > 0


def test_a_missing_proxy_raises_never_an_unregularised_step(peaked_model_path, monkeypatch):
    monkeypatch.setattr(reuse, "held_proxy", lambda engine, data: (None, "nothing held (test)"))
    spec = EngineSpec(peaked_model_path)
    with pytest.raises(ProxyUnavailableError, match="nothing held"):
        one_update(spec, _batch(spec, 6), actor_config_for("lp_reg_global"),
                   MicroBatchLayout("static 8", use_dynamic_bsz=False, micro_batch_size_per_gpu=8))


def _dp_update(rank, world_size, model_path, batch_file, layout):
    shard = _tiny.shard_for_rank(torch.load(batch_file, weights_only=False), rank, world_size)
    outcome, figures = _step_figures(EngineSpec(model_path), shard, layout)
    return outcome.masks[0], figures


@pytest.mark.distributed
def test_dp_2_gives_the_single_process_mask_and_figures(peaked_model_path, tmp_path):
    """Static training micro-batches of 4: the prepass and the log-prob pass see the same rows in the same company
    on 1 and 2 ranks; every figure is exact over the group."""
    spec = EngineSpec(peaked_model_path)
    batch = _batch(spec, 3)
    layout = MicroBatchLayout("static 4", use_dynamic_bsz=False, micro_batch_size_per_gpu=4)
    single_outcome, single = _step_figures(spec, batch, layout)
    batch_file = tmp_path / "batch.pt"
    torch.save(batch, batch_file)
    ranks = spawn_gloo(_dp_update, 2, peaked_model_path, str(batch_file), layout, verl_platform=True)
    assert torch.equal(torch.cat([mask for mask, _ in ranks]), single_outcome.masks[0])
    assert single[f"{LP_REG.metric_prefix}selected"] > 0
    for _, figures in ranks:
        assert figures == single


# ---------------------------------------------------------------------------------------------
# Through verl's TrainingWorker as the trainers drive it


def _use_lp_reg(worker, *, mini_batch, epochs, **knobs):
    import functools

    from verl.workers.utils.losses import ppo_loss

    config = _tiny.make_actor_config(policy_loss=LpRegGlobalPolicyLossConfig(**{**LP_REG_KNOBS, **knobs}),
                                     ppo_mini_batch_size=mini_batch, ppo_epochs=epochs)
    worker.set_loss_fn(functools.partial(ppo_loss, config=config))


@pytest.mark.parametrize("layout", ["infer", "train", "old"])
def test_the_worker_holds_the_proxy_for_every_optimizer_step_of_the_update(peaked_model_path, layout):
    """verl's log-prob pass through TrainingWorker.infer_batch computes the proxy (and returns verl's keys only); 2
    minibatches x 2 PPO epochs read it at all four optimizer steps, in every prepass_layout; the next trainer step's
    pass replaces it (its rows are found, the previous step's are not)."""
    from verl.utils import tensordict_utils as tu

    from verl_klcov_global.engine.proxy import PROXY_OUTPUT_KEY, PROXY_REQUEST_KEY

    from ..support.workers import build_training_worker
    from .test_reuse import rows, update

    worker = build_training_worker(peaked_model_path)
    _use_lp_reg(worker, mini_batch=16, epochs=2, prepass_layout=layout)
    for step in range(2):
        batch = rows(30 + step)
        data = batch.copy()
        tu.assign_non_tensor(data, calculate_entropy=True, compute_loss=False)
        output = worker.infer_batch(data)
        assert PROXY_OUTPUT_KEY not in output.keys() and PROXY_REQUEST_KEY not in data.keys()
        from verl.workers.utils.padding import response_from_nested

        batch["old_log_probs"] = response_from_nested(tu.get(output, "log_probs"), batch["response_mask"])
        proxy, why = reuse.held_proxy(worker.engine, batch)
        assert proxy is not None, why
        if step:
            assert reuse.held_proxy(worker.engine, previous)[0] is None  # replaced by this step's pass
        metrics = update(worker, batch, mini_batch=16, epochs=2)
        regularised = metrics[f"{LP_REG.metric_prefix}regularised"]
        regularised = getattr(regularised, "values", regularised)
        # four optimizer steps read it (a missing proxy raises), and some of their tokens are regularised
        assert len(regularised) == 4 and sum(regularised) > 0, regularised
        previous = batch


def test_copies_of_a_row_whose_pass_statistics_differ_in_the_last_bit_train_with_the_first_occurrences_proxy(
        peaked_model_path, monkeypatch):
    """GRPO repeats responses; where copies of a row get other last bits in verl's pass (bf16, packed sequences, some
    CPUs; made certain here, :func:`..support.copies.copies_one_ulp_apart`), every optimizer step of the update still
    gets the proxy (each copy the first occurrence's), so the update trains instead of raising
    ``ProxyUnavailableError`` on every rank; reuse of the pass keeps its strict rule (that step runs the prepass)."""
    from verl_klcov_global.engine import kept_pass, step as engine_step, weights

    from ..support.copies import copies_one_ulp_apart, with_copies
    from ..support.workers import build_training_worker
    from .test_reuse import log_prob_pass, rows, update

    worker = build_training_worker(peaked_model_path)
    _use_lp_reg(worker, mini_batch=16, epochs=2)
    batch = with_copies(rows(41), [0, 5, 9, 5])  # rows 28-31: copies of 0, 5, 9 and 5 again
    with copies_one_ulp_apart() as moved:
        log_prob_pass(worker, batch)
    assert moved == [4]
    kept = weights.state_of(worker.engine).kept
    assert len(kept.ambiguous) == 3 and kept.held and kept.proxy is not None
    proxy, why = reuse.held_proxy(worker.engine, batch)
    assert proxy is not None, why
    for copy, original in zip(range(28, 32), (0, 5, 9, 5)):
        assert torch.equal(proxy[copy], proxy[original])
    reasons = []
    real_run = engine_step.run_prepass_and_select

    def run(engine, data, settings, mode):
        result = real_run(engine, data, settings, mode)
        reasons.append(reuse.last_reason(engine))
        return result

    monkeypatch.setattr(engine_step, "run_prepass_and_select", run)
    metrics = update(worker, batch, mini_batch=16, epochs=2, shuffle=False)
    regularised = metrics[f"{LP_REG.metric_prefix}regularised"]
    regularised = getattr(regularised, "values", regularised)
    assert len(regularised) == 4 and sum(regularised) > 0, regularised  # four steps read the proxy; it acted
    reused = metrics[f"{LP_REG.metric_prefix}prepass_reused"]
    assert list(getattr(reused, "values", reused)) == [0.0] * 4
    # the first minibatch (rows 0-15) holds originals of copies: reuse refuses it, the prepass ran
    assert reasons[0] == reuse.AMBIGUOUS_ROWS, reasons
    assert not kept_pass.is_disabled()
