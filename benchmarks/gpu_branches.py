"""Phase ``branches`` of the GPU kit: the hook's accelerator-only branches, each checked so it can fail.

One tiny-model engine, verl's FSDP1 (``strategy=fsdp``; the diagnose and step phases use FSDP2), fp32,
remove-padding and dynamic batching, on the run's device. Checks:

* ``process group``: the engine's data-parallel group uses NCCL for the device's tensors (gloo in the
  CPU smoke), world size 1, and an all-reduce through it is right;
* ``device RNG restored`` / ``CPU RNG restored``: ``engine_prepass.compute_prepass_log_probs`` on an engine
  whose ``infer_batch`` first draws from the CPU and the device generators (so the prepass does
  consume random numbers): both states equal their values before the prepass;
* ``accelerator logits path`` (``CPU logits path`` in the smoke): inside ``engine_logprobs.batched_logsumexp``
  (PATCH ``prepass_batched_logsumexp``) fp32 no-grad logits on the device take the plugin's batched
  in-place path (verl's ``logprobs_from_logits_v2`` is not called), give the same bits twice, and
  equal verl's loop bit for bit on CPU or within the float32 summation bound on an accelerator (the
  hook promises self-consistency there); bf16 and grad-enabled logits keep verl's loop;
* ``prepass deterministic`` and ``prepass = compute_log_prob``: two prepasses give the same bits; the
  prepass's log-probs equal verl's compute_log_prob (same minibatch and inference layout, no
  entropy): bit for bit on CPU, within the summation bound on an accelerator;
* ``selection over the NCCL group``: one ``kl_cov_global`` optimizer step through the hook; the mask
  it selected over the DP group lives on the device, has the quota, and equals the selection of the
  same tokens without a group.
On CPU the device-only checks are recorded as not applicable, with the reason.
"""

from __future__ import annotations

import functools
import os

import torch

from .gpu_phases import Phase


def _tiny_engine(phase: Phase):
    from verl_klcov_global.lab import cpu as _cpu
    from verl_klcov_global.lab import tiny as _tiny
    from verl_klcov_global.lab.quiet import quiet_verl

    with quiet_verl():
        path = _tiny.build_tiny_model(os.path.join(phase.scratch, "tiny"))
        # use_dynamic_bsz in the engine config too: verl's compute_log_prob takes it from there
        engine = _cpu.build_fsdp_engine(path, device=phase.device, strategy="fsdp", dtype="fp32",
                                        use_remove_padding=True, use_dynamic_bsz=True, max_token_len_per_gpu=256,
                                        infer_max_token_len_per_gpu=512)
    batch = _tiny.make_minibatch(
        batch_size=16, prompt_len=16, response_len=64, vary_lengths=True, seed=3, use_remove_padding=True,
        use_dynamic_bsz=True, max_token_len_per_gpu=256,
    )
    return engine, batch


def _check_process_group(phase: Phase, engine) -> None:
    """The DP group's backend for the run's device (NCCL on cuda, as verl's "cpu:gloo,cuda:nccl"), and one
    all-reduce of a tensor on that device through it."""
    import torch.distributed as dist

    group = engine.get_data_parallel_group()
    backend = dist.get_backend(group)
    # "cpu:gloo,cuda:nccl" -> {"cpu": "gloo", "cuda": "nccl"}; a plain name serves every device
    by_device = dict(part.split(":") for part in backend.split(",")) if ":" in backend else {phase.device: backend}
    expected = "nccl" if phase.device == "cuda" else "gloo"
    world = dist.get_world_size(group)
    value = torch.full((1,), 3.0, device=phase.device)
    dist.all_reduce(value, group=group)
    summed = float(value) == 3.0 * world
    phase.data["process_group"] = {"backend": backend, "world_size": world}
    phase.check("process group", by_device.get(phase.device) == expected and world == 1 and summed,
                f"engine DP group backend {backend!r} ({phase.device}: {by_device.get(phase.device)!r}, expected "
                f"{expected!r}), world size {world}, all-reduce of a {phase.device} tensor "
                f"{'correct' if summed else 'WRONG'}")


