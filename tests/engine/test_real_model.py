"""The global modes on a real pretrained LM: SmolLM2-135M-Instruct (fp32, dequantized from 4 bits) on its own responses.

A minibatch of 8 responses is sampled from the model (2 arithmetic prompts x 4, chat template, T = 1, at most 24 new
tokens, stopped at EOS; lab/sampling.py). For each global mode, verl's real FSDP engine runs the prepass and the
selection with ``prepass_layout=train``, so that the prepass's forwards are the training micro-batches' (with the
default ``infer`` they never see the training micro-batch, and the comparison would be true by construction), at
training micro-batch sizes 8 (one micro-batch) and 2 (four).

The CPU rule (docs/DEVELOPING.md): the two layouts put each row in other micro-batch company, whose fp32 log-probs
and entropy may differ in their last bits on some CPUs. So each mask is checked to be exactly the mode's selection
on its own statistics, and the masks of the two layouts are equal where a measured margin says no score can cross
the selection's boundary (the premise, asserted). The per-micro-batch rule (the same selection taken inside each
micro-batch, as upstream's loss takes it) gives other masks at the two sizes.

Knobs for a minibatch of about 150 response tokens: kl_cov_ratio 0.02 (a quota of 3; in a micro-batch of 2 rows
the per-micro-batch rule's max(1, int(n * ratio)) floor of 1 token applies), clip_cov_ratio 0.02 with verl's window
(1, 5), entropy_top_ratio 0.2, STARE's defaults (stare_top_ratio 0.1 of each advantage sign) with variant C2, so that
both of its sets are compared (O1's set is C2's A > 0 part; checked).

STARE's update reads the old policy's entropy over the batch from verl's log-prob pass (its gate), so
:func:`test_stare_updates_read_the_log_prob_pass_and_do_not_depend_on_the_micro_batch_size` runs whole updates, each
after the pass (``lab.experiment.hold_old_policy_pass``, the helper ``one_update`` uses), on the module's engine: SGD
at lr 0, so that no update moves a parameter and every prepass and update of the module reads the pretrained weights.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

from verl_klcov_global.engine import step as engine_step
from verl_klcov_global.lab import sampling
from verl_klcov_global.lab import tiny as _tiny
from verl_klcov_global.config import StareGlobalPolicyLossConfig
from verl_klcov_global.engine.step import observe_selections
from verl_klcov_global.lab.experiment import EngineSpec, _release, hold_old_policy_pass
from verl_klcov_global.layout import MinibatchFields
from verl_klcov_global.modes import MODES
from verl_klcov_global.methods.stare.row import STARE
from verl_klcov_global.methods.stare.selection import stare_quota

from ..support.selections import (
    Recorded, kl_cov_scores, recorded_selections, reselect, selection_margin, top_k_margin,
)

pytestmark = pytest.mark.slow  # verl's real engine on a 134.5M-parameter model

PROMPTS, SAMPLES, NEW_TOKENS = 2, 4, 24
ROWS = PROMPTS * SAMPLES
SIZES = (ROWS, 2)
KNOBS = {
    "kl_cov_global": {"kl_cov_ratio": 0.02, "ppo_kl_coef": 1.0},
    "clip_cov_global": {"clip_cov_ratio": 0.02, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0},
    "high_entropy_global": {"entropy_top_ratio": 0.2},
    "stare_global": {"stare_variant": "C2"},
}
#: The STARE updates' gate targets: the default (0.3 nats), and one above any entropy a token of SmolLM2 can have
#: (ln 49,152 = 10.8), so that the gate is open and the weights act.
STARE_TARGETS = {"default": 0.3, "open": 100.0}


@pytest.fixture(scope="module")
def sampled(smollm2_path):
    model, tokenizer = sampling.load_policy(smollm2_path)
    batch = sampling.sample_chat_responses(model, tokenizer, sampling.arithmetic_prompts(PROMPTS, seed=0),
                                           samples_per_prompt=SAMPLES, max_new_tokens=NEW_TOKENS, seed=0)
    del model
    return batch


@pytest.fixture(scope="module")
def engine(smollm2_path):
    """The module's one engine; SGD at lr 0: the STARE updates move no parameter (module docstring). verl's log-prob
    pass takes the minibatch in one micro-batch (its static split needs a size that divides the rows)."""
    engine = EngineSpec(smollm2_path, lr=0.0, infer_micro_batch_size_per_gpu=ROWS).build()
    yield engine
    _release(engine)


@pytest.fixture(scope="module")
def initial(engine, sampled):
    """The pretrained policy's log-probs of the sampled responses (``old_log_probs`` = these + N(0, 0.05))."""
    probe = _tiny.make_minibatch(tokens=sampled.tokens(), group_size=SAMPLES, seed=0, micro_batch_size_per_gpu=ROWS)
    return _tiny.compute_current_log_probs(engine, probe)


