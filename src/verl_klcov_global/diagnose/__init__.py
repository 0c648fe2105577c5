"""``verl-klcov-global diagnose``: the command and what only it uses (the harness it stands on is :mod:`..lab`).

* :mod:`.run` -- the options, the #7829 experiment over a few blocks, the verdict and the report;
* :mod:`.user_config` -- the user's own Hydra config (``--config-name``): its shape, knobs and findings;
* :mod:`.user_losses` -- losses beyond the mode table (``--import``, ``--loss-mode``), checked against verl's registry;
* :mod:`.measured` -- those losses' verdict by measurement;
* :mod:`.knobs` -- the knobs a mode of the table gets (``--set``), and why a mode could not run;
* :mod:`.errors` -- :class:`DiagnoseError`, the one error type of all of them.

Arrows run from here to the harness (:mod:`verl_klcov_global.lab`), never back.
"""

from .errors import DiagnoseError
from .run import DiagnoseOptions, format_report, run_diagnose

__all__ = ["DiagnoseError", "DiagnoseOptions", "format_report", "run_diagnose"]
