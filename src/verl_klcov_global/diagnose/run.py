"""``verl-klcov-global diagnose``: the experiment of verl issue #7829 on the user's setup.

Runs the harness's :mod:`verl_klcov_global.lab.experiment` over a few blocks for ``vanilla`` (the
penalty-free control) and, for every global mode of the plugin (``loss_mode="all"``, the
default) or one of them, the mode and its verl counterpart (the name without ``_global``):
``kl_cov`` / ``kl_cov_global`` (and ``kl_cov_global[prepass=train]``), ``clip_cov`` /
``clip_cov_global``; for ``high_entropy_global`` and ``stare_global``, which verl has no counterpart of, the lab's
comparators of the authors' per-micro-batch rules (``high_entropy_per_micro_batch``, ``stare_per_micro_batch``,
:mod:`verl_klcov_global.lab.per_micro_batch`). It reports, per mode, the tokens selected under each layout, whether the
masks agree and the largest parameter difference between the layouts relative to the control.
Clip-Cov modes run the second layout twice, the second time with torch's generators in another
state (as a later step of a run finds them): upstream ``clip_cov`` draws with an unseeded
``torch.randperm``, so the two updates differ; ``clip_cov_global`` must not.
The report is invariant only when every global mode it ran is.

On the embedded tiny model (``--responses auto``), the rows of a mode that reads a min-p proxy of pi_old (Lp-Reg and
its comparator) run on the peaked policy (:func:`..lab.experiment.needs_peaked_policy`: the tiny model's LM head x8,
responses sampled from it) with their own control ``vanilla[policy=peaked]``: the tiny model's near-uniform
distribution keeps every token in the proxy, so nothing would be regularised and the comparison would prove nothing.

Where diagnose's default for a knob departs from the mode's own (the Clip-Cov window ``clip_cov_lb=0.3,
clip_cov_ratio=0.002``, not verl's 1 / 0.0002: on the embedded tiny model's random minibatches almost no covariance
exceeds 1, so verl's window would leave nothing to select and the comparison would prove nothing), the one table
:data:`.knobs.DIAGNOSE_DEPARTURES` says so and why.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Optional

from ..lab.quiet import quiet_verl
from .errors import DiagnoseError
from .knobs import DIAGNOSE_DEPARTURES, default_knob_values, knob_default  # noqa: F401  (diagnose's defaults)

INVARIANCE_FACTOR = 10.0  # a global mode must stay within this many times the control's noise floor


@dataclass(frozen=True)
class DiagnoseOptions:
    model: Optional[str] = None
    device: Optional[str] = None
    dtype: str = "fp32"
    micro_batches: int = 8
    layout: str = "dynamic"
    blocks: int = 3
    seed: int = 0
    batch_size: int = 64
    prompt_len: int = 16
    response_len: int = 128
    #: the built-in modes' knobs that diagnose has a flag of its own for (:func:`.knobs.flag_knobs`: ``--kl-cov-ratio``,
    #: ...), knob -> value: the values given, the rest diagnose's defaults (:func:`.knobs.knob_default`: the mode's, or
    #: :data:`.knobs.DIAGNOSE_DEPARTURES`'s); the per-micro-batch comparators read the same values. The report's
    #: ``options`` hold them beside the other fields (:func:`report_options`)
    knobs: dict = field(default_factory=dict)
    strategy: str = "fsdp"
    json_path: Optional[str] = None
    loss_mode: str = "all"
    # Set by ``--config-name`` (diagnose/user_config.py); the defaults are diagnose's own behaviour.
    #: the N-micro-batch layout given directly (static: sequences per micro-batch; dynamic: token
    #: budget) instead of derived from ``micro_batches``, which then only names it
    micro_batch_size_per_gpu: Optional[int] = None
    max_token_len_per_gpu: Optional[int] = None
    #: log-prob inference layout (the prepass's default layout); None: the largest divisor of ``batch_size`` up to 16
    #: (verl's static split needs a divisor) / max(4096, one sequence)
    infer_micro_batch_size_per_gpu: Optional[int] = None
    infer_max_token_len_per_gpu: Optional[int] = None
    use_remove_padding: bool = False
    gradient_checkpointing: bool = False
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None
    #: PPO clip range (verl's actor fields); None: verl's FSDPActorConfig default
    clip_ratio: Optional[float] = None
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: Optional[float] = None
    prepass_layout: str = "infer"
    #: also run kl_cov_global with the other prepass layout (``kl_cov_global[prepass=train]``) when
    #: ``prepass_layout`` is infer; ``--config-name`` runs only the config's layout
    compare_prepass_layouts: bool = True
    #: a loss outside the table (``--loss-mode NAME`` with ``--config-name``): the user's ``actor.policy_loss``
    #: as composed (``_target_`` included: verl's PolicyLossConfig or the user's class); None: verl's
    #: ``PolicyLossConfig`` with diagnose's values of verl's keys (:func:`.knobs.verl_knobs`), verl's defaults for
    #: the rest
    policy_loss: Optional[dict] = None
    #: ``--all-registered``: every loss verl itself registers (diagnose/user_losses.py), judged by measurement
    all_registered: bool = False
    #: ``--import``: the modules imported before the loss name was checked (recorded for the report)
    imports: tuple = ()
    #: ``--verbose``: verl's own warnings and logs are shown (at import and while the engines work)
    verbose: bool = False
    #: the entropy controller's knobs (``entropy_target``, ``entropy_control_*``) of the user's config, given to
    #: every global mode's config class whose mode it drives (``ModeSpec.entropy_sign``: not STARE's)
    #: (``--config-name``); empty: the controller off
    entropy_control: dict = field(default_factory=dict)
    #: the minibatch's tokens: ``sampled`` from the model (its chat template on the built-in arithmetic prompts,
    #: ``response_len`` new tokens at most, stopped at EOS; lab/sampling.py), ``random`` ids (the embedded tiny
    #: model's way), or ``auto``: sampled when the model's folder has a chat template, else random
    responses: str = "auto"
    #: sampled responses per prompt: the group of the random GRPO scores (``batch_size`` must be a multiple)
    samples_per_prompt: int = 4
    #: the sampling temperature (sampled responses)
    temperature: float = 1.0
    #: ``--set KEY=VALUE``: values of the diagnosed modes' knobs (``ModeSpec.knobs``) that have no diagnose flag of
    #: their own, e.g. a user's mode's new knob (a key that has one is moved into ``knobs``: diagnose/knobs.py);
    #: validated by the mode's config class and ``read_settings``
    set_knobs: dict = field(default_factory=dict)

    def __post_init__(self):
        """``knobs`` completed with diagnose's defaults; a key that is no knob with a flag is refused (give it in
        ``set_knobs``)."""
        defaults = default_knob_values()
        unknown = [knob for knob in self.knobs if knob not in defaults]
        if unknown:
            raise DiagnoseError(f"DiagnoseOptions.knobs: {', '.join(unknown)} has no diagnose flag (the knobs that "
                                f"have one: {', '.join(defaults)}); give it in set_knobs (--set)")
        object.__setattr__(self, "knobs", {**defaults, **self.knobs})

    @property
    def explicit_layout(self) -> bool:
        return self.micro_batch_size_per_gpu is not None or self.max_token_len_per_gpu is not None


def validate(options: DiagnoseOptions, explicit: tuple = ()) -> DiagnoseOptions:
    """Check every option up front; raise :class:`DiagnoseError` saying what to change (a
    :class:`~.knobs.ModeCannotRunError` when a mode's own code raised). Returns the options with ``--set``'s keys
    folded (:func:`.knobs.fold_set_knobs`; ``explicit``: the options given on the command line)."""
    _validate_model_and_device(options)
    options = _validate_modes(options, explicit)
    _validate_shape(options)
    return options


def _validate_model_and_device(options: DiagnoseOptions) -> None:
    """The model, its responses, the device and the dtype."""
    if options.model is not None:
        if not os.path.isdir(options.model):
            raise DiagnoseError(f"--model {options.model!r}: no such directory (give a local HF checkpoint folder)")
        if not os.path.isfile(os.path.join(options.model, "config.json")):
            raise DiagnoseError(f"--model {options.model!r}: no config.json there; is it a HF checkpoint folder?")
    if options.responses not in ("auto", "sampled", "random"):
        raise DiagnoseError(f"--responses must be auto, sampled or random, got {options.responses!r}")
    if options.responses == "sampled":
        if options.model is None:
            raise DiagnoseError("--responses sampled needs --model (a chat model's folder, or smollm2); the embedded "
                                "tiny model has no chat template")
        if not has_chat_template(options.model):
            raise DiagnoseError(f"--responses sampled: the tokenizer in {options.model} has no chat template; use "
                                "--responses random (random token ids) or a chat model's folder")
    if responses_of(options) == "sampled":
        if options.samples_per_prompt < 1 or options.batch_size % options.samples_per_prompt:
            raise DiagnoseError(f"--batch-size {options.batch_size} must be a multiple of --samples-per-prompt "
                                f"{options.samples_per_prompt} (sampled responses come in groups per prompt)")
        if not options.temperature > 0:
            raise DiagnoseError(f"--temperature must be > 0, got {options.temperature}")
    if options.device not in (None, "cpu", "cuda"):
        raise DiagnoseError(f"--device must be cpu or cuda, got {options.device!r}")
    if options.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise DiagnoseError("--device cuda: no CUDA device is visible; use --device cpu")
    if options.dtype not in ("fp32", "bf16"):
        raise DiagnoseError(f"--dtype must be fp32 or bf16, got {options.dtype!r}")

def _validate_modes(options: DiagnoseOptions, explicit: tuple) -> DiagnoseOptions:
    """The loss mode(s) diagnosed: ``--set`` folded, then every mode's config class and settings reader run on
    diagnose's knobs (a bad knob: :class:`DiagnoseError`; a mode's own code raising: ``ModeCannotRunError``)."""
    from .user_losses import check_loss_mode

    if options.all_registered and options.loss_mode != "all":
        raise DiagnoseError("--all-registered runs every loss verl registers; drop --loss-mode "
                            f"{options.loss_mode}")
    check_loss_mode(options.loss_mode)  # after --import: a user's loss is registered by now
    from ..modes import MODES
    from .knobs import ModeCannotRunError, flag_modes, fold_set_knobs

    options = fold_set_knobs(options, global_modes_of(options), explicit)
    diagnosed = global_modes_of(options)
    try:
        measured = measured_losses_of(options)
        if not measured:  # each built-in mode's config class validates its knobs' values and the actor fields
            for spec in flag_modes():
                _actor_config(options, spec.name)
        for mode in diagnosed:  # a diagnosed mode's config, then what only the loss reads (stare: the agg mode)
            try:
                actor_config = _actor_config(options, mode)
            except (ValueError, DiagnoseError):
                raise
            except Exception as error:  # not a bad knob: the mode's config class itself raised
                raise ModeCannotRunError(mode, f"its config class {MODES[mode].config_class.__name__}"
                                         if MODES[mode].config_class else "building its policy_loss", error) from None
            try:
                MODES[mode].read_settings(actor_config)
            except ValueError as error:
                raise ValueError(f"{mode}: {error}" + ("; or diagnose another mode with --loss-mode"
                                                       if options.loss_mode == "all" else "")) from None
            except Exception as error:
                raise ModeCannotRunError(mode, "its settings reader (ModeSpec.read_settings)", error) from None
        for loss in measured:
            _actor_config(options, loss)
    except DiagnoseError:
        raise
    except ValueError as error:
        raise DiagnoseError(str(error)) from None
    except Exception as error:  # the user's policy_loss config class (Hydra instantiate): say which
        raise DiagnoseError(f"cannot build the policy_loss config of {options.loss_mode!r} from "
                            f"{options.policy_loss}: {type(error).__name__}: {error}") from None
    return options


def _validate_shape(options: DiagnoseOptions) -> None:
    """The strategy, the minibatch's shape, the micro-batch layout and the report's folder."""
    if options.strategy not in ("fsdp", "fsdp2"):
        raise DiagnoseError(f"--strategy must be fsdp or fsdp2, got {options.strategy!r}")
    if options.blocks < 1:
        raise DiagnoseError(f"--blocks must be >= 1, got {options.blocks}")
    for name in ("batch_size", "prompt_len", "response_len"):
        if getattr(options, name) < 1:
            raise DiagnoseError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(options, name)}")
    if options.micro_batches < (1 if options.explicit_layout else 2):
        raise DiagnoseError(
            f"--micro-batches must be >= 2 (it is compared with 1 micro-batch), got {options.micro_batches}"
        )
    if options.micro_batches > options.batch_size:
        raise DiagnoseError(
            f"--micro-batches {options.micro_batches} cannot be formed from {options.batch_size} sequences: "
            "each micro-batch needs at least one sequence"
        )
    if options.layout not in ("dynamic", "static"):
        raise DiagnoseError(f"--layout must be dynamic or static, got {options.layout!r}")
    if options.layout == "static" and options.micro_batch_size_per_gpu is not None:
        if options.batch_size % options.micro_batch_size_per_gpu:
            raise DiagnoseError(f"micro_batch_size_per_gpu {options.micro_batch_size_per_gpu} does not divide the "
                                f"{options.batch_size} sequences")
    elif options.layout == "static" and options.batch_size % options.micro_batches:
        raise DiagnoseError(
            f"--layout static needs --micro-batches to divide --batch-size ({options.batch_size}); "
            f"got {options.micro_batches}. Use --layout dynamic or another count"
        )
    if options.json_path is not None:
        folder = os.path.dirname(os.path.abspath(options.json_path))
        if not os.path.isdir(folder):
            raise DiagnoseError(f"--json {options.json_path!r}: folder {folder!r} does not exist")


def has_chat_template(folder: str) -> bool:
    """Whether the HF folder's tokenizer carries a chat template (a ``chat_template.jinja`` or the key)."""
    if os.path.isfile(os.path.join(folder, "chat_template.jinja")):
        return True
    try:
        with open(os.path.join(folder, "tokenizer_config.json")) as handle:
            return bool(json.load(handle).get("chat_template"))
    except (OSError, ValueError):
        return False


