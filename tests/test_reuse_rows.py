"""``engine/reuse.py`` without an engine: the row digests, what is kept of a pass and how a minibatch gets it back.

The engine-level behaviour (verl's worker, trainer loop, ranks) is ``tests/engine/test_reuse.py`` and
``tests/test_reuse_trainer.py``; these are the pure parts, in the fast tier.
"""

from __future__ import annotations

import torch
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import no_padding_2_padding

from verl_klcov_global.engine import reuse
from verl_klcov_global.lab import tiny as _tiny
from verl_klcov_global.layout import fit_width, padded

ROWS = 12


def _rows(layout="v1", seed=3, temperature=1.0):
    return _tiny.make_minibatch(batch_size=ROWS, prompt_len=6, response_len=10, vary_lengths=True, seed=seed,
                                layout=layout, temperature=temperature)


def _pass_output(data, seed=0, entropy=True):
    """What verl's infer_batch returns: nested per-sequence log-probs (and entropy), random values."""
    lengths = data["input_ids"].offsets().diff().tolist()
    gen = torch.Generator().manual_seed(seed)
    nested = lambda: torch.nested.as_nested_tensor(  # noqa: E731
        [torch.randn(n, generator=gen) for n in lengths], layout=torch.jagged)
    output = {"log_probs": nested()}
    if entropy:
        output["entropy"] = nested()
    return {"model_output": output}


def test_a_rows_digest_covers_its_tokens_positions_split_and_temperature():
    base = reuse._row_digests(_rows())
    assert len(set(base)) == ROWS
    assert reuse._row_digests(_rows()) == base  # a pure function of the content
    assert reuse._row_digests(_rows("legacy")) == base  # the legacy layout's rows are the same rows
    changed = _rows()
    changed["input_ids"].values()[0] += 1
    assert [a == b for a, b in zip(reuse._row_digests(changed), base)] == [False] + [True] * (ROWS - 1)
    moved = _rows()
    moved["position_ids"].values()[1] += 1
    assert reuse._row_digests(moved)[0] != base[0]
    per_row = _rows()
    per_row["temperature"] = torch.linspace(0.5, 1.5, ROWS)  # a per-sample temperature tensor
    assert all(a != b for a, b in zip(reuse._row_digests(per_row), base))
    # a scalar temperature is a forward setting of the whole pass, compared separately
    assert dict(reuse._forward_settings(_rows(temperature=0.7)))["temperature"] == 0.7


def test_a_minibatch_of_shuffled_rows_gets_back_exactly_what_the_prepass_layout_gives():
    from verl_klcov_global.lab import cpu as _cpu

    _cpu.install_cpu_platform()  # the statistics go to verl's device: the host here
    data = _rows()
    output = _pass_output(data)
    kept, reason = reuse._keep(0, data, output, keep_entropy=True)
    assert reason == "kept" and kept.entropy is not None
    responses = int(data["response_mask"].values().sum())
    assert kept.nbytes == 8 * responses + 8 * (ROWS + 1) + 16 * ROWS
    order = [5, 0, 11, 3, 7]
    minibatch = tu.index_select_tensor_dict(data, order)
    rows = [kept.index[d] for d in reuse._row_digests(minibatch)]
    assert rows == order
    log_probs, entropy = reuse._gather(kept, rows, minibatch)
    width = padded(minibatch["response_mask"]).shape[1]
    for got, name in ((log_probs, "log_probs"), (entropy, "entropy")):
        full = no_padding_2_padding(output["model_output"][name], data)  # the pass's rows, as the prepass pads
        expected = fit_width(full[order], width)
        assert torch.equal(got, expected), name
    without, _ = reuse._keep(0, data, _pass_output(data, entropy=False), keep_entropy=True)
    assert without is None  # a step that reads entropy cannot use a pass that computed none


def test_equal_rows_with_different_statistics_are_ambiguous_and_equal_ones_are_not():
    data = _rows()
    twice = tu.index_select_tensor_dict(data, list(range(ROWS)) + [2])  # row 2 twice
    output = _pass_output(twice, entropy=False)
    kept, _ = reuse._keep(0, twice, output, keep_entropy=False)
    assert kept.index[reuse._row_digests(data)[2]] == reuse._AMBIGUOUS  # random values: they differ
    values = output["model_output"]["log_probs"].unbind()
    same = [*values[:ROWS], values[2].clone()]
    output["model_output"]["log_probs"] = torch.nested.as_nested_tensor(same, layout=torch.jagged)
    kept, _ = reuse._keep(0, twice, output, keep_entropy=False)
    assert kept.index[reuse._row_digests(data)[2]] == 2


def test_media_and_unknown_layouts_are_not_kept():
    data = _rows()
    data["multi_modal_inputs"] = [{} for _ in range(ROWS)]  # text only: verl's trainer sends empty dicts
    assert not reuse._has_media(data)
    data["multi_modal_inputs"] = [{}] * (ROWS - 1) + [{"pixel_values": torch.zeros(1)}]
    assert reuse._has_media(data)
    assert reuse._keep(0, data, _pass_output(data), keep_entropy=False)[0] is None
    plain = _rows()
    del plain["prompts"]
    assert reuse._row_digests(plain) is None


def test_the_decision_of_a_single_process_is_its_own():
    assert reuse.agreed(True) is True and reuse.agreed(False) is False
