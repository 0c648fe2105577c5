"""The verdict by measurement, for a loss outside the plugin's mode table (``diagnose --loss-mode NAME``).

A mode of the table has a mask to compare; any other loss registered in verl's
``POLICY_LOSS_REGISTRY`` (the user's, or verl's own with ``--all-registered``) only has its update.
Per block (one frozen minibatch) it runs, for ``vanilla`` (the control) and each loss:

* one update with the whole minibatch in **1 micro-batch** (the reference);
* one with **N micro-batches in the run's layout** (``--layout``, or the config's: dynamic by
  default) -- row ``NAME``;
* one with **N micro-batches in the other layout** (static <-> dynamic) -- row
  ``NAME[split=static]`` (or ``[split=dynamic]``), compared with ``vanilla[split=...]``;
* for each loss, not the control, the N-micro-batch update of its row once more with torch's
  generators in another state -- its "run again" column (a loss that draws at random moves
  there whatever the split).

A loss is invariant when, in every block, its parameter difference 1 vs N stays within
``INVARIANCE_FACTOR`` (10x) the control's in both layouts, and its repeated update within 10x the
control's 1-vs-N difference. Gradient clipping is off for these runs: under clipping a loss whose
per-micro-batch statistic only rescales the gradient (e.g. a mean taken inside each call, summed over
N calls: N times the gradient) would give the same clipped step, and the dependence would not show.

A loss that raises (a knob it needs and verl does not default, ``bypass_mode`` without its
``rollout_correction`` config, ...) is recorded as "could not run" with the reason (:func:`describe_error`).
"""

from __future__ import annotations

import math
import os
import traceback
from dataclasses import asdict
from typing import Any, Callable, Optional

#: Gradient clipping of the measured runs' SGD step: off (see the module docstring).
MEASURED_CLIP_GRAD = math.inf
#: The other layout's rows: ``NAME[split=static]`` / ``NAME[split=dynamic]``.
SPLIT_SUFFIX = "[split={}]"
CONTROL = "vanilla"


def other_kind(layout: str) -> str:
    """static <-> dynamic."""
    return "static" if layout == "dynamic" else "dynamic"


def split_row(name: str, kind: str) -> str:
    """The row of ``name`` in the other layout, e.g. ``my_loss[split=static]``."""
    return name + SPLIT_SUFFIX.format(kind)


def control_of(row: str) -> str:
    """The control row a row is compared with: ``vanilla``, or ``vanilla[split=...]`` for a split row."""
    for kind in ("static", "dynamic"):
        if row.endswith(SPLIT_SUFFIX.format(kind)):
            return split_row(CONTROL, kind)
    return CONTROL


