"""``diagnose --config-name``: the user's verl training config -> diagnose's options, each with its source.

:func:`compose_config` composes the config as ``python -m verl.trainer.main_ppo --config-path DIR
--config-name NAME [overrides]`` does (Hydra ``compose`` with the same search path).
:func:`plan_from_config` reads from it what decides the #7829 experiment (micro-batching, log-prob
inference layout, padding removal, strategy, dtype, loss aggregation, the policy-loss knobs of
every mode, the PPO clip range, the model path and the minibatch shape) and returns a
:class:`ConfigPlan`: the :class:`~verl_klcov_global.diagnose.run.DiagnoseOptions` to run, one
:class:`Setting` row per value with where it came from, how the minibatch was scaled to
``--max-tokens``, a note for every key diagnose cannot honour, and the driver's whole-config
findings (:mod:`verl_klcov_global.guardrails`: errors a ``main_ppo`` run would stop on, warnings
it would print) in the notes and in ``findings``.

Shape (one data-parallel rank, as one rank of the user's run sees it): ``S = ppo_mini_batch_size *
rollout.n / DP`` sequences with ``DP = n_gpus_per_node * nnodes / ulysses_sequence_parallel_size``,
every sequence at ``data.max_prompt_length + data.max_response_length`` tokens. The user's
micro-batching forms ``M`` micro-batches of it (static: ``S / ppo_micro_batch_size_per_gpu``;
dynamic: ``min(S, ceil(S * L / (ppo_max_token_len_per_gpu * SP)))``, verl's
``rearrange_micro_batches``). When ``S * L`` exceeds ``max_tokens`` the shape is scaled down:
prompt and response lengths first, by the same factor, down to ``min(P, 8)`` / ``min(R, 16)``
tokens; then the sequences, to a multiple of ``M``, never below ``M``. The micro-batch settings are
scaled with it so the scaled minibatch still forms ``M`` micro-batches.
"""

from __future__ import annotations

import copy
import math
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

from ..config import OLD_POLICY_LAYOUT
from ..configs import CONFIG_DIR
from .errors import DiagnoseError
from .run import DiagnoseOptions

#: Folder of the plugin's own configs (kl_cov_global.yaml, clip_cov_global.yaml), shipped in the package.
PACKAGE_CONFIG_DIR = CONFIG_DIR
#: verl's own trainer configs: main_ppo's config path when no --config-path is given.
VERL_CONFIG_MODULE = "verl.trainer.config"
#: --max-tokens defaults: tokens of the (per-rank) minibatch diagnose runs, per device.
DEFAULT_MAX_TOKENS = {"cpu": 2048, "cuda": 16384}
#: micro-batches formed when the config sets no micro-batch size (verl would refuse it; see notes)
DEFAULT_MICRO_BATCHES = 8
MIN_PROMPT_LEN, MIN_RESPONSE_LEN = 8, 16
#: blocks (independent minibatches) by default: 2, not diagnose's 3, so the plugin's config runs in
#: under 2 minutes on 2 CPU cores
DEFAULT_BLOCKS = 2

ACTOR = "actor_rollout_ref.actor"
ROLLOUT = "actor_rollout_ref.rollout"
MODEL = "actor_rollout_ref.model"
POLICY_LOSS = f"{ACTOR}.policy_loss"

SOURCE_CONFIG, SOURCE_OVERRIDE, SOURCE_DEFAULT, SOURCE_OPTION = "config", "override", "diagnose default", "option"


@dataclass(frozen=True)
class Setting:
    """One row of the summary: what diagnose used, from which key, and where the value came from.

    ``source``: ``config`` (the composed config file, with verl's defaults it builds on),
    ``override`` (a command-line override, directly or through an interpolation), ``diagnose
    default`` (the config leaves it unset, or diagnose fixes it on purpose) or ``option`` (a
    diagnose command-line option). ``yours``: the config's value when diagnose used another one.
    """

    name: str
    value: Any
    source: str
    key: Optional[str] = None
    yours: Any = None
    note: str = ""


@dataclass
class ConfigPlan:
    options: DiagnoseOptions
    settings: list[Setting] = field(default_factory=list)
    scaling: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    #: the driver's whole-config findings (``guardrails.py``) for the config, as dicts; also in ``notes``
    findings: list[dict] = field(default_factory=list)
    #: per trainer step: optimizer steps, prepasses run, prepasses verl's log-prob pass stands in for
    #: (:func:`prepass_counts`)
    prepasses: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"config": self.config, "settings": [asdict(s) for s in self.settings], "scaling": self.scaling,
                "notes": list(self.notes), "findings": list(self.findings), "prepasses": dict(self.prepasses)}


