"""The experiment of verl issue #7829 on verl's real FSDP engine: does the update depend on micro-batching?

One *block* = one frozen minibatch (advantages, ``old_log_probs = current + noise``)
and one optimizer update from the same initial weights per (loss mode, layout).
Comparing the parameters after the update between two layouts gives

* for ``vanilla`` (no penalty): the floating-point noise floor of re-associating sums;
* for a mode's upstream counterpart (``ModeSpec.upstream``, e.g. ``kl_cov``): noise + the effect
  of per-micro-batch selection (#7829);
* for a global mode of the table (:data:`verl_klcov_global.modes.MODES`): should stay at the noise floor.

Used by the tests and by ``verl-klcov-global diagnose``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from tensordict import TensorDict

from . import cpu as _cpu
from . import per_micro_batch as _per_micro_batch
from . import tiny as _tiny
from ..engine.prepass import PrepassResult
from ..engine.step import observe_selections
from ..modes import MODES, ModeSpec

def _lab_comparators() -> dict[str, _per_micro_batch.Comparator]:
    """The authors' per-loss-call rules of the table's modes (``ModeSpec.comparator``), by name, imported here."""
    found = (_per_micro_batch.comparator_of(spec) for spec in MODES.values())
    return {comparator.name: comparator for comparator in found if comparator is not None}


#: Upstream rules that only the lab registers (verl has no such loss): name -> (register it in this process,
#: its ``policy_loss`` config class). E.g. ``high_entropy_global``'s upstream is the authors' per-micro-batch rule.
LAB_UPSTREAMS: dict[str, tuple[Callable[[], str], type]] = {
    name: (functools.partial(_per_micro_batch.register, comparator), comparator.config_class)
    for name, comparator in _lab_comparators().items()
}
#: Upstream rules that read each micro-batch's entropy (the engine computes it for them: ``calculate_entropy``),
#: and those that read the proxy held from the log-prob pass.
ENTROPY_UPSTREAMS = tuple(name for name, c in _lab_comparators().items() if c.reads == "entropy")
PROXY_UPSTREAMS = tuple(name for name, c in _lab_comparators().items() if c.reads == "proxy")

#: Appended to a global mode's name: that mode with the prepass in the training micro-batch layout
#: (verl PR #7830's choice), e.g. ``kl_cov_global[prepass=train]``.
TRAIN_LAYOUT_SUFFIX = "[prepass=train]"


def registered_global_modes() -> tuple[str, ...]:
    """The modes of the table that verl's policy-loss registry holds (the plugin registered them), sorted."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    import verl_klcov_global  # noqa: F401  (registers the plugin's modes)

    return tuple(sorted(name for name, mode in MODES.items() if POLICY_LOSS_REGISTRY.get(name) is mode.policy_loss))


def upstream_mode(global_mode: str) -> Optional[str]:
    """verl's per-micro-batch counterpart of a global mode (``ModeSpec.upstream``), e.g. ``kl_cov``."""
    return MODES[global_mode].upstream


def train_layout_mode(global_mode: str) -> str:
    """The name of ``global_mode`` run with ``prepass_layout=train``."""
    return global_mode + TRAIN_LAYOUT_SUFFIX


def variant_of(mode: str) -> tuple[Optional[ModeSpec], Optional[str]]:
    """``(mode of the table, prepass layout it forces or None)`` of a name run by the experiment, or ``(None, None)``.

    ``kl_cov_global`` -> (its spec, None); ``kl_cov_global[prepass=train]`` -> (its spec, ``"train"``);
    ``vanilla`` or an upstream mode -> (None, None).
    """
    if mode.endswith(TRAIN_LAYOUT_SUFFIX) and mode.removesuffix(TRAIN_LAYOUT_SUFFIX) in MODES:
        return MODES[mode.removesuffix(TRAIN_LAYOUT_SUFFIX)], "train"
    return MODES.get(mode), None


