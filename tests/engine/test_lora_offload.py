"""LoRA, and param plus optimizer offload, through verl's real FSDP engine (CPU): every mode stays invariant.

Two engine settings users combine with the global modes and that change what the engine holds during the
prepass: a LoRA adapter (peft, ``target_modules="all-linear"``: only the adapter trains, the selection reads the
adapted policy) and verl's ``param_offload`` + ``optimizer_offload`` (verl's train-mode context loads and offloads
around the step; the prepass runs inside it). For each, one mode per statistic the prepass reads, at 1 against 8
static micro-batches: the masks bit for bit, and the update within ``NOISE_FACTOR`` x the penalty-free control's
difference between the same two layouts, less than the mode moved it from the control.

On a CPU verl's offload moves stay on the host: what this proves is that verl's offload and load calls around the
prepass and the step leave the selection and the update as without micro-batching, not the cost of the copies
(docs/PREPASS.md reasons that in bytes).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from verl_klcov_global.lab import cpu as _cpu
from verl_klcov_global.lab import tiny as _tiny
from verl_klcov_global.lab.experiment import EngineSpec, frozen_minibatch, max_abs_diff, one_update, static_layouts

from .test_response_gaps import POLICY_LOSSES as EVERY_MODE

pytestmark = pytest.mark.slow  # verl's real engine on CPU: the slow tier

BATCH, PROMPT, RESPONSE = 16, 8, 32
MICRO_BATCHES = 8
NOISE_FACTOR = 10
#: One mode per statistic the prepass reads: log-probs (KL-Cov; Clip-Cov reads the same), entropy (80/20; STARE
#: reads the same) and Lp-Reg's proxy from the held log-prob pass. tests/engine/test_ulysses.py runs all five.
POLICY_LOSSES = {mode: EVERY_MODE[mode] for mode in ("kl_cov_global", "high_entropy_global", "lp_reg_global")}
SETTINGS = {
    "lora": dict(strategy="fsdp2", lora_rank=4, lr=0.5),
    "param+optimizer offload": dict(strategy="fsdp2", param_offload=True, optimizer_offload=True),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_every_mode_is_invariant_to_the_micro_batches(tiny_model_path, setting):
    spec = EngineSpec(tiny_model_path, **SETTINGS[setting])
    batch = frozen_minibatch(dataclasses.replace(spec, lora_rank=0), 5, batch_size=BATCH, prompt_len=PROMPT,
                             response_len=RESPONSE, vary_lengths=True, micro_batch_size_per_gpu=BATCH)
    layouts = static_layouts(BATCH, MICRO_BATCHES)

    def updates(actor_config):
        return [one_update(spec, batch, actor_config, layout) for layout in layouts]

    control = updates(_tiny.make_actor_config(loss_mode="vanilla"))
    floor = max_abs_diff(control[0].params, control[1].params)
    assert floor > 0, "no noise floor: the two layouts did not differ at all, the comparison proves nothing"
    if setting == "lora":  # the adapter is on: only its weights moved, a small share of all
        initial = _cpu.engine_params_flat(spec.build())
        assert initial.numel() == control[0].params.numel()
        assert 0 < int((control[0].params != initial).sum()) < initial.numel() // 10
    for mode, policy_loss in POLICY_LOSSES.items():
        first, second = updates(_tiny.make_actor_config(policy_loss=policy_loss()))
        assert first.masks and len(first.masks) == len(second.masks), mode
        for one, other in zip(first.masks, second.masks, strict=True):
            assert one.any(), f"{mode} selected nothing: the test would prove nothing"
            assert torch.equal(one, other), f"{mode} ({setting}): the selection depends on the micro-batches"
        diff = max_abs_diff(first.params, second.params)
        effect = max_abs_diff(first.params, control[0].params)  # beyond the tolerance, or the check proves nothing
        assert diff <= NOISE_FACTOR * floor, (mode, setting, diff, floor)
        assert effect > NOISE_FACTOR * floor, (mode, setting, "the mode did not move the update beyond the tolerance")