def prepass_counts(config) -> dict:
    """Per trainer step of ``config``: optimizer steps, prepasses run, and prepasses verl's own log-prob pass
    stands in for (``engine/reuse.py``, ``engine/kept_pass.py``), with the reason in ``text``; ``{}`` unless a global mode is selected
    (verl's ``kl_cov`` / ``clip_cov``: counted for the global mode a switch would give, as the findings are).

    Every optimizer step makes one selection. verl runs one actor log-prob pass per local update
    (:func:`verl_klcov_global.guardrails.updates_per_old_log_prob_pass` counts the optimizer steps each pass
    serves): the legacy, ``sync`` and ``colocate_async`` trainers with the current weights, so the first optimizer
    step of each update reuses it; ``separate_async`` with the weights of the cycle's start, so only its first
    local step's does. None with ``bypass_mode`` (no actor pass) or ``prepass_layout=train``. Counted from the
    config alone; in the run the worker decides from evidence (a batch with multi-modal inputs, for one, always
    runs the prepass) and logs ``prepass_reused``.
    """
    from omegaconf import OmegaConf

    from .. import guardrails
    from ..modes import global_mode_of

    config = _as_global_mode(config)
    actor = OmegaConf.select(config, ACTOR, default=None)
    mode = global_mode_of(actor) if actor is not None else None
    if mode is None:
        return {}
    kind = guardrails.trainer_kind(config)
    per_pass = guardrails.updates_per_old_log_prob_pass(config)
    if per_pass is None:
        return {"text": "not counted: data.train_batch_size, ppo_mini_batch_size or ppo_epochs is not set"}
    sync_steps = 1
    if kind != "legacy":
        sync_steps = max(1, int(OmegaConf.select(config, f"trainer.v1.{kind}.parameter_sync_step", default=1) or 1))
    if kind == "separate_async":
        steps, passes_with_current_weights = per_pass, 1
    else:
        steps, passes_with_current_weights = sync_steps * per_pass, sync_steps
    layout = OmegaConf.select(config, f"{POLICY_LOSS}.prepass_layout", default="infer") or "infer"
    bypass = bool(OmegaConf.select(config, "algorithm.rollout_correction.bypass_mode", default=False))
    prepasses = None
    if layout == OLD_POLICY_LAYOUT:  # engine/old_policy.py: no forward at any step
        reused, prepasses = 0, 0
        why = ("prepass_layout=old: every step selects from pi_old's statistics, verl's old_log_probs and its "
               "log-prob pass's entropy, not the current policy's")
    elif bypass:
        reused, why = 0, "bypass_mode=True: the old log-probs are the rollout's, verl runs no actor log-prob pass"
    elif layout != "infer":
        reused, why = 0, f"prepass_layout={layout}: the prepass uses the training micro-batches, verl's pass does not"
    else:
        reused = passes_with_current_weights
        why = ("the first optimizer step of each update is made with the weights of verl's log-prob pass"
               if kind != "separate_async" else
               "only the first local step of a parameter_sync_step cycle runs verl's log-prob pass with the "
               "weights it updates")
    prepasses = steps - reused if prepasses is None else prepasses

    def count(n: int, one: str, many: str) -> str:
        return f"{n} {one if n == 1 else many}"

    text = (f"{count(steps, 'optimizer step', 'optimizer steps')} per trainer step ({kind} trainer), one selection "
            f"each: {count(prepasses, 'runs', 'run')} a prepass, {count(reused, 'reuses', 'reuse')} verl's own "
            f"log-prob pass ({why})")
    return {"optimizer_steps": steps, "prepasses": prepasses, "reused": reused, "trainer": kind,
            "prepass_layout": layout, "bypass_mode": bypass, "text": text}


def config_findings(config) -> list:
    """The driver's findings (:func:`verl_klcov_global.guardrails.findings`) for ``config``; for verl's own
    per-micro-batch mode (a mode's ``upstream``: ``kl_cov`` / ``clip_cov``) those its global mode would get (what a switch to the plugin would meet)."""
    from .. import guardrails

    return guardrails.findings(_as_global_mode(config))


def _as_global_mode(config):
    """``config``, or a copy of it with verl's per-micro-batch mode (a mode's ``upstream``) replaced by its global mode."""
    from omegaconf import OmegaConf

    from ..modes import MODES

    mode = OmegaConf.select(config, f"{POLICY_LOSS}.loss_mode", default=None)
    global_of_upstream = {spec.upstream: spec.name for spec in MODES.values() if spec.upstream}
    if mode in global_of_upstream:
        config = copy.deepcopy(config)
        OmegaConf.update(config, f"{POLICY_LOSS}.loss_mode", global_of_upstream[mode], merge=False)
    return config


# ---------------------------------------------------------------------------
# Composition
# ---------------------------------------------------------------------------


def default_config_dir(config_name: str) -> Optional[str]:
    """Where ``--config-name NAME`` is found without ``--config-path``: the plugin's own configs
    (:data:`PACKAGE_CONFIG_DIR`) when it holds ``NAME.yaml``, else None (verl's own trainer configs).
    ``main_ppo`` finds the same two without ``--config-path`` (the plugin's through its Hydra
    search-path plugin, ``hydra_plugins.verl_klcov_global_searchpath``)."""
    if os.path.isfile(os.path.join(PACKAGE_CONFIG_DIR, f"{config_name}.yaml")):
        return PACKAGE_CONFIG_DIR
    return None


