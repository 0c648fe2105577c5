"""The authors' per-micro-batch high-entropy rule, the lab's comparator (``methods/high_entropy/authors.py``, run by ``lab/per_micro_batch.py``).

Fast: the rule against an independent sort-based quantile (ties, empty micro-batches, rho = 1), its
errors, and that only the lab registers it (a fresh interpreter that loads the plugin does not).
Slow (verl's real FSDP engine on CPU, tiny model): through the lab's loss function it gets each
training micro-batch's entropy from verl's own forward; at rho = 1 its update is vanilla's bit for bit;
at rho = 0.2 its selection and update move with the micro-batch layout.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from verl_klcov_global.lab import per_micro_batch as lab
from verl_klcov_global.methods.high_entropy import authors as pmb


def reference_mask(entropy: torch.Tensor, response_mask: torch.Tensor, rho: float) -> torch.Tensor:
    """TRL's rule written out: sort the valid entropies, interpolate the (1 - rho) quantile linearly, keep >=."""
    values = sorted(float(v) for v in entropy[response_mask.bool()].float())
    if not values:
        return torch.zeros_like(response_mask, dtype=torch.bool)
    position = (1.0 - rho) * (len(values) - 1)
    low, high = math.floor(position), math.ceil(position)
    threshold = values[low] + (values[high] - values[low]) * (position - low)
    keep = torch.zeros_like(response_mask, dtype=torch.bool)
    for index in zip(*torch.nonzero(response_mask.bool(), as_tuple=True)):
        keep[index] = float(entropy[index].float()) >= torch.tensor(threshold, dtype=torch.float32).item()
    return keep


@pytest.mark.parametrize("rho", [0.2, 0.5, 0.05, 1.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_rule_is_the_linear_quantile_and_keeps_every_token_at_or_above_it(rho, seed):
    generator = torch.Generator().manual_seed(seed)
    entropy = torch.rand(6, 20, generator=generator) * 3
    entropy[2, :10] = 0.0  # deterministic tokens are ordinary keys
    response_mask = torch.rand(6, 20, generator=generator) < 0.7
    mask, threshold = pmb.per_micro_batch_entropy_mask(entropy, response_mask, rho)
    assert torch.equal(mask, reference_mask(entropy, response_mask, rho))
    assert not bool((mask & ~response_mask).any())
    if rho == 1.0:
        assert torch.equal(mask, response_mask)  # the 0-quantile is the minimum: every valid token
    assert threshold == pytest.approx(float(torch.quantile(entropy[response_mask], 1 - rho)))


def test_ties_at_the_threshold_make_the_count_exceed_the_quota():
    """TRL's `>=`: 10 valid tokens, rho 0.2 -> quota 2, but 5 tokens tie at the top -> all 5 kept."""
    entropy = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 0.1, 0.2, 0.3, 0.4, 0.5]])
    mask, threshold = pmb.per_micro_batch_entropy_mask(entropy, torch.ones_like(entropy, dtype=torch.bool), 0.2)
    assert threshold == 1.0 and int(mask.sum()) == 5 > max(1, int(10 * 0.2))


def test_a_micro_batch_without_valid_tokens_keeps_nothing():
    mask, threshold = pmb.per_micro_batch_entropy_mask(torch.rand(2, 4), torch.zeros(2, 4, dtype=torch.bool), 0.2)
    assert threshold is None and not bool(mask.any())


def _loss_inputs(rows=3, width=8):
    generator = torch.Generator().manual_seed(3)
    old = -torch.rand(rows, width, generator=generator)
    return dict(old_log_prob=old, log_prob=old + 0.01 * torch.randn(rows, width, generator=generator),
                advantages=torch.randn(rows, width, generator=generator),
                response_mask=torch.ones(rows, width, dtype=torch.bool))


