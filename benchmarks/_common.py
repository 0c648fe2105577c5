"""Shared helpers of the benchmarks: machine description, medians, tables, JSON."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
from typing import Any, Iterable, Sequence


def quiet() -> None:
    """Silence verl's import-time chatter (accelerator fallback, absent optional engines)."""
    import logging
    import warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", message=".*engine is not available.*")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger().setLevel(logging.ERROR)
    os.environ.setdefault("VERL_LOGGING_LEVEL", "ERROR")


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 4 * 1024 * 1024 * 8  # glibc's ceiling on 64-bit (32 MiB)


def tune_malloc() -> str:
    """Make glibc keep and reuse freed blocks up to 32 MiB instead of unmapping them.

    By default glibc serves a large temporary (10 MB for 10^6 float64 tokens) either
    from the heap or from fresh ``mmap`` memory, depending on the process's allocation
    history (its dynamic mmap threshold). Fresh memory costs a page fault per 4 KiB on
    first touch: 10-20 ms per 10^6-token selection (seen: 0 or ~12,000 minor faults per
    call, for either implementation, from one run to the next). Reusing blocks removes
    that noise, like the caching allocator on a GPU. Returns what was set, for the record.
    """
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1 and ok
    except (OSError, AttributeError):
        return "default (glibc mallopt unavailable)"
    return "mallopt M_MMAP_THRESHOLD=32MiB M_TRIM_THRESHOLD=1GiB" if ok else "default (mallopt refused)"


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not on Linux
        return []


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # pragma: no cover
        pass
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    """What produced the figures: CPUs, versions, thread count, load."""
    import torch

    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average_start": load_average(),
        "command": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.run", *sys.argv[1:]]),
    }
    try:
        import verl

        info["verl"] = verl.__version__
    except Exception as error:  # pragma: no cover - verl is a dependency
        info["verl"] = f"unavailable: {error!r}"
    return info


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-markdown table (also readable on a terminal)."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            if value != value:
                return "n/a"
            if abs(value) >= 1000:
                return f"{value:,.0f}"
            if abs(value) >= 100:
                return f"{value:.0f}"
            if abs(value) >= 10:
                return f"{value:.1f}"
            return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"
        if isinstance(value, int) and not isinstance(value, bool):
            return f"{value:,}"
        return str(value)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in text]) for i, h in enumerate(headers)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |" for r in text]
    return "\n".join(lines)


def write_json(path: str, payload: dict[str, Any]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=False, default=float)
        f.write("\n")
