"""``prepass_layout=old`` (``engine/old_policy.py``) on verl's real ``TrainingWorker`` (in-process and 2 gloo ranks, CPU, fp32).

The worker is driven as verl's trainers drive it (:mod:`.test_reuse`'s helpers): the log-prob pass
(``calculate_entropy=True``, ``old_log_probs`` set from its output), then ``train_mini_batch`` with 2 minibatches
x 2 epochs, so 4 optimizer steps of which 3 are off-policy. Required:

* every optimizer step selects from pi_old's statistics (the pass's log-probs and entropy of its rows), bit for
  bit what the mode's selection gives on them, with no forward at all (``engine.infer_batch`` is never called in
  the update), for the three modes on the v1 and the legacy batch layout; the current policy's log-probs differ
  by then (the test could tell the two apart);
* the entropy controller reads pi_old's entropy: the same minibatch in the two epochs measures the same H;
* the masks are the same bit for bit for training micro-batches of 8 and 2 rows and dynamic batching (one
  log-prob pass layout: pi_old's statistics are the same computation in all three), and the parameters after the
  update within 10x the ``vanilla`` control's float noise between the same layouts (KL-Cov off-policy by a
  measured margin: at pi = pi_old its gradient's sign is float noise, which moves with the micro-batching);
* over 2 gloo ranks, the masks are the single-process selection over the union of the ranks' minibatches, row
  by row; a rank that lacks pi_old's entropy makes both ranks raise :class:`OldPolicyStatisticsError` (no rank
  waits in a collective); in one process, an update with no log-prob pass before it raises with the fix.
"""

from __future__ import annotations

import functools

import pytest
import torch
from verl.utils import tensordict_utils as tu

from verl_klcov_global.config import KLCovGlobalPolicyLossConfig
from verl_klcov_global.engine import step as engine_step
from verl_klcov_global.engine.old_policy import OldPolicyStatisticsError
from verl_klcov_global.engine.prepass import compute_prepass_log_probs_and_entropy
from verl_klcov_global.lab import tiny as _tiny
from verl_klcov_global.modes import global_mode_of

from ..support.gloo import spawn_gloo
from ..support.noise_floor import any_difference, ratio_to_control
from ..support.workers import build_training_worker, full_state_dict, row_indices
from .test_reuse import MODES, ROWS, log_prob_pass, rows, update, use_mode, worker  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow  # verl's real engine / workers on CPU: the slow tier

MINI, EPOCHS = ROWS // 2, 2  # 4 optimizer steps per update
NOISE_FACTOR = 10.0


def _record_steps(monkeypatch, *, current_at: tuple[int, ...] = ()):
    """Every optimizer step's (minibatch, PrepassResult, current policy's (log-probs, entropy) or None); the current
    policy's statistics (a prepass forward, ``infer`` layout) only at the step indices ``current_at``, before the
    step."""
    steps = []
    real_run = engine_step.run_prepass_and_select

    def run(engine, data, settings, mode):
        result = real_run(engine, data, settings, mode)
        current = None
        if len(steps) in current_at:
            current = compute_prepass_log_probs_and_entropy(engine, data, "infer")
        steps.append((data.copy(), result, current))
        return result

    monkeypatch.setattr(engine_step, "run_prepass_and_select", run)
    return steps


def _count_forwards(monkeypatch, engine) -> list:
    """The engine's ``infer_batch`` calls from now on (the prepass's forwards go through it)."""
    calls = []
    real = engine.infer_batch

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "infer_batch", spy)
    return calls


def _expected_selection(worker, data, batch, pass_log_probs, pass_entropy, settings):
    """The mode's selection with the step's ``settings`` on pi_old's statistics of ``data``'s rows, found in ``batch``
    by content."""
    mode = global_mode_of(worker.loss_fn.keywords["config"])
    index = row_indices(data, batch)
    entropy = pass_entropy[index] if mode.reads_entropy(settings) else None
    return mode.select_minibatch(pass_log_probs[index], data, settings, None, entropy=entropy)