def compose_config(config_path: Optional[str], config_name: str, overrides: Sequence[str]):
    """The config ``main_ppo --config-path DIR --config-name NAME overrides...`` would get.

    ``config_path``: a folder (relative ones are read from the current directory; main_ppo reads
    them from verl/trainer/, so pass it an absolute path) or None (see :func:`default_config_dir`).
    Returns ``(config, raw, where)``: the resolved config, the same unresolved (interpolations as
    written) and the folder or ``pkg://verl.trainer.config``. Raises
    :class:`DiagnoseError` saying what to change when the config cannot be composed or resolved.
    """
    from hydra import compose, initialize_config_dir, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    if config_path is None:
        folder = default_config_dir(config_name)
    else:
        folder = os.path.abspath(os.path.expanduser(config_path))
        if not os.path.isdir(folder):
            raise DiagnoseError(f"--config-path {config_path!r}: no such directory")
        if not any(os.path.isfile(os.path.join(folder, config_name + ext)) for ext in (".yaml", ".yml")):
            raise DiagnoseError(f"--config-name {config_name!r}: no {config_name}.yaml in {folder}")
    _parse_overrides(overrides)  # a clear message for a malformed override before Hydra's longer one
    if GlobalHydra.instance().is_initialized():  # e.g. inside a Hydra app; compose needs its own
        GlobalHydra.instance().clear()
    try:
        if folder is None:
            with initialize_config_module(config_module=VERL_CONFIG_MODULE, version_base=None):
                raw = compose(config_name=config_name, overrides=list(overrides))
            where = f"pkg://{VERL_CONFIG_MODULE}"
        else:
            with initialize_config_dir(config_dir=folder, version_base=None):
                raw = compose(config_name=config_name, overrides=list(overrides))
            where = folder
        config = copy.deepcopy(raw)
        OmegaConf.resolve(config)  # interpolation errors now, with the key, not halfway through the run
    except DiagnoseError:
        raise
    except Exception as error:  # Hydra/OmegaConf/YAML: say which and why, then what to change
        cause = f" ({type(error.__cause__).__name__}: {error.__cause__})" if error.__cause__ else ""
        if getattr(error, "full_key", None):
            cause += f" at key {error.full_key}"
        where = folder or f"pkg://{VERL_CONFIG_MODULE}"
        if config_path is None and folder is None:
            cause += (f". Without --config-path, diagnose looks for {config_name}.yaml among the plugin's configs "
                      f"({PACKAGE_CONFIG_DIR}), then among verl's own trainer configs; give --config-path DIR")
        raise DiagnoseError(
            f"cannot compose config {config_name!r} from {where} with overrides {list(overrides)}: "
            f"{type(error).__name__}: {error}{cause}. Check the config file and the overrides as you would for "
            "python -m verl.trainer.main_ppo (a key the config does not declare needs a leading '+')"
        ) from None
    return config, raw, where


