"""Phase ``step`` of the GPU kit: step time, prepass cost and peak memory at a realistic shape.

Model: a random Qwen2.5-0.5B-shaped Qwen2 (``gpu_check.QWEN25_05B_LIKE``) saved in bf16 and built on
the device (the CPU smoke: the tiny model). Engine: verl's FSDP2 ``FSDPEngineWithLMHead``, world size
1, bf16 compute (fp32 master weights), AdamW, gradient checkpointing, remove-padding and dynamic
batching with the same per-GPU token budget for training and log-probs, as
``examples/dapo_kl_cov_global.sh`` sets them. Minibatch: 16 sequences, prompts of 256-512 and
responses of 2,048-4,096 random tokens, several micro-batches.

Measured on one engine, each operation timed with the device synchronised before and after, peak
memory from ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``:

* ``compute_log_prob``: verl's actor log-prob pass on the minibatch (:func:`compute_log_prob`);
  its first call is the warm-up and gives the ``old_log_probs`` of the minibatch, as in training;
* ``prepass``: the plugin's work before verl's step, alone: ``engine.optimizer_zero_grad()`` (the hook
  frees the gradients first) and ``engine.prepass.run_prepass_and_select`` (the no-grad forward in the inference
  layout and the selection), ``kl_cov_global``'s (log-probs only);
* ``prepass high_entropy_global``: the same for a mode whose row sets ``prepass_reads_entropy``: the forward
  computes the entropy too, so its figures compare with ``compute_log_prob`` (which verl runs with
  ``calculate_entropy=True``) on the same minibatch; its peak must not exceed ``compute_log_prob``'s;
* ``step <mode>``: one ``engine.train_batch`` (zero_grad, all micro-batches, optimizer step) for verl's
  mode and the plugin's global mode (prepass and selection included), for every global mode; its
  reference is verl's own counterpart when verl has one (``kl_cov``, ``clip_cov``), else ``vanilla``
  (``high_entropy_global``: the authors' per-micro-batch rule is the lab's comparator, not a verl loss).

One warm-up round, then ``reps`` timed rounds (training modes in rotated order). Also recorded: the
log-prob function verl called in each operation (counted), the attention implementation of the model
and the attention / log-softmax operators that ran in a profiled prepass on a small minibatch.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import time
from collections import Counter
from typing import Any, Callable, Iterator, Optional

import torch

from .gpu_phases import QWEN25_05B_LIKE, Phase, PhaseBudgetExceeded, progress

GIB = float(1 << 30)
_LOGPROB_FUNCTIONS = ("logprobs_from_logits_v2", "logprobs_from_logits_flash_attn", "logprobs_from_logits_torch_npu")
#: The plugin's batched path (PATCH prepass_batched_logsumexp), counted under this name.
PLUGIN_BATCHED = "engine_logprobs.log_probs_in_place"


def compute_log_prob(engine, batch, *, calculate_entropy: bool = True) -> torch.Tensor:
    """verl 0.9.1's actor ``compute_log_prob`` on ``batch``, in process: (B, R) float32 log-probs, padded.

    What ``ActorRolloutRefWorker.compute_log_prob`` -> ``TrainingWorker.infer_batch``
    (``workers/engine_workers.py`` ~398) does for the trainer's old-log-prob pass
    (``trainer/ppo/v1/trainer_base.py`` ~1653: ``calculate_entropy=True``, ``compute_loss=False``):
    the engine's log-prob micro-batching (``infer_max_token_len_per_gpu`` /
    ``infer_micro_batch_size_per_gpu``), eval mode, no loss function. (The worker is not built:
    importing ``verl.workers.engine_workers`` needs fastapi, uvicorn and Ray.)
    """
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    config = engine.engine_config
    data = batch.copy()
    tu.assign_non_tensor(
        data, calculate_entropy=calculate_entropy, compute_loss=False, use_dynamic_bsz=config.use_dynamic_bsz,
        max_token_len_per_gpu=config.infer_max_token_len_per_gpu,
        micro_batch_size_per_gpu=config.infer_micro_batch_size_per_gpu, use_fused_kernels=config.use_fused_kernels,
    )
    with engine.eval_mode():
        output = engine.infer_batch(data, loss_function=None)
    return no_padding_2_padding(output["model_output"]["log_probs"], data).float()


@contextlib.contextmanager
def count_logprob_calls() -> Iterator[Counter]:
    """Count calls of verl's log-prob kernels (what ``logprobs_from_logits`` dispatches to) and of the
    plugin's batched prepass path (:data:`PLUGIN_BATCHED`)."""
    import verl.utils.torch_functional as verl_F

    from verl_klcov_global.engine import logprobs as engine_logprobs


    calls: Counter = Counter()
    targets = [(verl_F, name, name) for name in _LOGPROB_FUNCTIONS if hasattr(verl_F, name)]
    targets.append((engine_logprobs, "log_probs_in_place", PLUGIN_BATCHED))
    originals = [(module, attr, getattr(module, attr)) for module, attr, _ in targets]

    def counted(label: str, function: Callable) -> Callable:
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            calls[label] += 1
            return function(*args, **kwargs)

        return wrapper

    for (module, attr, label), (_, _, function) in zip(targets, originals):
        setattr(module, attr, counted(label, function))
    try:
        yield calls
    finally:
        for module, attr, function in originals:
            setattr(module, attr, function)