def responses_of(options: DiagnoseOptions) -> str:
    """``sampled`` or ``random``: what ``auto`` means for these options (see ``DiagnoseOptions.responses``)."""
    if options.responses != "auto":
        return options.responses
    return "sampled" if options.model is not None and has_chat_template(options.model) else "random"


def resolve_model(options: DiagnoseOptions, progress=None) -> DiagnoseOptions:
    """``--model smollm2`` (a name of lab/real_model.py's ``REAL_MODELS``) as its prepared folder, converted on
    first use; a folder that exists under the given name is used as it is (a path always wins)."""
    from ..lab import real_model

    if options.model is None:
        return options
    try:
        folder = real_model.resolve_model_argument(options.model, progress=progress or _progress)
    except real_model.RealModelError as error:
        raise DiagnoseError(f"--model {options.model}: {error}") from None
    except OSError as error:  # the cache folder: full disk, no permission, ...
        raise DiagnoseError(f"--model {options.model}: cannot prepare it in {real_model.folder_of()}: {error}; set "
                            f"{real_model.CACHE_ENV} to a writable folder with 1 GB free") from None
    return options if folder == options.model else replace(options, model=folder)


def _progress(message: str) -> None:
    # the real stderr: quiet_verl() swaps sys.stderr while engines work
    print(message, file=sys.__stderr__, flush=True)


