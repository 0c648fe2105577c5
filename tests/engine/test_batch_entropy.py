"""The batch entropy the workers recompute for a once-per-trainer-step rule (``engine/batch_entropy.py``).

* :func:`mean_entropy` of :func:`pass_sums` is verl's ``agg_loss`` (what the driver logs as ``actor/entropy``)
  within float32 rounding, for the three per-token ``loss_agg_mode`` values; NaN where the driver's is;
* the sums are exact integers: any split of the rows over ranks gives the same sums, bit for bit (here
  over 2 gloo ranks, with :func:`agree`'s one all-reduce);
* :func:`agree` tells the update's first optimizer step from the later ones, and raises on every rank alike
  when no pass was seen or the ranks disagree.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from verl.trainer.ppo.core_algos import agg_loss

from verl_klcov_global.engine import batch_entropy
from verl_klcov_global.engine.batch_entropy import PassEntropyError, agree, mean_entropy, pass_sums

from ..support.gloo import spawn_gloo


def _pass(seed, rows=12, width=20):
    generator = torch.Generator().manual_seed(seed)
    entropy = torch.rand(rows, width, generator=generator, dtype=torch.float32) * 5
    lengths = torch.randint(0, width + 1, (rows,), generator=generator)
    lengths[0] = 0  # a row without a response token: left out of the sequence means, as verl does
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).float()
    return entropy, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode, scale", [("token-mean", None), ("seq-mean-token-mean", None),
                                         ("seq-mean-token-sum-norm", 20.0)])
def test_the_mean_is_the_drivers_agg_loss(seed, mode, scale):
    entropy, mask = _pass(seed)
    driver = float(agg_loss(loss_mat=entropy, loss_mask=mask, loss_agg_mode=mode, loss_scale_factor=scale))
    ours = mean_entropy(pass_sums(entropy, mask), mode, scale)
    assert abs(ours - driver) <= 1e-6 * driver, (ours, driver)


def test_a_nonfinite_entropy_or_no_token_gives_nan_as_the_driver_does():
    entropy, mask = _pass(3)
    assert math.isnan(mean_entropy(pass_sums(entropy, torch.zeros_like(mask)), "token-mean"))
    entropy[2, 0], mask[2, 0] = float("nan"), 1.0
    sums = pass_sums(entropy, mask)
    assert int(sums[4]) == 1 and math.isnan(mean_entropy(sums, "token-mean"))
    assert math.isnan(float(agg_loss(loss_mat=entropy, loss_mask=mask, loss_agg_mode="token-mean")))


def test_sum_modes_have_no_per_token_mean():
    entropy, mask = _pass(4)
    for mode in ("token-sum", "seq-mean-token-sum"):
        with pytest.raises(ValueError, match=mode):
            mean_entropy(pass_sums(entropy, mask), mode)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        mean_entropy(pass_sums(entropy, mask), "seq-mean-token-sum-norm")


def test_the_sums_of_any_row_split_add_up_exactly():
    entropy, mask = _pass(5, rows=16)
    whole = pass_sums(entropy, mask)
    for cut in (1, 5, 8, 15):
        assert torch.equal(pass_sums(entropy[:cut], mask[:cut]) + pass_sums(entropy[cut:], mask[cut:]), whole)


class _Engine:
    """A stand-in key for the per-engine record (``agree`` reads nothing of the engine itself)."""


def _record(engine, entropy, mask):
    from verl_klcov_global.engine.batch_entropy import _RECORDS, _Record

    record = _RECORDS.setdefault(engine, _Record())
    record.serial += 1
    record.sums, record.why_missing = pass_sums(entropy, mask), ""


def test_the_first_optimizer_step_of_an_update_is_the_one_after_a_new_pass():
    engine = _Engine()
    with pytest.raises(PassEntropyError, match="bypass_mode"):
        agree(engine, None, "stare_global")
    entropy, mask = _pass(6)
    _record(engine, entropy, mask)
    first, later = agree(engine, None, "stare_global"), agree(engine, None, "stare_global")
    assert first.first and not later.first
    assert torch.equal(first.sums, pass_sums(entropy, mask))
    _record(engine, entropy, mask)
    assert agree(engine, None, "stare_global").first


def test_a_pass_that_could_not_be_read_raises_with_the_reason():
    engine = _Engine()
    batch_entropy.record_pass(engine, SimpleNamespace(keys=lambda: []), {"model_output": {"log_probs": None}})
    with pytest.raises(PassEntropyError, match="calculate_entropy=False"):
        agree(engine, None, "stare_global")


def _agree_on_two_ranks(rank, world_size, see_pass):
    import torch.distributed as dist

    entropy, mask = _pass(7, rows=16)
    engine = _Engine()
    if see_pass[rank]:
        half = 16 // world_size
        _record(engine, entropy[rank * half:(rank + 1) * half], mask[rank * half:(rank + 1) * half])
    try:
        return "ok", agree(engine, dist.group.WORLD, "stare_global").sums
    except PassEntropyError as error:
        return "error", str(error)


def _two_ranks(rank, world_size):
    return [_agree_on_two_ranks(rank, world_size, see_pass) for see_pass in ((True, True), (True, False))]


@pytest.mark.distributed
def test_two_ranks_agree_on_the_single_process_sums_and_fail_together():
    """One spawn, two cases: both ranks saw their half of the pass; rank 1 saw none (both raise, neither hangs)."""
    entropy, mask = _pass(7, rows=16)
    both, one = zip(*spawn_gloo(_two_ranks, 2, verl_platform=True))
    assert all(kind == "ok" and torch.equal(sums, pass_sums(entropy, mask)) for kind, sums in both)
    assert [kind for kind, _ in one] == ["error", "error"]
    assert all("1 of 2 ranks saw no such pass" in text for _, text in one)