def test_without_the_micro_batch_entropy_it_says_it_is_the_labs_comparator():
    from verl_klcov_global.lab.tiny import make_actor_config

    config = make_actor_config(policy_loss=pmb.HighEntropyPerMicroBatchPolicyLossConfig())
    with pytest.raises(lab.MicroBatchEntropyUnavailableError, match="lab's comparator.*high_entropy_global"):
        pmb.compute_policy_loss_high_entropy_per_micro_batch(config=config, **_loss_inputs())


@pytest.mark.parametrize("ratio", [20, 0.0, 1.5])
def test_a_ratio_outside_0_1_is_refused_naming_the_key_and_the_fraction(ratio):
    from verl_klcov_global.lab.tiny import make_actor_config

    config = make_actor_config(policy_loss=pmb.HighEntropyPerMicroBatchPolicyLossConfig(entropy_top_ratio=ratio))
    inputs = _loss_inputs()
    with lab.provide_micro_batch_entropy(torch.rand(3, 8)), pytest.raises(ValueError, match="entropy_top_ratio.*fraction"):
        pmb.compute_policy_loss_high_entropy_per_micro_batch(config=config, **inputs)


def test_unselected_tokens_get_exactly_zero_loss_and_gradient_and_all_tokens_count_in_the_mean():
    """The comparator = verl's vanilla on A * mask; token-mean divides by every valid token."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    from verl_klcov_global.lab.tiny import make_actor_config

    config = make_actor_config(policy_loss=pmb.HighEntropyPerMicroBatchPolicyLossConfig(entropy_top_ratio=0.25))
    inputs = _loss_inputs()
    log_prob = inputs.pop("log_prob").requires_grad_(True)
    entropy = torch.rand(3, 8, generator=torch.Generator().manual_seed(9))
    with lab.provide_micro_batch_entropy(entropy):
        loss, metrics = pmb.compute_policy_loss_high_entropy_per_micro_batch(log_prob=log_prob, config=config, **inputs)
    loss.backward()
    mask, _ = pmb.per_micro_batch_entropy_mask(entropy, inputs["response_mask"], 0.25)
    assert metrics[pmb.SELECTED_METRIC] == float(mask.sum()) == 6  # 24 distinct entropies: exactly the top 25%
    assert bool((log_prob.grad[~mask] == 0).all()) and bool((log_prob.grad[mask] != 0).all())
    # the same number as vanilla's loss on the selected tokens, divided by all 24 valid tokens
    selected_only = inputs["response_mask"] & mask
    vanilla_selected, _ = compute_policy_loss_vanilla(
        old_log_prob=inputs["old_log_prob"], log_prob=log_prob.detach(), advantages=inputs["advantages"],
        response_mask=selected_only, loss_agg_mode="token-mean", config=config)
    assert torch.allclose(loss.detach(), vanilla_selected * 6 / 24, rtol=1e-6, atol=0)


@pytest.mark.slow  # a fresh interpreter importing verl: ~13 s
def test_only_the_lab_registers_it_never_the_plugin():
    """Both comparators: high_entropy_per_micro_batch and stare_per_micro_batch."""
    code = (
        "import verl, verl_klcov_global\n"
        "from verl_klcov_global import plugin\n"
        "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R\n"
        "plugin.install()\n"
        "assert 'high_entropy_per_micro_batch' not in R, 'the plugin registered the lab comparator'\n"
        "assert 'stare_per_micro_batch' not in R, 'the plugin registered the STARE comparator'\n"
        "import sys\n"
        "assert not [m for m in sys.modules if m.endswith('.authors')], 'the plugin imported an authors rule'\n"
        "from verl_klcov_global.lab import per_micro_batch\n"
        "from verl_klcov_global.methods.high_entropy import authors as high_entropy\n"
        "from verl_klcov_global.methods.stare import authors as stare\n"
        "assert 'high_entropy_per_micro_batch' not in R, 'importing the lab or a comparator registered it'\n"
        "assert 'stare_per_micro_batch' not in R, 'importing the lab or a comparator registered the STARE comparator'\n"
        "per_micro_batch.register(high_entropy.COMPARATOR)\n"
        "assert R['high_entropy_per_micro_batch'] is high_entropy.compute_policy_loss_high_entropy_per_micro_batch\n"
        "assert 'stare_per_micro_batch' not in R, 'registering one comparator registered the other'\n"
        "per_micro_batch.register(stare.COMPARATOR)\n"
        "assert R['stare_per_micro_batch'] is stare.compute_policy_loss_stare_per_micro_batch\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


# -- verl's real FSDP engine on CPU ----------------------------------------------------------------------

BATCH, PROMPT, RESPONSE = 16, 8, 32


@pytest.fixture(scope="module")
def engine_and_batch(tiny_model_path):
    from verl_klcov_global.lab.experiment import EngineSpec, frozen_minibatch

    spec = EngineSpec(tiny_model_path)
    return spec, frozen_minibatch(spec, seed=0, batch_size=BATCH, prompt_len=PROMPT, response_len=RESPONSE)


def _actor(mode, ratio=0.2):
    from verl_klcov_global.lab.tiny import make_actor_config

    if mode == pmb.NAME:
        return make_actor_config(policy_loss=pmb.HighEntropyPerMicroBatchPolicyLossConfig(entropy_top_ratio=ratio))
    return make_actor_config(loss_mode=mode)


@pytest.mark.slow
def test_at_rho_1_the_comparator_is_vanilla_bit_for_bit(engine_and_batch):
    from verl_klcov_global.lab.experiment import one_update, static_layouts

    lab.register(pmb.COMPARATOR)
    spec, batch = engine_and_batch
    layout = static_layouts(BATCH, 4)[1]
    vanilla = one_update(spec, batch, _actor("vanilla"), layout)
    everything = one_update(spec, batch, _actor(pmb.NAME, 1.0), layout)
    assert everything.selected_tokens == int(batch["response_mask"].sum())
    assert torch.equal(vanilla.params, everything.params)


@pytest.mark.slow
def test_the_comparator_reads_verls_training_entropy_and_moves_with_the_layout(engine_and_batch, monkeypatch):
    """Each micro-batch's mask = the rule on verl's compute_log_prob entropy of that micro-batch's rows; the
    1- and 4-micro-batch updates differ far beyond vanilla's layout noise."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    from verl_klcov_global.lab.experiment import max_abs_diff, one_update, static_layouts

    lab.register(pmb.COMPARATOR)
    spec, batch = engine_and_batch
    seen = []
    original = pmb.per_micro_batch_entropy_mask

    def recording(entropy, response_mask, rho):
        seen.append((entropy.clone(), response_mask.clone()))
        return original(entropy, response_mask, rho)

    monkeypatch.setattr(pmb, "per_micro_batch_entropy_mask", recording)
    one, four = static_layouts(BATCH, 4)
    outcomes = {layout.name: one_update(spec, batch, _actor(pmb.NAME), layout) for layout in (one, four)}
    assert len(seen) == 1 + 4
    # the entropy the comparator saw is verl's own entropy of the same rows (compute_log_prob, no grad)
    engine = spec.build()
    data = batch.copy()
    tu.assign_non_tensor(data, calculate_entropy=True, compute_loss=False)
    with engine.eval_mode():
        out = engine.infer_batch(data)
    reference = no_padding_2_padding(out["model_output"]["entropy"], data).float()
    whole, _ = seen[0]
    assert torch.allclose(whole, reference, rtol=1e-5, atol=1e-6), float((whole - reference).abs().max())
    mask_whole, _ = original(*seen[0], 0.2)
    masks_split = torch.cat([original(e, m, 0.2)[0] for e, m in seen[1:]])
    assert not torch.equal(mask_whole, masks_split), "the per-micro-batch rule did not move with the layout"
    control = max_abs_diff(one_update(spec, batch, _actor("vanilla"), one).params,
                           one_update(spec, batch, _actor("vanilla"), four).params)
    moved = max_abs_diff(outcomes[one.name].params, outcomes[four.name].params)
    assert control > 0 and moved > 10 * control, (moved, control)