def global_modes_of(options: DiagnoseOptions) -> tuple[str, ...]:
    """The global modes (of the table) this run diagnoses; none when it judges losses by measurement."""
    from ..lab.experiment import registered_global_modes

    if measured_losses_of(options):
        return ()
    return registered_global_modes() if options.loss_mode == "all" else (options.loss_mode,)


def measured_losses_of(options: DiagnoseOptions) -> tuple[str, ...]:
    """The losses outside the table this run judges by measurement (diagnose/measured.py): verl's own with
    ``--all-registered``, the one ``--loss-mode`` names, or none."""
    from .user_losses import is_measured_loss, verl_own_losses

    if options.all_registered:
        return verl_own_losses()
    return (options.loss_mode,) if is_measured_loss(options.loss_mode) else ()


def peaked_policy_modes(options: DiagnoseOptions) -> tuple[str, ...]:
    """The diagnosed global modes whose rows run on the peaked policy (:func:`..lab.experiment.needs_peaked_policy`:
    Lp-Reg, whose min-p proxy equals pi_old on the embedded tiny model), with their comparator and their own control
    ``vanilla[policy=peaked]``: only for the embedded tiny model with ``--responses auto``. ``--responses random``
    keeps them on the tiny model's random ids; a ``--model`` of the user's is their own policy."""
    from ..lab.experiment import needs_peaked_policy

    if options.model is not None or options.responses != "auto":
        return ()
    return tuple(mode for mode in global_modes_of(options) if needs_peaked_policy(mode))


def _actor_config(options: DiagnoseOptions, mode: str):
    """verl's FSDPActorConfig of ``mode`` with the options' loss knobs, aggregation and clip range.

    A mode of the table (or its ``[prepass=train]`` variant) gets its ``config_class`` with its
    knobs; its upstream counterpart verl's ``PolicyLossConfig`` with the knobs verl has.
    """
    from verl.workers.config import PolicyLossConfig

    from ..lab import tiny as _tiny
    from ..lab.experiment import LAB_UPSTREAMS, upstream_counts, variant_of
    from .knobs import knob_values, policy_loss_config

    actor = {name: getattr(options, name) for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high",
                                                       "clip_ratio_c", "loss_scale_factor")
             if getattr(options, name) is not None}
    actor["loss_agg_mode"] = options.loss_agg_mode
    spec, forced_layout = variant_of(mode)
    if spec is not None:
        # the entropy controller's knobs go to the modes it drives (entropy_sign != 0: STARE has its own feedback)
        control = options.entropy_control if spec.entropy_sign else {}
        policy_loss = policy_loss_config(spec, knob_values(options, spec), forced_layout or options.prepass_layout,
                                         control, given=options.set_knobs)
        return _tiny.make_actor_config(policy_loss=policy_loss, **actor)
    if mode in measured_losses_of(options):
        return _tiny.make_actor_config(policy_loss=_measured_policy_loss(options, mode), **actor)
    counts = upstream_counts(mode)
    if counts is not None:  # the same knob values as the global mode's
        values = knob_values(options, counts)
        if mode in LAB_UPSTREAMS:  # the lab's comparator: its own config class, every knob of the mode
            return _tiny.make_actor_config(policy_loss=LAB_UPSTREAMS[mode][1](loss_mode=mode, **values), **actor)
        knobs = {key: value for key, value in values.items() if key not in counts.plugin_knobs}
        return _tiny.make_actor_config(policy_loss=PolicyLossConfig(loss_mode=mode, **knobs), **actor)
    return _tiny.make_actor_config(policy_loss=_verl_policy_loss(options, mode), **actor)  # the control


def _verl_policy_loss(options: DiagnoseOptions, loss: str):
    """verl's ``PolicyLossConfig`` of ``loss`` with diagnose's values of verl's own keys (:func:`.knobs.verl_knobs`)
    and verl's defaults for the rest."""
    from verl.workers.config import PolicyLossConfig

    from .knobs import verl_knobs

    return PolicyLossConfig(loss_mode=loss, **{knob: options.knobs[knob] for knob in verl_knobs()})