class Meter:
    """Seconds and peak allocated bytes of one operation on ``device`` (peaks only on cuda)."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def measure(self, operation: Callable[[], Any]) -> tuple[Any, float, Optional[int], Optional[int]]:
        """(result, seconds, peak bytes, bytes allocated before): peaks None off cuda."""
        self.sync()
        before = None
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        started = time.perf_counter()
        result = operation()
        self.sync()
        seconds = time.perf_counter() - started
        peak = torch.cuda.max_memory_allocated() if self.cuda else None
        return result, seconds, peak, before


def _build_model(phase: Phase) -> tuple[str, dict]:
    from verl_klcov_global.lab import tiny as _tiny
    from verl_klcov_global.lab.quiet import quiet_verl

    path = os.path.join(phase.scratch, f"step-{phase.sizes.step_model}")
    with quiet_verl():
        if phase.sizes.step_model == "tiny":
            kwargs = dict(_tiny.TINY_MODEL_KWARGS)
            _tiny.build_tiny_model(path)
        else:
            kwargs = dict(QWEN25_05B_LIKE)
            _tiny.build_random_model(path, kwargs, seed=0, dtype=torch.bfloat16, device=phase.device)
    return path, kwargs


def _micro_batches(batch, max_token_len: int) -> list[int]:
    """Tokens of each micro-batch verl's dynamic batching forms from ``batch`` with this token budget."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches

    data = batch.copy()
    tu.assign_non_tensor(data, use_dynamic_bsz=True, max_token_len_per_gpu=max_token_len)
    micro_batches, _ = prepare_micro_batches(data=data, dp_group=None, same_micro_num_in_dp=False)
    return [int(mb["input_ids"].offsets().diff().sum()) for mb in micro_batches]


def _counted_ppo_loss(counter: list, config, model_output, data, dp_group=None):
    from verl.workers.utils.losses import ppo_loss

    counter.append(1)
    return ppo_loss(config, model_output, data, dp_group)


def _observe_attention(phase: Phase, engine, vocab_size: int) -> dict:
    """The model's attention implementation and the aten attention / log-softmax ops of a profiled prepass
    on a 2-sequence minibatch (same kernels as the big one: the same masks, dtypes and dispatch)."""
    from torch.profiler import ProfilerActivity, profile

    from verl_klcov_global.engine import prepass as engine_prepass

    from verl_klcov_global.lab import tiny as _tiny

    model = getattr(engine.module, "module", engine.module)
    config = getattr(model, "config", None)
    small = _tiny.make_minibatch(batch_size=2, prompt_len=16, response_len=64, vary_lengths=True, seed=7,
                                 vocab_size=vocab_size, use_remove_padding=True, use_dynamic_bsz=True,
                                 max_token_len_per_gpu=phase.sizes.step_max_token_len)
    wanted = ("scaled_dot_product", "flash", "attention", "log_softmax", "logsumexp", "cross_entropy")
    with engine.train_mode(), profile(activities=[ProfilerActivity.CPU]) as profiler:
        engine_prepass.compute_prepass_log_probs(engine, small, "infer")
    ops = {event.key: event.count for event in profiler.key_averages()
           if event.key.startswith("aten::") and any(word in event.key for word in wanted)}
    return {"attn_implementation": getattr(config, "_attn_implementation", None), "prepass_aten_ops": ops}