@pytest.mark.parametrize("layout", ["v1", "legacy"])
@pytest.mark.parametrize("mode", MODES)
def test_every_optimizer_step_selects_from_pi_old_with_no_forward(worker, monkeypatch, mode, layout):
    use_mode(worker, mode, layout="old", mini_batch=MINI, epochs=EPOCHS)
    batch = rows(31, layout=layout)
    pass_log_probs, pass_entropy = log_prob_pass(worker, batch)
    steps = _record_steps(monkeypatch, current_at=(3,))
    forwards = _count_forwards(monkeypatch, worker.engine)
    metrics = update(worker, batch, mini_batch=MINI, epochs=EPOCHS)
    assert len(forwards) == 1  # the recorder's own forward at step 3: the update ran none
    assert len(steps) == 4
    for data, result, _ in steps:
        assert result.from_old_policy and not result.reused and result.prepass_seconds == 0.0
        expected = _expected_selection(worker, data, batch, pass_log_probs, pass_entropy, result.settings)
        assert torch.equal(result.selection.mask, expected.mask)
        assert 0 < int(result.selection.mask.sum()) < int(result.selection.num_valid)  # a real selection
    data, _, (current, _) = steps[3]
    index = row_indices(data, batch)
    width = current.shape[1]
    assert not torch.equal(current, pass_log_probs[index][:, :width])  # the policy moved: pi_old is not pi
    prefix = global_mode_of(worker.loss_fn.keywords["config"]).metric_prefix
    assert [float(v) for v in metrics[prefix + "prepass_seconds"]] == [0.0] * 4
    assert [float(v) for v in metrics[prefix + "prepass_reused"]] == [0.0] * 4


def test_the_entropy_controller_reads_pi_olds_entropy(worker, monkeypatch):
    """KL-Cov reads no entropy, but its controller does: pi_old's, held for the whole update. Every step's H is the
    mean of the pass's entropy over its minibatch, where the current policy's has moved by the last step."""
    from verl.workers.utils.losses import ppo_loss

    from verl_klcov_global.engine import reuse

    policy_loss = KLCovGlobalPolicyLossConfig(kl_cov_ratio=0.02, ppo_kl_coef=1.0, entropy_target=5.0,
                                              prepass_layout="old")
    worker.set_loss_fn(functools.partial(ppo_loss, config=_tiny.make_actor_config(
        policy_loss=policy_loss, ppo_mini_batch_size=MINI, ppo_epochs=EPOCHS)))
    batch = rows(32)
    _, pass_entropy = log_prob_pass(worker, batch)
    steps = _record_steps(monkeypatch, current_at=(3,))
    update(worker, batch, mini_batch=MINI, epochs=EPOCHS)
    assert reuse.kept_rows(worker.engine) == ROWS  # held through the 4 optimizer steps
    assert len(steps) == 4
    for data, result, current in steps:
        mask = padded_mask(data)
        expected = float((pass_entropy[row_indices(data, batch)][:, :mask.shape[1]] * mask).sum() / mask.sum())
        assert result.steering.decision.entropy == pytest.approx(expected, rel=1e-6, abs=0)
    current_entropy = steps[3][2][1]
    mask = padded_mask(steps[3][0])
    current_mean = float((current_entropy[:, :mask.shape[1]] * mask).sum() / mask.sum())
    # the test tells pi_old from pi: 5.3e-5 apart at step 3 (tiny model, CPU), above the 6e-6 tolerance used above
    assert abs(current_mean - steps[3][1].steering.decision.entropy) > 1.5e-5


def padded_mask(data) -> torch.Tensor:
    from verl_klcov_global.layout import padded

    return padded(data["response_mask"]).float()


def test_an_update_without_a_log_prob_pass_cannot_read_pi_olds_entropy(worker):
    use_mode(worker, "high_entropy_global", layout="old")
    batch = rows(33)  # its old_log_probs (make_minibatch's noise) stand for the rollout's: no actor pass
    with pytest.raises(OldPolicyStatisticsError, match="reads pi_old's entropy .* this rank has none: no log-prob "
                                                       "pass kept .*prepass_layout=infer"):
        update(worker, batch)