@pytest.fixture(scope="module")
def selections(engine, initial, sampled):
    """{(mode, micro-batch size): Recorded} from the module's engine (the prepass changes no parameter)."""
    records = {}
    for name in KNOBS:
        mode = MODES[name]
        actor = _tiny.make_actor_config(policy_loss=mode.config_class(prepass_layout="train", **KNOBS[name]))
        settings = mode.read_settings(actor)
        for size in SIZES:
            batch = _tiny.make_minibatch(tokens=sampled.tokens(), group_size=SAMPLES, seed=0, log_probs=initial,
                                         micro_batch_size_per_gpu=size)
            with recorded_selections() as recorded:
                engine_step.run_prepass_and_select(engine, batch, settings, mode)  # recorded there
            (records[name, size],) = recorded
    return records


def _rows(fields: MinibatchFields, rows: slice) -> MinibatchFields:
    return MinibatchFields(
        response_mask=fields.response_mask[rows], log_probs=fields.log_probs[rows],
        response={key: value[rows] for key, value in fields.response.items()},
        sequence={key: (ids[rows], None if real is None else real[rows]) for key, (ids, real) in fields.sequence.items()},
        entropy=None if fields.entropy is None else fields.entropy[rows],
    )


def per_micro_batch_mask(record: Recorded, size: int) -> torch.Tensor:
    """The mode's selection taken inside each micro-batch of ``size`` rows alone (the upstream fault), concatenated."""
    fields = record.mode.read_minibatch(record.log_probs, record.data, record.entropy)
    rows = fields.response_mask.shape[0]
    return torch.cat([record.mode.select(_rows(fields, slice(start, start + size)), record.settings, None).mask
                      for start in range(0, rows, size)])


