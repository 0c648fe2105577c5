"""``engine/kept_pass.py`` and ``engine/reuse.py`` without an engine: the row digests, what is kept of a pass, how a
minibatch gets it back, and what a look-up does with copies of a row.

The engine-level behaviour (verl's worker, trainer loop, ranks) is ``tests/engine/test_reuse.py`` and
``tests/test_reuse_trainer.py``; these are the pure parts, in the fast tier.
"""

from __future__ import annotations

import math

import pytest
import torch
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import no_padding_2_padding

from verl_klcov_global.engine import kept_pass, reuse
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
    base = kept_pass.row_digests(_rows())
    assert len(set(base)) == ROWS
    assert kept_pass.row_digests(_rows()) == base  # a pure function of the content
    assert kept_pass.row_digests(_rows("legacy")) == base  # the legacy layout's rows are the same rows
    changed = _rows()
    changed["input_ids"].values()[0] += 1
    assert [a == b for a, b in zip(kept_pass.row_digests(changed), base)] == [False] + [True] * (ROWS - 1)
    moved = _rows()
    moved["position_ids"].values()[1] += 1
    assert kept_pass.row_digests(moved)[0] != base[0]
    per_row = _rows()
    per_row["temperature"] = torch.linspace(0.5, 1.5, ROWS)  # a per-sample temperature tensor
    assert all(a != b for a, b in zip(kept_pass.row_digests(per_row), base))
    # a scalar temperature is a forward setting of the whole pass, compared separately
    assert dict(kept_pass.forward_settings(_rows(temperature=0.7)))["temperature"] == 0.7


def test_a_minibatch_of_shuffled_rows_gets_back_exactly_what_the_prepass_layout_gives():
    from verl_klcov_global.lab import cpu as _cpu

    _cpu.install_cpu_platform()  # the statistics go to verl's device: the host here
    data = _rows()
    output = _pass_output(data)
    kept, reason = kept_pass.keep(0, data, output, keep_entropy=True)
    assert reason == "kept" and kept.entropy is not None
    responses = int(data["response_mask"].values().sum())
    assert kept.nbytes == 8 * responses + 8 * (ROWS + 1) + 16 * ROWS
    order = [5, 0, 11, 3, 7]
    minibatch = tu.index_select_tensor_dict(data, order)
    rows = [kept.index[d] for d in kept_pass.row_digests(minibatch)]
    assert rows == order
    log_probs, entropy = reuse._gather(kept, rows, minibatch, (kept.log_probs, kept.entropy))
    width = padded(minibatch["response_mask"]).shape[1]
    for got, name in ((log_probs, "log_probs"), (entropy, "entropy")):
        full = no_padding_2_padding(output["model_output"][name], data)  # the pass's rows, as the prepass pads
        expected = fit_width(full[order], width)
        assert torch.equal(got, expected), name
    without, _ = kept_pass.keep(0, data, _pass_output(data, entropy=False), keep_entropy=True)
    assert without is None  # a step that reads entropy cannot use a pass that computed none


def _with_copies(data, copies):
    """``data``'s rows followed by the rows ``copies`` once more (equal content)."""
    return tu.index_select_tensor_dict(data, list(range(ROWS)) + list(copies))


def _nudged_copies(data, output, copies, field="log_probs"):
    """``output`` with each copy's ``field`` moved by one ulp from its original's: the last-bit difference that a copy
    in other micro-batch company gets in bf16, in packed sequences and on some CPUs."""
    values = list(output["model_output"][field].unbind())
    for position, original in enumerate(copies, ROWS):
        values[position] = torch.nextafter(values[original], torch.full_like(values[original], math.inf))
    output["model_output"][field] = torch.nested.as_nested_tensor(values, layout=torch.jagged)
    return output


def test_equal_rows_with_different_statistics_are_ambiguous_and_equal_ones_are_not():
    data = _rows()
    twice = _with_copies(data, [2])
    output = _pass_output(twice, entropy=False)
    kept, _ = kept_pass.keep(0, twice, output, keep_entropy=False)
    digest = kept_pass.row_digests(data)[2]
    assert kept.index[digest] == 2 and digest in kept.ambiguous  # random values: they differ
    values = output["model_output"]["log_probs"].unbind()
    same = [*values[:ROWS], values[2].clone()]
    output["model_output"]["log_probs"] = torch.nested.as_nested_tensor(same, layout=torch.jagged)
    kept, _ = kept_pass.keep(0, twice, output, keep_entropy=False)
    assert kept.index[digest] == 2 and not kept.ambiguous


