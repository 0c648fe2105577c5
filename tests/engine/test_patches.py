"""PATCH ``train_batch_prepass`` (``engine/patches.py``, ``engine/step.py``): installation, its verl contracts,
and what it must not touch.

* the entry point installs it on a plain ``import verl``; installing again changes nothing;
* the patch target and the verl behaviour around it are what the engine patch expects (verl 0.9.1 and 0.8.0),
  so an upstream change fails here (and at import, in seams.py) and not silently in training;
* every loss mode outside the mode table runs verl's own ``train_batch`` (bit-identical update);
* the prepass restores the RNG state and ``module.training``;
* an engine the hook does not cover fails before any forward;
* ``prepass_layout`` ("train" / "infer") through ``KLCovGlobalPolicyLossConfig``.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from verl.utils import tensordict_utils as tu
from verl.workers.engine.base import BaseEngine
from verl.workers.utils.losses import ppo_loss

from verl_klcov_global.engine import patches as engine_patches, prepass as engine_prepass, step as engine_step

from verl_klcov_global.layout import padded

from verl_klcov_global import plugin
from verl_klcov_global.seams import VerlSeamError, check_seams
from verl_klcov_global.lab import cpu as _cpu
from verl_klcov_global.lab import tiny as _tiny
from verl_klcov_global.config import MASK_FIELD, KLCovGlobalPolicyLossConfig, read_kl_cov_settings
from verl_klcov_global.modes import global_mode_of
from verl_klcov_global.methods.kl_cov.row import KL_COV
from verl_klcov_global.lab.experiment import EngineSpec, frozen_minibatch

pytestmark = pytest.mark.slow  # verl's real engine / workers / trainer on CPU: the slow tier

ORIGINAL_ATTR = "__verl_klcov_global_original__"
BATCH, PROMPT, RESPONSE = 16, 8, 32
RATIO = 0.01  # 16 x <=32 response tokens: a quota of a few tokens


def loss_fn(mode: str, **policy_loss):
    if policy_loss:
        config = _tiny.make_actor_config(policy_loss=KLCovGlobalPolicyLossConfig(**policy_loss))
    else:
        config = _tiny.make_actor_config(loss_mode=mode, kl_cov_ratio=RATIO, ppo_kl_coef=1.0)
    return functools.partial(ppo_loss, config=config)


@pytest.fixture(scope="module")
def frozen_batch(tiny_model_path):
    """16 sequences of varied length, old_log_probs = initial policy + N(0, 0.05), 2 static micro-batches."""
    batch = frozen_minibatch(EngineSpec(tiny_model_path), 11, batch_size=BATCH, prompt_len=PROMPT,
                             response_len=RESPONSE, vary_lengths=True)
    return _tiny.set_micro_batching(batch, use_dynamic_bsz=False, micro_batch_size_per_gpu=8)


@pytest.fixture
def restore_hook():
    """Whatever a test does to BaseEngine.train_batch, leave the hook installed once, on verl's original."""
    original = getattr(BaseEngine.train_batch, ORIGINAL_ATTR, None) or BaseEngine.train_batch
    try:
        yield original
    finally:
        BaseEngine.train_batch = original
        engine_patches.install_hook()
        assert getattr(BaseEngine.train_batch, ORIGINAL_ATTR) is original


# ---------------------------------------------------------------------------------------------
# Installation and verl's contracts

_PROBE = """
import json, sys
import verl
from verl.workers.engine.base import BaseEngine
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
original = getattr(BaseEngine.train_batch, "__verl_klcov_global_original__", None)
print("RESULT " + json.dumps({
    "plugin_imported": "verl_klcov_global.plugin" in sys.modules,
    "hooked": original is not None,
    "registered": "kl_cov_global" in POLICY_LOSS_REGISTRY,
    "original": None if original is None else f"{original.__module__}.{original.__qualname__}",
}))
"""