def test_copies_of_a_row_whose_pass_statistics_differ_in_the_last_bit_read_the_first_occurrences_entropy(
        worker, monkeypatch):
    """Copies of a row whose pass statistics differ in the last bit (bf16, packed sequences, some CPUs; made certain
    here): every optimizer step still reads pi_old's entropy, each copy its first occurrence's, instead of raising
    ``OldPolicyStatisticsError`` on every rank. The log-probs stay each row's own ``old_log_probs``."""
    from verl_klcov_global.engine import weights

    from verl_klcov_global.layout import padded

    from ..support.copies import copies_one_ulp_apart, with_copies
    from ..support.workers import _row_key

    use_mode(worker, "high_entropy_global", layout="old", mini_batch=MINI, epochs=EPOCHS)
    batch = with_copies(rows(35), [3, 3, 20])  # rows 29-31: copies of 3, 3 and 20
    with copies_one_ulp_apart() as moved:
        pass_log_probs, pass_entropy = log_prob_pass(worker, batch)
    assert moved == [3] and len(weights.state_of(worker.engine).kept.ambiguous) == 2
    assert not torch.equal(pass_log_probs[29], pass_log_probs[3])  # the copies' own statistics differ
    first = {}
    for index, row in enumerate(batch["input_ids"].unbind()):
        first.setdefault(_row_key(row), index)
    steps = _record_steps(monkeypatch)
    update(worker, batch, mini_batch=MINI, epochs=EPOCHS, shuffle=False)
    assert len(steps) == 4
    config = worker.loss_fn.keywords["config"]
    mode, settings = global_mode_of(config), global_mode_of(config).read_settings(config)
    keys_of_batch = [_row_key(row) for row in batch["input_ids"].unbind()]
    copies_seen = 0
    for step, (data, result, _) in enumerate(steps):
        keys = [_row_key(row) for row in data["input_ids"].unbind()]
        own = list(range(step % 2 * MINI, step % 2 * MINI + MINI))  # no shuffle: the minibatches in order
        assert keys == [keys_of_batch[i] for i in own]
        originals = [first[key] for key in keys]
        copies_seen += sum(a != b for a, b in zip(own, originals))
        width = result.selection.mask.shape[1]
        expected = mode.select_minibatch(padded(data["old_log_probs"])[:, :width], data, settings, None,
                                         entropy=pass_entropy[originals][:, :width])
        assert torch.equal(result.selection.mask, expected.mask)
        assert 0 < int(result.selection.mask.sum()) < int(result.selection.num_valid)
    assert copies_seen == 2 * 3  # the copies' minibatch, in both epochs


def test_kl_cov_reads_only_the_old_log_probs_verl_hands_the_update(worker, monkeypatch):
    """Nothing is kept for a mode that reads no entropy: its statistics are the minibatch's own old_log_probs."""
    from verl_klcov_global.engine import reuse

    use_mode(worker, "kl_cov_global", layout="old", mini_batch=MINI, epochs=EPOCHS)
    batch = rows(34)
    pass_log_probs, pass_entropy = log_prob_pass(worker, batch)
    assert reuse.kept_rows(worker.engine) == 0
    steps = _record_steps(monkeypatch)
    update(worker, batch, mini_batch=MINI, epochs=EPOCHS)
    for data, result, _ in steps:
        assert torch.equal(result.selection.mask,
                           _expected_selection(worker, data, batch, pass_log_probs, pass_entropy, result.settings).mask)


# ---------------------------------------------------------------------------------------------
# Independent of micro-batching


#: the log-prob pass of every layout below: one static micro-batching, so pi_old's statistics (old_log_probs, the
#: held entropy) are the same computation on the same inputs in every layout, bit for bit on any CPU
PASS_KEYS = dict(use_dynamic_bsz=False, micro_batch_size_per_gpu=16)
#: KL-Cov's old log-probs are moved off pi by N(0, OFF_POLICY) (as a rollout engine's or a stale pi_old's would be):
#: at pi = pi_old the penalty's gradient is coef * sign(float noise) * grad log pi (docs/KL_COV.md), and a row's
#: fp32 log-probs move in the last bits with its micro-batch company on some CPUs (AMD EPYC: ~5e-7), so there the
#: update follows the micro-batching whatever selects the tokens
OFF_POLICY = 0.05
#: the smallest |log pi - log pi_old| on a selected token that the test accepts as deciding the sign: 200x the largest
#: micro-batch-company difference of a row's fp32 log-prob seen on these CPUs (4.8e-7)
SIGN_MARGIN = 1e-4