def _check_rng_restored(phase: Phase, engine, batch) -> None:
    from verl_klcov_global.engine import prepass as engine_prepass

    cuda = phase.device == "cuda"
    draws: list[float] = []
    original = engine.infer_batch

    def consuming_infer_batch(*args, **kwargs):  # each forward of the prepass draws from both generators
        draws.append(float(torch.rand(1)))
        if cuda:
            draws.append(float(torch.rand(1, device="cuda")))
        return original(*args, **kwargs)

    cpu_before = torch.get_rng_state()
    device_before = torch.cuda.get_rng_state() if cuda else None
    engine.infer_batch = consuming_infer_batch
    try:
        with engine.train_mode():
            engine_prepass.compute_prepass_log_probs(engine, batch.copy(), "infer")
    finally:
        del engine.infer_batch  # the instance attribute; the class's method is back
    consumed = len(draws) > 0
    cpu_ok = consumed and torch.equal(cpu_before, torch.get_rng_state())
    phase.check("CPU RNG restored", cpu_ok,
                f"prepass drew {len(draws)} number(s) inside infer_batch; CPU generator state "
                f"{'unchanged' if cpu_ok else 'CHANGED (or nothing was drawn)'} afterwards")
    if not cuda:
        phase.check("device RNG restored", None, "no accelerator generator on cpu")
        return
    device_ok = consumed and torch.equal(device_before, torch.cuda.get_rng_state())
    phase.check("device RNG restored", device_ok,
                f"cuda generator state {'unchanged' if device_ok else 'CHANGED (or nothing was drawn)'} after a "
                "prepass that drew from it")


def summation_bound(vocab_size: int, log_probs: torch.Tensor) -> float:
    """How far two float32 log-softmax values of the same logits may lie apart when only the order of
    the sum inside logsumexp differs: any order of summing V positive terms errs by at most (V-1) eps
    relative, so log(sum) by (V-1) eps absolute; the log, the add and the subtraction round once each."""
    eps = torch.finfo(torch.float32).eps
    return float((vocab_size - 1) * eps + 3 * eps * max(1.0, float(log_probs.abs().max())))


def _check_logits_path(phase: Phase) -> None:
    """PATCH ``prepass_batched_logsumexp`` on this device: fp32 no-grad logits take the plugin's batched
    in-place path (verl's row loop not called), deterministically, bit-identical to verl's loop on CPU
    (rows this narrow) and within :func:`summation_bound` of it on an accelerator; bf16 logits and
    grad-enabled calls keep verl's loop."""
    import verl.utils.torch_functional as verl_F

    from verl_klcov_global.engine import logprobs as engine_logprobs


    generator = torch.Generator().manual_seed(0)
    vocab = 97
    logits = torch.randn(6, 9, vocab, generator=generator).to(phase.device)
    labels = torch.randint(0, vocab, (6, 9), generator=generator).to(phase.device)
    verl_own = verl_F.logprobs_from_logits_v2
    calls = []

    @functools.wraps(verl_own)  # the hook checks the signature it wraps
    def counted(*args, **kwargs):
        calls.append(1)
        return verl_own(*args, **kwargs)

    with torch.no_grad():
        expected = verl_own(logits.clone(), labels)
    verl_F.logprobs_from_logits_v2 = counted
    try:
        with engine_logprobs.batched_logsumexp():
            with torch.no_grad():
                first = verl_F.logprobs_from_logits_v2(logits.clone(), labels)  # the path overwrites its logits
                again = verl_F.logprobs_from_logits_v2(logits.clone(), labels)
                batched_calls = len(calls)
                verl_F.logprobs_from_logits_v2(logits.clone().bfloat16(), labels)
            verl_F.logprobs_from_logits_v2(logits.clone().requires_grad_(), labels)
            fallback_calls = len(calls) - batched_calls
    finally:
        verl_F.logprobs_from_logits_v2 = verl_own
    cuda = phase.device == "cuda"
    diff = float((first - expected).abs().max())
    bound = summation_bound(vocab, expected)
    close = diff == 0.0 if not cuda else diff <= bound
    deterministic = torch.equal(first, again)
    routed = batched_calls == 0 and fallback_calls == 2
    phase.data["logits_path"] = {"max_abs_diff_to_verl": diff, "summation_bound": bound}
    name = "accelerator logits path" if cuda else "CPU logits path"
    phase.check(name, close and deterministic and routed,
                f"{phase.device} fp32 no-grad logits took the plugin's batched path "
                f"({'yes' if batched_calls == 0 else 'NO'}), bf16 and grad-enabled ones verl's loop "
                f"({fallback_calls}/2); max |batched - verl| {diff:.1e} "
                f"({'must be 0 on cpu' if not cuda else f'bound {bound:.1e}'}), repeat "
                f"{'bit-identical' if deterministic else 'DIFFERS'}")
    if not cuda:
        phase.check("accelerator logits path", None, "no accelerator logits on cpu (the CPU path is checked above)")


