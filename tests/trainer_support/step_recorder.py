"""Per-optimizer-step records from inside verl's workers, for the end-to-end test (test-only).

When ``KLCOV_STEP_RECORD_DIR`` is set, :func:`install` wraps verl 0.9.1's
``BaseEngine.train_batch`` (``workers/engine/base.py`` ~113; one call per optimizer step) *before*
the plugin's entry point wraps it, so this wrapper runs inside the plugin's: after the prepass,
on the very minibatch the optimizer step trains on. Each call appends one JSON line to
``<dir>/steps-<pid>.jsonl``: the process, its rank, the minibatch's row count and how many tokens
the per-token field ``global_selection_mask`` marks (``null`` when the field is absent, i.e. no
prepass ran for this step), and the file the plugin was imported from in that process
(``verl_klcov_global.__file__``, read from ``sys.modules``, or ``null``), and the loss function's name
(``ppo_loss`` for the actor, ``value_loss`` for a critic).

Nothing of the plugin is imported here: the mask is recognised by its field name, so the test's
claim that only the entry point loads the plugin stays true.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

RECORD_DIR_ENV = "KLCOV_STEP_RECORD_DIR"
MASK_KEY = "global_selection_mask"  # verl_klcov_global.config.MASK_FIELD, by name
_MARK = "__trainer_support_step_recorder__"


def install() -> None:
    directory = os.environ.get(RECORD_DIR_ENV)
    if not directory:
        return
    from verl.workers.engine.base import BaseEngine

    original = BaseEngine.train_batch
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def train_batch(self, data, loss_function):
        mask = data.get(MASK_KEY, None) if MASK_KEY in data.keys() else None
        record = {
            "pid": os.getpid(),
            "rank": int(os.environ.get("RANK", -1)),
            "rows": int(data.batch_size[0]),
            "mask_tokens": None if mask is None else int(_values(mask).sum()),
            "plugin_file": getattr(sys.modules.get("verl_klcov_global"), "__file__", None),
            "loss": _name(loss_function),
            "time": time.time(),
        }
        with open(os.path.join(directory, f"steps-{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        return original(self, data, loss_function)

    setattr(train_batch, _MARK, True)
    BaseEngine.train_batch = train_batch


def _name(function) -> str:
    """The loss function's name through ``functools.partial`` layers (verl's ``ppo_loss``, ``value_loss``)."""
    while isinstance(function, functools.partial):
        function = function.func
    return getattr(function, "__name__", type(function).__name__)


def _values(tensor):
    return tensor.values() if tensor.is_nested else tensor


def read(directory: str) -> dict[int, list[dict]]:
    """Records by rank, in call order."""
    by_rank: dict[int, list[dict]] = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("steps-") and name.endswith(".jsonl"):
            with open(os.path.join(directory, name)) as f:
                for line in f:
                    record = json.loads(line)
                    by_rank.setdefault(record["rank"], []).append(record)
    return {rank: sorted(records, key=lambda r: r["time"]) for rank, records in sorted(by_rank.items())}
