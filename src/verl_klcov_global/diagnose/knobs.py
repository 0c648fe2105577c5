"""The knobs ``diagnose`` gives a mode of the table, built-in or a user's, and why a mode could not run.

* :func:`flag_knobs` -- the knobs diagnose has a flag of its own for (``--<knob>``, an alias of ``--set KNOB=VALUE``):
  every knob of the built-in modes, read from the mode table (``ModeSpec.knobs``), but ``prepass_layout`` and a
  mode's ``knobs_without_diagnose_flag``; :func:`knob_default` is diagnose's default of each: the mode's, or
  diagnose's own where :data:`DIAGNOSE_DEPARTURES` says so;
* :func:`parse_set` -- ``--set KEY=VALUE`` (repeatable) as a dict, each value read as YAML (``0.1``, ``true``, ``O1``);
* :func:`fold_set_knobs` -- checks each key against the diagnosed modes' ``ModeSpec.knobs`` and moves the keys that
  have a flag into ``DiagnoseOptions.knobs``, so the report, the comparators and the mode read one value; the rest
  stay in ``DiagnoseOptions.set_knobs``;
* :func:`knob_values` / :func:`policy_loss_config` -- a mode's ``policy_loss``: its ``config_class`` or, without one,
  verl's ``PolicyLossConfig``, with the values above (a knob given nowhere keeps the class's default);
* :func:`knobs_text` -- a mode's knobs on the report's line (``ModeSpec.knobs_text``);
* :func:`mode_failure` -- an exception raised while a mode ran, as a :class:`ModeCannotRunError` that names the mode,
  the stage (its selection, objective, settings reader, ...: found in the traceback) and the message.

A value is validated by the mode itself: its config class on construction and its ``read_settings``.
"""

from __future__ import annotations

import dataclasses
import functools
import traceback
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

from .errors import DiagnoseError

#: The policy_loss key every global mode may take beside its knobs; a diagnose option of its own.
PREPASS_LAYOUT = "prepass_layout"

#: :attr:`Departure.with_config`: a ``--config-name`` plan takes your config's value, else the mode's default.
COMMAND_LINE_ONLY = "command line only"
#: :attr:`Departure.with_config`: a ``--config-name`` plan takes your config's value, else diagnose's.
WHERE_UNSET = "where your config leaves it unset"
#: :attr:`Departure.with_config`: a ``--config-name`` plan takes diagnose's value over your config's (its row shows
#: yours beside it).
ALWAYS = "always"


@dataclass(frozen=True)
class Departure:
    """diagnose's own default for a knob of the built-in modes, in place of the mode's: ``value``, and ``why``
    (``--help`` states both). It applies to every mode that has the knob (``ModeSpec.knobs``) and to its comparator.

    ``with_config``: what a ``--config-name`` plan does with it (:data:`COMMAND_LINE_ONLY`, :data:`WHERE_UNSET` or
    :data:`ALWAYS`); ``config_note``: the note of the plan's row where it applies :data:`ALWAYS`."""

    value: Any
    why: str
    with_config: str = COMMAND_LINE_ONLY
    config_note: str = ""

    def __post_init__(self):
        if self.with_config not in (COMMAND_LINE_ONLY, WHERE_UNSET, ALWAYS):
            raise ValueError(f"Departure.with_config must be one of {COMMAND_LINE_ONLY!r}, {WHERE_UNSET!r}, "
                             f"{ALWAYS!r}; got {self.with_config!r}")


