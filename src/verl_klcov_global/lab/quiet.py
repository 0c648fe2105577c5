"""Quiet verl, transformers and torch while an engine works (the lab's runs print only what they report)."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from typing import Iterator


@contextlib.contextmanager
def quiet_verl() -> Iterator[None]:
    """Hide verl/transformers/torch chatter (prints, warnings, logs) while an engine works."""
    with (
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        previous = logging.root.manager.disable
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(previous)
