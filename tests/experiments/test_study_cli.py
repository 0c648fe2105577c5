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


def _square(item: int, *, work_root: str) -> dict:
    return {"key": f"run{item}", "seconds": 0.0, "value": item * item, "work_root_exists": os.path.isdir(work_root)}


def test_a_resumable_study_runs_what_its_json_lacks_saves_each_run_and_refuses_other_settings(tmp_path, capsys):
    """The skeleton the studies share (open_study, run_pending, close_study, resumable_main's pieces)."""
    import functools

    import pytest

    from experiments.study_cli import close_study, open_study, run_pending

    path = str(tmp_path / "study.json")
    lines = []

    def work(work_root, todo):
        return functools.partial(_square, work_root=work_root)

    def run(items, study):
        return run_pending(items, study, key_of=lambda i: f"run{i}", cost=float, work=work, jobs=1, json_path=path,
                           describe=lambda r: f"value {r['value']}", progress=lines.append)

    study = run([1, 2], open_study({"steps": 3}, path))
    assert {k: v["value"] for k, v in study["runs"].items()} == {"run1": 1, "run2": 4}
    assert all(r["work_root_exists"] for r in study["runs"].values())
    assert json.load(open(path))["runs"].keys() == {"run1", "run2"}  # saved run by run
    assert lines[0] == "2 runs to do (0 already in the JSON), 1 job(s)" and "[1/2] run1" in lines[1]  # jobs 1: in order
    lines.clear()
    resumed = open_study({"steps": 3}, path)
    run([1, 2, 3], resumed)
    assert lines[0] == "1 runs to do (2 already in the JSON), 1 job(s)" and "run3: 0 s, value 9" in lines[1]
    args = argparse.Namespace(jobs=1, json=path, png=None)
    close_study(resumed, args, 0.0, summarize=lambda s: {"n": len(s["runs"])}, format_report=lambda s: "report",
                plot=lambda s, p: None)
    assert json.load(open(path))["summary"] == {"n": 3} and "report" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="other settings"):
        open_study({"steps": 4}, path)
