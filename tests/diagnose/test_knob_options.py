"""diagnose's knobs come from the mode table: the flags, the defaults and their departures, the report's knobs line,
``--config-name``'s rows; diagnose and the CLI name no built-in method themselves (fast: no engine runs)."""

from __future__ import annotations

import ast
import dataclasses
import os

import pytest

from verl_klcov_global import cli
from verl_klcov_global.diagnose import knobs as diagnose_knobs
from verl_klcov_global.diagnose.knobs import (
    ALWAYS,
    DIAGNOSE_DEPARTURES,
    Departure,
    flag_knobs,
    flag_modes,
    knob_default,
    mode_default,
)
from verl_klcov_global.diagnose.run import DiagnoseError, DiagnoseOptions, format_report, report_options, summarise
from verl_klcov_global.modes import MODES

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src",
                   "verl_klcov_global")


def test_every_knob_of_a_built_in_mode_has_a_flag_but_the_ones_its_row_keeps_for_set():
    flags = flag_knobs()
    for spec in flag_modes():
        for knob in spec.knobs:
            if knob == "prepass_layout" or knob in spec.knobs_without_diagnose_flag:
                assert knob not in flags
            else:
                assert knob in flags
    actions = {action.dest: action for action in cli.build_parser()._subparsers._group_actions[0].choices[
        "diagnose"]._actions}
    assert set(flags) <= set(actions)
    for knob in flags:
        assert actions[knob].option_strings == ["--" + knob.replace("_", "-")]


def test_the_defaults_are_the_modes_but_where_diagnose_departs_and_every_departure_is_a_knob():
    options = DiagnoseOptions()
    assert list(options.knobs) == list(flag_knobs())
    for knob, value in options.knobs.items():
        expected = DIAGNOSE_DEPARTURES[knob].value if knob in DIAGNOSE_DEPARTURES else mode_default(knob)
        assert value == expected == knob_default(knob)
    assert set(DIAGNOSE_DEPARTURES) <= set(flag_knobs())
    assert DiagnoseOptions(knobs={next(iter(flag_knobs())): 0.5}).knobs == {**options.knobs,
                                                                            next(iter(flag_knobs())): 0.5}
    with pytest.raises(DiagnoseError, match="no_such_knob has no diagnose flag"):
        DiagnoseOptions(knobs={"no_such_knob": 1})


def test_the_reports_options_hold_each_knob_beside_the_other_fields():
    options = DiagnoseOptions()
    flat = report_options(options)
    assert "knobs" not in flat and {knob: flat[knob] for knob in options.knobs} == options.knobs
    assert set(flat) == ({f.name for f in dataclasses.fields(DiagnoseOptions)} - {"knobs"}) | set(options.knobs)


def _rows(modes):
    return {mode: {"selected_per_layout": (1, 1), "masks_identical": True, "max_param_diff": 1e-9}
            for mode in ("vanilla", *modes)}


@pytest.mark.parametrize("spec", flag_modes(), ids=lambda spec: spec.name)
def test_the_knobs_line_shows_the_diagnosed_modes_knobs_only(spec):
    options = DiagnoseOptions(loss_mode=spec.name)
    line = format_report(summarise(options, "cpu", ["a", "b"], [_rows([spec.name])])).splitlines()[1]
    expected = diagnose_knobs.knobs_text(spec, report_options(options))
    assert f" | {expected} | 1 blocks" in line
    for other in flag_modes():
        text = diagnose_knobs.knobs_text(other, report_options(options))
        if other is not spec and text != expected:
            assert text not in line


def test_a_departure_kept_over_the_users_config_applies_to_any_knob(monkeypatch):
    """A departure :data:`ALWAYS` (STARE's open gate today) keeps diagnose's value with --config-name, the config's
    shown beside it, for whichever knob it names."""
    from verl_klcov_global.diagnose.user_config import plan_for

    from .test_user_config import REPO

    monkeypatch.chdir(REPO)
    spec = flag_modes()[0]
    knob = next(k for k in spec.knobs if k in flag_knobs() and k not in DIAGNOSE_DEPARTURES)
    yours = plan_for(None, spec.name, [], device="cpu")
    mine = {**DIAGNOSE_DEPARTURES, knob: Departure(0.125, "a test", with_config=ALWAYS, config_note="kept")}
    monkeypatch.setattr(diagnose_knobs, "DIAGNOSE_DEPARTURES", mine)
    plan = plan_for(None, spec.name, [], device="cpu")
    row = next(s for s in plan.settings if s.name == knob)
    assert (row.value, row.source, row.note) == (0.125, "diagnose default", "kept")
    assert row.yours == next(s for s in yours.settings if s.name == knob).value
    assert plan.options.knobs[knob] == 0.125


def _code_strings(path: str):
    """(line, text) of each identifier and string literal of ``path``, docstrings and the departures table aside."""
    tree = ast.parse(open(path).read())
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) or isinstance(node, ast.Expr):
            body = getattr(node, "body", None)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                skipped.add(id(node.value))
            elif body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                skipped.add(id(body[0].value))
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "DIAGNOSE_DEPARTURES" for t in node.targets):
            skipped.update(id(sub) for sub in ast.walk(node.value))
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value
        elif isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            yield node.lineno, node.name


def test_diagnose_and_the_cli_name_no_built_in_method_nor_its_knobs():
    """Everything they say of a method comes from the mode table; :data:`DIAGNOSE_DEPARTURES` is the one place in
    diagnose that names knobs."""
    names = {spec.name for spec in flag_modes()} | {spec.upstream for spec in flag_modes() if spec.upstream}
    names |= {knob for spec in flag_modes() for knob in spec.knobs if knob != "prepass_layout"}
    folder = os.path.join(SRC, "diagnose")
    paths = [os.path.join(folder, name) for name in sorted(os.listdir(folder)) if name.endswith(".py")]
    found = [(os.path.relpath(path, SRC), line, text) for path in paths + [os.path.join(SRC, "cli.py")]
             for line, text in _code_strings(path) if any(name in text for name in names)]
    assert found == []
    assert set(MODES) >= {spec.name for spec in flag_modes()}  # not vacuous
