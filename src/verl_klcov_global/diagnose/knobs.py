"""The knobs ``diagnose`` gives a mode of the table, built-in or a user's, and why a mode could not run.

* :func:`parse_set` -- ``--set KEY=VALUE`` (repeatable) as a dict, each value read as YAML (``0.1``, ``true``, ``O1``);
* :func:`fold_set_knobs` -- checks each key against the diagnosed modes' ``ModeSpec.knobs`` and moves the keys that
  have a diagnose option of their own (``kl_cov_ratio``, ``stare_top_ratio``, ...) into that option, so the report,
  the comparators and the mode read one value; the rest stay in ``DiagnoseOptions.set_knobs``;
* :func:`knob_values` / :func:`policy_loss_config` -- a mode's ``policy_loss``: its ``config_class`` or, without one,
  verl's ``PolicyLossConfig``, with the values above (a knob given nowhere keeps the class's default);
* :func:`mode_failure` -- an exception raised while a mode ran, as a :class:`ModeCannotRunError` that names the mode,
  the stage (its selection, objective, settings reader, ...: found in the traceback) and the message.

A value is validated by the mode itself: its config class on construction and its ``read_settings``.
"""

from __future__ import annotations

import dataclasses
import functools
import traceback
from typing import Any, Iterable, Optional

from .errors import DiagnoseError

#: The policy_loss key every global mode may take beside its knobs; a diagnose option of its own.
PREPASS_LAYOUT = "prepass_layout"


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
            raise DiagnoseError(f"--set {item!r}: give KEY=VALUE with KEY a policy_loss key of the mode, e.g. "
                                "--set kl_cov_ratio=0.002")
        if key in values:
            raise DiagnoseError(f"--set {key} is given twice ({values[key]!r} and {raw!r}); give it once")
        try:
            values[key] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            values[key] = raw
    return values


def option_fields(options) -> frozenset[str]:
    """The fields of ``options`` (``DiagnoseOptions``, the class or an instance): the knobs diagnose has an option of
    its own for are among them."""
    return frozenset(f.name for f in dataclasses.fields(options))


def fold_set_knobs(options, modes: Iterable[str], explicit: Iterable[str] = ()):
    """``options`` with each ``--set`` key checked and, where diagnose has an option of that name, moved into it.

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
    fields, folded, rest = option_fields(options), {}, {}
    for key, value in options.set_knobs.items():
        if key not in known:
            listing = "; ".join(f"{spec.name}: {', '.join(spec.knobs) or 'none'}" for spec in specs)
            raise DiagnoseError(f"--set {key}: not a knob of the mode{'s' if len(specs) > 1 else ''} diagnosed "
                                f"(ModeSpec.knobs; {listing})")
        if key in explicit:
            raise DiagnoseError(f"--set {key} and --{key.replace('_', '-')} both give {key}; give it once")
        (folded if key in fields else rest)[key] = value
    return dataclasses.replace(options, set_knobs=rest, **folded)


def knob_values(options, spec) -> dict[str, Any]:
    """The values diagnose gives ``spec.knobs`` (``prepass_layout`` apart): ``--set``, else diagnose's option of that
    name; a knob given by neither is left out (its config class's default, or verl's)."""
    fields = option_fields(options)
    values = {}
    for knob in spec.knobs:
        if knob == PREPASS_LAYOUT:
            continue
        if knob in options.set_knobs:
            values[knob] = options.set_knobs[knob]
        elif knob in fields:
            values[knob] = getattr(options, knob)
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