def _probe_processes():
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_PLUGINS"}
    procs = {}
    for policy in ("auto", "none"):
        procs[policy] = subprocess.Popen(
            [sys.executable, "-c", _PROBE], env={**env, "VERL_USE_EXTERNAL_PLUGINS": policy},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
    results = {}
    for policy, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        line = [x for x in out.splitlines() if x.startswith("RESULT ")]
        assert line, out[-2000:] + err[-2000:]
        results[policy] = json.loads(line[-1][len("RESULT "):])
    return results


@pytest.mark.needs_entry_point_group  # verl 0.8 has no verl.plugins group: tests/test_loading_routes.py covers its route
def test_entry_point_installs_the_hook_on_import_verl_in_a_clean_interpreter():
    results = _probe_processes()
    assert results["auto"] == {
        "plugin_imported": True, "hooked": True, "registered": True,
        "original": "verl.workers.engine.base.BaseEngine.train_batch",
    }
    # control: with verl's plugin loading switched off nothing of ours is there, so the entry point did it
    assert results["none"] == {"plugin_imported": False, "hooked": False, "registered": False, "original": None}


def test_installing_again_is_idempotent(restore_hook):
    original = restore_hook
    assert engine_patches.is_hook_installed()
    installed = BaseEngine.train_batch
    engine_patches.install_hook()
    plugin.install()
    engine_patches.install_hook()
    assert BaseEngine.train_batch is installed
    assert getattr(installed, ORIGINAL_ATTR) is original
    assert getattr(original, ORIGINAL_ATTR, None) is None  # one layer, not a wrapper of a wrapper
    engine_patches.uninstall_hook()
    assert BaseEngine.train_batch is original and not engine_patches.is_hook_installed()
    engine_patches.uninstall_hook()  # harmless when not installed
    assert BaseEngine.train_batch is original
    engine_patches.install_hook()
    engine_patches.install_hook()
    assert getattr(BaseEngine.train_batch, ORIGINAL_ATTR) is original


def test_patch_target_is_what_the_engine_patch_expects(restore_hook):
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    original = restore_hook
    # no version check: seams.py checks these seams at import, on every verl (tests/test_seams.py)
    assert f"{original.__module__}.{original.__qualname__}" == "verl.workers.engine.base.BaseEngine.train_batch"
    assert list(inspect.signature(original).parameters) == ["self", "data", "loss_function"]
    # the FSDP engine must reach BaseEngine.train_batch: an override anywhere below would bypass the hook
    assert [c for c in FSDPEngineWithLMHead.__mro__ if "train_batch" in vars(c)] == [BaseEngine]
    # the prepass calls infer_batch(data, loss_function=None)
    assert list(inspect.signature(BaseEngine.infer_batch).parameters)[:3] == ["self", "data", "loss_function"]
    # verl builds the loss as partial(ppo_loss, config=actor_config) (the hook reads .keywords["config"])
    # and calls it with keywords model_output / data / dp_group (the hook's wrapper takes those)
    assert list(inspect.signature(ppo_loss).parameters) == ["config", "model_output", "data", "dp_group"]
    # an upstream change of the signature fails the seam check (run at import, before any patch) loudly,
    # naming the known versions; seams.py is the one owner of signature checks
    def train_batch(self, batch, loss_fn, extra=None):  # a hypothetical future signature
        raise AssertionError("must not be called")

    engine_patches.uninstall_hook()
    BaseEngine.train_batch = train_batch
    with pytest.raises(VerlSeamError, match=r"(?s)BaseEngine\.train_batch.*\['self', 'batch', 'loss_fn', 'extra'\].*verl 0\.8\.0, 0\.9\.1"):
        check_seams(force=True)
    assert BaseEngine.train_batch is train_batch


def test_verl_behaves_as_the_prepass_memory_rules_assume(tiny_model_path, monkeypatch):
    """What the prepass's peak-memory reasoning (engine/prepass.py's docstring) takes from verl, observed in verl's
    real FSDP engine and contexts. (That ``train_batch`` frees the gradients before its forward-backward is
    observed on verl's own ``BaseEngine.train_batch`` by the control of ``test_unsupported_engine_raises_before_any_forward``.)"""
    engine = _cpu.build_fsdp_engine(tiny_model_path)
    for parameter in engine.module.parameters():  # gradients as a forward-backward leaves them
        parameter.grad = torch.ones_like(parameter)
    engine.optimizer_zero_grad()
    assert all(p.grad is None for p in engine.module.parameters())  # set to None: their memory is freed

    # train mode loads an offloaded optimizer's states onto the device, eval mode (compute_log_prob) does not
    moves = []
    monkeypatch.setattr(engine, "to", lambda device, model=True, optimizer=True, grad=True: moves.append(optimizer))
    monkeypatch.setattr(engine, "_is_offload_optimizer", True)
    assert engine.is_optimizer_offload_enabled
    with engine.train_mode():
        assert moves == [True]
    moves.clear()
    with engine.eval_mode():
        assert moves == [False]


# ---------------------------------------------------------------------------------------------
# Other loss modes: verl's train_batch untouched


def _train_once(model_path, batch, loss_function, seen):
    """Fresh engine, one train_batch; records the loss function verl's forward_backward_batch received."""
    engine = _cpu.build_fsdp_engine(model_path)
    real = engine.forward_backward_batch

    def recording(data, loss_function, forward_only=False):
        seen.append((loss_function, forward_only))
        return real(data, loss_function, forward_only=forward_only)

    engine.forward_backward_batch = recording
    before = _cpu.engine_params_flat(engine)
    torch.manual_seed(0)  # clip_cov draws with torch.randperm: the same draw in both runs
    with engine.train_mode():
        output = engine.train_batch(batch.copy(), loss_function=loss_function)
    return before, _cpu.engine_params_flat(engine), output


@pytest.mark.parametrize("mode", ["vanilla", "kl_cov", "clip_cov"])
def test_other_loss_modes_run_verls_train_batch_untouched(tiny_model_path, frozen_batch, mode, monkeypatch,
                                                          restore_hook):
    def no_prepass(*args, **kwargs):
        raise AssertionError(f"prepass ran for loss_mode={mode}")

    monkeypatch.setattr(engine_prepass, "compute_prepass_log_probs", no_prepass)
    loss_function = loss_fn(mode)
    observed, seen_hooked, seen_plain = [], [], []
    assert engine_patches.is_hook_installed()
    with engine_step.observe_selections(lambda engine, result: observed.append(result)):
        initial, hooked, output = _train_once(tiny_model_path, frozen_batch, loss_function, seen_hooked)
    engine_patches.uninstall_hook()
    try:
        _, plain, _ = _train_once(tiny_model_path, frozen_batch, loss_function, seen_plain)
    finally:
        engine_patches.install_hook()
    assert observed == []
    assert seen_hooked == [(loss_function, False)]  # one forward-backward, verl's own loss function object
    assert seen_plain == [(loss_function, False)]
    assert not torch.equal(initial, hooked), "the step did not move the parameters: nothing was compared"
    assert torch.equal(hooked, plain)
    assert not any(k.startswith(("actor/kl_cov/", "actor/clip_cov/")) for k in output["metrics"])


# ---------------------------------------------------------------------------------------------
# The prepass leaves RNG and module mode as it found them


def test_prepass_restores_rng_state_and_module_mode(tiny_model_path, frozen_batch):
    engine = _cpu.build_fsdp_engine(tiny_model_path)
    settings = read_kl_cov_settings(loss_fn("kl_cov_global").keywords["config"])
    real_infer = engine.infer_batch
    modes_during_forward = []

    def infer_consuming_rng(data, loss_function=None):
        modes_during_forward.append(engine.module.training)
        torch.rand(8)  # whatever the forward draws must be given back
        return real_infer(data, loss_function=loss_function)

    engine.infer_batch = infer_consuming_rng
    torch.manual_seed(1234)
    for training in (True, False, True):
        engine.module.train(training)
        state = torch.random.get_rng_state()
        result = engine_prepass.run_prepass_and_select(engine, frozen_batch, settings, KL_COV)
        assert torch.equal(torch.random.get_rng_state(), state)
        assert engine.module.training is training
        assert all(m.training is training for m in engine.module.modules())
        assert result.selection.quota >= 1
    assert modes_during_forward == [False, False, False]  # eval mode (no dropout) during the prepass
    torch.rand(1)  # control: the RNG does move when something draws from it
    assert not torch.equal(torch.random.get_rng_state(), state)


def test_prepass_with_dropout_model_draws_nothing_and_is_deterministic(tiny_model_path, frozen_batch, tmp_path):
    """With attention dropout > 0, verl's forward in train mode consumes RNG; the prepass must not."""
    dropout_path = str(tmp_path / "tiny_dropout")
    shutil.copytree(tiny_model_path, dropout_path)
    with open(os.path.join(dropout_path, "config.json")) as f:
        config = json.load(f)
    config["attention_dropout"] = 0.5
    with open(os.path.join(dropout_path, "config.json"), "w") as f:
        json.dump(config, f)
    engine = _cpu.build_fsdp_engine(dropout_path)
    data = frozen_batch.copy()
    tu.assign_non_tensor(data, calculate_entropy=False, compute_loss=False)

    # meaningful: a train-mode forward of verl's own infer_batch draws from the CPU RNG (dropout active)
    engine.module.train()
    state = torch.random.get_rng_state()
    first = engine.infer_batch(data.copy())["model_output"]["log_probs"].values()
    assert not torch.equal(torch.random.get_rng_state(), state)
    second = engine.infer_batch(data.copy())["model_output"]["log_probs"].values()
    assert not torch.equal(first, second)

    # the prepass: no draw, deterministic, the eval-mode log-probs, train mode restored
    state = torch.random.get_rng_state()
    prepass = [engine_prepass.compute_prepass_log_probs(engine, frozen_batch, "infer") for _ in range(2)]
    assert torch.equal(torch.random.get_rng_state(), state)
    assert engine.module.training
    assert torch.equal(prepass[0], prepass[1])
    eval_mode = _tiny.compute_current_log_probs(engine, frozen_batch)
    engine.module.train()
    mask = padded(frozen_batch["response_mask"]).bool()
    assert torch.allclose(prepass[0][mask], eval_mode[mask], atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Engines the hook does not cover


class _RecordingEngine(BaseEngine):
    """A minimal non-FSDP engine: records what verl's train_batch calls on it."""

    def __init__(self, strategy):
        self.calls = []
        # complete enough for a prepass to reach the forward, so "raises before any forward" is tested
        self.engine_config = SimpleNamespace(strategy=strategy, infer_micro_batch_size_per_gpu=16,
                                             infer_max_token_len_per_gpu=4096)
        self.module = torch.nn.Linear(1, 1)

    is_param_offload_enabled = False
    is_optimizer_offload_enabled = False

    def optimizer_zero_grad(self):
        self.calls.append("zero_grad")

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        self.calls.append("forward_only" if forward_only else "forward_backward")
        return {"metrics": {}, "loss": [], "model_output": {}}

    def optimizer_step(self):
        self.calls.append("optimizer_step")
        return 0.0

    def is_mp_src_rank_with_outputs(self):
        return True

    def get_data_parallel_group(self):
        return None


@pytest.mark.parametrize("mode", ["kl_cov_global", "clip_cov_global"])
@pytest.mark.parametrize("strategy", [None, "megatron", "fsdp", "fsdp2"])
def test_unsupported_engine_raises_before_any_forward(frozen_batch, strategy, mode):
    engine = _RecordingEngine(strategy)
    with pytest.raises(engine_step.UnsupportedEngineError) as raised:
        engine.train_batch(frozen_batch.copy(), loss_function=loss_fn(mode))
    message = str(raised.value)
    assert "fsdp" in message and "fsdp2" in message and "_RecordingEngine" in message
    assert f"loss_mode={mode} supports" in message and f"loss_mode={mode.removesuffix('_global')} " in message
    assert engine.calls == []
    # control: the same engine is reachable through verl's train_batch with any other loss mode
    engine.train_batch(frozen_batch.copy(), loss_function=loss_fn("kl_cov"))
    assert engine.calls == ["zero_grad", "forward_backward", "optimizer_step"]


# ---------------------------------------------------------------------------------------------
# prepass_layout through KLCovGlobalPolicyLossConfig


_MICRO_BATCH_KEYS = ("use_dynamic_bsz", "micro_batch_size_per_gpu", "max_token_len_per_gpu", "calculate_entropy")


def _kl_cov_global_update(engine, batch, loss_function):
    """One train_batch; returns (masks, micro-batch keys of every prepass forward, parameters after).

    Also checks that nothing of the prepass leaks into the training step: its forward-backward sees
    the batch's own micro-batch keys, and the mask field is gone from the batch afterwards.
    """
    results, prepass_keys, training_keys = [], [], []
    real_infer, real_forward_backward = engine.infer_batch, engine.forward_backward_batch

    def keys_of(data):
        return {k: tu.get_non_tensor_data(data, k, None) for k in _MICRO_BATCH_KEYS}

    def recording_infer(data, loss_function=None):
        prepass_keys.append(keys_of(data))
        return real_infer(data, loss_function=loss_function)

    def recording_forward_backward(data, loss_function, forward_only=False):
        if not forward_only:
            training_keys.append(keys_of(data))
        return real_forward_backward(data, loss_function, forward_only=forward_only)

    engine.infer_batch, engine.forward_backward_batch = recording_infer, recording_forward_backward
    data = batch.copy()
    try:
        with engine_step.observe_selections(lambda _engine, result: results.append(result)), engine.train_mode():
            engine.train_batch(data, loss_function=loss_function)
    finally:
        engine.infer_batch, engine.forward_backward_batch = real_infer, real_forward_backward
    assert training_keys in ([], [keys_of(batch)])
    assert MASK_FIELD not in data.keys()
    return [r.selection.mask for r in results], prepass_keys, _cpu.engine_params_flat(engine)


def test_prepass_layout_train_matches_infer_layout_end_to_end(tiny_model_path, frozen_batch):
    """Premise of the bit-for-bit mask and step (on any CPU): the two layouts' prepasses are one computation. With
    dynamic batching, a training token budget and a larger inference one that give verl the same number of
    micro-batches: verl splits by that number and the rows' lengths alone (``rearrange_micro_batches``), so both
    forward the same rows in the same micro-batches, checked here; only the key the prepass hands verl differs.
    (Static micro-batches of 4 rows vs one of 16 would put the rows in other company, where a row's fp32 log-probs
    may differ in the last bits on some CPUs.)"""
    from verl.workers.engine.utils import prepare_micro_batches

    ids = frozen_batch["input_ids"]
    tokens = int(ids.offsets().diff().sum()) if ids.is_nested else int(frozen_batch["attention_mask"].sum())
    train_budget = PROMPT + RESPONSE + tokens // 4  # 3 micro-batches of these 16 rows under either budget
    infer_budget = train_budget + 8
    batch = _tiny.set_micro_batching(frozen_batch.copy(), use_dynamic_bsz=True, max_token_len_per_gpu=train_budget)
    splits = [prepare_micro_batches(_tiny.set_micro_batching(frozen_batch.copy(), use_dynamic_bsz=True,
                                                             max_token_len_per_gpu=budget))[1]
              for budget in (train_budget, infer_budget)]
    assert splits[0] == splits[1] and len(splits[0]) > 1  # the premise: the same rows in the same micro-batches
    outcomes = {}
    for layout in ("train", "infer"):
        loss_function = loss_fn("kl_cov_global", kl_cov_ratio=RATIO, ppo_kl_coef=1.0, prepass_layout=layout)
        config = loss_function.keywords["config"]
        assert type(config.policy_loss) is KLCovGlobalPolicyLossConfig and global_mode_of(config) is KL_COV
        assert read_kl_cov_settings(config).prepass_layout == layout
        engine = _cpu.build_fsdp_engine(tiny_model_path, use_dynamic_bsz=True, max_token_len_per_gpu=train_budget,
                                        infer_max_token_len_per_gpu=infer_budget)
        outcomes[layout] = _kl_cov_global_update(engine, batch, loss_function)
    (train_masks, train_keys, train_params), (infer_masks, infer_keys, infer_params) = outcomes["train"], \
        outcomes["infer"]
    # the layouts really differ: the training token budget vs the engine's inference one
    assert [k["max_token_len_per_gpu"] for k in train_keys] == [train_budget]
    assert [k["max_token_len_per_gpu"] for k in infer_keys] == [infer_budget]
    assert len(train_masks) == len(infer_masks) == 1 and train_masks[0].any()
    assert torch.equal(train_masks[0], infer_masks[0])  # bit for bit by construction (see the docstring)
    assert torch.equal(train_params, infer_params)  # same mask, same step


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_infer_layout_without_inference_micro_batch_setting_raises(tiny_model_path, frozen_batch, dynamic):
    engine = _cpu.build_fsdp_engine(tiny_model_path, infer_micro_batch_size_per_gpu=None,
                                    infer_max_token_len_per_gpu=None)
    batch = _tiny.set_micro_batching(frozen_batch.copy(), use_dynamic_bsz=dynamic, micro_batch_size_per_gpu=8,
                                     max_token_len_per_gpu=BATCH * (PROMPT + RESPONSE))
    setting = "infer_max_token_len_per_gpu" if dynamic else "infer_micro_batch_size_per_gpu"
    advice = "log_prob_max_token_len_per_gpu" if dynamic else "log_prob_micro_batch_size_per_gpu"
    before = _cpu.engine_params_flat(engine)
    with pytest.raises(ValueError, match=rf"{setting} is not set.*{advice}.*prepass_layout=train"):
        _kl_cov_global_update(engine, batch, loss_fn("kl_cov_global", kl_cov_ratio=RATIO, prepass_layout="infer"))
    assert torch.equal(_cpu.engine_params_flat(engine), before)  # raised before the optimizer step
    # the same engine and batch work with the training layout
    masks, keys, after = _kl_cov_global_update(
        engine, batch, loss_fn("kl_cov_global", kl_cov_ratio=RATIO, prepass_layout="train"))
    assert len(masks) == 1 and masks[0].any() and not torch.equal(after, before)
    assert keys[0]["use_dynamic_bsz"] is dynamic


# --- PATCH prepass_batched_logsumexp -------------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 7, 50), (40, 50), (1, 50)])
def test_batched_logsumexp_is_bit_identical_to_verls_loop_and_restored(shape):
    import verl.utils.torch_functional as verl_F

    from verl_klcov_global.engine.logprobs import batched_logsumexp

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(*shape, generator=gen) * 5
    labels = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    original = verl_F.logprobs_from_logits_v2
    expected = original(logits, labels)
    with torch.no_grad(), batched_logsumexp():
        assert verl_F.logprobs_from_logits_v2 is not original
        got = verl_F.logprobs_from_logits(logits, labels)  # the public entry reaches the patched v2
    assert verl_F.logprobs_from_logits_v2 is original
    assert torch.equal(got, expected)


def test_batched_logsumexp_leaves_grad_bf16_and_non_contiguous_logits_to_verl(monkeypatch):
    import verl.utils.torch_functional as verl_F

    from verl_klcov_global.engine.logprobs import batched_logsumexp

    calls = []
    original = verl_F.logprobs_from_logits_v2
    def recording(logits, labels):
        calls.append((logits.dtype, logits.is_contiguous()))
        return original(logits, labels)

    monkeypatch.setattr(verl_F, "logprobs_from_logits_v2", recording)
    logits, labels = torch.randn(4, 9), torch.randint(0, 9, (4,))
    with batched_logsumexp():
        verl_F.logprobs_from_logits_v2(logits.clone().requires_grad_(), labels)  # grad enabled: verl's loop
        with torch.no_grad():
            verl_F.logprobs_from_logits_v2(logits.bfloat16(), labels)
            verl_F.logprobs_from_logits_v2(logits.t().contiguous().t(), labels)  # non-contiguous: verl's
            on_meta = verl_F.logprobs_from_logits_v2(logits.to("meta"), labels.to("meta"))  # any device: ours
            verl_F.logprobs_from_logits_v2(logits.clone(), labels)  # fp32, no grad: ours
    assert calls == [(torch.float32, True), (torch.bfloat16, True), (torch.float32, False)]
    assert on_meta.device.type == "meta" and on_meta.shape == (4,)


def test_loss_wrapper_passes_distillation_logits_processor_calls_through():
    """verl calls the loss function as ``logits_processor_func(student_logits=..., data=...)`` for top-k distillation."""
    from verl_klcov_global.engine.step import _loss_with_mask_slice

    seen = []

    def loss_function(**kwargs):
        seen.append(sorted(kwargs))
        return "processed"

    assert _loss_with_mask_slice(loss_function, None, student_logits=torch.zeros(1), data=None) == "processed"
    assert seen == [["data", "student_logits"]]