def _measured_policy_loss(options: DiagnoseOptions, loss: str):
    """The policy_loss config of a loss outside the table: the user's (``options.policy_loss``, through its
    ``_target_`` as verl builds it), else verl's ``PolicyLossConfig`` with diagnose's knobs."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import PolicyLossConfig

    if options.policy_loss is not None:
        node = {**options.policy_loss, "loss_mode": loss}
        return omega_conf_to_dataclass(node, None if "_target_" in node else PolicyLossConfig)
    return _verl_policy_loss(options, loss)


def layouts_of(options: DiagnoseOptions, seq_len: Optional[int] = None):
    """(1 micro-batch, N micro-batches) for the options: derived from ``micro_batches``, or given directly.

    ``seq_len``: the padded sequence length (default ``prompt_len + response_len``; sampled responses: their
    templated prompt's and longest response's widths).
    """
    from ..lab.experiment import MicroBatchLayout, dynamic_layouts, static_layouts

    seq_len = options.prompt_len + options.response_len if seq_len is None else seq_len
    name = f"{options.micro_batches} micro-batch" + ("es" if options.micro_batches != 1 else "")
    if options.layout == "dynamic" and options.max_token_len_per_gpu is not None:
        return (MicroBatchLayout("1 micro-batch", True, max_token_len_per_gpu=options.batch_size * seq_len),
                MicroBatchLayout(name, True, max_token_len_per_gpu=options.max_token_len_per_gpu))
    if options.layout == "static" and options.micro_batch_size_per_gpu is not None:
        return (MicroBatchLayout("1 micro-batch", False, micro_batch_size_per_gpu=options.batch_size),
                MicroBatchLayout(name, False, micro_batch_size_per_gpu=options.micro_batch_size_per_gpu))
    if options.layout == "dynamic":
        return dynamic_layouts(options.batch_size, seq_len, options.micro_batches)
    return static_layouts(options.batch_size, options.micro_batches)


def run_diagnose(options: DiagnoseOptions, progress=_progress, extra: Optional[dict] = None,
                 explicit: tuple = ()) -> dict:
    """Run the experiment; return the report (also written to ``options.json_path`` when set).

    ``extra``: more report keys, e.g. ``--config-name``'s settings table (``diagnose/user_config.py``).
    A loss outside the table (``--loss-mode NAME``, ``--all-registered``) is judged by measurement
    (:mod:`.measured`); one named by ``--loss-mode`` that raises in its update is a :class:`DiagnoseError`.
    """
    import torch

    options = validate(resolve_model(options, progress), explicit)
    quiet = contextlib.nullcontext if options.verbose else quiet_verl
    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="verl_klcov_diagnose_") as scratch:
        setup = _prepare(options, scratch, device, progress, quiet)
        runner = _runner(options, setup)
        blocks = _run_blocks(options, setup, runner, progress, quiet)
    report = _report(options, device, setup, runner, blocks)
    report["seconds"] = round(time.perf_counter() - started, 1)
    report.update(extra or {})
    if options.json_path:
        _write_json_atomically(options.json_path, report)
    return report


@dataclass(frozen=True)
class _Setup:
    """What every block of a run shares: the model (``model_path``, ``vocab_size``), its sampled responses (None:
    random ids) and their padded ``seq_len``, the engine ``spec``, the ``layouts`` compared (a third one for the
    ``measured`` losses), and the peaked policy of the modes that need it (``peaked_globals``: none without one)."""

    model_path: str
    vocab_size: int
    sampled: Optional[list]
    seq_len: int
    spec: Any
    layouts: tuple
    measured: tuple
    peaked_globals: tuple
    peaked_control: str
    peaked_spec: Any = None
    peaked_samples: Optional[list] = None


def _prepare(options: DiagnoseOptions, scratch: str, device: str, progress, quiet) -> _Setup:
    """The model (the embedded tiny one is built in ``scratch``), its responses, the engine and the layouts; the
    peaked policy and its responses when a diagnosed mode needs it (:func:`peaked_policy_modes`)."""
    from . import measured as _measured
    from ..lab import tiny as _tiny
    from ..lab.experiment import PEAKED_POLICY_SUFFIX

    measured = measured_losses_of(options)
    with quiet():
        model_path = options.model or _tiny.build_tiny_model(os.path.join(scratch, "tiny"), seed=options.seed)
    vocab_size = _vocab_size(model_path)
    sampled = (_sample_blocks(options, model_path, progress, device) if responses_of(options) == "sampled"
               else None)
    seq_len = (max(b.prompts.shape[1] + b.responses.shape[1] for b in sampled) if sampled
               else options.prompt_len + options.response_len)
    spec = _engine_spec(options, model_path, seq_len, device, measured)
    layouts = (sampled_dynamic_layouts(options, sampled) if sampled and options.layout == "dynamic"
               and not options.explicit_layout else layouts_of(options, seq_len))
    peaked_globals = peaked_policy_modes(options)
    peaked_spec, peaked_samples = None, None
    if peaked_globals:  # the same shape as the random-id minibatches: the same layouts
        with quiet():
            peaked_spec, peaked_samples = _peaked_policy(options, spec, os.path.join(scratch, "peaked"),
                                                         vocab_size, peaked_globals, progress)
    if measured:
        kind = _measured.other_kind(options.layout)
        layouts = (*layouts, _measured.other_layout(options.batch_size, seq_len, options.micro_batches, kind))
    return _Setup(model_path, vocab_size, sampled, seq_len, spec, layouts, measured, peaked_globals,
                  "vanilla" + PEAKED_POLICY_SUFFIX, peaked_spec, peaked_samples)


@dataclass(frozen=True)
class _Runner:
    """How each block runs: ``run(batch, peaked_batch, report_step)`` -> the block's rows, ``updates()`` per block;
    ``modes`` / ``peaked_modes``: the rows of the table's modes on the options' minibatch and on the peaked policy
    (empty when losses are judged by measurement); ``failed``: the measured losses that raised, name -> why."""

    modes: tuple
    peaked_modes: tuple
    updates: Callable[[], int]
    run: Callable[..., dict]
    failed: dict


def _runner(options: DiagnoseOptions, setup: _Setup) -> _Runner:
    """The runner of the table's modes (:func:`_table_runner`) or of the losses judged by measurement."""
    from . import measured as _measured

    running = {"mode": None}  # the name being updated: a failure is reported as that mode's

    def actor_config_for(mode):
        running["mode"] = mode
        return _actor_config(options, "vanilla" if mode == setup.peaked_control else mode)

    failed: dict[str, str] = {}
    if not setup.measured:
        modes, peaked_modes, updates, run = _table_runner(options, setup.spec, setup.peaked_spec, setup.layouts,
                                                          setup.peaked_globals, setup.peaked_control,
                                                          actor_config_for, running)
        return _Runner(modes, peaked_modes, updates, run, failed)

    def updates() -> int:
        return _measured.updates_per_block(tuple(loss for loss in setup.measured if loss not in failed))

    def run(batch, peaked_batch, report_step) -> dict:
        return _measured.run_measured_block(setup.spec, batch, setup.layouts, actor_config_for, setup.measured,
                                            failed, progress=report_step)

    return _Runner((), (), updates, run, failed)


