"""Loads verl-klcov-global in a Ray process, or stops that process with what to do.

Ray ships this directory to every process of a run whose driver config selects one of the plugin's
loss modes (``runtime_env.py_modules``), and verl imports it on ``import verl``
(``VERL_USE_EXTERNAL_MODULES``). It must not import anything of the plugin at module level
besides the one guarded import below: it exists precisely for processes that may lack the plugin.
A plugin that is there but finds a moved verl seam raises its own ``VerlSeamError``, passed on unchanged.
"""

import os
import socket
import sys

_REQUIRED_BY = os.environ.get("VERL_KLCOV_GLOBAL_REQUIRED_BY", "a verl-klcov-global loss mode")
# verl_klcov_global.install_hint.INSTALL_HINT, which the driver passes in (this process may lack the plugin)
_INSTALL_HINT = os.environ.get("VERL_KLCOV_GLOBAL_INSTALL_HINT", "see verl-klcov-global's README.md, \"Install\"")

try:
    import verl_klcov_global.plugin  # noqa: F401  (registers the loss modes, installs the hook)
except Exception as error:
    if any(cls.__name__ == "VerlSeamError" for cls in type(error).__mro__):
        # The plugin is here but this verl moved a seam it relies on: its own message (the same as the driver's)
        # says what to pin; "install the plugin" would be the wrong advice.
        raise
    raise ImportError(
        f"verl-klcov-global: {_REQUIRED_BY} needs the plugin in every Ray process, but this process "
        f"(host {socket.gethostname()}, python {sys.executable}) cannot import it: "
        f"{type(error).__name__}: {error}. "
        f"Install the driver's version where the Ray workers run ({_INSTALL_HINT}), "
        "or point runtime_env.py_executable at an interpreter that has it. "
        "docs/LOADING.md (verl-klcov-global) lists every way to load it."
    ) from error
