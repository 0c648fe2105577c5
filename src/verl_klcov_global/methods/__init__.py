"""The built-in methods, one folder each; everything outside a method's folder asks the mode table.

A method's folder holds its whole definition:

* ``config.py`` -- its config class (each knob written once, with default, validation and help:
  :func:`verl_klcov_global.knob_doc.knob`), its settings and their reader;
* ``selection.py`` -- its pure selection (torch and :mod:`verl_klcov_global.selection`'s shared core only);
* ``objective.py`` -- its per-token loss on a given mask (may use verl's ``core_algos``);
* ``row.py`` -- its row of the mode table, registered with :func:`verl_klcov_global.modes.register_mode`, exactly as
  a user's own module registers one;
* optionally a per-trainer-step rule (``schedule.py``) and its authors' per-loss-call rule (``authors.py``: a lab
  comparator, imported only by ``diagnose`` and the lab, never in the trainer's processes; the row names it in
  ``ModeSpec.comparator``).

Adding a built-in method is a folder and one line: its name in :data:`BUILT_IN_METHODS`.
"""

from __future__ import annotations

import importlib

#: The built-in methods' folders, in the mode table's order (the order ``diagnose`` runs them).
BUILT_IN_METHODS = ("kl_cov", "clip_cov", "high_entropy", "stare", "lp_reg")


def register_built_in_modes() -> None:
    """Import each built-in method's ``row`` module, which registers its row in the mode table (idempotent)."""
    for name in BUILT_IN_METHODS:
        importlib.import_module(f"{__name__}.{name}.row")
