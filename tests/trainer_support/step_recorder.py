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
#: Set (to anything): after each actor step rank 0 also writes the full parameters, ``params-<pid>.pt`` (the last).
RECORD_PARAMS_ENV = "KLCOV_STEP_RECORD_PARAMS"
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
        output = original(self, data, loss_function)
        if os.environ.get(RECORD_PARAMS_ENV) and record["loss"] != "value_loss":
            _write_params(self, os.path.join(directory, f"params-{os.getpid()}.pt"))
        return output

    setattr(train_batch, _MARK, True)
    BaseEngine.train_batch = train_batch


def _write_params(engine, path: str) -> None:
    """The engine's full parameters after the step as one float64 vector in sorted-key order, written by rank 0
    (gathering them is a collective: every rank calls this after the same step)."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    state = get_model_state_dict(engine.module, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    if int(os.environ.get("RANK", 0)) == 0:
        values = [(v.full_tensor() if isinstance(v, DTensor) else v).detach().reshape(-1).double()
                  for _, v in sorted(state.items())]
        torch.save(torch.cat(values), path)


def read_params(directory: str):
    """Rank 0's parameters after the last actor step (one ``params-*.pt``)."""
    import torch

    (name,) = [n for n in os.listdir(directory) if n.startswith("params-")]
    return torch.load(os.path.join(directory, name))


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
