"""The shared tail of the experiment commands (:mod:`.learning`, :mod:`.trajectory`, exploration).

Each command computes a JSON-ready report, prints it as text and may draw it; this module holds what
they share, so that a new study writes only its runs, its report text and its picture:

* :func:`new_parser` -- the command's parser, its module docstring as the description;
* :func:`load_pyplot` / :func:`save_figure` -- matplotlib's pyplot on the Agg backend (or an exit that says
  what to install); a figure laid out, written and closed;
* :func:`add_output_arguments` / :func:`add_run_arguments` -- the flags ``--png``, ``--json``,
  ``--from-json`` and ``--steps``, ``--jobs``, ``--seed``;
* :func:`redraw_from_json` -- ``--from-json``: no runs, the report and the picture of an earlier JSON;
* :func:`write_outputs` -- print the report, write the JSON, draw the PNG;
* :func:`run_in_jobs` -- independent tasks over spawned processes, longest first, results in order;
* the resumable study's skeleton, which :mod:`.entropy_target`, :mod:`.old_policy` and :mod:`.exploration` share
  (each keeps only its runs, its table and its picture): :func:`open_study` (a new study, or the one ``--json``
  holds, whose settings must be these), :func:`run_pending` (the runs not yet in it, longest first over ``--jobs``
  processes, each saved at once with progress and the time left), :func:`close_study` (its time, summary, report,
  JSON and picture), and :func:`resumable_main`, the whole command of a study over ``--steps``; below them :func:`save_json` (written whole after every run: a crash loses nothing written
  before), :func:`resumed_from` and :func:`finish_study`.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import traceback
from typing import Any, Callable, Optional, Sequence

__all__ = ["new_parser", "load_pyplot", "save_figure", "add_output_arguments", "add_run_arguments", "redraw_from_json", "write_outputs",
           "run_in_jobs", "save_json", "resumed_from", "finish_study", "open_study", "run_pending", "close_study",
           "resumable_main"]

#: What to install when matplotlib is missing (the pictures only; the runs and the JSON do without).
PLOT_HINT = ("the picture needs matplotlib (`pip install matplotlib`, or the plugin's plot extra: "
             "`pip install 'verl-klcov-global[plot]'`, or `pip install -e '.[plot]'` in a clone)")


def load_pyplot():
    """``matplotlib.pyplot`` with the non-interactive Agg backend; ``SystemExit`` with :data:`PLOT_HINT` if
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise SystemExit(f"{PLOT_HINT} ({error})")
    return plt


def save_figure(fig, path: str, *, dpi: int) -> None:
    """``fig`` laid out (``tight_layout``), written to ``path`` at ``dpi`` and closed."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    load_pyplot().close(fig)


def new_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The command's parser: ``prog`` (e.g. ``python -m experiments.learning``), ``description`` (the module
    docstring) shown as written."""
    return argparse.ArgumentParser(prog=prog, description=description,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--png PATH`` (the picture), ``--json PATH`` (every figure), ``--from-json PATH`` (no runs: redraw)."""
    parser.add_argument("--png", help="write the picture here (needs matplotlib: the plot extra)")
    parser.add_argument("--json", help="write every figure here (the full report)")
    parser.add_argument("--from-json", metavar="PATH", help="no runs: report and draw a JSON an earlier run wrote")


def add_run_arguments(parser: argparse.ArgumentParser, *, steps_default: int, jobs_default: Optional[int] = 2,
                      seed_default: int) -> None:
    """``--steps`` (GRPO steps per run), ``--jobs`` (processes; left out when ``jobs_default`` is None) and
    ``--seed``, with the command's defaults."""
    parser.add_argument("--steps", type=int, default=steps_default, help="GRPO steps per run (default %(default)s)")
    if jobs_default is not None:
        parser.add_argument("--jobs", type=int, default=jobs_default,
                            help="processes running runs in parallel (default %(default)s)")
    parser.add_argument("--seed", type=int, default=seed_default, help="the runs' seed (default %(default)s)")


def _draw(report: dict, args: argparse.Namespace, plot: Callable[[dict, str], None]) -> None:
    if args.png:
        plot(report, args.png)
        print(f"picture: {args.png}")


def redraw_from_json(args: argparse.Namespace, format_report: Callable[[dict], str],
                     plot: Callable[[dict, str], None], prepare: Optional[Callable[[dict], Any]] = None) -> int:
    """``--from-json``: load ``args.from_json``, let ``prepare(report)`` fill in what an older JSON lacks (in
    place, or by returning the new report), print ``format_report(report)``, draw it if ``--png``; returns 0."""
    with open(args.from_json) as f:
        report = json.load(f)
    if prepare is not None:
        prepared = prepare(report)
        report = report if prepared is None else prepared
    print(format_report(report))
    _draw(report, args, plot)
    return 0


def write_outputs(report: dict, args: argparse.Namespace, format_report: Callable[[dict], str],
                  plot: Callable[[dict, str], None]) -> None:
    """Print ``format_report(report)``; write the report to ``--json`` (creating its folder; values JSON
    cannot hold, as strings) and draw ``--png``, printing each path written."""
    print(format_report(report))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"report: {args.json}")
    _draw(report, args, plot)