def _move_old_log_probs_off_policy(batch, seed: int) -> None:
    old = batch["old_log_probs"]
    generator = torch.Generator().manual_seed(seed)
    if old.is_nested:
        values = old.values()
        moved = values + OFF_POLICY * torch.randn(values.shape, generator=generator)
        batch["old_log_probs"] = torch.nested.nested_tensor_from_jagged(moved, old.offsets())
    else:
        batch["old_log_probs"] = old + OFF_POLICY * torch.randn(old.shape, generator=generator)


def _run_update(model_path, mode, *, dynamic: bool, micro: int, seed: int = 35, off_policy: bool = False):
    """(every step's mask, the parameters after the update, the smallest |log pi - log pi_old| on a selected token
    over the steps, or None for a control)."""
    from verl_klcov_global.layout import padded

    worker = build_training_worker(model_path, lr=0.1, clip_grad=1.0, micro_batch_size_per_gpu=micro,
                                   infer_micro_batch_size_per_gpu=16, use_dynamic_bsz=dynamic,
                                   max_token_len_per_gpu=200, infer_max_token_len_per_gpu=400)
    use_mode(worker, mode, layout="old", mini_batch=MINI, epochs=EPOCHS)
    batch = rows(seed)
    masks, margins = [], []
    real_run = engine_step.run_prepass_and_select

    def run(engine, data, settings, mode_spec):
        result = real_run(engine, data, settings, mode_spec)
        masks.append(result.selection.mask.clone())
        if off_policy and mode != "vanilla":  # the current policy before the step (an eval forward, RNG restored)
            current = compute_prepass_log_probs_and_entropy(engine, data, "infer")[0]
            width = current.shape[1]
            selected = result.selection.mask[:, :width]
            margins.append(float((current - padded(data["old_log_probs"])[:, :width]).abs()[selected].min()))
        return result

    engine_step.run_prepass_and_select = run
    try:
        log_prob_pass(worker, batch, **PASS_KEYS)
        if off_policy:
            _move_old_log_probs_off_policy(batch, seed)
        update(worker, batch, mini_batch=MINI, epochs=EPOCHS)
    finally:
        engine_step.run_prepass_and_select = real_run
    return masks, full_state_dict(worker.engine), (min(margins) if margins else None)




@pytest.mark.parametrize("mode", MODES)
def test_masks_and_update_do_not_depend_on_micro_batching(tiny_model_path, mode):
    """Premises: the masks are bit for bit because pi_old's statistics are (one pass layout, :data:`PASS_KEYS`);
    the update is within 10x the vanilla control's noise between the same layouts (tensor by tensor,
    ``tests/support/noise_floor.py``) because every training
    layout's difference is float noise in continuous terms, and for KL-Cov because the sign of
    log pi - log pi_old on every selected token is decided by at least :data:`SIGN_MARGIN` (measured)."""
    off_policy = mode == "kl_cov_global"
    layouts = {"static 8": dict(dynamic=False, micro=8), "static 2": dict(dynamic=False, micro=2),
               "dynamic 200 tokens": dict(dynamic=True, micro=8)}
    control = {name: _run_update(tiny_model_path, "vanilla", off_policy=off_policy, **kw)[1]
               for name, kw in layouts.items()}
    runs = {name: _run_update(tiny_model_path, mode, off_policy=off_policy, **kw) for name, kw in layouts.items()}
    reference_masks, reference_params, _ = runs["static 8"]
    assert len(reference_masks) == 4 and all(m.any() for m in reference_masks)
    if off_policy:
        margins = [margin for _, _, margin in runs.values()]
        assert min(margins) >= SIGN_MARGIN, f"a selected token's sign is not decided: margins {margins}"
    for name in ("static 2", "dynamic 200 tokens"):
        masks, params, _ = runs[name]
        assert all(torch.equal(a, b) for a, b in zip(masks, reference_masks, strict=True)), name
        assert any_difference(control[name], control["static 8"]), "no noise: the two layouts gave the same control"
        ratio = ratio_to_control(params, reference_params, control[name], control["static 8"])
        assert ratio <= NOISE_FACTOR, (name, ratio)
    # the masks changed the update: the comparison is not between two vanilla runs
    assert ratio_to_control(reference_params, control["static 8"], control["static 2"], control["static 8"]) > 100


