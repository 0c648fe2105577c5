"""The error every part of ``diagnose`` raises for a bad option or a loss it cannot run: one type, imported by all."""

from __future__ import annotations


class DiagnoseError(ValueError):
    """A bad option, reported before any work is done."""