#: Where diagnose's default for a knob departs from the mode's own, its value and why: the one place in diagnose
#: where knobs are named (``--help`` states each; the report's knobs line shows the values used).
DIAGNOSE_DEPARTURES = {
    "ppo_kl_coef": Departure(
        1.0, "the KL-Cov paper's coefficient (the packaged kl_cov_global.yaml's); verl's field is 0.1",
        with_config=WHERE_UNSET),
    "clip_cov_ratio": Departure(0.002, "ten times verl's 0.0002: a quota above 1 token on the tiny model's minibatch"),
    "clip_cov_lb": Departure(0.3, "almost no covariance of the tiny random model exceeds verl's 1.0, whose window "
                                  "would leave nothing to select"),
    "stare_target_entropy": Departure(
        100.0, "above any model's entropy: the gate is open and the weights apply in the one update per layout, as in "
               "the per-micro-batch comparator, which has no gate",
        with_config=ALWAYS,
        config_note="diagnose keeps STARE's gate open (a target above any model's entropy): the gate is once per "
                    "trainer step, the same for every micro-batching, and shut it would leave nothing to compare; "
                    "--stare-target-entropy sets it"),
}


def flag_modes() -> list[Any]:
    """The built-in modes (``seams.GLOBAL_MODE_NAMES``) of the mode table that have a config class, in the table's
    order: the modes whose knobs diagnose has flags for. A user's mode gets its knobs through ``--set``."""
    from ..modes import MODES
    from ..seams import GLOBAL_MODE_NAMES

    return [spec for name, spec in MODES.items() if name in GLOBAL_MODE_NAMES and spec.config_class is not None]


def flag_knobs() -> dict[str, Any]:
    """knob -> the first mode (:func:`flag_modes`) that has it, for every knob diagnose has a flag of its own for
    (``--kl-cov-ratio``, ...), in the table's order: each mode's ``knobs`` but ``prepass_layout`` (diagnose's own
    option) and its ``knobs_without_diagnose_flag`` (given by ``--set`` only)."""
    found: dict[str, Any] = {}
    for spec in flag_modes():
        for knob in spec.knobs:
            if knob != PREPASS_LAYOUT and knob not in spec.knobs_without_diagnose_flag:
                found.setdefault(knob, spec)
    return found


def mode_default(knob: str) -> Any:
    """The default of ``knob`` in the config class of the first built-in mode whose knobs include it
    (:func:`flag_modes`): a knob with a flag, or ``prepass_layout``."""
    from ..knob_doc import default_of

    for spec in flag_modes():
        if knob in spec.knobs:
            return default_of(spec.config_class, knob)
    raise KeyError(f"{knob} is no knob of a built-in mode ({', '.join(spec.name for spec in flag_modes())})")


def knob_default(knob: str) -> Any:
    """diagnose's default for a knob of :func:`flag_knobs`: :data:`DIAGNOSE_DEPARTURES`'s value, else the mode's
    (:func:`mode_default`)."""
    return DIAGNOSE_DEPARTURES[knob].value if knob in DIAGNOSE_DEPARTURES else mode_default(knob)


def default_knob_values() -> dict[str, Any]:
    """Every knob of :func:`flag_knobs` with diagnose's default (:func:`knob_default`), in the table's order."""
    return {knob: knob_default(knob) for knob in flag_knobs()}


def verl_knobs() -> tuple[str, ...]:
    """The knobs of :func:`flag_knobs` that are verl's own ``PolicyLossConfig`` keys (not one of their mode's
    ``plugin_knobs``): what verl's class gets for a loss outside the table and for the control."""
    return tuple(knob for knob, spec in flag_knobs().items() if knob not in spec.plugin_knobs)


def example_knob() -> tuple[str, Any]:
    """A knob and a value of it, for the examples of ``--help`` and the errors: the first built-in mode's ratio knob
    at its paper's first value (``ModeSpec.ratio_knob``, ``paper_ratios``)."""
    for spec in flag_modes():
        if spec.ratio_knob is not None and spec.paper_ratios:
            return spec.ratio_knob, spec.paper_ratios[0][1]
    raise LookupError("no built-in mode of the table has a ratio_knob with paper_ratios to give as an example")