def _call_indexed(task: tuple) -> tuple[int, Any]:
    """A job process's task; an exception that would not unpickle in the parent (which would leave the pool
    waiting for ever) goes back as a RuntimeError with the task's traceback."""
    fn, index, item = task
    try:
        return index, fn(item)
    except Exception as error:
        text = traceback.format_exc()
        try:
            pickle.loads(pickle.dumps(error))
        except Exception:
            raise RuntimeError(f"task {index} ({item!r}) raised {type(error).__name__}, which does not pickle; "
                               f"its traceback in the job process:\n{text}") from None
        raise


def run_in_jobs(fn: Callable[[Any], Any], items: Sequence[Any], *, jobs: int,
                cost: Optional[Callable[[Any], float]] = None,
                on_result: Optional[Callable[[int, Any], None]] = None) -> list:
    """``[fn(item) for item in items]``, spread over ``jobs`` spawned processes (``jobs`` <= 1: in this one).

    Tasks are handed out longest first by ``cost(item)`` (item order without ``cost``), one at a time to
    whichever process is free. ``on_result(index, result)`` runs in this process as each task finishes
    (progress lines, incremental saves). ``fn`` and the items must pickle (``fn`` a module-level function,
    e.g. a ``functools.partial`` of one), and ``fn(item)`` must not depend on the process it runs in or on
    what ran there before: each task seeds itself. A task's exception is raised here.
    """
    items = list(items)
    results: list = [None] * len(items)
    if jobs <= 1 or not items:
        for index, item in enumerate(items):
            results[index] = fn(item)
            if on_result is not None:
                on_result(index, results[index])
        return results
    import multiprocessing

    order = sorted(range(len(items)), key=lambda i: -cost(items[i])) if cost else range(len(items))
    with multiprocessing.get_context("spawn").Pool(min(jobs, len(items))) as pool:
        for index, result in pool.imap_unordered(_call_indexed, [(fn, i, items[i]) for i in order], chunksize=1):
            results[index] = result
            if on_result is not None:
                on_result(index, result)
    return results


def save_json(data: dict, path: str) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename: the file is whole at every moment."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def resumed_from(path: Optional[str], settings: dict) -> Optional[dict]:
    """The study an earlier invocation left at ``path`` (None when there is none), if its ``settings`` are these;
    ``SystemExit`` saying what to do when they differ (a study is never mixed with runs of other settings)."""
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        earlier = json.load(f)
    if earlier.get("settings") != json.loads(json.dumps(settings)):
        raise SystemExit(f"{path} holds a study with other settings; pass another --json path (or delete it) to "
                         "start a new one")
    return earlier


def finish_study(study: dict, args: argparse.Namespace, started: float, format_report: Callable[[dict], str],
                 plot: Callable[[dict, str], None]) -> None:
    """The end of a resumable study's invocation: its report and times printed, ``--json`` written, ``--png`` drawn.

    ``started``: ``time.perf_counter()`` when this invocation began; ``study['seconds']`` is the study's total.
    """
    import time

    print(format_report(study))
    print(f"this invocation {time.perf_counter() - started:.0f} s with {args.jobs} job(s); the study's total "
          f"{study['seconds']:.0f} s")
    if args.json:
        save_json(study, args.json)
    _draw(study, args, plot)


# -- the resumable study's skeleton ------------------------------------------------------------------------


