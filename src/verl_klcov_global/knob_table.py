"""The README's knob table, made from the config classes (each knob's default, help and valid values are written once,
on its field: :mod:`.knob_doc`).

``python -m verl_klcov_global.knob_table`` prints it; ``--write README.md`` replaces the table between the README's
two markers; ``tests/test_knob_table.py`` checks that the README holds exactly what this prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, Optional

from .knob_doc import KNOB, default_of, doc_of, knob_names
from .modes import MODES, ModeSpec

BEGIN = "<!-- knob table: made by `python -m verl_klcov_global.knob_table --write README.md`; do not edit by hand -->"
END = "<!-- end of the knob table -->"
HEADER = ("| mode | key | meaning | default | valid |", "|---|---|---|---|---|")


def built_in_modes() -> list[ModeSpec]:
    """The plugin's own modes (a config class of this package), in the table's order."""
    return [mode for mode in MODES.values()
            if mode.config_class is not None and mode.config_class.__module__.startswith(__package__ + ".")]


def _owner(cls: type, name: str) -> type:
    """The class that first declares the knob ``name`` (the base for a knob a subclass only re-defaults)."""
    if name in getattr(cls, "VERL_KNOBS", {}):
        return cls
    declaring = [klass for klass in cls.__mro__ if name in getattr(klass, "__annotations__", {})
                 and dataclasses.is_dataclass(klass) and any(
                     f.name == name and KNOB in f.metadata for f in dataclasses.fields(klass))]
    return declaring[-1]


def _value(value: Any) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`{value}`"
    return repr(value)


def _grouped(cls: type, names: list[str]) -> list[list[str]]:
    """``names`` in runs that share a ``KnobDoc.row`` label (a knob without one is a row of its own)."""
    rows: list[list[str]] = []
    for name in names:
        label = doc_of(cls, name).row
        if rows and label is not None and doc_of(cls, rows[-1][0]).row == label:
            rows[-1].append(name)
        else:
            rows.append([name])
    return rows


def _defaults(modes: list[ModeSpec], keys: list[str]) -> str:
    by_value: dict[str, list[str]] = {}
    for mode in modes:
        by_value.setdefault(", ".join(_value(default_of(mode.config_class, key)) for key in keys), []).append(mode.name)
    if len(by_value) == 1:
        return next(iter(by_value))
    return "; ".join(f"{', '.join(f'`{name}`' for name in names)}: {values}" for values, names in by_value.items())


def _row(label: str, cls: type, keys: list[str], defaults: str) -> str:
    """One row: the keys' helps joined, the first key's valid values and default note (they speak for the row)."""
    doc = doc_of(cls, keys[0])
    meaning = "; ".join(doc_of(cls, key).help for key in keys)
    return (f"| {label} | {', '.join(f'`{key}`' for key in keys)} | {meaning} | {defaults}{doc.default_note} | "
            f"{doc.valid} |")


def rows(modes: Optional[list[ModeSpec]] = None) -> list[str]:
    """The table's rows: each mode's own knobs (verl's keys it reads, then its fields), then the knobs its class
    shares with others (``prepass_layout``, the entropy controller's), once, naming the modes that have them."""
    modes = built_in_modes() if modes is None else modes
    lines = list(HEADER)
    shared: dict[str, list[ModeSpec]] = {}
    for mode in modes:
        cls = mode.config_class
        names = list(knob_names(cls)) + list(knob_names(cls, controller=True))
        own = [name for name in names if _owner(cls, name) is cls]
        for name in names:
            if name not in own:
                shared.setdefault(name, []).append(mode)
        for index, keys in enumerate(_grouped(cls, own)):
            lines.append(_row(f"`{mode.name}`" if index == 0 else "", cls, keys, _defaults([mode], keys)))
    owners = {name: _owner(modes_[0].config_class, name) for name, modes_ in shared.items()}
    order = sorted(shared, key=lambda name: (len(owners[name].__mro__), _declared_index(owners[name], name)))
    for keys in _shared_runs(order, owners):
        having = shared[keys[0]]
        label = "all" if len(having) == len(modes) else ", ".join(f"`{mode.name}`" for mode in having)
        lines.append(_row(label, owners[keys[0]], keys, _defaults(having, keys)))
    return lines


def _declared_index(cls: type, name: str) -> int:
    return [f.name for f in dataclasses.fields(cls)].index(name)


def _shared_runs(order: list[str], owners: dict[str, type]) -> list[list[str]]:
    runs: list[list[str]] = []
    for name in order:
        label = doc_of(owners[name], name).row
        if runs and label is not None and owners[runs[-1][0]] is owners[name] and \
                doc_of(owners[name], runs[-1][0]).row == label:
            runs[-1].append(name)
        else:
            runs.append([name])
    return runs


def table() -> str:
    """The table with its two markers, as the README holds it."""
    return "\n".join([BEGIN, *rows(), END])


def replace_in(text: str) -> str:
    """``text`` (the README) with the part between the markers replaced by :func:`table`."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + table() + text[end:]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_klcov_global.knob_table", description=__doc__.split("\n")[0])
    parser.add_argument("--write", metavar="README", help="replace the table between the markers of this file")
    args = parser.parse_args(argv)
    if args.write is None:
        print(table())
        return 0
    with open(args.write) as handle:
        text = handle.read()
    if BEGIN not in text or END not in text:
        print(f"{args.write} has no knob table markers ({BEGIN!r} ... {END!r})", file=sys.stderr)
        return 2
    with open(args.write, "w") as handle:
        handle.write(replace_in(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