def _parse_overrides(overrides: Sequence[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides(list(overrides))
    except Exception as error:
        raise DiagnoseError(f"cannot parse the Hydra overrides {list(overrides)}: {error}") from None


def _overridden_keys(overrides: Sequence[str]) -> set[str]:
    return {override.key_or_group for override in _parse_overrides(overrides)}


# ---------------------------------------------------------------------------
# Reading the config
# ---------------------------------------------------------------------------


class _Reader:
    """Values of the composed config with their source (config or override)."""

    def __init__(self, config, raw, overrides: Sequence[str]):
        self.config = config
        self.raw = raw  # the unresolved config: interpolations as written
        self.overridden = _overridden_keys(overrides)

    def get(self, key: str, default: Any = None) -> Any:
        from omegaconf import OmegaConf

        value = OmegaConf.select(self.config, key, default=default)
        return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value

    def has(self, key: str) -> bool:
        from omegaconf import OmegaConf

        return OmegaConf.select(self.config, key, default=_MISSING) is not _MISSING

    def source(self, key: str) -> str:
        """``override`` when an override names the key (or a parent), or the key interpolates one; else config."""
        if self._overridden(key):
            return SOURCE_OVERRIDE
        for ref in self._references(key):
            if self._overridden(ref):
                return f"{SOURCE_OVERRIDE} (via {ref})"
        return SOURCE_CONFIG

    def _overridden(self, key: str) -> bool:
        return any(key == k or key.startswith(k + ".") for k in self.overridden)

    def _references(self, key: str) -> list[str]:
        from omegaconf import OmegaConf

        value = OmegaConf.select(self.raw, key, default=None, throw_on_resolution_failure=False)
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(self.raw, parent) if parent else self.raw
        try:
            raw_value = node._get_node(leaf)._value() if node is not None else value
        except Exception:
            return []
        if not isinstance(raw_value, str) or "${" not in raw_value:
            return []
        return re.findall(r"\$\{(?:oc\.select:)?([A-Za-z_][\w.]*)", raw_value)


_MISSING = object()


def _positive_int(value: Any, key: str, required: bool = False) -> Optional[int]:
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DiagnoseError(f"{key} must be a positive integer, got {value!r}; set {key}=<int>")
    return value


def _micro_batches_dynamic(sequences: int, seq_len: int, budget: int) -> int:
    """verl 0.9.1 ``rearrange_micro_batches`` on ``sequences`` rows of ``seq_len`` tokens each."""
    return min(sequences, math.ceil(sequences * seq_len / budget))


def _budget_for(sequences: int, seq_len: int, micro_batches: int) -> int:
    """The smallest token budget >= one sequence with which verl forms ``micro_batches`` micro-batches."""
    budget = max(seq_len, math.ceil(sequences * seq_len / micro_batches))
    while budget > seq_len and _micro_batches_dynamic(sequences, seq_len, budget - 1) <= micro_batches:
        budget -= 1
    while _micro_batches_dynamic(sequences, seq_len, budget) > micro_batches:
        budget += 1
    return budget


@dataclass(frozen=True)
class Shape:
    sequences: int
    prompt_len: int
    response_len: int

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def tokens(self) -> int:
        return self.sequences * self.seq_len

    def text(self) -> str:
        return f"{self.sequences} x ({self.prompt_len} + {self.response_len}) = {self.tokens:,} tokens"


def scale_shape(full: Shape, micro_batches: int, max_tokens: int) -> Shape:
    """``full`` when it fits ``max_tokens``; else lengths scaled first (down to the minimums), then sequences
    (a multiple of ``micro_batches``, at least ``micro_batches``). Raises when even that does not fit."""
    if full.tokens <= max_tokens:
        return full
    min_p, min_r = min(full.prompt_len, MIN_PROMPT_LEN), min(full.response_len, MIN_RESPONSE_LEN)
    factor = max_tokens / full.tokens
    prompt = max(min_p, math.floor(full.prompt_len * factor))
    response = max(min_r, math.floor(full.response_len * factor))
    shape = Shape(full.sequences, prompt, response)
    if shape.tokens <= max_tokens:
        return shape
    fit = max_tokens // shape.seq_len
    sequences = fit - fit % micro_batches
    if sequences < micro_batches:
        raise DiagnoseError(
            f"--max-tokens {max_tokens} cannot hold your {micro_batches} micro-batches: even at {prompt} + {response} "
            f"tokens per sequence they need {micro_batches * shape.seq_len} tokens; raise --max-tokens to at least "
            f"{micro_batches * shape.seq_len}"
        )
    return Shape(sequences, prompt, response)


class _Planner:
    """A plan being made: the composed config's reader ``r``, and the summary's rows and notes so far."""

    def __init__(self, reader: _Reader):
        self.r = reader
        self.settings: list[Setting] = []
        self.notes: list[str] = []

    def take(self, name: str, key: str, value: Any = _MISSING, *, source: Optional[str] = None, yours: Any = None,
             note: str = "") -> Any:
        """A row for config key ``key``: its value (or ``value``), from the key's source (or ``source``); returns
        the value."""
        value = self.r.get(key) if value is _MISSING else value
        self.settings.append(Setting(name, value, source or self.r.source(key), key, yours, note))
        return value

    def fixed(self, name: str, value: Any, note: str = "", source: str = SOURCE_DEFAULT) -> Any:
        """A row for a value no config key gives (diagnose's own, or an option's); returns the value."""
        self.settings.append(Setting(name, value, source, None, None, note))
        return value


def plan_from_config(config, *, overrides: Sequence[str] = (), raw=None, max_tokens: Optional[int] = None,
                     device: Optional[str] = None, tiny_model: bool = False, blocks: Optional[int] = None,
                     seed: int = 0, loss_mode: Optional[str] = None, json_path: Optional[str] = None,
                     where: str = "", config_name: str = "") -> ConfigPlan:
    """Diagnose's options from a composed verl trainer config; see the module docstring."""
    p = _Planner(_Reader(config, raw if raw is not None else config, overrides))
    device = _plan_device(p, device)
    model = _plan_model(p, tiny_model)
    engine = _plan_engine(p)
    loss_mode, policy_loss = _plan_modes(p, loss_mode)
    loss = _plan_loss(p, loss_mode, policy_loss)
    full, sp, dp = _plan_full_shape(p)
    batching = _plan_micro_batching(p, full, sp, dp)
    shape, scaling, layout = _plan_scaled_layout(p, full, batching, sp, dp, max_tokens, device)
    blocks = _plan_run(p, policy_loss, batching.micro_batches, blocks, seed)
    found = config_findings(config)
    p.notes += [f"{finding.severity}: {finding.text()}" for finding in found]

    options = DiagnoseOptions(
        model=model, device=device, blocks=blocks, seed=seed, json_path=json_path, loss_mode=loss_mode,
        batch_size=shape.sequences, prompt_len=shape.prompt_len, response_len=shape.response_len,
        micro_batches=batching.micro_batches, compare_prepass_layouts=False, policy_loss=policy_loss,
        **engine, **loss, **layout,
    )
    return ConfigPlan(options, p.settings, scaling, p.notes,
                      {"name": config_name, "path": where, "overrides": list(overrides)},
                      [finding.to_json() for finding in found], prepass_counts(config))


def _plan_device(p: _Planner, device: Optional[str]) -> str:
    """The device: ``--device``, else cuda when one is visible, else cpu."""
    import torch

    source = SOURCE_OPTION if device else SOURCE_DEFAULT
    return p.fixed("device", device or ("cuda" if torch.cuda.is_available() else "cpu"), source=source)


def _plan_model(p: _Planner, tiny_model: bool) -> Optional[str]:
    """The config's model path when it is a local HF checkpoint folder; else (or ``--tiny-model``) None, the
    embedded tiny Qwen2."""
    model_path = p.r.get(f"{MODEL}.path")
    if tiny_model:
        return p.fixed("model", None, "--tiny-model: the embedded tiny Qwen2", source=SOURCE_OPTION)
    if isinstance(model_path, str) and os.path.isfile(os.path.join(os.path.expanduser(model_path), "config.json")):
        return p.take("model", f"{MODEL}.path", os.path.expanduser(model_path))
    p.take("model", f"{MODEL}.path", None, source=SOURCE_DEFAULT, yours=model_path,
           note="not a local HF checkpoint here: the embedded tiny Qwen2 instead")
    p.notes.append(f"model: {MODEL}.path={model_path!r} is not a local HF checkpoint folder on this machine "
                   "(no config.json there); diagnose runs the embedded tiny Qwen2 instead. The selection's "
                   "dependence on micro-batching is the same mechanism; the figures are the tiny model's.")
    return None


def _plan_engine(p: _Planner) -> dict:
    """The engine's options: strategy (verl's FSDP engine only), dtype, padding removal, gradient checkpointing."""
    strategy = p.r.get(f"{ACTOR}.strategy")
    if strategy in ("fsdp", "fsdp2"):
        p.take("strategy", f"{ACTOR}.strategy")
    else:
        p.take("strategy", f"{ACTOR}.strategy", "fsdp2", source=SOURCE_DEFAULT, yours=strategy,
               note="diagnose drives verl's FSDP engine only")
        p.notes.append(f"strategy: {ACTOR}.strategy={strategy!r} is not verl's FSDP engine; the plugin supports "
                       "fsdp/fsdp2 only (with another engine a global mode raises UnsupportedEngineError at the first "
                       "step). diagnose goes on with fsdp2 and your micro-batching: what the plugin would do on FSDP.")
        strategy = "fsdp2"
    dtype_key = f"{ACTOR}.fsdp_config.mixed_precision.param_dtype"
    param_dtype = p.r.get(dtype_key)
    names = {"bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32", "float32": "fp32"}
    if param_dtype is None:
        dtype = p.take("dtype", dtype_key, "bf16", source=SOURCE_CONFIG,
                       note="unset: verl's FSDP engine computes in bf16")
    elif param_dtype in names:
        dtype = p.take("dtype", dtype_key, names[param_dtype])
    else:
        dtype = p.take("dtype", dtype_key, "bf16", source=SOURCE_DEFAULT, yours=param_dtype,
                       note="diagnose runs fp32 or bf16")
        p.notes.append(f"dtype: {dtype_key}={param_dtype!r} is not supported by diagnose (fp32 or bf16); it runs bf16.")
    use_remove_padding = bool(p.take("use_remove_padding", f"{MODEL}.use_remove_padding"))
    gradient_checkpointing = bool(p.take("gradient checkpointing", f"{MODEL}.enable_gradient_checkpointing"))
    return dict(strategy=strategy, dtype=dtype, use_remove_padding=use_remove_padding,
                gradient_checkpointing=gradient_checkpointing)


def _plan_modes(p: _Planner, loss_mode: Optional[str]) -> tuple[str, Optional[dict]]:
    """What is diagnosed (``--loss-mode``, else the plugin mode of your loss's family, else every plugin mode for
    vanilla, else your loss, judged by measurement), and the policy_loss a loss outside the table gets (your
    config's, as composed: verl's fields or your class's ``_target_``; None for the table's modes)."""
    from ..modes import MODES

    your_mode = p.r.get(f"{POLICY_LOSS}.loss_mode")
    family = next((spec.name for spec in MODES.values() if your_mode in (spec.name, spec.upstream)), None)
    if loss_mode is None and (family is not None or your_mode in (None, "vanilla")):
        loss_mode = family or "all"  # the plugin mode of the user's family, or every plugin mode
        p.take("modes diagnosed", f"{POLICY_LOSS}.loss_mode", loss_mode,
               yours=your_mode if your_mode != loss_mode else None,
               note=f"with the upstream mode and vanilla; --loss-mode {'|'.join(['all', *MODES])}|NAME to choose")
    elif loss_mode is None:  # a loss outside the table (the user's, registered by --import): judged by measurement
        loss_mode = p.take("modes diagnosed", f"{POLICY_LOSS}.loss_mode",
                           note="outside the plugin's table: judged by measurement, with vanilla")
    else:
        p.fixed("modes diagnosed", loss_mode, source=SOURCE_OPTION)
    policy_loss = None if loss_mode in ("all", *MODES) else p.r.get(POLICY_LOSS)
    if policy_loss is not None:
        p.take("policy_loss config", f"{POLICY_LOSS}._target_", policy_loss.get("_target_"),
               note="the config class of the loss diagnosed, with every policy_loss key of your config")
    return loss_mode, policy_loss


def _plan_loss(p: _Planner, loss_mode: str, policy_loss: Optional[dict]) -> dict:
    """The loss's options: aggregation, the modes' knobs (:func:`_plan_knobs`), the entropy controller's knobs, the
    PPO clip range."""
    loss_agg_mode = p.take("loss_agg_mode", f"{ACTOR}.loss_agg_mode")
    loss_scale_factor = p.take("loss_scale_factor", f"{ACTOR}.loss_scale_factor")
    if loss_agg_mode == "seq-mean-token-sum-norm" and loss_scale_factor is None:
        p.notes.append("loss_agg_mode=seq-mean-token-sum-norm without loss_scale_factor: verl divides by each "
                       "micro-batch's padded width, so even vanilla (the control) depends on the micro-batching and "
                       f"the verdict can fail for that reason alone; set {ACTOR}.loss_scale_factor.")
    knobs, prepass_layout, set_knobs = _plan_knobs(p, loss_mode, policy_loss)
    entropy_control = _plan_entropy_control(p, policy_loss)
    clip = {name: p.take(name, f"{ACTOR}.{name}") for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high",
                                                                "clip_ratio_c")}
    return dict(loss_agg_mode=loss_agg_mode, loss_scale_factor=loss_scale_factor, knobs=knobs,
                prepass_layout=prepass_layout, set_knobs=set_knobs, entropy_control=entropy_control, **clip)


def _plan_knobs(p: _Planner, loss_mode: str, policy_loss: Optional[dict]) -> tuple[dict, Any, dict]:
    """``(knobs, prepass_layout, set_knobs)`` of the modes from your ``policy_loss``.

    Every knob diagnose has a flag for (:func:`.knobs.flag_knobs`) and ``prepass_layout``: your config's value, else
    the plugin's default (:func:`_plan_knob`). ``set_knobs``: the other knobs of the diagnosed modes (a user's mode's)
    that your config sets. A row for each knob of a diagnosed mode, in the table's order, then ``prepass_layout``'s;
    a loss outside the table gets the values and no rows: the plugin's knobs do not concern it.
    """
    from ..modes import MODES
    from .knobs import PREPASS_LAYOUT, flag_knobs

    flags, shown, set_knobs = flag_knobs(), {}, {}
    diagnosed = [spec for name, spec in MODES.items() if loss_mode in ("all", name)] if policy_loss is None else []
    for spec in diagnosed:
        for knob in spec.knobs:
            key = f"{POLICY_LOSS}.{knob}"
            if knob in flags and knob not in shown:
                shown[knob] = _plan_knob(p, knob, row=True)
            elif knob not in flags and knob != PREPASS_LAYOUT and knob not in set_knobs and p.r.get(key) is not None:
                set_knobs[knob] = p.take(knob, key, note=f"a knob of {spec.name}")
    prepass_layout = _plan_knob(p, PREPASS_LAYOUT, row=policy_loss is None)
    knobs = {knob: shown[knob] if knob in shown else _plan_knob(p, knob, row=False) for knob in flags}
    return knobs, prepass_layout, set_knobs


def _plan_knob(p: _Planner, knob: str, row: bool) -> Any:
    """One knob's value from your ``policy_loss``, with a row when ``row``: your config's value, else the plugin's
    default (the mode's, :func:`.knobs.mode_default`), except where :data:`.knobs.DIAGNOSE_DEPARTURES` applies to a
    plan: :data:`.knobs.WHERE_UNSET`, diagnose's value in place of the mode's default; :data:`.knobs.ALWAYS`,
    diagnose's value over your config's (shown beside it)."""
    from .knobs import ALWAYS, DIAGNOSE_DEPARTURES, WHERE_UNSET, mode_default

    key = f"{POLICY_LOSS}.{knob}"
    yours = p.r.get(key)
    departure = DIAGNOSE_DEPARTURES.get(knob)
    if departure is not None and departure.with_config == ALWAYS:
        if row:
            p.take(knob, key, departure.value, source=SOURCE_DEFAULT, yours=yours if yours != departure.value else None,
                   note=departure.config_note)
        return departure.value
    if yours is not None:
        return p.take(knob, key) if row else yours
    value = departure.value if departure is not None and departure.with_config == WHERE_UNSET else mode_default(knob)
    if row:
        p.take(knob, key, value, source=SOURCE_DEFAULT, note="not in your policy_loss: the plugin's default")
    return value


def _plan_entropy_control(p: _Planner, policy_loss: Optional[dict]) -> dict:
    """The entropy controller's knobs your policy_loss sets, given to every global mode it drives; empty (the
    controller off) without ``entropy_target``, and for a loss outside the table."""
    if policy_loss is not None:
        return {}  # the plugin's entropy controller drives the table's modes only: no rows for a loss outside it
    if p.r.get(f"{POLICY_LOSS}.entropy_target") is None:
        p.fixed("entropy controller", "off", "entropy_target is null: the modes' ratios stay as configured")
        return {}
    from ..entropy_control import CONTROL_KNOBS

    entropy_control = {}  # every global mode runs with the controller: its first step's ratio is the controller's
    for knob in CONTROL_KNOBS:
        key = f"{POLICY_LOSS}.{knob}"
        if p.r.get(key) is not None:
            entropy_control[knob] = p.take(knob, key, note="the entropy controller" if knob == "entropy_target" else "")
    return entropy_control


def _plan_full_shape(p: _Planner) -> tuple[Shape, int, int]:
    """One data-parallel rank's minibatch at the config's full lengths, the Ulysses size and the data-parallel size."""
    sp = _positive_int(p.take("ulysses_sequence_parallel_size", f"{ACTOR}.ulysses_sequence_parallel_size"),
                       f"{ACTOR}.ulysses_sequence_parallel_size") or 1
    world = (_positive_int(p.take("n_gpus_per_node", "trainer.n_gpus_per_node"), "trainer.n_gpus_per_node") or 1) * (
        _positive_int(p.take("nnodes", "trainer.nnodes"), "trainer.nnodes") or 1)
    if world % sp:
        raise DiagnoseError(f"trainer.n_gpus_per_node * trainer.nnodes = {world} is not divisible by "
                            f"{ACTOR}.ulysses_sequence_parallel_size = {sp}")
    dp = world // sp
    mini = _positive_int(p.take("ppo_mini_batch_size (prompts)", f"{ACTOR}.ppo_mini_batch_size"),
                         f"{ACTOR}.ppo_mini_batch_size", required=True)
    n = _positive_int(p.take("rollout.n", f"{ROLLOUT}.n"), f"{ROLLOUT}.n") or 1
    if (mini * n) % dp:
        raise DiagnoseError(f"ppo_mini_batch_size * rollout.n = {mini * n} sequences do not split over {dp} "
                            f"data-parallel ranks; verl's main_ppo refuses this too")
    prompt_len = _positive_int(p.take("max_prompt_length", "data.max_prompt_length"), "data.max_prompt_length",
                               required=True)
    response_len = _positive_int(p.take("max_response_length", "data.max_response_length"),
                                 "data.max_response_length", required=True)
    if sp > 1:
        p.notes.append(f"Ulysses sequence parallelism {sp}: diagnose runs one data-parallel rank's whole shard in one "
                       f"process, with verl's token budgets x {sp} as verl's micro-batching applies them; the "
                       "sequence-parallel forward itself is not reproduced.")
    return Shape(mini * n // dp, prompt_len, response_len), sp, dp


@dataclass(frozen=True)
class _MicroBatching:
    """The user's micro-batching on the full shape: ``micro_batches`` formed; ``dynamic``: the token ``budget`` and
    the log-prob pass's ``infer_budget``; static: ``micro`` and ``infer_micro`` sequences per micro-batch, each with
    the source and note of a value diagnose supplied where the config has none (None / "": the config's)."""

    dynamic: bool
    micro_batches: int
    budget: Optional[int] = None
    infer_budget: Optional[int] = None
    micro: Optional[int] = None
    micro_source: Optional[str] = None
    micro_note: str = ""
    infer_micro: Optional[int] = None
    infer_source: Optional[str] = None
    infer_note: str = ""


_MICRO_KEY = f"{ACTOR}.ppo_micro_batch_size_per_gpu"
_BUDGET_KEY = f"{ACTOR}.ppo_max_token_len_per_gpu"
_INFER_MICRO_KEY = f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu"
_INFER_BUDGET_KEY = f"{ROLLOUT}.log_prob_max_token_len_per_gpu"


def _plan_micro_batching(p: _Planner, full: Shape, sp: int, dp: int) -> _MicroBatching:
    """The user's micro-batching (dynamic: token budgets; static: sequences per micro-batch) on the full shape."""
    use_dynamic_bsz = bool(p.take("use_dynamic_bsz", f"{ACTOR}.use_dynamic_bsz"))
    log_prob_dynamic = p.r.get(f"{ROLLOUT}.log_prob_use_dynamic_bsz")
    p.take("log_prob_use_dynamic_bsz", f"{ROLLOUT}.log_prob_use_dynamic_bsz")
    if bool(log_prob_dynamic) != use_dynamic_bsz:
        p.notes.append(f"{ROLLOUT}.log_prob_use_dynamic_bsz={log_prob_dynamic} differs from {ACTOR}.use_dynamic_bsz="
                       f"{use_dynamic_bsz}: verl's actor worker asserts they agree. diagnose follows the actor's.")
    return _plan_dynamic(p, full, sp) if use_dynamic_bsz else _plan_static(p, full, dp)


def _plan_dynamic(p: _Planner, full: Shape, sp: int) -> _MicroBatching:
    """Dynamic micro-batches: verl's ``rearrange_micro_batches`` on the token budget (x the Ulysses size)."""
    budget = _positive_int(p.r.get(_BUDGET_KEY), _BUDGET_KEY)
    if budget is None:
        raise DiagnoseError(f"{ACTOR}.use_dynamic_bsz=True needs {_BUDGET_KEY}; set it")
    if budget * sp < full.seq_len:
        raise DiagnoseError(f"{_BUDGET_KEY}={budget} (x SP {sp}) is below one sequence of {full.seq_len} tokens "
                            "(max_prompt_length + max_response_length): verl's dynamic batching refuses it")
    infer_budget = _positive_int(p.r.get(_INFER_BUDGET_KEY), _INFER_BUDGET_KEY)
    if infer_budget is None:
        raise DiagnoseError(f"use_dynamic_bsz=True needs {_INFER_BUDGET_KEY}; set it")
    return _MicroBatching(True, _micro_batches_dynamic(full.sequences, full.seq_len, budget * sp), budget=budget,
                          infer_budget=infer_budget)


def _plan_static(p: _Planner, full: Shape, dp: int) -> _MicroBatching:
    """Static micro-batches of ``ppo_micro_batch_size_per_gpu`` sequences (diagnose's when the config has none)."""
    micro = _positive_int(p.r.get(_MICRO_KEY), _MICRO_KEY)
    micro_source, micro_note = None, ""
    if micro is None:
        micro_batches = min(DEFAULT_MICRO_BATCHES, full.sequences)
        while full.sequences % micro_batches:
            micro_batches -= 1
        micro = full.sequences // micro_batches
        micro_source, micro_note = SOURCE_DEFAULT, f"unset: {micro_batches} micro-batches"
        legacy = p.r.get(f"{ACTOR}.ppo_micro_batch_size")
        p.notes.append(f"{_MICRO_KEY} is null and use_dynamic_bsz is False: verl's main_ppo would refuse this "
                       f"config" + (f" (the deprecated ppo_micro_batch_size={legacy} is not read by verl 0.9.1's "
                                    "engine workers)" if legacy is not None else "")
                       + f". diagnose uses {micro} sequences per micro-batch ({micro_batches} micro-batches); "
                       f"set {_MICRO_KEY} to see your own.")
    if micro < 1 or full.sequences % micro:
        raise DiagnoseError(f"{_MICRO_KEY}={micro} does not divide the {full.sequences} sequences one "
                            f"data-parallel rank holds (ppo_mini_batch_size * rollout.n / {dp}); verl refuses it")
    infer_micro = _positive_int(p.r.get(_INFER_MICRO_KEY), _INFER_MICRO_KEY)
    infer_source, infer_note = None, ""
    if infer_micro is None:
        infer_micro, infer_source, infer_note = micro, SOURCE_DEFAULT, "unset: the training micro-batch size"
        p.notes.append(f"{_INFER_MICRO_KEY} is null (verl's main_ppo would refuse it with static batching): "
                       f"diagnose's log-prob inference (the prepass's default layout) uses {micro}, the training "
                       "micro-batch size.")
    return _MicroBatching(False, full.sequences // micro, micro=micro, micro_source=micro_source,
                          micro_note=micro_note, infer_micro=infer_micro, infer_source=infer_source,
                          infer_note=infer_note)


def _plan_scaled_layout(p: _Planner, full: Shape, batching: _MicroBatching, sp: int, dp: int,
                        max_tokens: Optional[int], device: str) -> tuple[Shape, dict, dict]:
    """The shape diagnose runs (scaled down to ``--max-tokens``), the report's ``scaling``, and the micro-batch
    settings scaled with it so that it still forms the user's number of micro-batches (DiagnoseOptions' layout)."""
    max_tokens_source = SOURCE_OPTION if max_tokens else SOURCE_DEFAULT
    max_tokens = max_tokens or DEFAULT_MAX_TOKENS.get(device, DEFAULT_MAX_TOKENS["cuda"])
    micro_batches = batching.micro_batches
    shape = scale_shape(full, micro_batches, max_tokens)
    scaled = shape != full
    p.fixed("--max-tokens", max_tokens, f"default for {device}" if max_tokens_source == SOURCE_DEFAULT else "",
            source=max_tokens_source)
    if not scaled:
        scaling_text = f"per data-parallel rank {full.text()} fits --max-tokens {max_tokens}: not scaled"
    else:
        parts = []
        if (shape.prompt_len, shape.response_len) != (full.prompt_len, full.response_len):
            parts.append(f"lengths x{shape.seq_len / full.seq_len:.3g} to {shape.prompt_len} + {shape.response_len}")
        parts.append(f"sequences kept ({full.sequences})" if shape.sequences == full.sequences
                     else f"sequences {full.sequences} -> {shape.sequences}")
        scaling_text = (f"per data-parallel rank {full.text()} > --max-tokens {max_tokens}: scaled to {shape.text()} "
                        f"({', '.join(parts)}); micro-batch settings scaled to keep {micro_batches} micro-batches")
    layout = (_scaled_dynamic_layout(p, full, shape, batching, sp) if batching.dynamic
              else _scaled_static_layout(p, full, shape, batching))
    p.settings.append(Setting("minibatch per DP rank", shape.text(),
                              SOURCE_CONFIG if not scaled else f"{SOURCE_CONFIG}, scaled", None,
                              full.text() if scaled else None, "all sequences at the maximum lengths"))
    scaling = {"full": asdict(full), "used": asdict(shape), "max_tokens": max_tokens, "scaled": scaled,
               "micro_batches": micro_batches, "data_parallel_size": dp, "text": scaling_text}
    return shape, scaling, layout


def _scaled_dynamic_layout(p: _Planner, full: Shape, shape: Shape, batching: _MicroBatching, sp: int) -> dict:
    """The token budgets of ``shape`` (the training one forms the user's number of micro-batches)."""
    scaled = shape != full
    budget, infer_budget = batching.budget, batching.infer_budget
    user_budget = budget * sp if not scaled else _budget_for(shape.sequences, shape.seq_len, batching.micro_batches)
    p.take("ppo_max_token_len_per_gpu", _BUDGET_KEY, user_budget, yours=budget if user_budget != budget else None,
           note=("scaled" if scaled else "") + (f" (x SP {sp})" if sp > 1 else ""))
    user_infer = infer_budget * sp
    if scaled:
        user_infer = max(shape.seq_len, math.ceil(infer_budget * sp * shape.tokens / full.tokens))
    if user_infer < shape.seq_len:
        raise DiagnoseError(f"{_INFER_BUDGET_KEY}={infer_budget} is below one sequence of {shape.seq_len} tokens: "
                            "verl's dynamic batching refuses it")
    p.take("log_prob_max_token_len_per_gpu", _INFER_BUDGET_KEY, user_infer,
           yours=infer_budget if user_infer != infer_budget else None, note="scaled" if scaled else "")
    return dict(layout="dynamic", max_token_len_per_gpu=user_budget, infer_max_token_len_per_gpu=user_infer,
                infer_micro_batch_size_per_gpu=None)


def _scaled_static_layout(p: _Planner, full: Shape, shape: Shape, batching: _MicroBatching) -> dict:
    """The micro-batch sizes of ``shape`` (the training one forms the user's number of micro-batches)."""
    micro, infer_micro = batching.micro, batching.infer_micro
    user_micro = shape.sequences // batching.micro_batches
    p.take("ppo_micro_batch_size_per_gpu", _MICRO_KEY, user_micro, source=batching.micro_source,
           yours=micro if user_micro != micro else None,
           note=("; ".join(x for x in (batching.micro_note, "scaled" if user_micro != micro else "") if x)))
    user_infer_micro = infer_micro if shape.sequences == full.sequences else max(
        1, infer_micro * shape.sequences // full.sequences)
    p.take("log_prob_micro_batch_size_per_gpu", _INFER_MICRO_KEY, user_infer_micro, source=batching.infer_source,
           yours=infer_micro if user_infer_micro != infer_micro else None,
           note="; ".join(x for x in (batching.infer_note, "scaled" if user_infer_micro != infer_micro else "") if x))
    return dict(layout="static", micro_batch_size_per_gpu=user_micro, infer_micro_batch_size_per_gpu=user_infer_micro,
                infer_max_token_len_per_gpu=None)


def _plan_run(p: _Planner, policy_loss: Optional[dict], micro_batches: int, blocks: Optional[int], seed: int) -> int:
    """What diagnose runs its own way (one update, its optimizer, its blocks and seed), with a note for each key of
    the config it does not reproduce; returns the blocks."""
    if micro_batches == 1:
        p.notes.append("your micro-batching puts a data-parallel rank's whole minibatch in one micro-batch: upstream's "
                       "selection does not depend on micro-batching here (only on the DP size, which one process "
                       "cannot show); both layouts below are the same.")
    for name, key, ignored_if in (("ppo_epochs", f"{ACTOR}.ppo_epochs", 1),
                                  ("entropy_coeff", f"{ACTOR}.entropy_coeff", 0),
                                  ("use_kl_loss", f"{ACTOR}.use_kl_loss", False)):
        value = p.r.get(key)
        if value is not None and value != ignored_if:
            p.notes.append(f"{key}={value!r} is not reproduced: diagnose runs one optimizer update"
                           + (" per layout" if name == "ppo_epochs" else f" with {name}={ignored_if!r}")
                           + " (it does not change which tokens are selected).")
    p.fixed("optimizer",
            "SGD lr 0.02, clip 0.05, 1 step" if policy_loss is None else "SGD lr 0.02, no clipping, 1 step",
            "on purpose: parameter differences are gradient differences (your optim settings are not used)")
    if blocks is None:
        blocks = p.fixed("blocks", DEFAULT_BLOCKS, "independent minibatches (seeds)")
    else:
        p.fixed("blocks", blocks, source=SOURCE_OPTION)
    p.fixed("seed", seed, source=SOURCE_OPTION if seed != 0 else SOURCE_DEFAULT)
    return blocks


def plan_for(config_path: Optional[str], config_name: str, overrides: Sequence[str], **kwargs) -> ConfigPlan:
    """Compose (:func:`compose_config`) and plan (:func:`plan_from_config`) in one call."""
    config, raw, where = compose_config(config_path, config_name, overrides)
    return plan_from_config(config, overrides=overrides, raw=raw, where=where, config_name=config_name, **kwargs)