@pytest.mark.parametrize("field", ["log_probs", "entropy"])
def test_reuse_refuses_copies_one_ulp_apart_and_held_look_ups_resolve_them_to_the_first_occurrence(field):
    """Copies of a row that differ in one bit of one statistic: reuse's look-up (strict) turns the minibatch down, the
    held look-up (pi_old's entropy, Lp-Reg's proxy: no other source) gives every copy the first occurrence's row,
    whatever order or split the update's minibatch has."""
    from verl_klcov_global.lab import cpu as _cpu

    _cpu.install_cpu_platform()
    copies = [2, 7, 2]  # row 2 three times in all, row 7 twice
    data = _with_copies(_rows(), copies)
    output = _nudged_copies(data, _pass_output(data), copies, field)
    kept, _ = kept_pass.keep(0, data, output, keep_entropy=True, hold=True)
    assert len(kept.ambiguous) == 2
    order = [13, 5, 2, 14, 12, 7]  # copies first, then originals, among other rows
    minibatch = tu.index_select_tensor_dict(data, order)
    rows, why = reuse.rows_in(kept, minibatch, reuse.Ambiguity.REFUSE)
    assert rows is None and why == reuse.AMBIGUOUS_ROWS
    rows, why = reuse.rows_in(kept, minibatch, reuse.Ambiguity.FIRST_OCCURRENCE)
    assert rows == [7, 5, 2, 2, 2, 7], why
    log_probs, entropy = reuse._gather(kept, rows, minibatch, (kept.log_probs, kept.entropy))
    assert torch.equal(log_probs[0], log_probs[5]) and torch.equal(entropy[2], entropy[3])
    # a row the pass saw once is found by both; one whose content it saw twice is refused even alone (which copy it
    # is, is not known)
    assert reuse.rows_in(kept, tu.index_select_tensor_dict(data, [5, 0, 11]), reuse.Ambiguity.REFUSE)[0] == [5, 0, 11]
    assert reuse.rows_in(kept, tu.index_select_tensor_dict(data, [2]), reuse.Ambiguity.REFUSE)[0] is None


def test_media_and_unknown_layouts_are_not_kept():
    data = _rows()
    data["multi_modal_inputs"] = [{} for _ in range(ROWS)]  # text only: verl's trainer sends empty dicts
    assert not kept_pass.has_media(data)
    data["multi_modal_inputs"] = [{}] * (ROWS - 1) + [{"pixel_values": torch.zeros(1)}]
    assert kept_pass.has_media(data)
    assert kept_pass.keep(0, data, _pass_output(data), keep_entropy=False)[0] is None
    plain = _rows()
    del plain["prompts"]
    assert kept_pass.row_digests(plain) is None


def test_the_decision_of_a_single_process_is_its_own():
    engine = _engine_with_mesh_of(1)
    assert reuse.agreed(engine, True) is True and reuse.agreed(engine, False) is False


class _Mesh:
    def __init__(self, ranks: int):
        self.ranks = ranks

    def size(self) -> int:
        return self.ranks


def _engine_with_mesh_of(ranks: int):
    """Stands in for an engine in the one thing an agreement reads of it: its device mesh's size."""
    import types

    return types.SimpleNamespace(device_mesh=_Mesh(ranks))


def test_an_agreement_spans_the_engines_whole_mesh_and_refuses_one_narrower_than_the_default_group():
    """Agreements reduce over the default process group because verl's FSDP engine builds its device mesh over all of
    it (the prepass forward's collectives span that mesh, Ulysses SP peers included). An engine whose mesh spans fewer
    ranks is refused by name on every rank, instead of an all-reduce that would wait for ranks that never call it."""
    from verl_klcov_global.lab import cpu as _cpu

    _cpu.init_process_group_cpu(0, 1)
    assert reuse.agreement_group(_engine_with_mesh_of(1)) is None  # the default group
    with pytest.raises(reuse.AgreementGroupError, match="spans 2 of the default process group's 1 ranks"):
        reuse.agreed(_engine_with_mesh_of(2), True)
    with pytest.raises(reuse.AgreementGroupError, match="spans no of"):
        reuse.agreed(object(), True)
