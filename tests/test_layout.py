"""The stored mask reaches each micro-batch intact, whatever verl's split and sample order.

Property-based, on verl's own machinery: the mask is stored with ``layout.mask_in_layout_of``,
the minibatch is permuted with verl's ``index_select_tensor_dict`` and split with verl's
``prepare_micro_batches`` (static, or dynamic which reorders samples), and every
micro-batch's slice is read by the step's own loss wrapper (``engine.step._loss_with_mask_slice``), as it
hands it to the loss through ``provide_selection_mask``.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from verl.utils import tensordict_utils as tu
from verl.workers.engine.utils import prepare_micro_batches

from verl_klcov_global.lab import tiny as _tiny
from verl_klcov_global import loss
from verl_klcov_global.config import MASK_FIELD
from verl_klcov_global.engine import step
from verl_klcov_global.layout import mask_in_layout_of, padded
from verl_klcov_global.methods.kl_cov.selection import select_kl_cov_tokens

BATCH, PROMPT, RESPONSE = 12, 4, 10


def read_through_the_loss_wrapper(micro_batch):
    """The mask the step's loss wrapper provides to the loss call of ``micro_batch``."""
    provided = []

    def loss_function(model_output, data, dp_group):
        provided.append(loss._CURRENT_MASK.get().mask)
        return None, {}

    step._loss_with_mask_slice(loss_function, None, model_output=None, data=micro_batch)
    assert loss._CURRENT_MASK.get() is None  # scoped to the one loss call
    return provided[0]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 1000), layout=st.sampled_from(["v1", "legacy"]), dynamic=st.booleans(),
       micro_batch_size=st.sampled_from([1, 2, 3, 4, 6, 12]), token_budget=st.integers(PROMPT + RESPONSE, 80),
       permutation_seed=st.integers(0, 1000), ratio=st.sampled_from([0.05, 0.3, 1.0]))
def test_each_micro_batch_reads_exactly_its_rows_of_the_minibatch_mask(
    seed, layout, dynamic, micro_batch_size, token_budget, permutation_seed, ratio
):
    minibatch = _tiny.make_minibatch(batch_size=BATCH, prompt_len=PROMPT, response_len=RESPONSE, vary_lengths=True,
                                     seed=seed, layout=layout)
    selection = select_kl_cov_tokens(padded(minibatch["advantages"]), padded(minibatch["old_log_probs"]),
                                     padded(minibatch["response_mask"]), ratio)
    minibatch[MASK_FIELD] = mask_in_layout_of(selection.mask, minibatch["response_mask"])
    minibatch["row_id"] = torch.arange(BATCH)

    order = torch.randperm(BATCH, generator=torch.Generator().manual_seed(permutation_seed))
    shuffled = tu.index_select_tensor_dict(minibatch, order)
    _tiny.set_micro_batching(shuffled, use_dynamic_bsz=dynamic, micro_batch_size_per_gpu=micro_batch_size,
                             max_token_len_per_gpu=token_budget)
    micro_batches, _ = prepare_micro_batches(shuffled, dp_group=None, same_micro_num_in_dp=False)

    seen = []
    for micro_batch in micro_batches:
        rows = micro_batch["row_id"]
        read = read_through_the_loss_wrapper(micro_batch)
        expected = selection.mask[rows]
        assert read.shape == padded(micro_batch["response_mask"]).shape
        assert torch.equal(read, expected[:, : read.shape[1]])
        assert not expected[:, read.shape[1]:].any()  # nothing selected beyond this micro-batch's width
        seen += rows.tolist()
    assert sorted(seen) == list(range(BATCH))
    assert sum(int(read_through_the_loss_wrapper(mb).sum()) for mb in micro_batches) == selection.num_selected