def _run_blocks(options: DiagnoseOptions, setup: _Setup, runner: _Runner, progress, quiet) -> list[dict]:
    """Each block's rows (its own frozen minibatch, seed ``options.seed + block``). A loss named by ``--loss-mode``
    that raised is a :class:`DiagnoseError`; with ``--all-registered`` its rows leave every block."""
    from . import measured as _measured

    blocks = []
    for block in range(options.blocks):
        seed = options.seed + block
        prefix = f"[block {block + 1}/{options.blocks}]"
        progress(f"{prefix} building the frozen minibatch (seed {seed})")
        with quiet():
            batch, peaked_batch = _minibatches(
                options, setup.spec, seed, setup.vocab_size, None if setup.sampled is None else setup.sampled[block],
                bool(setup.measured or runner.modes), setup.peaked_spec,
                None if setup.peaked_spec is None else setup.peaked_samples[block])
        step = {"n": 0, "of": runner.updates()}

        def report_step(message, prefix=prefix, step=step):
            step["n"] += 1
            progress(f"{prefix} update {step['n']}/{step['of']}: {message}")

        with quiet():
            blocks.append(runner.run(batch, peaked_batch, report_step))
        if runner.failed and not options.all_registered:
            (loss, why), = runner.failed.items()
            raise DiagnoseError(
                f"--loss-mode {loss}: the loss raised {why} in its update. Give it the settings it needs with "
                "--config-name/--config-path and overrides: its actor.policy_loss keys, or your own config "
                "class through actor.policy_loss._target_ (docs/DIAGNOSE.md, \"Diagnose your own loss\")")
    for loss in runner.failed:  # a loss that raised in a later block has rows in the earlier ones: compare none
        for rows in blocks:
            rows.pop(loss, None)
            rows.pop(_measured.split_row(loss, _measured.other_kind(options.layout)), None)
    return blocks


def _report(options: DiagnoseOptions, device: str, setup: _Setup, runner: _Runner, blocks: list[dict]) -> dict:
    """The report of the blocks' rows (:func:`summarise`), with how the responses were made, the peaked policy, the
    gradient clipping and verl's version."""
    controls = {row: setup.peaked_control for row in blocks[0] if setup.peaked_globals and row in runner.peaked_modes}
    report = summarise(options, device, [layout.name for layout in setup.layouts[:2]], blocks,
                       other_layout_name=setup.layouts[2].name if setup.measured else None,
                       could_not_run=runner.failed, controls=controls)
    report["responses"] = _responses_report(options, setup.sampled)
    if setup.peaked_globals:
        report["peaked_policy"] = _peaked_policy_report(options, runner.peaked_modes, setup.peaked_control,
                                                        setup.peaked_samples)
    report["clip_grad"] = None if math.isinf(setup.spec.clip_grad) else setup.spec.clip_grad
    report["verl_version"] = _verl_version()
    return report


def _minibatches(options: DiagnoseOptions, spec, seed: int, vocab_size: int, sampled, plain: bool, peaked_spec,
                 peaked_sample):
    """One block's frozen minibatches: the options' (random ids, or ``sampled``'s responses; None unless ``plain``)
    and the peaked policy's (None without one; its update's forward at temperature 1, as the random-id rows')."""
    from ..lab.experiment import frozen_minibatch

    tokens = {} if sampled is None else dict(tokens=sampled.tokens(), temperature=options.temperature,
                                              group_size=options.samples_per_prompt)
    batch = peaked_batch = None
    if plain:
        batch = frozen_minibatch(spec, seed, batch_size=options.batch_size, prompt_len=options.prompt_len,
                                 response_len=options.response_len, vocab_size=vocab_size, **tokens)
    if peaked_spec is not None:
        peaked_batch = frozen_minibatch(peaked_spec, seed, tokens=peaked_sample.tokens())
    return batch, peaked_batch


def _engine_spec(options: DiagnoseOptions, model_path: str, seq_len: int, device: str, measured):
    """The engine of every update: the options' strategy, dtype, padding and log-prob inference layout (by default
    the largest divisor of the batch up to 16 sequences, or 4,096 tokens or one sequence); a loss judged by
    measurement without gradient clipping (:mod:`.measured`)."""
    from . import measured as _measured
    from ..lab.experiment import EngineSpec, largest_divisor_at_most

    return EngineSpec(
        model_path, strategy=options.strategy, dtype=options.dtype, device=device,
        use_remove_padding=options.use_remove_padding, gradient_checkpointing=options.gradient_checkpointing,
        infer_micro_batch_size_per_gpu=(options.infer_micro_batch_size_per_gpu
                                        or largest_divisor_at_most(options.batch_size, 16)),
        infer_max_token_len_per_gpu=options.infer_max_token_len_per_gpu or max(4096, seq_len),
        **({"clip_grad": _measured.MEASURED_CLIP_GRAD} if measured else {}),
    )


def _peaked_policy(options: DiagnoseOptions, spec, folder: str, vocab_size: int, peaked_globals, progress):
    """The peaked policy's engine spec (the tiny model with its LM head scaled, saved in ``folder``) and its
    responses, one block per seed, at the random-id minibatches' shape."""
    from ..lab import tiny as _tiny
    from ..lab.experiment import PEAKED_LM_HEAD_SCALE, sample_peaked_blocks

    peaked_spec = replace(spec, model_path=_tiny.build_peaked_model(folder, spec.model_path, PEAKED_LM_HEAD_SCALE))
    progress(f"sampling {options.blocks} x {options.batch_size} responses of {options.response_len} tokens "
             f"from the peaked policy ({', '.join(peaked_globals)})")
    samples = sample_peaked_blocks(
        peaked_spec.model_path, [options.seed + block for block in range(options.blocks)],
        batch_size=options.batch_size, prompt_len=options.prompt_len, response_len=options.response_len,
        vocab_size=vocab_size)
    return peaked_spec, samples