# ---------------------------------------------------------------------------------------------
# Two ranks


def _two_ranks(rank: int, world_size: int, model_path: str):
    import verl_klcov_global  # noqa: F401  (the patches)

    results = []
    real_run = engine_step.run_prepass_and_select

    def run(engine, data, settings, mode):
        result = real_run(engine, data, settings, mode)
        results.append((data.copy(), result.selection.mask.clone()))
        return result

    engine_step.run_prepass_and_select = run
    worker = build_training_worker(model_path, lr=0.1, clip_grad=1.0, micro_batch_size_per_gpu=8,
                                   infer_micro_batch_size_per_gpu=16)
    use_mode(worker, "high_entropy_global", layout="old", mini_batch=ROWS, epochs=EPOCHS)
    full = rows(36, batch_size=2 * ROWS)
    shard = _tiny.shard_for_rank(full, rank, world_size)  # verl's contiguous DP chunk
    log_prob_pass(worker, shard)
    update(worker, shard, mini_batch=ROWS, epochs=EPOCHS)  # 2 minibatches of 16 rows per rank, 2 epochs
    steps = [(row_indices(data, full), mask) for data, mask in results]
    # a rank whose minibatch has rows its pass did not see: no pi_old entropy there
    other = _tiny.shard_for_rank(rows(37, batch_size=2 * ROWS), rank, world_size)
    log_prob_pass(worker, other)
    if rank == 1:
        other = _tiny.shard_for_rank(rows(38, batch_size=2 * ROWS), rank, world_size)
    try:
        update(worker, other, mini_batch=ROWS, epochs=1)
        raised = None
    except OldPolicyStatisticsError as error:
        raised = str(error)
    return steps, raised


@pytest.mark.distributed
def test_two_ranks_select_what_one_process_selects_and_fail_together(tiny_model_path):
    (steps0, raised0), (steps1, raised1) = spawn_gloo(_two_ranks, 2, tiny_model_path, verl_platform=True)
    assert raised0 is not None and "another rank has none" in raised0
    assert raised1 is not None and "rows were not in verl's log-prob pass" in raised1
    # one process: pi_old's statistics of the whole batch (the same model init), one selection per step over the
    # union of the two ranks' minibatches
    worker = build_training_worker(tiny_model_path, lr=0.1, clip_grad=1.0, micro_batch_size_per_gpu=8,
                                   infer_micro_batch_size_per_gpu=16)
    use_mode(worker, "high_entropy_global", layout="old")
    full = rows(36, batch_size=2 * ROWS)
    pass_log_probs, pass_entropy = log_prob_pass(worker, full)
    assert len(steps0) == len(steps1) == 4
    config = worker.loss_fn.keywords["config"]
    mode, settings = global_mode_of(config), global_mode_of(config).read_settings(config)
    selected = 0
    for (index0, mask0), (index1, mask1) in zip(steps0, steps1):
        union = index0 + index1
        data = tu.index_select_tensor_dict(full, union)
        expected = mode.select_minibatch(pass_log_probs[union], data, settings, None, entropy=pass_entropy[union])
        lengths = data["response_mask"].offsets().diff().tolist()
        for row, (mask, at) in enumerate([(mask0, i) for i in range(len(index0))]
                                         + [(mask1, i) for i in range(len(index1))]):
            n = lengths[row]
            assert torch.equal(mask[at, :n], expected.mask[row, :n]), (row, union[row])
        selected += int(expected.mask.sum())
    assert selected > 0