def other_layout(batch_size: int, seq_len: int, micro_batches: int, kind: str):
    """``micro_batches`` micro-batches in layout ``kind`` (static: the largest size <= ceil(B / N) that
    divides the B sequences, as verl's static split needs; dynamic: a token budget that forms N)."""
    from ..lab.experiment import MicroBatchLayout, dynamic_layouts, largest_divisor_at_most

    if kind == "dynamic":
        layout = dynamic_layouts(batch_size, seq_len, micro_batches)[1]
        return MicroBatchLayout(f"{layout.name} (dynamic)", True, max_token_len_per_gpu=layout.max_token_len_per_gpu)
    size = largest_divisor_at_most(batch_size, -(-batch_size // micro_batches))
    count = batch_size // size
    return MicroBatchLayout(f"{count} micro-batch{'es' if count != 1 else ''} (static)", False,
                            micro_batch_size_per_gpu=size)


def describe_error(error: BaseException) -> str:
    """One line: the exception's type and message; for an assertion without a message, where it failed."""
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = f"{type(error).__name__}: {message}" if message else type(error).__name__
    frames = traceback.extract_tb(error.__traceback__)
    if not message and frames:
        frame = frames[-1]
        parts = frame.filename.split(os.sep)
        where = os.sep.join(parts[parts.index("site-packages") + 1:]) if "site-packages" in parts else frame.filename
        text += f" at {where}:{frame.lineno} ({frame.line})"
    return text


def run_measured_block(engine_spec, batch, layouts, actor_config_for: Callable[[str], Any],
                       losses: tuple[str, ...], failed: dict[str, str],
                       progress: Callable[[str], None] = lambda message: None) -> dict[str, dict]:
    """One block: the control and every loss not in ``failed`` under ``layouts`` = (1 micro-batch, N in the
    run's layout, N in the other), see the module docstring. Returns ``{row: ModeResult as a dict}``.

    A loss that raises is added to ``failed`` (name -> :func:`describe_error`) and has no row; the
    control raising ends the run (nothing could be compared).
    """
    from ..lab.experiment import ModeResult, max_abs_diff, one_update

    reference, primary, other = layouts
    kind = "dynamic" if other.use_dynamic_bsz else "static"
    rows: dict[str, dict] = {}
    for loss in (CONTROL, *losses):
        if loss in failed:
            continue
        runs = [(reference, None), (primary, None), (other, None)] + ([(primary, 1_000_003)] if loss != CONTROL else [])
        try:
            outcomes = []
            for layout, reseed in runs:
                progress(f"{loss} / {layout.name}" + (" (again, other RNG state)" if reseed else ""))
                outcomes.append(one_update(engine_spec, batch, actor_config_for(loss), layout, reseed=reseed))
        except Exception as error:
            if loss == CONTROL:
                raise
            failed[loss] = describe_error(error)
            continue
        selected = (0, 0) if loss == CONTROL else None  # a loss outside the table has no selection to count
        first, in_primary, in_other = (outcome.params for outcome in outcomes[:3])
        repeat = max_abs_diff(in_primary, outcomes[3].params) if len(outcomes) == 4 else None
        rows[loss] = asdict(ModeResult(loss, selected, None, max_abs_diff(first, in_primary), repeat))
        rows[split_row(loss, kind)] = asdict(ModeResult(split_row(loss, kind), selected, None,
                                                        max_abs_diff(first, in_other)))
    return rows


def updates_per_block(losses: tuple[str, ...]) -> int:
    """3 updates for the control, 4 for each loss."""
    return 3 + 4 * len(losses)


def verdict(name: str, modes: dict[str, dict], kind: str, layout_names: tuple[str, str], blocks: int,
            limit: float) -> tuple[bool, str]:
    """``(invariant, sentence)`` of a measured loss from its two rows' ratios (``kind``: the other layout's)
    and its repeat ratio."""
    worst = max(modes[name]["ratio_to_control"])
    worst_other = max(modes[split_row(name, kind)]["ratio_to_control"])
    repeat = max(modes[name].get("repeat_ratio_to_control", [0.0]))
    ok = worst <= limit and worst_other <= limit and repeat <= limit
    primary, other = layout_names
    text = (
        f"{name} is {'INVARIANT' if ok else 'NOT invariant'} to micro-batching (judged by measurement: a loss "
        f"outside the plugin's table has no mask to compare): max|dtheta| 1 vs N micro-batches up to "
        f"{_ratio(worst)}x the control's noise floor with {primary}, {_ratio(worst_other)}x with {other} (limit "
        f"{limit:g}x, {blocks} block{'s' if blocks != 1 else ''}), run again with another RNG state within "
        f"{_ratio(repeat)}x"
    )
    return ok, text


def registry_table(report: dict, kind: str) -> list[dict]:
    """``--all-registered``: one row per loss: its worst ratio to control in the run's layout and in the
    other (``kind``), its worst rerun ratio, its verdict; or could not run, and why."""
    rows = []
    for name in report["measured_losses"]:
        row = {"name": name, "ratio_to_control": None, "ratio_to_control_" + kind: None, "rerun_ratio": None}
        if name in report["could_not_run"]:
            rows.append({**row, "verdict": "could not run with defaults", "why": report["could_not_run"][name]})
            continue
        figures, other = report["modes"][name], report["modes"][split_row(name, kind)]
        invariant = report["verdicts"][name].startswith(f"{name} is INVARIANT")
        rows.append({**row, "ratio_to_control": max(figures["ratio_to_control"]),
                     "ratio_to_control_" + kind: max(other["ratio_to_control"]),
                     "rerun_ratio": max(figures.get("repeat_ratio_to_control", [0.0])),
                     "verdict": "invariant" if invariant else "NOT invariant", "why": ""})
    return rows


def _ratio(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if value < 10 else f"{value:.0f}" if value < 1e5 else f"{value:.1e}"


def format_registry_table(report: dict) -> list[str]:
    """The ``--all-registered`` table as Markdown (it goes into docs as printed): worst over the blocks."""
    layout = report["options"]["layout"]
    kind = other_kind(layout)
    lines = [f"| loss | ratio to control, {layout} | ratio to control, {kind} | run again / control | verdict |",
             "|---|---|---|---|---|"]
    for row in report["registered_losses"]:
        verdict_text = row["verdict"] + (f": {row['why']}" if row["why"] else "")
        lines.append(f"| `{row['name']}` | {_ratio(row['ratio_to_control'])} | "
                     f"{_ratio(row['ratio_to_control_' + kind])} | {_ratio(row['rerun_ratio'])} | "
                     f"{verdict_text.replace('|', '/')} |")
    return lines