def clip_cov_candidates(record: Recorded, log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clip-Cov's candidates on ``record``'s minibatch with these log-probs (selection/clip_cov.py's rule), with the
    covariance and the log-ratio to the old policy they were decided on (float64, (batch, width))."""
    fields = record.mode.read_minibatch(log_probs, record.data)
    settings = record.settings
    valid = fields.response_mask.bool()
    advantages, old = fields.response["advantages"], fields.response["old_log_probs"]
    ratio = torch.exp(fields.log_probs - old)
    clipped = -advantages * torch.clamp(ratio, 1 - settings.clip_ratio_low, 1 + settings.clip_ratio_high) > (
        -advantages * ratio)
    cov = kl_cov_scores(advantages, fields.log_probs, valid)
    candidates = valid & ~clipped & (cov > settings.clip_cov_lb) & (cov < settings.clip_cov_ub)
    return candidates, cov, (fields.log_probs - old).double()


def clip_cov_margin(record: Recorded, other_log_probs: torch.Tensor) -> tuple[float, float]:
    """(margin, drift): how far the valid tokens' covariance lies from the window's bounds and their log-ratio from
    the PPO clip bounds (the nearest of either), against twice the largest difference of those quantities between
    ``record``'s statistics and ``other_log_probs``. ``margin > drift``: no token can change sides."""
    settings = record.settings
    valid = record.mode.read_minibatch(record.log_probs, record.data).response_mask.bool()
    _, cov, log_ratio = clip_cov_candidates(record, record.log_probs)
    _, other_cov, other_log_ratio = clip_cov_candidates(record, other_log_probs)
    bounds = torch.tensor([math.log(1 - settings.clip_ratio_low), math.log(1 + settings.clip_ratio_high)],
                          dtype=torch.float64)
    to_window = torch.minimum((cov - settings.clip_cov_lb).abs(), (cov - settings.clip_cov_ub).abs())[valid]
    to_clip = (log_ratio[valid].unsqueeze(1) - bounds).abs().min(dim=1).values
    drift = max(float((cov - other_cov)[valid].abs().max()), float((log_ratio - other_log_ratio)[valid].abs().max()))
    return min(float(to_window.min()), float(to_clip.min())), 2 * drift


def stare_margin(record: Recorded, log_probs: torch.Tensor) -> tuple[float, float]:
    """(gap, drift) of STARE's selection: the smallest, over its sets (A > 0; with C2 also A < 0), of the gap between
    the k-th and (k+1)-th largest surprisal -log pi of ``record``'s statistics in the set (k its quota), and the
    largest difference of the surprisal between those statistics and ``log_probs``. ``gap > 2 * drift``: no token can
    cross a set's boundary."""
    fields, other = (record.mode.read_minibatch(lp, record.data) for lp in (record.log_probs, log_probs))
    advantages = fields.response["advantages"]
    valid = fields.response_mask.bool() & advantages.isfinite() & fields.log_probs.isfinite()
    surprisal, other_surprisal = -fields.log_probs.double(), -other.log_probs.double()
    sets = [valid & (advantages > 0)] + ([valid & (advantages < 0)] if record.settings.with_negative else [])
    gaps = []
    for members in sets:
        k = stare_quota(int(members.sum()), record.settings.stare_top_ratio)
        if k:
            gaps.append(top_k_margin(surprisal, other_surprisal, members, k)[0])
    return min(gaps), float((surprisal - other_surprisal)[valid].abs().max())


def test_sampled_responses_are_the_models_own(sampled):
    """The minibatch is a rollout: templated prompts, responses stopped at EOS, reproducible from the seed."""
    assert sampled.batch_size == ROWS
    lengths = sampled.response_mask.sum(1)
    assert int(lengths.min()) >= 1 and int(lengths.max()) <= NEW_TOKENS
    for row, length in enumerate(lengths.tolist()):  # a row that stopped early ends with its EOS
        if length < sampled.responses.shape[1]:
            assert int(sampled.responses[row, length - 1]) == sampled.eos_token_id
    entropy = sampled.entropies[sampled.response_mask.bool()]
    assert 0.0 < float(entropy.mean()) < math.log(49152)


@pytest.mark.parametrize("name", list(KNOBS))
def test_masks_do_not_depend_on_the_training_micro_batch_size(name, selections, capsys):
    one, four = (selections[name, size] for size in SIZES)
    for record in (one, four):  # each mask is exactly the selection on the statistics its prepass computed
        assert torch.equal(record.result.selection.mask, reselect(record).mask)
    assert int(one.result.selection.mask.sum()) > 0, "vacuous: nothing selected"
    if name == "clip_cov_global":
        gap, twice_drift = clip_cov_margin(one, four.log_probs)
        assert gap > twice_drift, f"the premise: window/clip margin {gap:.3g} vs twice the difference {twice_drift:.3g}"
        assert torch.equal(clip_cov_candidates(one, one.log_probs)[0], clip_cov_candidates(one, four.log_probs)[0])
        margin = f"window/clip margin / twice the difference {gap / twice_drift if twice_drift else math.inf:.3g}"
    elif name == "stare_global":
        gap, drift = stare_margin(one, four.log_probs)
        assert drift == 0 or gap > 2 * drift, f"the premise: top-k gap {gap:.3g} vs surprisal difference {drift:.3g}"
        margin = f"top-k gap / difference {gap / drift if drift else math.inf:.3g}"
        selection = one.result.selection
        assert selection.positive_quota > 0 and selection.negative_quota > 0, "vacuous: a set without selection"
        # variant O1 (the default) takes C2's A > 0 set alone
        o1 = one.mode.select_minibatch(one.log_probs, one.data, dataclasses.replace(one.settings, with_negative=False),
                                       None)
        assert torch.equal(o1.mask, selection.mask & (one.mode.read_minibatch(one.log_probs, one.data)
                                                      .response["advantages"] > 0))
    else:
        gap, drift = selection_margin(one, four.log_probs, four.entropy)
        assert drift == 0 or gap > 2 * drift, f"the premise: top-k gap {gap:.3g} vs statistics difference {drift:.3g}"
        margin = f"top-k gap / difference {gap / drift if drift else math.inf:.3g}"
    assert torch.equal(one.result.selection.mask, four.result.selection.mask)
    fault_one, fault_four = per_micro_batch_mask(one, SIZES[0]), per_micro_batch_mask(four, SIZES[1])
    assert torch.equal(fault_one, one.result.selection.mask)  # one micro-batch holding the minibatch: the same rule
    assert not torch.equal(fault_one, fault_four), "the per-micro-batch rule should depend on the micro-batch size"
    with capsys.disabled():
        print(f"\n[SmolLM2-135M, {name}, prepass_layout=train, micro-batch {SIZES[0]} vs {SIZES[1]}] selected "
              f"{int(one.result.selection.mask.sum())} of {int(one.result.selection.num_valid)}; {margin}; "
              f"per micro-batch: {int(fault_one.sum())} vs {int(fault_four.sum())} selected, "
              f"{int((fault_one != fault_four).sum())} tokens differ")


def _scalar(value) -> float:
    values = getattr(value, "values", value)
    return float(values[0] if isinstance(values, (list, tuple)) else values)


def stare_update(engine, sampled, initial, *, size: int, target: float):
    """One update of ``stare_global`` (defaults: O1, top ratio 0.1, W 1.1; the gate at ``target``) at training
    micro-batch ``size``, after verl's log-prob pass as the trainer runs it: (its ``actor/stare/`` figures, its mask)."""
    from verl.workers.utils.losses import ppo_loss

    actor = _tiny.make_actor_config(policy_loss=StareGlobalPolicyLossConfig(stare_target_entropy=target))
    batch = _tiny.make_minibatch(tokens=sampled.tokens(), group_size=SAMPLES, seed=0, log_probs=initial,
                                 micro_batch_size_per_gpu=size)
    hold_old_policy_pass(engine, batch, actor)  # without it the update raises PassEntropyError
    masks = []
    with observe_selections(lambda _engine, result: masks.append(result.selection.mask.clone())), engine.train_mode():
        output = engine.train_batch(batch, loss_function=functools.partial(ppo_loss, config=actor))
    metrics = output["metrics"]
    per_micro_batch = metrics[STARE.metric_prefix + "selected_in_micro_batch"]  # the loss's count, per micro-batch
    per_micro_batch = getattr(per_micro_batch, "values", per_micro_batch)
    figures = {key.removeprefix(STARE.metric_prefix): _scalar(value) for key, value in metrics.items()
               if key.startswith(STARE.metric_prefix)  # the timings and the reuse flag are no figures
               and not key.endswith(("_seconds", "prepass_share", "prepass_reused", "selected_in_micro_batch"))}
    figures["selected_in_micro_batches"] = float(sum(per_micro_batch))
    (mask,) = masks  # one optimizer step
    return figures, mask, _scalar(metrics["grad_norm"])


def test_stare_updates_read_the_log_prob_pass_and_do_not_depend_on_the_micro_batch_size(engine, sampled, initial,
                                                                                       selections, capsys):
    """With the gate open, updates at micro-batch sizes 8 and 2 read the same batch entropy (the pass's), select the
    same tokens and log the same figures, bit for bit (the pass and the infer-layout prepass are one computation at
    both sizes: the weights are the same, lr 0); the batch entropy is the pass's token mean (the prepass of
    ``high_entropy_global`` at size 8 computed the same rows in one micro-batch: within 1e-5); the quota is the
    fork's ceiling of 10% of the A > 0 tokens. With the default target the gate stays shut on SmolLM2 (its entropy is
    far above 0.3 nats), and the gradient differs from the open gate's: the weights act."""
    (open_8, mask_8, grad_open_8), (open_2, mask_2, grad_open_2) = (
        stare_update(engine, sampled, initial, size=size, target=STARE_TARGETS["open"]) for size in SIZES)
    shut_2, mask_shut, grad_shut_2 = stare_update(engine, sampled, initial, size=SIZES[1],
                                                  target=STARE_TARGETS["default"])
    assert open_8 == open_2 and torch.equal(mask_8, mask_2) and torch.equal(mask_shut, mask_2)
    assert open_8["gate_on"] == 1.0 and shut_2["gate_on"] == 0.0
    assert open_8["reweight_w_in_use"] == 1.1 and open_8["selected_negative"] == 0.0
    assert open_8["selected_positive"] == stare_quota(int(open_8["candidates_positive"]), 0.1) > 0
    assert open_8["selected_in_micro_batches"] == open_8["selected"]  # the loss calls got the whole mask, in slices
    record = selections["high_entropy_global", ROWS]
    mask = record.mode.read_minibatch(record.log_probs, record.data, record.entropy).response_mask.bool()
    prepass_mean = float(record.entropy.double()[mask].mean())
    assert abs(open_8["batch_entropy"] - prepass_mean) <= 1e-5, (open_8["batch_entropy"], prepass_mean)
    assert shut_2["batch_entropy"] == open_2["batch_entropy"] > STARE_TARGETS["default"]
    assert grad_shut_2 != grad_open_2
    with capsys.disabled():
        print(f"\n[SmolLM2-135M, stare_global updates after the log-prob pass, micro-batch {SIZES[0]} vs {SIZES[1]}] "
              f"batch entropy {open_8['batch_entropy']:.4f} (prepass token mean {prepass_mean:.4f}); gate open at "
              f"target {STARE_TARGETS['open']:g}, shut at {STARE_TARGETS['default']:g}; selected "
              f"{open_8['selected_positive']:.0f} of {open_8['candidates_positive']:.0f} A > 0 tokens "
              f"(surprisal share {open_8['selected_surprisal_share']:.3f}); grad norm open {grad_open_8:.6g} (8) / "
              f"{grad_open_2:.6g} (2), shut {grad_shut_2:.6g} (2)")


#: lp_reg_global on SmolLM2: rho- 0.1 of the ~90 A < 0 tokens (the authors' 0.01 gives a quota of 1; at 0.05 all
#: 4 selected tokens lie outside the min-p support, where nothing is regularised); kappa and beta the authors'
LP_REG_KNOBS = {"lp_reg_neg_ratio": 0.1, "lp_reg_min_p": 0.02}


def lp_reg_update(engine, sampled, initial, *, size: int):
    """One update of ``lp_reg_global`` at training micro-batch ``size`` after verl's log-prob pass (the proxy's
    source): (its ``actor/lp_reg/`` figures, its mask, the grad norm, the held proxy and the pass's log-probs)."""
    from verl.workers.utils.losses import ppo_loss

    from verl_klcov_global.config import LpRegGlobalPolicyLossConfig
    from verl_klcov_global.engine import reuse
    from verl_klcov_global.methods.lp_reg.row import LP_REG

    actor = _tiny.make_actor_config(policy_loss=LpRegGlobalPolicyLossConfig(**LP_REG_KNOBS))
    batch = _tiny.make_minibatch(tokens=sampled.tokens(), group_size=SAMPLES, seed=0, log_probs=initial,
                                 micro_batch_size_per_gpu=size)
    hold_old_policy_pass(engine, batch, actor)  # without it the update raises ProxyUnavailableError
    proxy, _ = reuse.held_proxy(engine, batch)
    masks = []
    with observe_selections(lambda _engine, result: masks.append(result.selection.mask.clone())), engine.train_mode():
        output = engine.train_batch(batch, loss_function=functools.partial(ppo_loss, config=actor))
    metrics = output["metrics"]
    figures = {key.removeprefix(LP_REG.metric_prefix): _scalar(value) for key, value in metrics.items()
               if key.startswith(LP_REG.metric_prefix)
               and not key.endswith(("_seconds", "prepass_share", "prepass_reused", "selected_in_micro_batch"))}
    (mask,) = masks
    return figures, mask, _scalar(metrics["grad_norm"]), proxy


def test_lp_reg_updates_take_their_quota_whatever_the_micro_batch_size(engine, sampled, initial, capsys):
    """Updates at micro-batch sizes 8 and 2 after the log-prob pass: the same mask and selection figures bit for bit;
    selected tokens inside the min-p support are regularised (SmolLM2's distributions are peaked: the filter removes
    real mass). At size 8 the authors' per-call rule switches nothing off; at 2 it may (printed).
    Which selected tokens are regularised is compared between the sizes only where the support test's margin
    (-log of the support's mass: log pi_proxy - log pi_old at lr 0) is far above float noise (the premise, asserted)."""
    (at_8, mask_8, grad_8, proxy), (at_2, mask_2, grad_2, _) = (
        lp_reg_update(engine, sampled, initial, size=size) for size in SIZES)
    selection = ("quota", "selected", "selected_negative", "candidates_negative", "valid_tokens", "log_prob_mean",
                 "selected_log_prob_mean")
    assert torch.equal(mask_8, mask_2) and all(at_8[key] == at_2[key] for key in selection)
    assert at_8["selected_negative"] == max(1, int(at_8["candidates_negative"] * 0.1)) > 1
    assert at_8["per_call_switched_off"] == 0 <= at_2["per_call_switched_off"]
    assert 0 < at_8["selected_in_support_share"] <= 1 and at_8["regularised"] > 0 and at_8["kl_mean"] > 0
    from verl_klcov_global.layout import fit_width

    inside = mask_8.to(proxy.device) & torch.isfinite(proxy)
    old = fit_width(initial.to(proxy.device).double(), proxy.shape[1])
    margin = float((proxy.double() - old)[inside].min())  # -log(support mass) of the selected tokens in it
    with capsys.disabled():
        print(f"\n[SmolLM2-135M, lp_reg_global updates after the log-prob pass, micro-batch {SIZES[0]} vs {SIZES[1]}] "
              f"selected {at_8['selected_negative']:.0f} of {at_8['candidates_negative']:.0f} A < 0 tokens, "
              f"{at_8['selected_in_support_share']:.3f} inside the proxy's support, regularised {at_8['regularised']:.0f} "
              f"| {at_2['regularised']:.0f} (KL mean {at_8['kl_mean']:.4g}); per-call switch-off "
              f"{at_8['per_call_switched_off']:.0f} | {at_2['per_call_switched_off']:.0f}; grad norm {grad_8:.6g} | "
              f"{grad_2:.6g}; support-test margin {margin:.3g}")
    assert margin > 1e-4  # the premise: far above fp32 noise, no selected token can change sides
    assert at_8["regularised"] == at_2["regularised"]
