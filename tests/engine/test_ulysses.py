"""Ulysses sequence parallelism: kl_cov_global selects and updates as without it, counting nothing twice.

verl's FSDP engine runs Ulysses SP over gloo with the test-only CPU varlen attention of
``tests/support/ulysses.py`` (verl wires Ulysses into flash-attention only). Each rank of an
SP group holds its DP rank's whole shard and, after verl's all-gather, the same log-probs; the
prepass must select over the DP group only (``engine.get_data_parallel_group()``), else every
token is counted once per SP rank.

Against a single process (SP 1, DP 1, same attention, same packed input), for SP 2 x DP 1 and
SP 2 x DP 2: masks bit for bit, quota and valid-token count equal, and the parameter update
within ``NOISE_FACTOR`` x the penalty-free control's difference between the same two settings.
The all-to-all and head counts show that attention really went through verl's Ulysses path.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from verl_klcov_global.lab import tiny as _tiny
from verl_klcov_global.lab.experiment import MicroBatchLayout, frozen_minibatch, max_abs_diff, one_update
from verl_klcov_global.layout import fit_width, padded
from verl_klcov_global.engine.step import observe_selections

from ..support.gloo import spawn_gloo, threads_of_a_rank
from ..support.selections import recorded_selections, selection_margin
from ..support.ulysses import UlyssesEngineSpec, cpu_varlen_attention, varlen_attention_cpu
from .test_reuse import ROW_COMPANY_NOISE

pytestmark = pytest.mark.slow  # verl's real engine / workers / trainer on CPU: the slow tier

BATCH, PROMPT, RESPONSE = 16, 16, 48
MICRO_BATCH = 4  # sequences per micro-batch and DP rank: 4 micro-batches at DP 1, 2 at DP 2
RATIO = 0.02  # 16 x <=48 response tokens: a quota of several tokens
SEED = 0
MODES = ("vanilla", "kl_cov_global")
NOISE_FACTOR = 10  # kl_cov_global's SP difference must stay within 10x the control's
HEADS = _tiny.TINY_MODEL_KWARGS["num_attention_heads"]
KV_HEADS = _tiny.TINY_MODEL_KWARGS["num_key_value_heads"]


def actor_config_for(mode):
    return _tiny.make_actor_config(loss_mode=mode, kl_cov_ratio=RATIO, ppo_kl_coef=1.0)


LAYOUT = MicroBatchLayout(f"static {MICRO_BATCH}", use_dynamic_bsz=False, micro_batch_size_per_gpu=MICRO_BATCH)


def _updates(spec: UlyssesEngineSpec, batch) -> dict:
    """One update per mode on ``batch`` (this rank's shard); what the prepass saw and selected."""
    seen = []

    def record(engine, result):
        group = engine.get_data_parallel_group()
        selection = result.selection
        seen.append(dict(
            dp_rank=engine.get_data_parallel_rank(), dp_size=engine.get_data_parallel_size(),
            dp_group_size=dist.get_world_size(group), quota=selection.quota, num_valid=selection.num_valid,
            num_selected=selection.num_selected, mask=selection.mask.clone(),
        ))

    with cpu_varlen_attention() as counts, observe_selections(record), recorded_selections() as records:
        params = {mode: one_update(spec, batch, actor_config_for(mode), LAYOUT).params for mode in MODES}
    (selection,) = seen  # vanilla makes none, kl_cov_global one per optimizer step
    (recorded,) = records
    selection["log_probs"] = recorded.log_probs  # the statistics the prepass selected on
    return dict(params=params, selection=selection, record=recorded, kernel_heads=set(counts.kernel_heads),
                kernel_kv_heads=set(counts.kernel_kv_heads), kernel_calls=counts.kernel_calls,
                all_to_all=counts.all_to_all)


def _sp_rank_updates(rank, world_size, model_path, batch_file, sp_size):
    """Spawn target: this rank's DP shard (rank // sp_size; verl's mesh is (dp, sp)), one update per mode."""
    batch = torch.load(batch_file, weights_only=False)
    dp_size = world_size // sp_size
    shard = _tiny.shard_for_rank(batch, rank // sp_size, dp_size)
    out = _updates(UlyssesEngineSpec(model_path, sp_size=sp_size), shard)
    out.pop("record")  # its minibatch stays here: the test has the same rows
    return out


@pytest.fixture(scope="module")
def single_process(tiny_model_path):
    """SP 1, DP 1: the frozen minibatch (old log-probs = initial policy + N(0, 0.05)) and its updates."""
    spec = UlyssesEngineSpec(tiny_model_path, sp_size=1)
    with cpu_varlen_attention():
        batch = frozen_minibatch(spec, SEED, batch_size=BATCH, prompt_len=PROMPT, response_len=RESPONSE,
                                 vary_lengths=True, micro_batch_size_per_gpu=MICRO_BATCH)
    with threads_of_a_rank(2):  # the ranks' threads (the forwards differ anyway: Ulysses shards the sequences)
        return batch, _updates(spec, batch)


def _padded_cat(masks: list[torch.Tensor], width: int) -> torch.Tensor:
    return torch.cat([fit_width(m, width) for m in masks])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("sp_size, dp_size", [(2, 1), (2, 2)], ids=["sp2-dp1", "sp2-dp2"])
def test_ulysses_sp_gives_the_single_process_mask_counts_and_update(
        single_process, tiny_model_path, tmp_path, sp_size, dp_size, capsys):
    """Premise of the mask: Ulysses shards every sequence, so SP 2's forward is not SP 1's computation and a token's
    fp32 log-probs may differ in the last bits on some CPUs. What holds on every CPU, and is checked: the SP ranks'
    masks are exactly the single-process selection on the log-probs their own prepass computed (nothing counted
    twice: N, quota and selection are the single process's); the two sides' log-probs differ by company noise only;
    the masks are equal because the gap at the top-k boundary of the covariance exceeds twice its largest difference
    between the two sides (measured); the update is within NOISE_FACTOR x the control's difference."""
    batch, single = single_process
    reference = single["selection"]
    # The reference itself: no all-to-all, every head in one kernel call; the penalty acts.
    assert single["all_to_all"] == 0 and single["kernel_heads"] == {HEADS} and single["kernel_calls"] > 0
    assert reference["num_valid"] == int(batch["response_mask"].values().sum())
    assert reference["quota"] > 1 and reference["num_selected"] == reference["quota"]

    batch_file = tmp_path / "batch.pt"
    torch.save(batch, batch_file)
    ranks = spawn_gloo(_sp_rank_updates, sp_size * dp_size, tiny_model_path, str(batch_file), sp_size)

    for rank, out in enumerate(ranks):
        # verl's Ulysses path ran: 4 all-to-alls per attention forward (q, k, v, output), heads split over SP.
        assert out["kernel_calls"] > 0 and out["all_to_all"] >= 4 * out["kernel_calls"], out
        assert out["kernel_heads"] == {HEADS // sp_size}, out["kernel_heads"]
        assert out["kernel_kv_heads"] == {max(KV_HEADS, sp_size) // sp_size}, out["kernel_kv_heads"]
        # The prepass exchanged over the DP group of the (dp, sp) mesh, not the world.
        seen = out["selection"]
        assert (seen["dp_rank"], seen["dp_size"], seen["dp_group_size"]) == (rank // sp_size, dp_size, dp_size)
        # Nothing counted twice: N, quota and selection are the single process's, not sp_size times them.
        for key in ("num_valid", "quota", "num_selected"):
            assert seen[key] == reference[key], (key, seen[key], reference[key])

    # SP ranks of one DP group agree on the mask; the DP shards' masks form the single-process mask.
    for rank, out in enumerate(ranks):
        assert torch.equal(out["selection"]["mask"], ranks[rank - rank % sp_size]["selection"]["mask"])
    width = reference["mask"].shape[1]
    masks = _padded_cat([ranks[d * sp_size]["selection"]["mask"] for d in range(dp_size)], width)
    log_probs = _padded_cat([ranks[d * sp_size]["selection"]["log_probs"] for d in range(dp_size)], width)
    record = single["record"]
    again = record.mode.select_minibatch(log_probs, record.data, record.settings, None)
    assert torch.equal(masks, again.mask)  # the selection on SP's own statistics, over the whole minibatch
    valid = padded(record.data["response_mask"]).bool()
    assert float((log_probs - record.log_probs).abs()[valid].max()) < ROW_COMPANY_NOISE
    gap, drift = selection_margin(record, log_probs)
    assert drift == 0 or gap > 2 * drift, f"the premise: top-k gap {gap:.3g} vs covariance difference {drift:.3g}"
    assert torch.equal(masks, reference["mask"])  # follows from the margin

    # Every rank holds the same update; kl_cov_global differs from SP 1 only as much as the control does.
    for mode in MODES:
        for out in ranks[1:]:
            assert torch.equal(out["params"][mode], ranks[0]["params"][mode]), mode
    control = max_abs_diff(ranks[0]["params"]["vanilla"], single["params"]["vanilla"])
    ours = max_abs_diff(ranks[0]["params"]["kl_cov_global"], single["params"]["kl_cov_global"])
    penalty = max_abs_diff(single["params"]["kl_cov_global"], single["params"]["vanilla"])
    assert control > 0, "SP and single process gave bit-identical vanilla updates: no noise floor to compare to"
    assert ours <= NOISE_FACTOR * control, (ours, control)
    assert penalty > 100 * control, "the penalty did not move the update beyond the noise: the test proves nothing"
    with capsys.disabled():
        print(f"\n[SP {sp_size} x DP {dp_size} vs SP 1] selected {reference['num_selected']}/{reference['num_valid']}, "
              f"kl_cov_global/control {ours / control:.2f} (control {control:.2e}, penalty effect {penalty:.2e}); "
              f"top-k gap {gap:.2e} vs covariance difference {drift:.2e}")


def test_cpu_varlen_attention_is_causal_attention_within_each_packed_sequence():
    """The test kernel against a plain per-sequence causal softmax, GQA heads, Ulysses-style padding."""
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 1, 7, 3]  # the last one like verl's Ulysses pad: positions 0..pad-1
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    total, heads, kv_heads, dim = sum(lengths), 4, 2, 8
    q = torch.randn(1, total, heads, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(1, total, kv_heads, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(1, total, kv_heads, dim, generator=gen, dtype=torch.float64)
    out = varlen_attention_cpu(q, k, v, None, total, position_ids=positions, is_causal=True, softmax_scale=0.3)

    expected, start = torch.empty_like(q), 0
    for n in lengths:
        for h in range(heads):
            kh = h // (heads // kv_heads)
            scores = 0.3 * q[0, start:start + n, h] @ k[0, start:start + n, kh].T
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            expected[0, start:start + n, h] = scores.softmax(-1) @ v[0, start:start + n, kh]
        start += n
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)

    with pytest.raises(NotImplementedError, match="position_ids only"):
        varlen_attention_cpu(q, k, v, None, total, position_ids=positions, dropout=0.1)