def _median(values: list[float]) -> Optional[float]:
    return statistics.median(values) if values else None


class Figures:
    """Seconds and peaks per operation: the warm-up round's and the timed rounds'; writes them into ``data``."""

    def __init__(self, data: dict, pairs: list[tuple[str, str]]):
        self.data, self.pairs = data, pairs
        self.samples: dict[str, list[float]] = {}
        self.peaks: dict[str, list[int]] = {}
        self.warmup: dict[str, float] = {}
        self.warmup_peaks: dict[str, int] = {}
        self.logprob_calls: dict[str, dict[str, int]] = {}
        self.loss_calls: dict[str, int] = {}
        self.hook_metrics: dict[str, dict[str, list[float]]] = {}  # mode -> metric -> values

    def record(self, name: str, seconds: float, peak: Optional[int], timed: bool) -> None:
        if timed:
            self.samples.setdefault(name, []).append(seconds)
            if peak is not None:
                self.peaks.setdefault(name, []).append(peak)
        else:
            self.warmup[name] = seconds
            if peak is not None:
                self.warmup_peaks[name] = peak

    def save(self) -> None:
        """Medians (peaks: maxima) of the timed rounds, or the warm-up's when no round was timed."""
        timed = bool(self.samples)
        data = self.data
        data["figures_from"] = "timed rounds (medians; peak: max)" if timed else "the warm-up round only"
        data["warmup_seconds"] = self.warmup
        data["samples_seconds"] = self.samples
        data["median_seconds"] = ({n: _median(v) for n, v in self.samples.items()} if timed else dict(self.warmup))
        data["peak_gib"] = ({n: max(v) / GIB for n, v in self.peaks.items()} if timed
                            else {n: v / GIB for n, v in self.warmup_peaks.items()})
        data["logprob_calls"] = self.logprob_calls
        data["loss_calls_per_step"] = self.loss_calls
        data["hook_metrics"] = {mode: {name: _median(values) for name, values in metrics.items()}
                                for mode, metrics in self.hook_metrics.items()}
        data["ratios"] = _ratios(data, self.pairs)


def _build_engine(phase: Phase, path: str):
    from verl_klcov_global.lab import cpu as _cpu
    from verl_klcov_global.lab.quiet import quiet_verl

    sizes = phase.sizes
    started = time.monotonic()
    with quiet_verl():
        engine = _cpu.build_fsdp_engine(
            path, device=phase.device, strategy="fsdp2", dtype="bf16", lr=1e-6, clip_grad=1.0, optimizer="AdamW",
            use_remove_padding=True, use_dynamic_bsz=True, max_token_len_per_gpu=sizes.step_max_token_len,
            infer_max_token_len_per_gpu=sizes.step_infer_max_token_len, gradient_checkpointing=True,
        )
    phase.data["engine"] = {
        "strategy": "fsdp2", "world_size": 1, "compute": "bf16 (fp32 master weights)", "optimizer": "AdamW lr 1e-6",
        "gradient_checkpointing": True, "use_remove_padding": True, "use_dynamic_bsz": True,
        # verl's default compiles the entropy function (compute_log_prob only); eager here saves the compile
        "use_torch_compile": False,
        "ppo_max_token_len_per_gpu": sizes.step_max_token_len,
        "log_prob_max_token_len_per_gpu": sizes.step_infer_max_token_len,
        "build_seconds": round(time.monotonic() - started, 1),
        "parameters": int(sum(p.numel() for p in engine.module.parameters())),
    }
    return engine


