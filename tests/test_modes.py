"""The mode table (modes.py): what each mode reads from verl's minibatch layouts, and that the layout does not matter."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from verl.utils import tensordict_utils as tu

from verl_klcov_global.lab import tiny as _tiny
from verl_klcov_global.config import ClipCovGlobalPolicyLossConfig, KLCovGlobalPolicyLossConfig
from verl_klcov_global.layout import padded, sequence_token_ids
from verl_klcov_global.modes import global_mode_of
from verl_klcov_global.methods.clip_cov.row import CLIP_COV
from verl_klcov_global.methods.kl_cov.row import KL_COV
from verl_klcov_global.selection.keys import sequence_hashes

BATCH, PROMPT, RESPONSE = 12, 6, 10


def clip_cov_actor(**policy_loss):
    knobs = dict(clip_cov_ratio=0.02, clip_cov_lb=0.0, clip_cov_ub=100.0, clip_cov_seed=3)
    return _tiny.make_actor_config(policy_loss=ClipCovGlobalPolicyLossConfig(**{**knobs, **policy_loss}))


def test_dispatch_by_loss_mode():
    assert global_mode_of(clip_cov_actor()) is CLIP_COV
    assert global_mode_of(_tiny.make_actor_config(policy_loss=KLCovGlobalPolicyLossConfig())) is KL_COV
    for mode in ("vanilla", "kl_cov", "clip_cov"):
        assert global_mode_of(_tiny.make_actor_config(loss_mode=mode)) is None
    assert global_mode_of(None) is None
    assert (CLIP_COV.metric_prefix, KL_COV.metric_prefix) == ("actor/clip_cov/", "actor/kl_cov/")


def _minibatch(seed, layout):
    return _tiny.make_minibatch(batch_size=BATCH, prompt_len=PROMPT, response_len=RESPONSE, vary_lengths=True,
                                seed=seed, layout=layout, old_log_prob_noise=0.3,
                                log_probs=-6 + torch.rand(BATCH, RESPONSE, generator=torch.Generator().manual_seed(seed)))


def _select(data, log_probs):
    actor = clip_cov_actor()
    return CLIP_COV.select_minibatch(log_probs, data, CLIP_COV.read_settings(actor), None)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 1000), permutation_seed=st.integers(0, 1000))
def test_clip_cov_draw_is_the_same_in_every_trainer_layout_and_sample_order(seed, permutation_seed):
    v1, legacy = _minibatch(seed, "v1"), _minibatch(seed, "legacy")
    log_probs = padded(v1["old_log_probs"]) + 0.2  # any current log-probs, the same for both layouts
    # the sequences' identity: v1 and legacy carry the same tokens in different layouts
    ids_v1, ids_legacy = sequence_token_ids(v1), sequence_token_ids(legacy)
    assert all(torch.equal(a, b) for a, b in zip(sequence_hashes(*ids_v1), sequence_hashes(*ids_legacy)))
    selection = _select(v1, log_probs)
    assert 0 < selection.num_selected < selection.num_candidates  # a real draw
    assert torch.equal(_select(legacy, log_probs).mask, selection.mask)
    # a padded input_ids read with its attention_mask (DataProto layout) hashes the same
    padded_ids = v1.copy()
    dense, real = ids_v1
    padded_ids["input_ids"], padded_ids["attention_mask"] = dense, real.long()
    assert torch.equal(_select(padded_ids, log_probs).mask, selection.mask)
    # permuting the minibatch permutes the mask: the draw follows the sequences
    order = torch.randperm(BATCH, generator=torch.Generator().manual_seed(permutation_seed))
    shuffled = tu.index_select_tensor_dict(v1, order)
    assert torch.equal(_select(shuffled, log_probs[order]).mask, selection.mask[order])


def test_clip_cov_without_input_ids_says_why():
    data = _minibatch(0, "v1")
    del data["input_ids"]
    with pytest.raises(KeyError, match="clip_cov_global needs the minibatch's `input_ids`"):
        _select(data, padded(data["old_log_probs"]))


# ---------------------------------------------------------------------------------------------
# high_entropy_global: the entropy is a prepass output, asked for by the row, not by the name


def high_entropy_actor(**policy_loss):
    from verl_klcov_global.config import HighEntropyGlobalPolicyLossConfig

    return _tiny.make_actor_config(policy_loss=HighEntropyGlobalPolicyLossConfig(**policy_loss))


def test_high_entropy_row():
    from verl_klcov_global.modes import MODES
    from verl_klcov_global.methods.high_entropy.row import HIGH_ENTROPY

    assert global_mode_of(high_entropy_actor()) is HIGH_ENTROPY is MODES["high_entropy_global"]
    assert HIGH_ENTROPY.metric_prefix == "actor/high_entropy/"
    assert HIGH_ENTROPY.upstream == "high_entropy_per_micro_batch"  # the lab's comparator, never the plugin's
    assert (HIGH_ENTROPY.ratio_knob, HIGH_ENTROPY.paper_ratios) == ("entropy_top_ratio", (("14B", 0.2), ("32B", 0.2)))
    assert HIGH_ENTROPY.response_fields == () and HIGH_ENTROPY.sequence_fields == ()
    # the only row whose prepass computes the entropy; KL-Cov's and Clip-Cov's stay log-probs only
    assert {name for name, mode in MODES.items() if mode.prepass_reads_entropy} >= {"high_entropy_global"}
    assert not KL_COV.prepass_reads_entropy and not CLIP_COV.prepass_reads_entropy


@pytest.mark.parametrize("layout", ["v1", "legacy"])
def test_high_entropy_selection_reads_the_prepass_entropy_in_either_trainer_layout(layout):
    from verl_klcov_global import select_high_entropy_tokens
    from verl_klcov_global.methods.high_entropy.row import HIGH_ENTROPY

    data = _minibatch(4, layout)
    response_mask = padded(data["response_mask"]).bool()
    width = response_mask.shape[1]
    entropy = torch.rand(BATCH, width + 3, generator=torch.Generator().manual_seed(9))  # wider: cut to the mask
    settings_ = HIGH_ENTROPY.read_settings(high_entropy_actor(entropy_top_ratio=0.25))
    log_probs = padded(data["old_log_probs"])  # unused by this selection
    selection = HIGH_ENTROPY.select_minibatch(log_probs, data, settings_, None, entropy)
    expected = select_high_entropy_tokens(entropy[:, :width], response_mask, 0.25)
    assert torch.equal(selection.mask, expected.mask) and selection.quota == expected.quota > 1
    with pytest.raises(ValueError, match="high_entropy_global selects on the current-policy entropy"):
        HIGH_ENTROPY.select_minibatch(log_probs, data, settings_, None)
    # a mode whose selection does not read it carries it only when the prepass computed it (its entropy
    # controller on), cut to the mask's width like every field
    assert KL_COV.read_minibatch(log_probs, data).entropy is None
    assert torch.equal(KL_COV.read_minibatch(log_probs, data, entropy).entropy, entropy[:, :width])
