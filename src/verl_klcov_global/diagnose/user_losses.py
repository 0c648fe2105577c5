"""The losses ``diagnose`` can run beyond the plugin's mode table: verl's policy-loss registry.

* :func:`import_user_modules` -- ``--import MODULE``: import the modules that register a user's
  losses (verl's ``register_policy_loss``), as verl's ``VERL_USE_EXTERNAL_MODULES`` does, with the
  current directory importable as for ``python -m``;
* :func:`check_loss_mode` -- a ``--loss-mode`` name, checked after those imports;
* :func:`is_measured_loss` -- a registered loss outside the table, judged by measurement alone
  (:mod:`.measured`);
* :func:`verl_own_losses` -- the losses verl itself registers (``--all-registered``): chosen by the
  module that defines each function, so neither the plugin's, the lab's nor a user's.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Iterable

from .errors import DiagnoseError

#: The penalty-free control every run compares with; not a loss diagnose judges.
CONTROL = "vanilla"
#: ``--loss-mode all``: every mode of the plugin's table.
ALL_TABLE_MODES = "all"


def _registry() -> dict:
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    import verl_klcov_global  # noqa: F401  (registers the plugin's modes)

    return POLICY_LOSS_REGISTRY


def registered_names() -> list[str]:
    """Every name in verl's ``POLICY_LOSS_REGISTRY`` in this process, sorted."""
    return sorted(_registry())


def import_user_modules(modules: Iterable[str]) -> None:
    """Import each module in turn (``importlib.import_module``), the current directory first on ``sys.path``.

    Raises :class:`DiagnoseError` naming the module and its error when one does not import.
    """
    modules = list(modules)
    if not modules:
        return
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)  # as for `python -m`: the console script's sys.path[0] is its own folder
    for module in modules:
        try:
            importlib.import_module(module)
        except BaseException as error:  # SystemExit / KeyboardInterrupt from a module's import too: say which
            if isinstance(error, KeyboardInterrupt):
                raise
            hint = ""
            if module.endswith(".py"):
                hint = f"; give the module's name ({module[:-3].replace(os.sep, '.')}), not its file"
            elif isinstance(error, ModuleNotFoundError) and error.name and module.startswith(error.name):
                hint = (f"; is it on the Python path? diagnose imports from the current directory ({here}) "
                        "and the installed packages")
            raise DiagnoseError(f"--import {module}: the module does not import: "
                                f"{type(error).__name__}: {error}{hint}") from None


def is_table_mode(name: str) -> bool:
    from ..modes import MODES

    return name in MODES


def is_measured_loss(name: str) -> bool:
    """A registered loss outside the plugin's table (and not the control): its verdict rests on measurement."""
    return name not in (ALL_TABLE_MODES, CONTROL) and not is_table_mode(name) and name in _registry()


def check_loss_mode(name: str) -> None:
    """Raise :class:`DiagnoseError` unless ``name`` is ``all``, a mode of the table or a registered loss
    other than the control; the message lists the registered names."""
    if name == ALL_TABLE_MODES or (is_table_mode(name) and name in _registry()) or is_measured_loss(name):
        return
    if name == CONTROL:
        raise DiagnoseError(f"--loss-mode {CONTROL} is the control every run compares with (its noise floor); "
                            "choose the loss you want judged")
    names = ", ".join(n for n in registered_names() if n != CONTROL)
    raise DiagnoseError(
        f"--loss-mode {name!r} is not in verl's policy-loss registry. Registered here: {names}. A loss of your "
        "own: --import the module that registers it with verl's register_policy_loss (the current directory "
        "is importable), e.g. --import my_losses --loss-mode " + name
    )


def verl_own_losses() -> tuple[str, ...]:
    """The registered losses whose function is defined in verl's own modules (``verl`` or ``verl.*``),
    in verl's registration order, the control excluded."""
    return tuple(name for name, function in _registry().items()
                 if name != CONTROL and _is_verl_module(getattr(function, "__module__", None) or ""))


def _is_verl_module(module: str) -> bool:
    return module == "verl" or module.startswith("verl.")
