"""The plugin's Hydra configs, shipped in the wheel: one ``<mode>.yaml`` per mode of the table.

Each is verl's ``ppo_trainer`` config with the policy loss switched to the plugin's mode. Once the
package is installed, ``hydra_plugins.verl_klcov_global_searchpath`` puts this folder on every Hydra
app's config search path (after the app's own), so ``python -m verl.trainer.main_ppo
--config-name=kl_cov_global`` finds it from any directory; a ``--config-path`` of your own still wins.
This folder is also a package so that ``pkg://verl_klcov_global.configs`` works in a user's own
``hydra.searchpath``.
"""

import os

#: This folder: the one copy of the plugin's configs.
CONFIG_DIR = os.path.dirname(os.path.abspath(__file__))
#: The config names it holds (its YAML files; tests/test_packaging.py checks one per mode of the table).
CONFIG_NAMES = tuple(sorted(name[:-len(".yaml")] for name in os.listdir(CONFIG_DIR) if name.endswith(".yaml")))
