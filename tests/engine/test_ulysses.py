"""Ulysses sequence parallelism: the global modes select and update as without it, counting nothing twice.

verl's FSDP engine runs Ulysses SP over gloo with the test-only CPU varlen attention of
``tests/support/ulysses.py`` (verl wires Ulysses into flash-attention only). Each rank of an
SP group holds its DP rank's whole shard and, after verl's all-gather, the same log-probs; the
prepass must select over the DP group only (``engine.get_data_parallel_group()``), else every
token is counted once per SP rank.

Against a single process (SP 1, DP 1, same attention, same packed input), for SP 2 x DP 1 and
SP 2 x DP 2: masks bit for bit, quota and valid-token count equal, and the parameter update
within ``NOISE_FACTOR`` x the penalty-free control's difference between the same two settings.
The all-to-all and head counts show that attention really went through verl's Ulysses path.

With dynamic batch sizes, every mode of the table at SP 2: two token budgets (verl multiplies the budget by the SP
size) give bit-identical masks over the whole minibatch and updates within the control's noise.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from verl_klcov_global.lab import tiny as _tiny
from verl_klcov_global.lab.experiment import MicroBatchLayout, frozen_minibatch, max_abs_diff, one_update
from verl_klcov_global.modes import MODES as TABLE
from verl_klcov_global.layout import fit_width, padded
from verl_klcov_global.engine.step import observe_selections

from ..support.gloo import spawn_gloo, threads_of_a_rank
from ..support.selections import recorded_selections, selection_margin
from ..support.ulysses import UlyssesEngineSpec, cpu_varlen_attention, varlen_attention_cpu
from .test_response_gaps import POLICY_LOSSES
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


#: Two token budgets (dynamic batch sizes): the whole minibatch in one micro-batch, and a few sequences' worth.
DYNAMIC_LAYOUTS = (
    MicroBatchLayout("dynamic, one budget for all", True, max_token_len_per_gpu=BATCH * (PROMPT + RESPONSE)),
    MicroBatchLayout("dynamic, 2 sequences' budget", True, max_token_len_per_gpu=2 * (PROMPT + RESPONSE)),
)


def _sp_dynamic_rank_updates(rank, world_size, model_path, batch_file):
    """Spawn target: SP ``world_size`` x DP 1 (every rank holds the whole minibatch); per mode of the table and the
    control, one update at each of :data:`DYNAMIC_LAYOUTS`: its masks, figures and parameters."""
    batch = torch.load(batch_file, weights_only=False)
    spec = UlyssesEngineSpec(model_path, sp_size=world_size)
    policy_losses = dict(vanilla=lambda: None, **POLICY_LOSSES)
    out = {}
    with cpu_varlen_attention() as counts:
        for mode, policy_loss in policy_losses.items():
            config = (_tiny.make_actor_config(loss_mode="vanilla") if mode == "vanilla"
                      else _tiny.make_actor_config(policy_loss=policy_loss()))
            out[mode] = [one_update(spec, batch, config, layout) for layout in DYNAMIC_LAYOUTS]
    for updates in out.values():
        for update in updates:
            update.metrics = {}  # verl's Metric objects stay in the rank
    return dict(updates=out, all_to_all=counts.all_to_all, kernel_heads=set(counts.kernel_heads))


@pytest.mark.slow
@pytest.mark.distributed
def test_ulysses_sp2_with_dynamic_batch_sizes_every_mode_is_invariant(single_process, tiny_model_path, tmp_path):
    """SP 2 with dynamic batch sizes, every mode of the table (Lp-Reg's proxy and STARE's gate through the held
    log-prob pass): at two token budgets the masks are bit for bit the same and whole-minibatch (the valid-token
    count is the minibatch's, not twice it), the SP ranks agree, and the update differs no more than
    ``NOISE_FACTOR`` x the control's difference between the same two budgets, less than the mode moved it."""
    batch, _ = single_process
    batch_file = tmp_path / "batch.pt"
    torch.save(batch, batch_file)
    ranks = spawn_gloo(_sp_dynamic_rank_updates, 2, tiny_model_path, str(batch_file))
    assert sorted(POLICY_LOSSES) == sorted(TABLE)
    for out in ranks:  # verl's Ulysses path ran
        assert out["all_to_all"] > 0 and out["kernel_heads"] == {HEADS // 2}, out
    num_valid = int(batch["response_mask"].values().sum())
    control = ranks[0]["updates"]["vanilla"]
    floor = max_abs_diff(control[0].params, control[1].params)
    assert floor > 0, "the two budgets gave bit-identical control updates: no noise floor to compare to"
    for mode in POLICY_LOSSES:
        first, second = ranks[0]["updates"][mode]
        assert first.masks and len(first.masks) == len(second.masks), mode
        for one, other, figures in zip(first.masks, second.masks, first.figures, strict=True):
            assert one.any(), f"{mode} selected nothing: the test would prove nothing"
            assert torch.equal(one, other), f"{mode}: the selection depends on the token budget under SP 2"
            assert figures["valid_tokens"] == num_valid, (mode, figures)
        for update, theirs in zip(ranks[0]["updates"][mode], ranks[1]["updates"][mode], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(update.masks, theirs.masks, strict=True)), mode
            assert torch.equal(update.params, theirs.params), mode
        diff = max_abs_diff(first.params, second.params)
        assert diff <= NOISE_FACTOR * floor, (mode, diff, floor)
        effect = max_abs_diff(first.params, control[0].params)  # beyond the tolerance, or the check proves nothing
        assert effect > NOISE_FACTOR * floor, f"{mode} did not move the update beyond the tolerance: {effect:.3g}"


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
