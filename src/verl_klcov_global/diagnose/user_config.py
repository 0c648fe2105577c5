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
    stands in for (``engine/reuse.py``), with the reason in ``text``; ``{}`` unless a global mode is selected
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


def _stare_knobs(r, take) -> dict[str, Any]:
    """stare_global's knobs for a plan that diagnoses it: the config's, else the plugin's defaults; the gate's target
    is diagnose's own (open: :class:`.run.DiagnoseOptions`), since the point is the update with the weights on."""
    from .. import config as c

    defaults = {"stare_top_ratio": c.DEFAULT_STARE_TOP_RATIO, "stare_reweight_w": c.DEFAULT_STARE_REWEIGHT_W,
                "stare_reweight_m": c.DEFAULT_STARE_REWEIGHT_M, "stare_variant": c.DEFAULT_STARE_VARIANT,
                "stare_adaptive": False, "stare_alpha": c.DEFAULT_STARE_ALPHA, "stare_w_max": c.DEFAULT_STARE_W_MAX,
                "stare_m_min": c.DEFAULT_STARE_M_MIN}
    knobs = {}
    for knob, default in defaults.items():
        key = f"{POLICY_LOSS}.{knob}"
        knobs[knob] = (take(knob, key) if r.get(key) is not None else
                       take(knob, key, default, source=SOURCE_DEFAULT, note="not in your policy_loss: the plugin's default"))
    key = f"{POLICY_LOSS}.stare_target_entropy"
    target = DiagnoseOptions.stare_target_entropy
    knobs["stare_target_entropy"] = take(
        "stare_target_entropy", key, target, source=SOURCE_DEFAULT,
        yours=r.get(key) if r.get(key) != target else None,
        note="diagnose keeps STARE's gate open (a target above any model's entropy): the gate is once per trainer "
             "step, the same for every micro-batching, and shut it would leave nothing to compare; "
             "--stare-target-entropy sets it")
    return knobs


