"""Puts verl-klcov-global's configs on the config search path of every Hydra app (Hydra's SearchPathPlugin).

Hydra imports every module of the ``hydra_plugins`` namespace package when an app starts and calls
:meth:`VerlKLCovGlobalSearchPathPlugin.manipulate_search_path`. The folder is *appended*, after the
app's primary config path (``--config-path``, or ``verl/trainer/config`` for ``main_ppo``), so a
config of the same name in the user's own folder wins.

The folder is located with ``importlib.util.find_spec``, which finds the installed package without
importing it: ``pkg://verl_klcov_global.configs`` would make Hydra import ``verl_klcov_global`` (and
so torch and verl, ~9 s on 2 CPU cores) in every Hydra app of the environment, and a plugin that
fails to import (e.g. against a verl whose seams moved) would then stop every Hydra app, even
``main_ppo`` runs that do not use the plugin.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

PROVIDER = "verl-klcov-global"
PACKAGE = "verl_klcov_global"


def config_dir() -> Optional[str]:
    """``<installed verl_klcov_global>/configs``, or None when the package or the folder is missing."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        folder = os.path.join(location, "configs")
        if os.path.isfile(os.path.join(folder, "kl_cov_global.yaml")):
            return folder
    return None


class VerlKLCovGlobalSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        folder = config_dir()
        if folder is not None:
            search_path.append(provider=PROVIDER, path=f"file://{folder}")