def compared_modes(global_mode: str) -> tuple[str, ...]:
    """What diagnose runs for ``global_mode``: the control, verl's counterpart when registered, the mode
    (and its prepass=train variant when ``ModeSpec.diagnose_train_layout``)."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    spec = MODES[global_mode]
    if spec.upstream in LAB_UPSTREAMS:
        LAB_UPSTREAMS[spec.upstream][0]()  # in-process only: the plugin never registers a lab comparator
    modes = ("vanilla",) + ((spec.upstream,) if spec.upstream in POLICY_LOSS_REGISTRY else ()) + (global_mode,)
    return modes + ((train_layout_mode(global_mode),) if spec.diagnose_train_layout else ())


def upstream_counts(mode: str) -> Optional[ModeSpec]:
    """The mode of the table whose ``upstream`` is ``mode`` (it knows how to count upstream's selected tokens)."""
    return next((spec for spec in MODES.values() if spec.upstream == mode), None)


def largest_divisor_at_most(rows: int, limit: int) -> int:
    """The largest micro-batch size <= ``limit`` that divides ``rows`` (verl's static split needs a divisor).

    The experiment's default training micro-batch size for a minibatch of ``rows`` sequences.
    """
    return max(size for size in range(1, max(1, min(rows, limit)) + 1) if rows % size == 0)


@dataclass(frozen=True)
class MicroBatchLayout:
    """How one optimizer minibatch is split into micro-batches (verl's non-tensor keys)."""

    name: str
    use_dynamic_bsz: bool
    micro_batch_size_per_gpu: Optional[int] = None
    max_token_len_per_gpu: Optional[int] = None

    def apply(self, td: TensorDict) -> TensorDict:
        return _tiny.set_micro_batching(
            td, use_dynamic_bsz=self.use_dynamic_bsz, micro_batch_size_per_gpu=self.micro_batch_size_per_gpu,
            max_token_len_per_gpu=self.max_token_len_per_gpu,
        )


def dynamic_layouts(batch_size: int, seq_len: int, micro_batches: int) -> tuple[MicroBatchLayout, MicroBatchLayout]:
    """One dynamic micro-batch holding everything vs ``micro_batches`` dynamic ones.

    Every sequence has ``seq_len`` tokens, so a token budget of
    ``ceil(batch_size / micro_batches) * seq_len`` forms ``micro_batches`` micro-batches.
    """
    if micro_batches < 1 or micro_batches > batch_size:
        raise ValueError(f"micro-batches must be in [1, {batch_size}] (the minibatch size), got {micro_batches}")
    per_micro = -(-batch_size // micro_batches)
    return (
        MicroBatchLayout("1 micro-batch", True, max_token_len_per_gpu=batch_size * seq_len),
        MicroBatchLayout(f"{micro_batches} micro-batches", True, max_token_len_per_gpu=per_micro * seq_len),
    )


def static_layouts(batch_size: int, micro_batches: int) -> tuple[MicroBatchLayout, MicroBatchLayout]:
    """One static micro-batch of ``batch_size`` vs micro-batches of ``batch_size // micro_batches``."""
    if micro_batches < 1 or batch_size % micro_batches:
        raise ValueError(f"micro-batches must divide the minibatch size {batch_size}, got {micro_batches}")
    return (
        MicroBatchLayout("1 micro-batch", False, micro_batch_size_per_gpu=batch_size),
        MicroBatchLayout(f"{micro_batches} micro-batches", False, micro_batch_size_per_gpu=batch_size // micro_batches),
    )


@dataclass(frozen=True)
class EngineSpec:
    """Everything that defines the engine of one update (the same initial weights every time)."""

    model_path: str
    strategy: str = "fsdp"
    dtype: str = "fp32"
    use_remove_padding: bool = False
    gradient_checkpointing: bool = False
    lr: float = 0.02
    clip_grad: float = 0.05
    infer_micro_batch_size_per_gpu: int = 16
    infer_max_token_len_per_gpu: int = 4096
    lora_rank: int = 0
    param_offload: bool = False
    optimizer_offload: bool = False
    device: str = "cpu"

    def build(self):
        return _cpu.build_fsdp_engine(
            self.model_path, strategy=self.strategy, dtype=self.dtype, lr=self.lr, clip_grad=self.clip_grad,
            use_remove_padding=self.use_remove_padding, gradient_checkpointing=self.gradient_checkpointing,
            infer_micro_batch_size_per_gpu=self.infer_micro_batch_size_per_gpu,
            infer_max_token_len_per_gpu=self.infer_max_token_len_per_gpu, lora_rank=self.lora_rank,
            lora_alpha=2 * self.lora_rank or 16, param_offload=self.param_offload,
            optimizer_offload=self.optimizer_offload, device=self.device,
        )


@dataclass
class UpdateOutcome:
    """One optimizer update: parameters after it and what was selected.

    ``params``: float64 (P,) full parameter vector after the step.
    ``masks``: per optimizer step, the global mode's mask (batch, response_len) of this rank.
    ``figures``: per optimizer step, the global selection's figures (``Selection.figures()``).
    ``selected_tokens``: tokens selected (a global mode: its global selection; an upstream mode:
    the sum over micro-batches of ``ModeSpec.count_upstream_selected``; vanilla: 0).
    """

    params: torch.Tensor
    masks: list[torch.Tensor] = field(default_factory=list)
    selected_tokens: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    figures: list[dict[str, float]] = field(default_factory=list)


def _counting_ppo_loss(counter: list, config, model_output, data, dp_group=None):
    """verl's ppo_loss, counting the tokens an upstream mode of the table selects in each micro-batch.

    The lab's comparators get their micro-batch's entropy through
    :func:`.per_micro_batch.ppo_loss_with_entropy` and report their own count."""
    counts = upstream_counts(config.policy_loss.loss_mode)
    loss, metrics = _per_micro_batch.ppo_loss_with_entropy(config, model_output, data, dp_group)
    reported = next((name for name in _per_micro_batch.selected_metrics() if name in metrics), None)
    if reported is not None:
        selected = metrics[reported]
        counter.append(round(float(selected.values[0] if hasattr(selected, "values") else selected)))
    elif counts is not None and counts.count_upstream_selected is not None:
        counter.append(counts.count_upstream_selected(int(data["response_mask"].sum()), config.policy_loss, metrics))
    return loss, metrics


def one_update(engine_spec: EngineSpec, batch: TensorDict, actor_config, layout: MicroBatchLayout,
               reseed: Optional[int] = None) -> UpdateOutcome:
    """Build a fresh engine, run one ``train_batch`` of ``batch`` with ``layout``, return the outcome.

    ``reseed``: reseed torch's global generators after building the engine (which seeds them), as a
    later step of a real run would find them in another state. Collective when world size > 1
    (every rank calls it with its shard).
    """
    engine = engine_spec.build()
    if reseed is not None:
        torch.manual_seed(reseed)
    td = layout.apply(batch.copy())
    if actor_config.policy_loss.get("loss_mode", "vanilla") in ENTROPY_UPSTREAMS:
        from verl.utils import tensordict_utils as tu

        tu.assign_non_tensor(td, calculate_entropy=True)  # the training forward computes each micro-batch's entropy
    hold_old_policy_pass(engine, td, actor_config)
    if actor_config.policy_loss.get("loss_mode", "vanilla") in PROXY_UPSTREAMS:
        _store_comparator_proxy(engine, td, actor_config)
    quotas: list[int] = []
    selections: list[PrepassResult] = []
    loss_function = functools.partial(functools.partial(_counting_ppo_loss, quotas), config=actor_config)
    with observe_selections(lambda _engine, result: selections.append(result)), engine.train_mode():
        output = engine.train_batch(td, loss_function=loss_function)
    params = _cpu.engine_params_flat(engine)
    _release(engine)
    if selections:
        selected = selections[-1].selection.num_selected
    else:
        selected = sum(quotas)
    return UpdateOutcome(
        params=params,
        masks=[s.selection.mask.clone() for s in selections],
        figures=[s.selection.figures() for s in selections],
        selected_tokens=selected,
        metrics=dict(output.get("metrics", {})) if isinstance(output, dict) else {},
    )


def _store_comparator_proxy(engine, td: TensorDict, actor_config) -> None:
    """The proxy for a lab comparator that reads it (``reads="proxy"``, e.g. ``lp_reg_per_micro_batch``): the same
    log-prob pass of pi_old that its global mode holds, stored as the per-token field ``PROXY_FIELD`` of ``td``
    (verl's split carries each micro-batch's slice to the comparator's loss call)."""
    from ..mode_config import PROXY_FIELD
    from ..engine import kept_pass, reuse
    from ..engine.proxy import PROXY_REQUEST_KEY
    from ..layout import values_in_layout_of

    loss_mode = actor_config.policy_loss.get("loss_mode", "vanilla")
    mode = upstream_counts(loss_mode)  # the global mode whose upstream it is: the comparator takes its knobs
    min_p = float(mode.proxy_min_p(mode.read_settings(actor_config)))
    log_prob_pass(engine, td, kept_pass.log_prob_pass(engine, keep_entropy=False, keep_proxy=True),
                  extra={PROXY_REQUEST_KEY: min_p})
    proxy, why = reuse.held_proxy(engine, td)
    if proxy is None:
        raise RuntimeError(f"{loss_mode}: no proxy held from the log-prob pass: {why}")
    td[PROXY_FIELD] = values_in_layout_of(proxy, td["response_mask"], dtype=torch.float32)


def hold_old_policy_pass(engine, td: TensorDict, actor_config) -> None:
    """The log-prob pass verl's trainer would run before the update (``calculate_entropy=True``, here on the fresh
    engine: pi_old), seen by the plugin as PATCH ``log_prob_pass_context`` sees verl's (``engine/kept_pass.py``), where
    the config reads it: ``prepass_layout=old`` with a step that reads entropy (held for the update), or a mode with
    a once-per-trainer-step rule (``ModeSpec.update_rule``: STARE's gate reads the batch's entropy). Nothing for any
    other config.

    The pass is micro-batched with the engine's log-prob inference settings, as verl's ``TrainingWorker.infer_batch``
    does, never with the training layout's: the held statistics are then one computation for every training layout
    diagnose compares (where a row's last bits follow its micro-batch company they would otherwise differ, and a
    near-tie of the selection could flip)."""
    from ..mode_config import OLD_POLICY_LAYOUT
    from ..engine import kept_pass
    from ..modes import global_mode_of

    mode = global_mode_of(actor_config)
    if mode is None:
        return
    settings = mode.read_settings(actor_config)
    if mode.proxy_min_p is not None:  # Lp-Reg's proxy from pi_old's logits, held for the update
        from ..engine.proxy import PROXY_REQUEST_KEY

        log_prob_pass(engine, td, kept_pass.log_prob_pass(engine, keep_entropy=mode.reads_entropy(settings),
                                                          keep_proxy=True, batch_entropy=mode.reads_batch_entropy),
                      extra={PROXY_REQUEST_KEY: float(mode.proxy_min_p(settings))})
        return
    hold = settings.prepass_layout == OLD_POLICY_LAYOUT and mode.reads_entropy(settings)
    if not hold and not mode.reads_batch_entropy:
        return
    log_prob_pass(engine, td, kept_pass.log_prob_pass(engine, keep_entropy=True, hold=True, keep=hold,
                                                      batch_entropy=mode.reads_batch_entropy))


def log_prob_pass(engine, td: TensorDict, context=None, extra: Optional[dict] = None) -> TensorDict:
    """verl's actor log-prob pass on ``td`` (``compute_log_prob``: ``calculate_entropy=True``, the engine's log-prob
    inference micro-batching, eval mode), inside ``context`` (a :func:`verl_klcov_global.engine.kept_pass.log_prob_pass`
    block, or none), with the non-tensor keys ``extra`` on its copy of ``td``; returns its outputs (``model_output``
    with nested ``log_probs`` and ``entropy``).

    Static micro-batches: verl's split needs a size that divides the rows (it asserts so), so the pass runs with
    :func:`inference_micro_batch_size` (the engine's ``infer_micro_batch_size_per_gpu`` when it divides them)."""
    import contextlib

    from verl.utils import tensordict_utils as tu

    data = td.copy()
    tu.assign_non_tensor(data, calculate_entropy=True, compute_loss=False, **(extra or {}))
    if tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=False):
        tu.assign_non_tensor(data, max_token_len_per_gpu=engine.engine_config.infer_max_token_len_per_gpu)
    else:
        tu.assign_non_tensor(data, micro_batch_size_per_gpu=inference_micro_batch_size(
            len(data), engine.engine_config.infer_micro_batch_size_per_gpu))
    with context or contextlib.nullcontext(), engine.eval_mode():
        return engine.infer_batch(data)


def inference_micro_batch_size(rows: int, size: Optional[int]) -> int:
    """The static micro-batch size of a log-prob pass over ``rows`` sequences: ``size`` (the engine's
    ``infer_micro_batch_size_per_gpu``) when it divides ``rows``, else the largest divisor of ``rows`` below it (verl's
    static split asserts that the size divides the data; a trainer's batch is a multiple of its log-prob micro-batch
    size, diagnose's minibatch need not be)."""
    return largest_divisor_at_most(rows, size or rows)


def _release(engine) -> None:
    """Free an engine now: diagnose builds several per block, with real checkpoints on a GPU."""
    import gc

    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def frozen_minibatch(engine_spec: EngineSpec, seed: int, *, batch_size: int = 64, prompt_len: int = 16,
                     response_len: int = 128, layout: str = "v1", **batch_kwargs) -> TensorDict:
    """A minibatch whose ``old_log_probs`` are the initial policy's log-probs + N(0, 0.05).

    The perturbation matters: with old == current exactly, |log-ratio| has zero
    gradient and kl_cov's penalty is invisible (see VERL_NOTES).
    """
    if batch_kwargs.get("tokens") is not None:  # a rollout's rows: their count
        batch_size = int(batch_kwargs["tokens"]["responses"].shape[0])
    batch_kwargs.setdefault("micro_batch_size_per_gpu", largest_divisor_at_most(batch_size, 8))
    common = dict(batch_size=batch_size, prompt_len=prompt_len, response_len=response_len, seed=seed,
                  layout=layout, use_remove_padding=engine_spec.use_remove_padding, **batch_kwargs)
    probe = _tiny.make_minibatch(**common)
    engine = engine_spec.build()
    current = _tiny.compute_current_log_probs(engine, probe)
    _release(engine)
    return _tiny.make_minibatch(**common, log_probs=current)


#: Appended to the control's name when it runs on the peaked policy: ``vanilla[policy=peaked]``.
PEAKED_POLICY_SUFFIX = "[policy=peaked]"
#: The peaked policy: the embedded tiny model with its LM head times this (:func:`.tiny.build_peaked_model`).
PEAKED_LM_HEAD_SCALE = 8.0
#: The temperature its responses are drawn at (the update's forward stays at 1).
PEAKED_SAMPLING_TEMPERATURE = 0.5


def needs_peaked_policy(global_mode: str) -> bool:
    """Whether ``global_mode``'s rows need a policy sharper than the embedded tiny model's to show anything.

    A mode that reads a min-p proxy of pi_old (``ModeSpec.proxy_min_p``: Lp-Reg) regularises a selected token only
    where the filter cut some mass at its position. The tiny model's next-token distribution is near-uniform (max /
    median p about 1.6), so a kappa such as the authors' 0.02 keeps every token: the proxy is pi_old, no token is
    regularised, and the update cannot depend on which tokens were selected. Its rows run on the peaked policy."""
    return MODES[global_mode].proxy_min_p is not None


def sample_peaked_blocks(model_path: str, seeds, *, batch_size: int, prompt_len: int, response_len: int,
                         vocab_size: int) -> list:
    """Per seed, :func:`.sampling.sample_after_random_prompts` from the peaked policy at ``model_path`` (fp32, CPU)
    at :data:`PEAKED_SAMPLING_TEMPERATURE`: every response ``response_len`` tokens, so the minibatch has the shape of
    the random-id ones and the same micro-batch layouts.

    The temperature is below the update's 1: at 1, the draws outside kappa 0.02's support (about 11% of them with
    the LM head x8) are the lowest-probability tokens of the minibatch, the ones Lp-Reg's quota takes first and never
    regularises; at 0.5 about half of the lowest 1% lie inside the support."""
    from . import sampling

    model, tokenizer = sampling.load_policy(model_path)
    return [sampling.sample_after_random_prompts(model, tokenizer, batch_size=batch_size, prompt_len=prompt_len,
                                                 response_len=response_len, vocab_size=vocab_size, seed=seed,
                                                 temperature=PEAKED_SAMPLING_TEMPERATURE) for seed in seeds]


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@dataclass
class ModeResult:
    """One loss mode in one block: the two layouts' outcomes and their difference."""

    mode: str
    #: tokens selected under each layout; None for a loss outside the table (diagnose/measured.py: nothing to count)
    selected_per_layout: Optional[tuple[int, int]]
    masks_identical: Optional[bool]
    max_param_diff: float
    #: max|dtheta| between two runs of the same layout (the second), for modes run twice; else None
    repeat_param_diff: Optional[float] = None


def run_block(engine_spec: EngineSpec, batch: TensorDict, layouts: tuple[MicroBatchLayout, MicroBatchLayout],
              actor_config_for: Callable[[str], Any], modes: tuple[str, ...], repeat_modes=(),
              progress: Callable[[str], None] = lambda message: None) -> dict[str, ModeResult]:
    """Run every mode under both layouts on the same frozen ``batch``.

    Modes in ``repeat_modes`` run the second layout once more with torch's generators in another
    state, to show whether the same update is reproduced (upstream clip_cov's unseeded
    ``torch.randperm`` draws other tokens).
    """
    results = {}
    for mode in modes:
        outcomes = []
        runs = list(layouts) + ([layouts[1]] if mode in repeat_modes else [])
        for index, layout in enumerate(runs):
            progress(f"{mode} / {layout.name}" + (" (again)" if index == 2 else ""))
            reseed = 1_000_003 if index == 2 else None
            outcomes.append(one_update(engine_spec, batch, actor_config_for(mode), layout, reseed=reseed))
        first, second = outcomes[:2]
        repeat_param_diff = max_abs_diff(second.params, outcomes[2].params) if len(outcomes) == 3 else None
        masks_identical = None
        if first.masks and second.masks:
            masks_identical = all(torch.equal(x, y) for x, y in zip(first.masks, second.masks, strict=True))
        results[mode] = ModeResult(
            mode=mode,
            selected_per_layout=(first.selected_tokens, second.selected_tokens),
            masks_identical=masks_identical,
            max_param_diff=max_abs_diff(first.params, second.params),
            repeat_param_diff=repeat_param_diff,
        )
    return results