def _describe_minibatch(batch, sizes) -> dict:
    from verl_klcov_global import layout

    responses = layout.padded(batch["response_mask"]).sum(1)
    return {
        "sequences": sizes.step_batch, "tokens": int(batch["input_ids"].offsets().diff().sum()),
        "response_tokens": int(responses.sum()), "response_len_min": int(responses.min()),
        "response_len_max": int(responses.max()),
        "train_micro_batch_tokens": _micro_batches(batch, sizes.step_max_token_len),
        "infer_micro_batch_tokens": _micro_batches(batch, sizes.step_infer_max_token_len),
    }


#: The prepass operation of each global mode that has a prepass of its own kind: ``prepass`` (log-probs only, the
#: covariance modes') and ``prepass <mode>`` for a mode whose row sets ``prepass_reads_entropy``.
def prepass_operation(mode) -> str:
    return f"prepass {mode.name}" if mode.prepass_reads_entropy else "prepass"


def _actor_config(mode_name: str, sizes):
    """The actor config of one step: the mode's own config class for a mode of the table, verl's otherwise."""
    from verl_klcov_global.lab import tiny as _tiny
    from verl_klcov_global.modes import MODES

    spec = MODES.get(mode_name)
    # KL-Cov's and Clip-Cov's knobs are verl's own (PolicyLossConfig); every other mode's are its config class's
    if spec is not None and spec.config_class is not None and spec.name not in ("kl_cov_global", "clip_cov_global"):
        return _tiny.make_actor_config(policy_loss=spec.config_class(), ppo_mini_batch_size=sizes.step_batch)
    return _tiny.make_actor_config(loss_mode=mode_name, kl_cov_ratio=sizes.kl_cov_ratio, ppo_kl_coef=1.0,
                                   ppo_mini_batch_size=sizes.step_batch)


def _operations(engine, batch, sizes, modes: list[str], figures: Figures) -> dict[str, Callable[[], Any]]:
    """The measured operations by name: compute_log_prob, each kind of prepass, and one training step per mode."""
    from verl_klcov_global.engine import prepass as engine_prepass
    from verl_klcov_global.modes import MODES
    from verl_klcov_global.methods.kl_cov.row import KL_COV

    configs = {mode: _actor_config(mode, sizes) for mode in modes}
    prepass_modes = {KL_COV.name: KL_COV}
    prepass_modes.update({m: MODES[m] for m in modes if m in MODES and MODES[m].prepass_reads_entropy})

    def prepass(spec):
        settings = spec.read_settings(_actor_config(spec.name, sizes))

        def run():
            """The hook's work before verl's step: free the gradients, prepass forward, selection."""
            with engine.train_mode():
                engine.optimizer_zero_grad()
                return engine_prepass.run_prepass_and_select(engine, batch.copy(), settings, spec)
        return run

    def old_policy_pass(mode: str):
        """verl's log-prob pass of the trainer step, where the mode reads it (STARE's batch entropy, Lp-Reg's
        proxy): run before the timed step, as the trainer runs it before the update (untimed)."""
        from verl_klcov_global.lab.experiment import hold_old_policy_pass

        hold_old_policy_pass(engine, batch.copy(), configs[mode])

    def train_step(mode: str):
        counter: list = []
        loss = functools.partial(_counted_ppo_loss, counter, config=configs[mode])
        with engine.train_mode():
            output = engine.train_batch(batch.copy(), loss_function=loss)
        figures.loss_calls[mode] = len(counter)
        metrics = output.get("metrics", {}) if isinstance(output, dict) else {}
        prefix = MODES[mode].metric_prefix if mode in MODES else None
        for name in ("prepass_seconds", "selection_seconds", "prepass_share"):
            metric = metrics.get(f"{prefix}{name}") if prefix else None
            if metric is not None:
                value = metric.aggregate() if hasattr(metric, "aggregate") else metric
                value = float(value[0] if isinstance(value, list) else value)
                figures.hook_metrics.setdefault(mode, {}).setdefault(name, []).append(value)
        return output

    operations = {"compute_log_prob": lambda: compute_log_prob(engine, batch)}
    operations.update({prepass_operation(spec): prepass(spec) for spec in prepass_modes.values()})
    for mode in modes:
        step = functools.partial(train_step, mode)
        step.before = functools.partial(old_policy_pass, mode)  # run by _run_rounds before the timer starts
        operations[f"step {mode}"] = step
    return operations