def _table_runner(options: DiagnoseOptions, spec, peaked_spec, layouts, peaked_globals, peaked_control,
                  actor_config_for, running: dict):
    """The rows of the table's modes (on the options' minibatch, and the peaked policy's rows with their own
    control), the number of updates per block, and ``run(batch, peaked_batch, report_step)``, one block's results.

    A mode that raises is exit 2 with the mode and the stage, never 1 (which means: measured)."""
    from ..lab.experiment import TRAIN_LAYOUT_SUFFIX, compared_modes, run_block
    from ..modes import MODES
    from .knobs import mode_failure

    def rows_of(global_modes) -> tuple[str, ...]:
        rows = tuple(dict.fromkeys(m for g in global_modes for m in compared_modes(g)))
        if options.prepass_layout == "train" or not options.compare_prepass_layouts:
            rows = tuple(m for m in rows if not m.endswith(TRAIN_LAYOUT_SUFFIX))
        return rows

    plain_globals = tuple(g for g in global_modes_of(options) if g not in peaked_globals)
    modes = rows_of(plain_globals) if plain_globals else ()
    # the peaked policy's rows: their own control first, then the modes' and comparators' rows
    peaked_modes = tuple(peaked_control if m == "vanilla" else m for m in rows_of(peaked_globals))
    drawn = {name for mode in MODES.values() if mode.draws_at_random for name in (mode.name, mode.upstream)}
    repeat_modes = tuple(m for m in modes + peaked_modes if m in drawn)

    def updates() -> int:
        return 2 * (len(modes) + len(peaked_modes)) + len(repeat_modes)

    def run(batch, peaked_batch, report_step) -> dict:
        results = {}
        try:
            for engine_spec, minibatch, rows in ((spec, batch, modes), (peaked_spec, peaked_batch, peaked_modes)):
                if rows:
                    results.update(run_block(engine_spec, minibatch, layouts, actor_config_for, modes=rows,
                                             repeat_modes=repeat_modes, progress=report_step))
        except DiagnoseError:
            raise
        except Exception as error:
            raise mode_failure(running["mode"] or "diagnose", error) from None
        return {mode: asdict(result) for mode, result in results.items()}

    return modes, peaked_modes, updates, run


