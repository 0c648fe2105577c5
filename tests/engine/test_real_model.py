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
(1, 5), entropy_top_ratio 0.2.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from verl_klcov_global.engine import step as engine_step
from verl_klcov_global.lab import sampling
from verl_klcov_global.lab import tiny as _tiny
from verl_klcov_global.lab.experiment import EngineSpec, _release
from verl_klcov_global.layout import MinibatchFields
from verl_klcov_global.modes import MODES

from ..support.selections import Recorded, kl_cov_scores, recorded_selections, reselect, selection_margin

pytestmark = pytest.mark.slow  # verl's real engine on a 134.5M-parameter model

PROMPTS, SAMPLES, NEW_TOKENS = 2, 4, 24
ROWS = PROMPTS * SAMPLES
SIZES = (ROWS, 2)
KNOBS = {
    "kl_cov_global": {"kl_cov_ratio": 0.02, "ppo_kl_coef": 1.0},
    "clip_cov_global": {"clip_cov_ratio": 0.02, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0},
    "high_entropy_global": {"entropy_top_ratio": 0.2},
}


@pytest.fixture(scope="module")
def sampled(smollm2_path):
    model, tokenizer = sampling.load_policy(smollm2_path)
    batch = sampling.sample_chat_responses(model, tokenizer, sampling.arithmetic_prompts(PROMPTS, seed=0),
                                           samples_per_prompt=SAMPLES, max_new_tokens=NEW_TOKENS, seed=0)
    del model
    return batch


@pytest.fixture(scope="module")
def selections(smollm2_path, sampled):
    """{(mode, micro-batch size): Recorded} from one engine (the prepass changes no parameter)."""
    spec = EngineSpec(smollm2_path)
    probe = _tiny.make_minibatch(tokens=sampled.tokens(), group_size=SAMPLES, seed=0, micro_batch_size_per_gpu=ROWS)
    engine = spec.build()
    initial = _tiny.compute_current_log_probs(engine, probe)
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
    _release(engine)
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