def _run_rounds(phase: Phase, meter: Meter, operations: dict, modes: list[str], figures: Figures,
                compute_log_prob_warmup: float) -> Optional[str]:
    """One warm-up round (compute_log_prob already warmed up), then the timed rounds that fit the budget.

    Returns why rounds were left out, or None. Training steps run in an order rotated every round.
    """
    from verl_klcov_global.lab.quiet import quiet_verl

    rounds, done, round_seconds = phase.sizes.step_reps, 0, None
    for round_index in range(-1, rounds):  # -1: the warm-up round
        timed = round_index >= 0
        if round_seconds is not None and phase.remaining() < round_seconds + 15:
            why = (f"{rounds - done} timed round(s) of ~{round_seconds:.0f} s left out: "
                   f"{max(0.0, phase.remaining()):.0f} s of the phase budget left")
            phase.note(why)
            phase.data["timed_rounds"] = done
            return why
        shift = max(0, round_index) % max(1, len(modes))
        prepasses = [name for name in operations if name.startswith("prepass")]
        order = ["compute_log_prob", *prepasses] + [f"step {m}" for m in modes[shift:] + modes[:shift]]
        started = time.monotonic()
        for name in order:
            if name == "compute_log_prob" and not timed:
                continue  # warmed up already (it made the minibatch's old_log_probs)
            before = getattr(operations[name], "before", None)
            if before is not None:
                with quiet_verl():
                    before()
            with quiet_verl(), count_logprob_calls() as calls:
                _, seconds, peak, _ = meter.measure(operations[name])
            figures.record(name, seconds, peak, timed)
            if not timed:
                figures.logprob_calls[name] = dict(calls)
            progress(f"  {'round ' + str(round_index + 1) if timed else 'warm-up'}: {name} {seconds:.2f} s"
                     + (f", peak {peak / GIB:.1f} GiB" if peak is not None else ""))
        round_seconds = time.monotonic() - started + (0.0 if timed else compute_log_prob_warmup)
        done += int(timed)
        figures.save()
    phase.data["timed_rounds"] = done
    return None


def run(phase: Phase) -> None:
    from verl_klcov_global.lab import tiny as _tiny
    from verl_klcov_global.lab.quiet import quiet_verl
    from verl_klcov_global.lab.experiment import _release, registered_global_modes, upstream_mode
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    sizes, data, meter = phase.sizes, phase.data, Meter(phase.device)
    from verl_klcov_global.lab.experiment import LAB_UPSTREAMS

    # each global mode against verl's own counterpart; a mode whose counterpart is only the lab's comparator
    # (high_entropy_global) against vanilla: the step it replaces
    pairs = [(upstream_mode(m) if upstream_mode(m) in POLICY_LOSS_REGISTRY and upstream_mode(m) not in LAB_UPSTREAMS
              else "vanilla", m) for m in registered_global_modes()]
    modes = list(dict.fromkeys(mode for pair in pairs for mode in pair))
    figures = Figures(data, pairs)

    started = time.monotonic()
    path, model_kwargs = _build_model(phase)
    data["model"] = {"name": sizes.step_model, "config": model_kwargs,
                     "weights": "random, saved in " + ("fp32" if sizes.step_model == "tiny" else "bf16"),
                     "build_seconds": round(time.monotonic() - started, 1)}
    engine = _build_engine(phase, path)
    progress(f"  model {sizes.step_model}: {data['engine']['parameters']:,} parameters, engine built in "
             f"{data['engine']['build_seconds']} s")

    common = dict(batch_size=sizes.step_batch, prompt_len=sizes.step_prompt, response_len=sizes.step_response_max,
                  min_response_len=sizes.step_response_min, vary_lengths=True, seed=0,
                  vocab_size=model_kwargs["vocab_size"], use_remove_padding=True, use_dynamic_bsz=True,
                  max_token_len_per_gpu=sizes.step_max_token_len)
    # The warm-up compute_log_prob gives the minibatch its old_log_probs, as in training.
    probe = _tiny.make_minibatch(**common)
    with quiet_verl(), count_logprob_calls() as calls:
        old_log_probs, seconds, peak, before = meter.measure(lambda: compute_log_prob(engine, probe))
    figures.record("compute_log_prob", seconds, peak, timed=False)
    figures.logprob_calls["compute_log_prob"] = dict(calls)
    batch = _tiny.make_minibatch(**common, log_probs=old_log_probs)
    data["minibatch"] = _describe_minibatch(batch, sizes)
    data["memory_before_gib"] = None if before is None else before / GIB
    progress(f"  minibatch: {sizes.step_batch} sequences, {data['minibatch']['tokens']:,} tokens, "
             f"{len(data['minibatch']['train_micro_batch_tokens'])} training / "
             f"{len(data['minibatch']['infer_micro_batch_tokens'])} log-prob micro-batches; warm-up "
             f"compute_log_prob {seconds:.2f} s")

    operations = _operations(engine, batch, sizes, modes, figures)
    cut_short = _run_rounds(phase, meter, operations, modes, figures, seconds)
    with quiet_verl():
        data["attention"] = _observe_attention(phase, engine, model_kwargs["vocab_size"])
    figures.save()
    _checks(phase, data, pairs)
    _release(engine)
    if cut_short:
        raise PhaseBudgetExceeded(cut_short)