def _check_prepass_equals_compute_log_prob(phase: Phase, engine, batch) -> torch.Tensor:
    """Two prepasses give the same bits; against verl's compute_log_prob (same minibatch and layout, same
    forward) they are bit-identical on CPU and within :func:`summation_bound` on an accelerator, where the
    batched logsumexp sums in another order than verl's row loop."""
    from verl_klcov_global.engine import prepass as engine_prepass

    from .gpu_step import compute_log_prob

    with engine.train_mode():
        prepass = engine_prepass.compute_prepass_log_probs(engine, batch.copy(), "infer").float()
        repeat = engine_prepass.compute_prepass_log_probs(engine, batch.copy(), "infer").float()
    deterministic = torch.equal(prepass, repeat)
    phase.check("prepass deterministic", deterministic,
                f"two prepasses of the same minibatch give {'the same bits' if deterministic else 'DIFFERENT bits'}")
    verl_lp = compute_log_prob(engine, batch, calculate_entropy=False)
    cuda = phase.device == "cuda"
    same_shape = prepass.shape == verl_lp.shape
    diff = float((prepass.cpu() - verl_lp.cpu()).abs().max()) if same_shape else float("inf")
    from verl_klcov_global.lab.tiny import TINY_MODEL_KWARGS

    bound = summation_bound(TINY_MODEL_KWARGS["vocab_size"], verl_lp)
    ok = same_shape and (diff == 0.0 if not cuda else diff <= bound)
    phase.data["prepass_vs_compute_log_prob"] = {"max_abs_diff": diff, "summation_bound": bound if cuda else 0.0}
    phase.check("prepass = compute_log_prob", ok,
                f"prepass log-probs vs verl's compute_log_prob on the same minibatch and layout, "
                f"{tuple(prepass.shape)} fp32 on {phase.device}: max |diff| {diff:.1e} "
                f"({'must be 0 on cpu' if not cuda else f'summation bound {bound:.1e}'})")
    return prepass


def _check_selection_over_group(phase: Phase, engine, batch, log_probs: torch.Tensor) -> None:
    from verl.workers.utils.losses import ppo_loss

    from verl_klcov_global.engine import step as engine_step

    from verl_klcov_global import layout
    from verl_klcov_global.lab import tiny as _tiny
    from verl_klcov_global.methods.kl_cov.selection import kl_cov_quota, select_kl_cov_tokens

    ratio = 0.02
    config = _tiny.make_actor_config(loss_mode="kl_cov_global", kl_cov_ratio=ratio, ppo_kl_coef=1.0)
    results = []
    with engine_step.observe_selections(lambda _engine, result: results.append(result)), engine.train_mode():
        output = engine.train_batch(batch.copy(), loss_function=functools.partial(ppo_loss, config=config))
    if len(results) != 1:
        phase.check("selection over the NCCL group" if phase.device == "cuda" else "selection over the gloo group",
                    False, f"expected one prepass selection in the step, saw {len(results)}")
        return
    selection = results[0].selection
    response_mask = layout.padded(batch["response_mask"])
    advantages = layout.padded(batch["advantages"]).to(log_probs.device)
    lp = layout.fit_width(log_probs, response_mask.shape[1])
    alone = select_kl_cov_tokens(advantages, lp, response_mask.to(lp.device), ratio, group=None)
    quota = kl_cov_quota(int(response_mask.sum()), ratio)
    same = torch.equal(selection.mask.cpu(), alone.mask.cpu())
    on_device = selection.mask.device.type == phase.device
    metrics = output.get("metrics", {}) if isinstance(output, dict) else {}
    timed = "actor/kl_cov/prepass_seconds" in metrics
    group = "NCCL" if phase.device == "cuda" else "gloo"
    phase.data["selection"] = {"quota": quota, "selected": selection.num_selected,
                               "mask_device": str(selection.mask.device)}
    phase.check(f"selection over the {group} group", same and on_device and selection.num_selected == quota and timed,
                f"kl_cov_global step: {selection.num_selected} of quota {quota} selected, mask on "
                f"{selection.mask.device}, {'identical to' if same else 'DIFFERENT from'} the selection without a "
                f"group; prepass metrics {'reported' if timed else 'MISSING'}")
    if phase.device != "cuda":
        phase.check("selection over the NCCL group", None, "no NCCL on cpu (the gloo group is checked above)")


def run(phase: Phase) -> None:
    from verl_klcov_global.lab.quiet import quiet_verl
    from verl_klcov_global.lab.experiment import _release

    engine, batch = _tiny_engine(phase)
    try:
        _check_process_group(phase, engine)
        with quiet_verl():
            _check_rng_restored(phase, engine, batch)
        _check_logits_path(phase)
        with quiet_verl():
            log_probs = _check_prepass_equals_compute_log_prob(phase, engine, batch)
            _check_selection_over_group(phase, engine, batch, log_probs)
    finally:
        _release(engine)
