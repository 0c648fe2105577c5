"""A knob's documentation, written once, on its config-class field: what it means and which values are valid.

A plugin knob is a dataclass field declared with :func:`knob` (its default, its help, its valid values); a key of
verl's own ``PolicyLossConfig`` that a mode reads is listed in the class's ``VERL_KNOBS`` with :class:`KnobDoc`.
Everything that shows knobs derives from there: the mode table's knob lists (:func:`knob_names`), the README's
knob table (:mod:`.knob_table`). Validation stays in the classes' ``__post_init__`` and the modes' settings readers,
which read raw mappings too (the driver's check before Ray).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

#: The field-metadata key that holds a knob's :class:`KnobDoc`.
KNOB = "verl_klcov_global_knob"


@dataclass(frozen=True)
class KnobDoc:
    """``help``: what the knob means; ``valid``: its valid values, in words; ``row``: knobs of one class that share
    a label share one row of the README's table (the first one's help and valid values stand for the row);
    ``default_note``: words after the default (e.g. whose value it is); ``controller``: a knob of the entropy
    controller, which the mode table lists apart (``diagnose`` gives it through its controller options);
    ``choices``: the values a command line offers, where they are few."""

    help: str
    valid: str
    row: Optional[str] = None
    default_note: str = ""
    controller: bool = False
    choices: tuple = ()


def knob(default: Any, *, help: str, valid: str, row: Optional[str] = None, default_note: str = "",
         controller: bool = False, choices: tuple = ()) -> Any:
    """A dataclass field for a plugin knob: ``default`` and its :class:`KnobDoc`."""
    return dataclasses.field(default=default,
                             metadata={KNOB: KnobDoc(help, valid, row, default_note, controller, choices)})


def doc_of(cls: type, name: str) -> Optional[KnobDoc]:
    """The :class:`KnobDoc` of ``cls``'s knob ``name`` (a field declared with :func:`knob`, or a key of its
    ``VERL_KNOBS``), None if ``name`` is not a knob of ``cls``."""
    verl = getattr(cls, "VERL_KNOBS", {})
    if name in verl:
        return verl[name]
    field = next((f for f in dataclasses.fields(cls) if f.name == name), None)
    return None if field is None else field.metadata.get(KNOB)


def knob_names(cls: type, *, controller: bool = False) -> tuple[str, ...]:
    """``cls``'s knobs in the order the table lists them: the verl keys it reads (``VERL_KNOBS``), then its own
    fields declared with :func:`knob` (a subclass's before those of the bases, each in declaration order).
    ``controller``: the entropy controller's knobs instead of the others."""
    own: list[str] = []
    for klass in cls.__mro__:
        if not dataclasses.is_dataclass(klass):
            continue
        declared = getattr(klass, "__annotations__", {})
        for field in dataclasses.fields(klass):
            doc = field.metadata.get(KNOB)
            if field.name in declared and doc is not None and doc.controller == controller and field.name not in own:
                own.append(field.name)
    verl = [] if controller else [name for name in getattr(cls, "VERL_KNOBS", {}) if name not in own]
    return tuple(verl + own)


def default_of(cls: type, name: str) -> Any:
    """The default of ``cls``'s field ``name``."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return field.default_factory() if field.default is dataclasses.MISSING else field.default