def _ratios(data: dict, pairs: list[tuple[str, str]]) -> dict:
    med, peak = data["median_seconds"], data["peak_gib"]

    def ratio(table: dict, a: str, b: str) -> Optional[float]:
        return table[a] / table[b] if table.get(a) and table.get(b) else None

    out = {}
    for name in (n for n in med if n.startswith("prepass")):
        out[f"{name}/compute_log_prob seconds"] = ratio(med, name, "compute_log_prob")
        out[f"{name}/compute_log_prob peak"] = ratio(peak, name, "compute_log_prob")
    for upstream, mode in pairs:
        out[f"{mode}/{upstream} seconds"] = ratio(med, f"step {mode}", f"step {upstream}")
        out[f"{mode}/{upstream} peak"] = ratio(peak, f"step {mode}", f"step {upstream}")
        out[f"prepass/step {upstream} seconds"] = ratio(med, "prepass", f"step {upstream}")
        out[f"prepass {mode}/step {upstream} seconds"] = ratio(med, f"prepass {mode}", f"step {upstream}")
    return out


def _checks(phase: Phase, data: dict, pairs: list[tuple[str, str]]) -> None:
    train_mbs = len(data["minibatch"]["train_micro_batch_tokens"])
    calls = set(data["loss_calls_per_step"].values())
    phase.check("several micro-batches", train_mbs > 1 and calls == {train_mbs},
                f"{train_mbs} training micro-batches; loss called {sorted(calls)} time(s) per step")
    for upstream, mode in pairs:
        ratio = data["ratios"].get(f"{mode}/{upstream} seconds")
        progress(f"  step time {mode} / {upstream}: {ratio:.2f}" if ratio else f"  step time {mode}: no ratio")
    peak = data["peak_gib"]
    name = "prepass peak <= verl's own peak"
    if phase.device != "cuda":
        phase.check(name, None, "no allocator statistics on cpu")
        return
    verl_peaks = {op: peak[op] for op in ["compute_log_prob"] + [f"step {up}" for up, _ in pairs] if op in peak}
    reference = max(verl_peaks.values())
    prepasses = {op: value for op, value in peak.items() if op.startswith("prepass")}
    phase.check(name, all(value <= reference for value in prepasses.values()),
                ", ".join(f"{op} {value:.2f} GiB" for op, value in prepasses.items()) + "; verl's own: "
                + ", ".join(f"{op} {value:.2f} GiB" for op, value in verl_peaks.items()))
    # the entropy prepass against the pass it mirrors: verl's compute_log_prob with entropy on the same minibatch
    for op in (op for op in prepasses if op != "prepass"):
        phase.check(f"{op} peak <= compute_log_prob's", prepasses[op] <= peak["compute_log_prob"],
                    f"{op} {prepasses[op]:.2f} GiB; compute_log_prob (calculate_entropy=True) "
                    f"{peak['compute_log_prob']:.2f} GiB")