def knobs_text(spec, values: Mapping[str, Any]) -> str:
    """``spec``'s knobs as the report's knobs line shows them: ``spec.knobs_text(values)``, or ``knob value`` for each
    knob of :func:`flag_knobs` it has, ``" | "`` between them. ``values``: knob -> the value used."""
    flags = flag_knobs()
    own = {knob: values[knob] for knob in spec.knobs if knob in flags}
    if spec.knobs_text is not None:
        return spec.knobs_text(own)
    return " | ".join(f"{knob} {value}" for knob, value in own.items())


class ModeCannotRunError(DiagnoseError):
    """A mode raised while diagnose built, validated or ran it: ``mode``, ``stage`` and the ``cause``; the traceback
    text is kept for ``--verbose``. The command exits 2 (1 means: the mode ran and depends on the micro-batching)."""

    def __init__(self, mode: str, stage: str, cause: BaseException, raised: Optional[BaseException] = None):
        self.mode, self.stage, self.cause = mode, stage, cause
        raised = raised or cause  # the exception as raised (``cause`` may be one it chains to)
        self.traceback_text = "".join(traceback.format_exception(type(raised), raised, raised.__traceback__))
        super().__init__(f"{mode} cannot run: {stage} raised {type(cause).__name__}: {cause}")


def parse_set(items: Iterable[str]) -> dict[str, Any]:
    """``["key=value", ...]`` as ``{key: value}``, each value parsed as YAML (as a Hydra override's is)."""
    import yaml

    values: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            knob, value = example_knob()
            raise DiagnoseError(f"--set {item!r}: give KEY=VALUE with KEY a policy_loss key of the mode, e.g. "
                                f"--set {knob}={value}")
        if key in values:
            raise DiagnoseError(f"--set {key} is given twice ({values[key]!r} and {raw!r}); give it once")
        try:
            values[key] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            values[key] = raw
    return values


def fold_set_knobs(options, modes: Iterable[str], explicit: Iterable[str] = ()):
    """``options`` with each ``--set`` key checked and, where diagnose has a flag for it (:func:`flag_knobs`), moved
    into ``options.knobs`` (``prepass_layout``: into diagnose's option of that name).

    ``modes``: the table modes diagnosed; every key must be a knob of one of them (``ModeSpec.knobs``).
    ``explicit``: the options given on the command line (a key given both ways is refused).
    """
    from ..modes import MODES

    if not options.set_knobs:
        return options
    specs = [MODES[mode] for mode in modes if mode in MODES]
    if not specs:
        raise DiagnoseError("--set gives knobs of the global modes of the table, and this run diagnoses none "
                            f"({options.loss_mode}): give a loss outside the table its settings with --config-name")
    known = {knob for spec in specs for knob in spec.knobs}
    folded, own_option, rest = {}, {}, {}
    for key, value in options.set_knobs.items():
        if key not in known:
            listing = "; ".join(f"{spec.name}: {', '.join(spec.knobs) or 'none'}" for spec in specs)
            raise DiagnoseError(f"--set {key}: not a knob of the mode{'s' if len(specs) > 1 else ''} diagnosed "
                                f"(ModeSpec.knobs; {listing})")
        if key in explicit:
            raise DiagnoseError(f"--set {key} and --{key.replace('_', '-')} both give {key}; give it once")
        if key == PREPASS_LAYOUT:  # diagnose's option of that name
            own_option[key] = value
        else:
            (folded if key in options.knobs else rest)[key] = value
    return dataclasses.replace(options, set_knobs=rest, knobs={**options.knobs, **folded}, **own_option)


def knob_values(options, spec) -> dict[str, Any]:
    """The values diagnose gives ``spec.knobs`` (``prepass_layout`` apart): ``--set``, else ``options.knobs`` (a flag
    or diagnose's default); a knob given by neither is left out (its config class's default, or verl's)."""
    values = {}
    for knob in spec.knobs:
        if knob == PREPASS_LAYOUT:
            continue
        if knob in options.set_knobs:
            values[knob] = options.set_knobs[knob]
        elif knob in options.knobs:
            values[knob] = options.knobs[knob]
    return values


