"""The experiments' shared command tail (``experiments.study_cli``): flags, report files, redraw, jobs."""

from __future__ import annotations

import argparse
import json
import operator
import os

from experiments.study_cli import add_output_arguments, add_run_arguments, redraw_from_json, run_in_jobs, \
    write_outputs


def _parser(**run_defaults) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_output_arguments(parser)
    add_run_arguments(parser, **run_defaults)
    return parser


def test_flags_and_defaults():
    args = _parser(steps_default=40, seed_default=1).parse_args([])
    assert (args.steps, args.jobs, args.seed, args.png, args.json, args.from_json) == (40, 2, 1, None, None, None)
    args = _parser(steps_default=6, jobs_default=None, seed_default=0).parse_args(["--from-json", "a.json"])
    assert args.from_json == "a.json" and not hasattr(args, "jobs")


def test_write_outputs_then_redraw_prints_the_same_report(tmp_path, capsys):
    drawn = []

    def plot(report, path):
        drawn.append((report["x"], path))

    def format_report(report):
        return f"x = {report['x']}, y = {report.get('y')}"

    path = tmp_path / "new" / "folder" / "report.json"
    args = _parser(steps_default=2, seed_default=0).parse_args(["--json", str(path), "--png", "p.png"])
    write_outputs({"x": 3, "odd": {1, 2}}, args, format_report, plot)
    written = capsys.readouterr().out.splitlines()
    assert written == ["x = 3, y = None", f"report: {path}", "picture: p.png"]
    assert json.loads(path.read_text()) == {"x": 3, "odd": "{1, 2}"}  # what JSON cannot hold: as text

    args = _parser(steps_default=2, seed_default=0).parse_args(["--from-json", str(path)])
    assert redraw_from_json(args, format_report, plot, prepare=lambda r: r.update(y=7)) == 0
    assert capsys.readouterr().out.splitlines() == ["x = 3, y = 7"] and drawn == [(3, "p.png")]  # no --png: no picture


def test_run_in_jobs_returns_results_in_item_order_from_either_path():
    items = [-3, 1, -2, 5]
    seen = []
    here = run_in_jobs(abs, items, jobs=1, on_result=lambda i, r: seen.append((i, r)))
    assert here == [3, 1, 2, 5] and seen == [(0, 3), (1, 1), (2, 2), (3, 5)]
    seen.clear()
    spawned = run_in_jobs(operator.neg, items, jobs=2, cost=abs, on_result=lambda i, r: seen.append((i, r)))
    assert spawned == [3, -1, 2, -5] and sorted(seen) == [(0, 3), (1, -1), (2, 2), (3, -5)]
    assert run_in_jobs(abs, [], jobs=2) == []


def test_run_in_jobs_runs_in_other_processes():
    pids = run_in_jobs(_pid, range(3), jobs=2)
    assert os.getpid() not in pids


def _pid(_item) -> int:
    return os.getpid()


class _Unpicklable(Exception):
    def __init__(self, message, detail):  # pickling keeps args=(message,) only: unpickling fails
        super().__init__(message)


def _fail(item):
    raise _Unpicklable(f"item {item}", "detail")


def test_a_failing_task_is_raised_here_even_when_its_exception_does_not_pickle():
    import pytest

    with pytest.raises(RuntimeError, match=r"(?s)task 0 \(7\) raised _Unpicklable.*item 7"):
        run_in_jobs(_fail, [7], jobs=2)
    with pytest.raises(ZeroDivisionError):
        run_in_jobs(_divide, [0], jobs=2)


def _divide(item):
    return 1 / item