def sampled_dynamic_layouts(options: DiagnoseOptions, sampled: list):
    """(1 micro-batch, N micro-batches) with token budgets for sampled rows, whose lengths vary (EOS).

    verl forms ``min(rows, ceil(tokens / budget))`` dynamic micro-batches (``rearrange_micro_batches``), so the
    budget is the larger of the longest row and ``ceil(T / N)``, T the largest block's tokens: that block gets N
    micro-batches, a block with fewer tokens may get fewer; the name says the counts formed.
    """
    import torch

    from ..lab.experiment import MicroBatchLayout

    lengths = [torch.cat([batch.prompt_mask, batch.response_mask], dim=1).sum(1) for batch in sampled]
    totals = [int(row_lengths.sum()) for row_lengths in lengths]
    budget = max(max(int(row_lengths.max()) for row_lengths in lengths), -(-max(totals) // options.micro_batches))
    counts = sorted({min(options.batch_size, -(-total // budget)) for total in totals})
    formed = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return (MicroBatchLayout("1 micro-batch", True, max_token_len_per_gpu=max(totals)),
            MicroBatchLayout(f"{formed} micro-batches ({budget}-token budget)", True, max_token_len_per_gpu=budget))


def _sample_blocks(options: DiagnoseOptions, model_path: str, progress, device: str = "cpu") -> list:
    """Each block's responses, sampled from the model (lab/sampling.py, fp32 on ``device``) with seed
    ``options.seed + block``."""
    from ..lab import sampling

    with quiet_verl():
        model, tokenizer = sampling.load_policy(model_path, device)
    batches = []
    for block in range(options.blocks):
        seed = options.seed + block
        progress(f"[block {block + 1}/{options.blocks}] sampling {options.batch_size} responses of at most "
                 f"{options.response_len} tokens from the model (seed {seed})")
        prompts = sampling.arithmetic_prompts(options.batch_size // options.samples_per_prompt, seed)
        with quiet_verl():
            batches.append(sampling.sample_chat_responses(
                model, tokenizer, prompts, samples_per_prompt=options.samples_per_prompt,
                max_new_tokens=options.response_len, temperature=options.temperature, seed=seed))
    return batches


def _peaked_policy_report(options: DiagnoseOptions, rows: tuple, control: str, sampled: list) -> dict:
    """Which rows ran on the peaked policy, what it is, and the mean entropy of its draws per block."""
    from ..lab.experiment import PEAKED_LM_HEAD_SCALE, PEAKED_SAMPLING_TEMPERATURE

    return {"rows": list(rows), "control": control, "lm_head_scale": PEAKED_LM_HEAD_SCALE,
            "sampling_temperature": PEAKED_SAMPLING_TEMPERATURE, "forward_temperature": 1.0,
            "prompts": f"{options.prompt_len} random ids", "response_len": options.response_len,
            "draw_entropy": [float(batch.entropies[batch.response_mask.bool()].mean()) for batch in sampled]}


def _responses_report(options: DiagnoseOptions, sampled) -> dict:
    """How the minibatch's tokens were made, and (sampled) their shape and the sampling entropy per block."""
    if sampled is None:
        return {"kind": "random"}
    blocks = []
    for batch in sampled:
        mask = batch.response_mask.bool()
        entropies = batch.entropies[mask]
        blocks.append({"prompt_width": int(batch.prompts.shape[1]), "response_width": int(batch.responses.shape[1]),
                       "response_tokens": int(mask.sum()), "stopped_at_eos": int((batch.responses == batch.eos_token_id)
                                                                                 .any(1).sum()),
                       "mean_entropy": float(entropies.mean()) if entropies.numel() else 0.0})
    return {"kind": "sampled", "prompts": "arithmetic (lab/sampling.py), chat template",
            "samples_per_prompt": options.samples_per_prompt, "temperature": options.temperature, "blocks": blocks}


def _verl_version() -> str:
    """The verl this report was made with (a table of verl's losses is per verl)."""
    import verl

    return str(getattr(verl, "__version__", "unknown"))


def _vocab_size(model_path: str) -> int:
    with open(os.path.join(model_path, "config.json")) as handle:
        return int(json.load(handle)["vocab_size"])


def _ratios(diffs: list, controls: list) -> list:
    return [d / c if c > 0 else (0.0 if d == 0 else math.inf) for d, c in zip(diffs, controls)]


def report_options(options: DiagnoseOptions) -> dict:
    """The report's ``options``: every field of ``options``, with each knob of ``options.knobs`` beside them (one key
    per knob, as ``--<knob>`` names it)."""
    flat = {}
    for name, value in asdict(options).items():
        if name == "knobs":
            flat.update(value)
        else:
            flat[name] = value
    return flat


def summarise(options: DiagnoseOptions, device: str, layout_names: list[str], blocks: list[dict], *,
              other_layout_name: Optional[str] = None, could_not_run: Optional[dict] = None,
              controls: Optional[dict] = None) -> dict:
    """Per-mode figures over blocks, ratios to the control, and one verdict per global mode or measured loss.

    A global mode is invariant when its masks are identical in every block and its parameter
    difference between the layouts stays within ``INVARIANCE_FACTOR`` times the control's; a
    mode that was run twice (Clip-Cov) must also repeat itself within that factor. A loss outside
    the table is judged by measurement alone (:func:`.measured.verdict`: both layouts and the
    repeated update, each row against its own control ``vanilla`` / ``vanilla[split=...]``;
    ``other_layout_name`` names the other layout). The report is invariant when every diagnosed
    mode or loss that ran is; ``could_not_run`` (name -> why) lists the measured losses that raised.
    ``controls`` (row -> control row): rows compared with a control other than ``vanilla`` (the peaked policy's).
    """
    from . import measured as _measured

    control_rows = dict(controls or {})
    modes = _mode_figures(blocks, control_rows)
    verdicts, invariant = {}, True
    for mode in (m for m in global_modes_of(options) if m in modes):
        ok, verdicts[mode] = _global_verdict(mode, modes, len(blocks), control_rows.get(mode))
        invariant = invariant and ok
    measured = measured_losses_of(options)
    kind = _measured.other_kind(options.layout)
    for loss in (m for m in measured if m in modes):
        ok, verdicts[loss] = _measured.verdict(
            loss, modes, kind, (f"{layout_names[1]} ({options.layout})", other_layout_name or kind), len(blocks),
            INVARIANCE_FACTOR)
        invariant = invariant and ok
    report = {
        "options": report_options(options),
        "device": device,
        "layouts": layout_names,
        "modes": modes,
        "verdicts": verdicts,
        "invariant": invariant,
        "verdict": "; ".join(verdicts.values()),
    }
    if control_rows:
        report["controls"] = control_rows
    if measured:
        report.update(measured_losses=list(measured), other_layout=other_layout_name, could_not_run=dict(could_not_run or {}))
        if options.all_registered:
            report["registered_losses"] = _measured.registry_table(report, kind)
    return report


def _mode_figures(blocks: list[dict], control_rows: dict) -> dict:
    """Each row's figures over the blocks: tokens selected per layout, whether the masks agree, the parameter
    differences between the layouts (and of the repeated update, where it ran) and their ratios to its control's
    (``control_rows``' row, else :func:`.measured.control_of`'s, else ``vanilla``)."""
    from . import measured as _measured

    def controls_of(mode: str) -> list:
        control = control_rows.get(mode) or _measured.control_of(mode)
        return [block[control if control in block else "vanilla"]["max_param_diff"] for block in blocks]

    modes = {}
    for mode in blocks[0]:
        controls = controls_of(mode)
        diffs = [block[mode]["max_param_diff"] for block in blocks]
        masks = [block[mode]["masks_identical"] for block in blocks]
        modes[mode] = {
            "selected_per_layout": [block[mode]["selected_per_layout"] for block in blocks],
            "masks_identical": None if all(m is None for m in masks) else all(bool(m) for m in masks),
            "max_param_diff": diffs,
            "ratio_to_control": _ratios(diffs, controls),
        }
        repeats = [block[mode].get("repeat_param_diff") for block in blocks]
        if all(r is not None for r in repeats):
            modes[mode]["repeat_param_diff"] = repeats
            modes[mode]["repeat_ratio_to_control"] = _ratios(repeats, controls)
    return modes


def _global_verdict(mode: str, modes: dict, blocks: int, control_row: Optional[str]) -> tuple[bool, str]:
    """Whether the global ``mode`` is invariant (see :func:`summarise`), and the verdict's words, with its upstream's
    figures beside it; ``control_row``: its control when not ``vanilla`` (the peaked policy's)."""
    from ..lab.experiment import upstream_mode

    figures = modes[mode]
    worst = max(figures["ratio_to_control"])
    repeat_worst = max(figures.get("repeat_ratio_to_control", [0.0]))
    ok = bool(figures["masks_identical"]) and worst <= INVARIANCE_FACTOR and repeat_worst <= INVARIANCE_FACTOR
    text = (
        f"{mode} is {'INVARIANT' if ok else 'NOT invariant'} to micro-batching: masks "
        f"{'identical' if figures['masks_identical'] else 'DIFFER'} in all {blocks} blocks, "
        f"max|dtheta| up to {worst:.2f}x the control's noise floor (limit {INVARIANCE_FACTOR:g}x)"
    )
    if control_row is not None:
        text = text.replace("the control's noise floor",
                            f"the control's noise floor ({control_row}, on the peaked policy)")
    if "repeat_ratio_to_control" in figures:
        text += f", run again with another RNG state within {repeat_worst:.2f}x"
    upstream = upstream_mode(mode)
    if not any(any(pair) for pair in figures["selected_per_layout"]):
        text += " (vacuous: it selected no token, so there was nothing to compare)"
    if upstream in modes:
        text += f"; {upstream} differs by up to {max(modes[upstream]['ratio_to_control']):.3g}x"
        if "repeat_ratio_to_control" in modes[upstream]:
            text += (f" between layouts and by up to {max(modes[upstream]['repeat_ratio_to_control']):.3g}x "
                     "run again with another RNG state")
    return ok, text


def _ratio_text(ratio: float) -> str:
    return f"{ratio:.2f}" if ratio < 10 else f"{ratio:.0f}"


def _value_text(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def format_settings(report: dict) -> list[str]:
    """``--config-name``'s summary: the config, every setting used with its source, how the shape was scaled."""
    config = report["config"]
    overrides = " ".join(config["overrides"]) or "none"
    lines = [f"config: {config['name']} from {config['path']} | overrides: {overrides}", ""]
    rows = [("setting", "used", "yours (if other)", "from", "key / note")]
    for setting in report["settings"]:
        used = _value_text(setting["value"])
        if setting["name"] == "model" and setting["value"] is None:
            used = "embedded tiny Qwen2"
        yours = "" if setting["yours"] is None else _value_text(setting["yours"])
        where = " | ".join(x for x in (setting["key"] and setting["key"].replace("actor_rollout_ref.", ""),
                                       setting["note"]) if x)
        rows.append((setting["name"], used, yours, setting["source"], where))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines += ["  ".join(f"{cell:<{width}}" for cell, width in zip(row, widths)) + "  " + row[4] for row in rows]
    lines = [line.rstrip() for line in lines]
    lines += ["", f"shape: {report['scaling']['text']}"]
    if report.get("prepasses"):
        lines += [f"prepasses: {report['prepasses']['text']}"]
    lines += [f"note: {note}" for note in report["notes"]]
    return lines + [""]


def _minibatch_text(options: dict, responses: dict) -> str:
    if responses["kind"] != "sampled":
        return (f"minibatch: {options['batch_size']} x ({options['prompt_len']} prompt + {options['response_len']} "
                "response) tokens")
    blocks = responses["blocks"]
    return (f"minibatch: {options['batch_size']} responses sampled from the model ({options['batch_size'] // responses['samples_per_prompt']} "
            f"arithmetic prompts x {responses['samples_per_prompt']}, chat template, T={responses['temperature']:g}, "
            f"<= {options['response_len']} new tokens, stopped at EOS): response tokens "
            + ", ".join(str(b["response_tokens"]) for b in blocks) + ", mean entropy "
            + ", ".join(f"{b['mean_entropy']:.2f}" for b in blocks) + " nats per block")


def _peaked_policy_text(peaked: dict) -> str:
    return (f"rows {', '.join(peaked['rows'])}: the peaked policy (the tiny model's LM head "
            f"x{peaked['lm_head_scale']:g}), "
            f"responses sampled from it at T={peaked['sampling_temperature']:g} after {peaked['prompts']} (mean "
            "entropy of the draws " + ", ".join(f"{e:.2f}" for e in peaked["draw_entropy"]) + " nats per block), "
            f"update at T={peaked['forward_temperature']:g}; compared with {peaked['control']}")


def _knobs_text(report: dict) -> Optional[str]:
    """The knobs of the report's line: a measured loss's policy_loss (the user's config class, or verl's
    ``PolicyLossConfig`` with diagnose's values of verl's keys), else each diagnosed built-in mode's knobs
    (:func:`.knobs.knobs_text`, in the table's order) and ``--set``'s; None when there are none."""
    from .knobs import flag_modes, knobs_text, verl_knobs

    options = report["options"]
    if report.get("measured_losses"):
        if options.get("policy_loss"):
            return f"policy_loss: your config's ({options['policy_loss'].get('_target_')})"
        return ("policy_loss: verl's PolicyLossConfig, " + ", ".join(f"{knob} {options[knob]}" for knob in verl_knobs())
                + ", verl's defaults for the rest")
    parts = [knobs_text(spec, options) for spec in flag_modes() if spec.name in report["modes"]]
    if options.get("set_knobs"):
        parts.append("--set " + ", ".join(f"{key}={value}" for key, value in options["set_knobs"].items()))
    return " | ".join(parts) or None


def format_report(report: dict) -> str:
    """The table a person reads at a glance (after ``--config-name``'s settings summary, when there is one)."""
    options = report["options"]
    first, second = report["layouts"]
    lines = format_settings(report) if "settings" in report else []
    width = max(29, *(len(mode) + 1 for mode in report["modes"]))  # 29: the table modes' column as before
    knobs = _knobs_text(report)
    lines += [
        f"model: {options['model'] or 'embedded tiny Qwen2 (built locally)'} | device {report['device']} | "
        f"{options['dtype']} | {options['strategy']} | {options['layout']} micro-batches"
        + (" | remove padding" if options.get("use_remove_padding") else "")
        + (f"; rows [split=...]: {report['other_layout']}" if report.get("other_layout") else "")
        + (" | gradient clipping off" if report.get("measured_losses") else ""),
        " | ".join([_minibatch_text(options, report.get("responses") or {"kind": "random"}),
                    *([knobs] if knobs else []),
                    *([f"entropy controller {options['entropy_control']}"] if options.get("entropy_control") else []),
                    f"{len(next(iter(report['modes'].values()))['max_param_diff'])} blocks",
                    f"{report.get('seconds', '?')} s"]),
        *([_peaked_policy_text(report["peaked_policy"])] if report.get("peaked_policy") else []),
        "",
        f"{'mode':<{width}} {'tokens selected (' + first + ' | ' + second + ')':<44} {'masks':<10} "
        f"{'max|dtheta| between layouts':<30} {'ratio to control':<22} again, other RNG state / control",
    ]
    for mode, figures in report["modes"].items():
        selected = ", ".join("-" if pair is None else f"{pair[0]} | {pair[1]}" for pair in figures["selected_per_layout"])
        masks = {None: "-", True: "identical", False: "DIFFER"}[figures["masks_identical"]]
        diffs = ", ".join(f"{d:.1e}" for d in figures["max_param_diff"])
        ratios = ", ".join(_ratio_text(r) for r in figures["ratio_to_control"])
        repeats = ", ".join(_ratio_text(r) for r in figures.get("repeat_ratio_to_control", [])) or "-"
        lines.append(f"{mode:<{width}} {selected:<44} {masks:<10} {diffs:<30} {ratios:<22} {repeats}")
    lines.append("")
    for mode, verdict in report["verdicts"].items():
        ok = verdict.startswith(f"{mode} is INVARIANT")
        lines.append(("OK: " if ok else "FAIL: ") + verdict)
    for loss, why in report.get("could_not_run", {}).items():
        lines.append(f"SKIPPED: {loss} could not run with these settings: {why}")
    if "registered_losses" in report:
        from .measured import format_registry_table

        lines += ["", "verl's own losses (registered by verl's modules), worst over the blocks:", ""]
        lines += format_registry_table(report)
        lines.append("")
    if "measured_losses" in report:
        failing = [loss for loss, verdict in report["verdicts"].items() if not verdict.startswith(f"{loss} is INVARIANT")]
        lines.append("verdict: " + ("every loss diagnosed is invariant" if report["invariant"]
                                    else f"NOT invariant: {', '.join(failing)}"))
    else:
        lines.append("verdict: " + ("every global mode is invariant" if report["invariant"] else "NOT invariant"))
    return "\n".join(lines)


def _json_safe(value):
    """Non-finite floats as null: ``Infinity``/``NaN`` are not JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def _write_json_atomically(path: str, report: dict) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    handle = tempfile.NamedTemporaryFile("w", dir=folder, prefix=".diagnose-", suffix=".json", delete=False)
    try:
        with handle:
            json.dump(_json_safe(report), handle, indent=2, allow_nan=False)
        os.replace(handle.name, path)
    except BaseException:
        os.unlink(handle.name)
        raise