def policy_loss_config(spec, knobs: dict[str, Any], prepass_layout: str, control: Optional[dict] = None,
                       given: Iterable[str] = ()):
    """``spec``'s policy_loss: ``spec.config_class(**knobs)``, or verl's ``PolicyLossConfig(loss_mode=spec.name,
    **knobs)`` for a mode without one; ``prepass_layout`` and the controller's ``control`` knobs where the class
    has them. A knob the class has no field for is left out, unless ``given`` (``--set``) names it: then an error."""
    from verl.workers.config import PolicyLossConfig

    cls = spec.config_class or PolicyLossConfig
    fields = {f.name for f in dataclasses.fields(cls)}
    missing = [key for key in given if key in knobs and key not in fields]
    if missing:
        owner = (f"its config class {cls.__name__}" if spec.config_class else
                 "it has no config class, and verl's PolicyLossConfig")
        raise DiagnoseError(f"--set {missing[0]}: {spec.name} takes no such key: {owner} has no field {missing[0]!r}"
                            + ("" if spec.config_class else "; give the mode a config_class with that field "
                               "(docs/ADDING_A_MODE.md)"))
    kwargs = {key: value for key, value in {**knobs, **(control or {})}.items() if key in fields}
    if PREPASS_LAYOUT in fields:
        kwargs[PREPASS_LAYOUT] = prepass_layout
    if spec.config_class is None:
        kwargs["loss_mode"] = spec.name
    return cls(**kwargs)


# ---------------------------------------------------------------------------
# Which part of a mode raised

#: ModeSpec fields that hold the mode's own code, and the stage each names
_STAGES = (("select", "its selection (ModeSpec.select)"), ("objective", "its objective (ModeSpec.objective)"),
           ("read_settings", "its settings reader (ModeSpec.read_settings)"),
           ("update_rule", "its update rule (ModeSpec.update_rule)"),
           ("setting_warnings", "its setting warnings (ModeSpec.setting_warnings)"),
           ("proxy_min_p", "its proxy_min_p"), ("selection_reach", "its selection_reach"),
           ("config_class", "its config class"))


def _code_of(function) -> set:
    """The code objects a callable runs first (a function, a bound method, a partial, a class, a callable object)."""
    while isinstance(function, functools.partial):
        function = function.func
    function = getattr(function, "__func__", function)
    if isinstance(function, type):
        return {getattr(member, "__code__", None) for member in vars(function).values()} - {None}
    code = getattr(function, "__code__", None) or getattr(getattr(type(function), "__call__", None), "__code__", None)
    return {code} if code is not None else set()


def _chain(error: BaseException) -> list[BaseException]:
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def stage_of(spec, error: BaseException) -> tuple[Optional[str], BaseException]:
    """The stage of ``spec`` whose code is on ``error``'s traceback (or a cause's), outermost first, and that
    exception; ``(None, error)`` when none of the mode's own code is (the engine, verl, the plugin raised)."""
    codes = [(stage, _code_of(getattr(spec, name))) for name, stage in _STAGES if getattr(spec, name, None) is not None]
    for exception in _chain(error):
        for frame, _ in traceback.walk_tb(exception.__traceback__):
            for stage, stage_codes in codes:
                if frame.f_code in stage_codes:
                    return stage, exception
    return None, error


def mode_failure(name: str, error: BaseException) -> ModeCannotRunError:
    """``error``, raised while diagnose ran ``name`` (a mode of the table, a comparator or the control), as the
    :class:`ModeCannotRunError` the command reports."""
    from ..lab.experiment import variant_of

    spec, _ = variant_of(name)
    stage, cause = stage_of(spec, error) if spec is not None else (None, error)
    return ModeCannotRunError(name, stage or "its update (verl's engine and the plugin's step)", cause, error)