def open_study(settings: dict, json_path: Optional[str], **fields: Any) -> dict:
    """A study ``{"settings", "runs", "seconds", **fields}``: new, or the one an earlier invocation left at
    ``json_path`` (its runs and seconds kept; :func:`resumed_from` refuses other settings)."""
    study = {"settings": settings, "runs": {}, "seconds": 0.0, **fields}
    earlier = resumed_from(json_path, settings)
    if earlier is not None:
        study.update(runs=earlier.get("runs", {}), seconds=earlier.get("seconds", 0.0))
    return study


def run_pending(items: Sequence[Any], study: dict, *, key_of: Callable[[Any], str], cost: Callable[[Any], float],
                work: Callable[[str, list], Callable[[Any], dict]], describe: Callable[[dict], str], jobs: int,
                json_path: Optional[str] = None, progress: Callable[[str], None] = print,
                prefix: str = "study_") -> dict:
    """Runs the ``items`` whose key is not yet in ``study['runs']``, longest (``cost``) first over ``jobs`` spawned
    processes; each finished run (a dict with ``key`` and ``seconds``) is added to ``study`` and saved to
    ``json_path`` at once, which is what makes a rerun resume, and reported with ``describe(run)`` and the time left.

    ``work(work_root, todo)`` prepares what the runs share in a temporary folder (the model, built once) and
    returns the picklable function that runs one item."""
    import tempfile
    import time

    todo = [item for item in items if key_of(item) not in study["runs"]]
    progress(f"{len(todo)} runs to do ({len(items) - len(todo)} already in the JSON), {jobs} job(s)")
    if not todo:
        return study
    total, spent, done, started = sum(map(cost, todo)), 0.0, 0, time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=prefix) as work_root:
        run_one = work(work_root, todo)

        def finished(index: int, run: dict) -> None:
            nonlocal spent, done
            done += 1
            spent += cost(todo[index])
            study["runs"][run["key"]] = run
            if json_path:
                save_json(study, json_path)
            elapsed = time.perf_counter() - started
            progress(f"[{done}/{len(todo)}] {run['key']}: {run['seconds']:.0f} s, {describe(run)}; "
                     f"{elapsed / 60:.1f} min elapsed, ~{elapsed / spent * (total - spent) / 60:.1f} min left")

        run_in_jobs(run_one, todo, jobs=jobs, cost=cost, on_result=finished)
    return study


def close_study(study: dict, args: argparse.Namespace, started: float, summarize: Callable[[dict], dict],
                format_report: Callable[[dict], str], plot: Callable[[dict, str], None]) -> None:
    """This invocation's time added to the study's, its jobs and summary set; then :func:`finish_study`."""
    import time

    study["seconds"] = study.get("seconds", 0.0) + (time.perf_counter() - started)
    study["jobs"] = args.jobs
    study["summary"] = summarize(study)
    finish_study(study, args, started, format_report, plot)


def resumable_main(argv: Optional[Sequence[str]], *, prog: str, doc: str, default_steps: int, min_steps: int,
                   settings: Callable[[int], dict], planned_runs: Callable[[int], list],
                   run_study: Callable[..., dict], summarize: Callable[[dict], dict],
                   format_report: Callable[[dict], str], plot: Callable[[dict, str], None],
                   prepare: Callable[[dict], None], finish: Callable[[dict, int], None] = lambda study, steps: None) -> int:
    """The command of a resumable study over ``--steps`` and ``--jobs`` (plus ``--png``, ``--json``, ``--from-json``):
    ``--from-json`` redraws (``prepare`` sets what the picture needs); else the planned runs not yet in ``--json``,
    then ``finish(study, steps)`` (a study's own additions) and :func:`close_study`."""
    import time

    parser = new_parser(prog, doc)
    add_output_arguments(parser)  # --png, --json (also what a rerun resumes from), --from-json
    parser.add_argument("--steps", type=int, default=default_steps, help="GRPO steps per run (default %(default)s)")
    parser.add_argument("--jobs", type=int, default=2, help="processes running runs in parallel (default %(default)s)")
    args = parser.parse_args(argv)
    if args.from_json:
        return redraw_from_json(args, format_report, plot, prepare=prepare)
    if args.steps < min_steps:
        parser.error(f"--steps must be at least {min_steps}")
    study = open_study(settings(args.steps), args.json)
    started = time.perf_counter()
    run_study(planned_runs(args.steps), study, jobs=args.jobs, json_path=args.json,
              progress=lambda message: print(message, flush=True))
    finish(study, args.steps)
    close_study(study, args, started, summarize, format_report, plot)
    return 0
