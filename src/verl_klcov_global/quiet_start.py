"""The plugin's own command starts quietly: verl's import-time warnings stay hidden while the package loads.

``import verl`` on a machine without a GPU writes a dozen lines to stderr ("No supported accelerator
detected ... Falling back to 'nvidia'", five "... engine is not available") before
``verl-klcov-global diagnose`` has even parsed its arguments. None of them applies to a CPU diagnose.

Only the package's ``__init__`` runs early enough to hide them on both routes to the command: the
console script (its wrapper imports ``verl_klcov_global.cli``, so the package first) and ``python -m
verl_klcov_global`` (runpy imports the package before its ``__main__``). ``__init__`` therefore calls
:func:`quiet_verl_import` before ``import verl`` and closes what it returns after its last import.

Semantics: in the plugin's command without ``--verbose``, from that call until the close, Python
warnings are ignored and log records up to WARNING are dropped (``logging.disable``); errors still show.
Everything is restored at the close. In every other process (a trainer, a Ray worker, a test, a user's
script) and with ``--verbose`` nothing changes. Standard library only: it runs before verl is imported.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from typing import Optional, Sequence

__all__ = ["COMMAND", "VERBOSE_FLAG", "is_plugin_command", "quiet_verl_import", "wants_quiet_start"]

#: The console script's name (pyproject's ``[project.scripts]``) and the package ``python -m`` runs.
COMMAND = "verl-klcov-global"
PACKAGE = "verl_klcov_global"
#: The command-line flag that keeps verl's warnings visible.
VERBOSE_FLAG = "--verbose"


def is_plugin_command(argv: Sequence[str], orig_argv: Optional[Sequence[str]]) -> bool:
    """Whether this process is the plugin's own command.

    ``argv`` is ``sys.argv`` while the package is imported: the console script's path
    (``.../bin/verl-klcov-global``), or ``"-m"`` while ``python -m`` imports the package (runpy sets
    ``argv[0]`` to the module's file only afterwards); ``orig_argv`` (``sys.orig_argv``) then names
    the module after ``-m``.
    """
    if not argv:
        return False
    script = os.path.basename(argv[0])
    if script in (COMMAND, f"{COMMAND}.exe", f"{COMMAND}-script.py"):
        return True
    if argv[0] != "-m" or not orig_argv:
        return False
    args = list(orig_argv)
    for index, arg in enumerate(args[1:], start=1):
        if arg == "-m":
            return index + 1 < len(args) and args[index + 1] == PACKAGE
        if arg.startswith("-m"):  # python -mverl_klcov_global
            return arg[2:] == PACKAGE
    return False


def wants_quiet_start(argv: Optional[Sequence[str]] = None, orig_argv: Optional[Sequence[str]] = None) -> bool:
    """The plugin's command (:func:`is_plugin_command`) without ``--verbose``; defaults: this process's."""
    argv = sys.argv if argv is None else argv
    orig_argv = getattr(sys, "orig_argv", None) if orig_argv is None else orig_argv
    return is_plugin_command(argv, orig_argv) and VERBOSE_FLAG not in list(argv)[1:]


def quiet_verl_import(argv: Optional[Sequence[str]] = None,
                      orig_argv: Optional[Sequence[str]] = None) -> contextlib.ExitStack:
    """Hide warnings and log records up to WARNING until the returned stack is closed, when
    :func:`wants_quiet_start`; otherwise an empty stack (closing it does nothing)."""
    stack = contextlib.ExitStack()
    if wants_quiet_start(argv, orig_argv):
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        stack.callback(logging.disable, logging.root.manager.disable)
        logging.disable(logging.WARNING)
    return stack