def plan_from_config(config, *, overrides: Sequence[str] = (), raw=None, max_tokens: Optional[int] = None,
                     device: Optional[str] = None, tiny_model: bool = False, blocks: Optional[int] = None,
                     seed: int = 0, loss_mode: Optional[str] = None, json_path: Optional[str] = None,
                     where: str = "", config_name: str = "") -> ConfigPlan:
    """Diagnose's options from a composed verl trainer config; see the module docstring."""
    import torch

    r = _Reader(config, raw if raw is not None else config, overrides)
    settings: list[Setting] = []
    notes: list[str] = []

    def take(name: str, key: str, value: Any = _MISSING, *, source: Optional[str] = None, yours: Any = None,
             note: str = "") -> Any:
        value = r.get(key) if value is _MISSING else value
        settings.append(Setting(name, value, source or r.source(key), key, yours, note))
        return value

    def fixed(name: str, value: Any, note: str = "", source: str = SOURCE_DEFAULT) -> Any:
        settings.append(Setting(name, value, source, None, None, note))
        return value

    device_source = SOURCE_OPTION if device else SOURCE_DEFAULT
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    fixed("device", device, source=device_source)

    # model
    model_path = r.get(f"{MODEL}.path")
    if tiny_model:
        model = fixed("model", None, "--tiny-model: the embedded tiny Qwen2", source=SOURCE_OPTION)
    elif isinstance(model_path, str) and os.path.isfile(os.path.join(os.path.expanduser(model_path), "config.json")):
        model = take("model", f"{MODEL}.path", os.path.expanduser(model_path))
    else:
        model = None
        take("model", f"{MODEL}.path", None, source=SOURCE_DEFAULT, yours=model_path,
             note="not a local HF checkpoint here: the embedded tiny Qwen2 instead")
        notes.append(f"model: {MODEL}.path={model_path!r} is not a local HF checkpoint folder on this machine "
                     "(no config.json there); diagnose runs the embedded tiny Qwen2 instead. The selection's "
                     "dependence on micro-batching is the same mechanism; the figures are the tiny model's.")

    # engine
    strategy = r.get(f"{ACTOR}.strategy")
    if strategy in ("fsdp", "fsdp2"):
        take("strategy", f"{ACTOR}.strategy")
    else:
        take("strategy", f"{ACTOR}.strategy", "fsdp2", source=SOURCE_DEFAULT, yours=strategy,
             note="diagnose drives verl's FSDP engine only")
        notes.append(f"strategy: {ACTOR}.strategy={strategy!r} is not verl's FSDP engine; the plugin supports "
                     "fsdp/fsdp2 only (with another engine a global mode raises UnsupportedEngineError at the first "
                     "step). diagnose goes on with fsdp2 and your micro-batching: what the plugin would do on FSDP.")
        strategy = "fsdp2"
    dtype_key = f"{ACTOR}.fsdp_config.mixed_precision.param_dtype"
    param_dtype = r.get(dtype_key)
    names = {"bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32", "float32": "fp32"}
    if param_dtype is None:
        dtype = take("dtype", dtype_key, "bf16", source=SOURCE_CONFIG,
                     note="unset: verl's FSDP engine computes in bf16")
    elif param_dtype in names:
        dtype = take("dtype", dtype_key, names[param_dtype])
    else:
        dtype = take("dtype", dtype_key, "bf16", source=SOURCE_DEFAULT, yours=param_dtype,
                     note="diagnose runs fp32 or bf16")
        notes.append(f"dtype: {dtype_key}={param_dtype!r} is not supported by diagnose (fp32 or bf16); it runs bf16.")
    use_remove_padding = bool(take("use_remove_padding", f"{MODEL}.use_remove_padding"))
    gradient_checkpointing = bool(take("gradient checkpointing", f"{MODEL}.enable_gradient_checkpointing"))

    # loss
    your_mode = r.get(f"{POLICY_LOSS}.loss_mode")
    from ..modes import MODES

    family = next((spec.name for spec in MODES.values() if your_mode in (spec.name, spec.upstream)), None)
    if loss_mode is None and (family is not None or your_mode in (None, "vanilla")):
        loss_mode = family or "all"  # the plugin mode of the user's family, or every plugin mode
        take("modes diagnosed", f"{POLICY_LOSS}.loss_mode", loss_mode,
             yours=your_mode if your_mode != loss_mode else None,
             note=f"with the upstream mode and vanilla; --loss-mode {'|'.join(['all', *MODES])}|NAME to choose")
    elif loss_mode is None:  # a loss outside the table (the user's, registered by --import): judged by measurement
        loss_mode = take("modes diagnosed", f"{POLICY_LOSS}.loss_mode",
                         note="outside the plugin's table: judged by measurement, with vanilla")
    else:
        fixed("modes diagnosed", loss_mode, source=SOURCE_OPTION)
    # a loss outside the table gets the config's policy_loss as composed: verl's fields or the user's class (_target_)
    policy_loss = None if loss_mode in ("all", *MODES) else r.get(POLICY_LOSS)
    if policy_loss is not None:
        take("policy_loss config", f"{POLICY_LOSS}._target_", policy_loss.get("_target_"),
             note="the config class of the loss diagnosed, with every policy_loss key of your config")
    loss_agg_mode = take("loss_agg_mode", f"{ACTOR}.loss_agg_mode")
    loss_scale_factor = take("loss_scale_factor", f"{ACTOR}.loss_scale_factor")
    if loss_agg_mode == "seq-mean-token-sum-norm" and loss_scale_factor is None:
        notes.append("loss_agg_mode=seq-mean-token-sum-norm without loss_scale_factor: verl divides by each "
                     "micro-batch's padded width, so even vanilla (the control) depends on the micro-batching and "
                     f"the verdict can fail for that reason alone; set {ACTOR}.loss_scale_factor.")
    knobs = {}
    plugin_defaults = {"kl_cov_ratio": 0.0002, "ppo_kl_coef": 1.0, "clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0,
                       "clip_cov_ub": 5.0, "clip_cov_seed": 0, "entropy_top_ratio": 0.2,
                       "prepass_layout": "infer", "lp_reg_neg_ratio": 0.01, "lp_reg_pos_ratio": 0.0,
                       "lp_reg_min_p": 0.02}
    for knob, default in plugin_defaults.items():
        key = f"{POLICY_LOSS}.{knob}"
        if policy_loss is not None:  # the plugin's knobs do not concern a loss outside its table: no rows
            knobs[knob] = default if r.get(key) is None else r.get(key)
        elif r.get(key) is not None:
            knobs[knob] = take(knob, key)
        else:
            knobs[knob] = take(knob, key, default, source=SOURCE_DEFAULT,
                               note="not in your policy_loss: the plugin's default")
    if policy_loss is None and loss_mode in ("all", "stare_global"):
        knobs.update(_stare_knobs(r, take))
    set_knobs = {}
    if policy_loss is None:  # a mode's knobs that diagnose has no option for (a user's mode's): your config's values
        from .knobs import option_fields

        for spec in (spec for name, spec in MODES.items() if loss_mode in ("all", name)):
            for knob in spec.knobs:
                key = f"{POLICY_LOSS}.{knob}"
                if knob not in option_fields(DiagnoseOptions) and knob not in set_knobs and r.get(key) is not None:
                    set_knobs[knob] = take(knob, key, note=f"a knob of {spec.name}")
    entropy_control = {}
    if policy_loss is not None:
        pass  # the plugin's entropy controller drives the table's modes only: no rows for a loss outside it
    elif r.get(f"{POLICY_LOSS}.entropy_target") is None:
        fixed("entropy controller", "off", "entropy_target is null: the modes' ratios stay as configured")
    else:  # every global mode runs with the controller: its first step's ratio is the controller's
        from ..entropy_control import CONTROL_KNOBS

        for knob in CONTROL_KNOBS:
            key = f"{POLICY_LOSS}.{knob}"
            if r.get(key) is not None:
                entropy_control[knob] = take(knob, key, note="the entropy controller" if knob == "entropy_target" else "")
    clip = {name: take(name, f"{ACTOR}.{name}") for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high",
                                                              "clip_ratio_c")}

    # minibatch per DP rank
    sp = _positive_int(take("ulysses_sequence_parallel_size", f"{ACTOR}.ulysses_sequence_parallel_size"),
                       f"{ACTOR}.ulysses_sequence_parallel_size") or 1
    world = (_positive_int(take("n_gpus_per_node", "trainer.n_gpus_per_node"), "trainer.n_gpus_per_node") or 1) * (
        _positive_int(take("nnodes", "trainer.nnodes"), "trainer.nnodes") or 1)
    if world % sp:
        raise DiagnoseError(f"trainer.n_gpus_per_node * trainer.nnodes = {world} is not divisible by "
                            f"{ACTOR}.ulysses_sequence_parallel_size = {sp}")
    dp = world // sp
    mini = _positive_int(take("ppo_mini_batch_size (prompts)", f"{ACTOR}.ppo_mini_batch_size"),
                         f"{ACTOR}.ppo_mini_batch_size", required=True)
    n = _positive_int(take("rollout.n", f"{ROLLOUT}.n"), f"{ROLLOUT}.n") or 1
    if (mini * n) % dp:
        raise DiagnoseError(f"ppo_mini_batch_size * rollout.n = {mini * n} sequences do not split over {dp} "
                            f"data-parallel ranks; verl's main_ppo refuses this too")
    prompt_len = _positive_int(take("max_prompt_length", "data.max_prompt_length"), "data.max_prompt_length",
                               required=True)
    response_len = _positive_int(take("max_response_length", "data.max_response_length"),
                                 "data.max_response_length", required=True)
    full = Shape(mini * n // dp, prompt_len, response_len)
    if sp > 1:
        notes.append(f"Ulysses sequence parallelism {sp}: diagnose runs one data-parallel rank's whole shard in one "
                     f"process, with verl's token budgets x {sp} as verl's micro-batching applies them; the "
                     "sequence-parallel forward itself is not reproduced.")

    # the user's micro-batching on the full shape
    use_dynamic_bsz = bool(take("use_dynamic_bsz", f"{ACTOR}.use_dynamic_bsz"))
    log_prob_dynamic = r.get(f"{ROLLOUT}.log_prob_use_dynamic_bsz")
    take("log_prob_use_dynamic_bsz", f"{ROLLOUT}.log_prob_use_dynamic_bsz")
    if bool(log_prob_dynamic) != use_dynamic_bsz:
        notes.append(f"{ROLLOUT}.log_prob_use_dynamic_bsz={log_prob_dynamic} differs from {ACTOR}.use_dynamic_bsz="
                     f"{use_dynamic_bsz}: verl's actor worker asserts they agree. diagnose follows the actor's.")
    micro_key = f"{ACTOR}.ppo_micro_batch_size_per_gpu"
    budget_key = f"{ACTOR}.ppo_max_token_len_per_gpu"
    infer_micro_key = f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu"
    infer_budget_key = f"{ROLLOUT}.log_prob_max_token_len_per_gpu"
    if use_dynamic_bsz:
        budget = _positive_int(r.get(budget_key), budget_key)
        if budget is None:
            raise DiagnoseError(f"{ACTOR}.use_dynamic_bsz=True needs {budget_key}; set it")
        if budget * sp < full.seq_len:
            raise DiagnoseError(f"{budget_key}={budget} (x SP {sp}) is below one sequence of {full.seq_len} tokens "
                                "(max_prompt_length + max_response_length): verl's dynamic batching refuses it")
        micro_batches = _micro_batches_dynamic(full.sequences, full.seq_len, budget * sp)
        infer_budget = _positive_int(r.get(infer_budget_key), infer_budget_key)
        if infer_budget is None:
            raise DiagnoseError(f"use_dynamic_bsz=True needs {infer_budget_key}; set it")
    else:
        micro = _positive_int(r.get(micro_key), micro_key)
        micro_source, micro_note = None, ""
        if micro is None:
            micro_batches = min(DEFAULT_MICRO_BATCHES, full.sequences)
            while full.sequences % micro_batches:
                micro_batches -= 1
            micro = full.sequences // micro_batches
            micro_source, micro_note = SOURCE_DEFAULT, f"unset: {micro_batches} micro-batches"
            legacy = r.get(f"{ACTOR}.ppo_micro_batch_size")
            notes.append(f"{micro_key} is null and use_dynamic_bsz is False: verl's main_ppo would refuse this "
                         f"config" + (f" (the deprecated ppo_micro_batch_size={legacy} is not read by verl 0.9.1's "
                                      "engine workers)" if legacy is not None else "")
                         + f". diagnose uses {micro} sequences per micro-batch ({micro_batches} micro-batches); "
                         f"set {micro_key} to see your own.")
        if micro < 1 or full.sequences % micro:
            raise DiagnoseError(f"{micro_key}={micro} does not divide the {full.sequences} sequences one "
                                f"data-parallel rank holds (ppo_mini_batch_size * rollout.n / {dp}); verl refuses it")
        micro_batches = full.sequences // micro
        infer_micro = _positive_int(r.get(infer_micro_key), infer_micro_key)
        infer_source, infer_note = None, ""
        if infer_micro is None:
            infer_micro, infer_source, infer_note = micro, SOURCE_DEFAULT, "unset: the training micro-batch size"
            notes.append(f"{infer_micro_key} is null (verl's main_ppo would refuse it with static batching): "
                         f"diagnose's log-prob inference (the prepass's default layout) uses {micro}, the training "
                         "micro-batch size.")

    # scale to the device
    max_tokens_source = SOURCE_OPTION if max_tokens else SOURCE_DEFAULT
    max_tokens = max_tokens or DEFAULT_MAX_TOKENS.get(device, DEFAULT_MAX_TOKENS["cuda"])
    shape = scale_shape(full, micro_batches, max_tokens)
    scaled = shape != full
    fixed("--max-tokens", max_tokens, f"default for {device}" if max_tokens_source == SOURCE_DEFAULT else "",
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
    if use_dynamic_bsz:
        user_budget = budget * sp if not scaled else _budget_for(shape.sequences, shape.seq_len, micro_batches)
        take("ppo_max_token_len_per_gpu", budget_key, user_budget, yours=budget if user_budget != budget else None,
             note=("scaled" if scaled else "") + (f" (x SP {sp})" if sp > 1 else ""))
        user_infer = infer_budget * sp
        if scaled:
            user_infer = max(shape.seq_len, math.ceil(infer_budget * sp * shape.tokens / full.tokens))
        if user_infer < shape.seq_len:
            raise DiagnoseError(f"{infer_budget_key}={infer_budget} is below one sequence of {shape.seq_len} tokens: "
                                "verl's dynamic batching refuses it")
        take("log_prob_max_token_len_per_gpu", infer_budget_key, user_infer,
             yours=infer_budget if user_infer != infer_budget else None, note="scaled" if scaled else "")
        layout_kwargs = dict(layout="dynamic", max_token_len_per_gpu=user_budget,
                             infer_max_token_len_per_gpu=user_infer, infer_micro_batch_size_per_gpu=None)
    else:
        user_micro = shape.sequences // micro_batches
        take("ppo_micro_batch_size_per_gpu", micro_key, user_micro, source=micro_source,
             yours=micro if user_micro != micro else None,
             note=("; ".join(x for x in (micro_note, "scaled" if user_micro != micro else "") if x)))
        user_infer_micro = infer_micro if shape.sequences == full.sequences else max(
            1, infer_micro * shape.sequences // full.sequences)
        take("log_prob_micro_batch_size_per_gpu", infer_micro_key, user_infer_micro, source=infer_source,
             yours=infer_micro if user_infer_micro != infer_micro else None,
             note="; ".join(x for x in (infer_note, "scaled" if user_infer_micro != infer_micro else "") if x))
        layout_kwargs = dict(layout="static", micro_batch_size_per_gpu=user_micro,
                             infer_micro_batch_size_per_gpu=user_infer_micro, infer_max_token_len_per_gpu=None)
    settings.append(Setting("minibatch per DP rank", shape.text(),
                            SOURCE_CONFIG if not scaled else f"{SOURCE_CONFIG}, scaled", None,
                            full.text() if scaled else None, "all sequences at the maximum lengths"))
    if micro_batches == 1:
        notes.append("your micro-batching puts a data-parallel rank's whole minibatch in one micro-batch: upstream's "
                     "selection does not depend on micro-batching here (only on the DP size, which one process "
                     "cannot show); both layouts below are the same.")
    for name, key, ignored_if in (("ppo_epochs", f"{ACTOR}.ppo_epochs", 1),
                                  ("entropy_coeff", f"{ACTOR}.entropy_coeff", 0),
                                  ("use_kl_loss", f"{ACTOR}.use_kl_loss", False)):
        value = r.get(key)
        if value is not None and value != ignored_if:
            notes.append(f"{key}={value!r} is not reproduced: diagnose runs one optimizer update"
                         + (" per layout" if name == "ppo_epochs" else f" with {name}={ignored_if!r}")
                         + " (it does not change which tokens are selected).")
    fixed("optimizer", "SGD lr 0.02, clip 0.05, 1 step" if policy_loss is None else "SGD lr 0.02, no clipping, 1 step",
          "on purpose: parameter differences are gradient differences (your optim settings are not used)")
    if blocks is None:
        blocks = fixed("blocks", DEFAULT_BLOCKS, "independent minibatches (seeds)")
    else:
        fixed("blocks", blocks, source=SOURCE_OPTION)
    fixed("seed", seed, source=SOURCE_OPTION if seed != 0 else SOURCE_DEFAULT)

    found = config_findings(config)
    notes += [f"{finding.severity}: {finding.text()}" for finding in found]

    options = DiagnoseOptions(
        model=model, device=device, dtype=dtype, strategy=strategy, blocks=blocks, seed=seed, json_path=json_path,
        loss_mode=loss_mode, batch_size=shape.sequences, prompt_len=shape.prompt_len,
        response_len=shape.response_len, micro_batches=micro_batches, use_remove_padding=use_remove_padding,
        gradient_checkpointing=gradient_checkpointing, loss_agg_mode=loss_agg_mode,
        loss_scale_factor=loss_scale_factor, compare_prepass_layouts=False, policy_loss=policy_loss,
        entropy_control=entropy_control, set_knobs=set_knobs, **knobs, **clip, **layout_kwargs,
    )
    scaling = {"full": asdict(full), "used": asdict(shape), "max_tokens": max_tokens, "scaled": scaled,
               "micro_batches": micro_batches, "data_parallel_size": dp, "text": scaling_text}
    return ConfigPlan(options, settings, scaling, notes,
                      {"name": config_name, "path": where, "overrides": list(overrides)},
                      [finding.to_json() for finding in found], prepass_counts(config))


def plan_for(config_path: Optional[str], config_name: str, overrides: Sequence[str], **kwargs) -> ConfigPlan:
    """Compose (:func:`compose_config`) and plan (:func:`plan_from_config`) in one call."""
    config, raw, where = compose_config(config_path, config_name, overrides)
    return plan_from_config(config, overrides=overrides, raw=raw, where=where, config_name=config_name, **kwargs)
