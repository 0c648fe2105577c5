"""The plugin's Hydra configs, shipped in the wheel: ``kl_cov_global.yaml``, ``clip_cov_global.yaml``,
``high_entropy_global.yaml``, ``stare_global.yaml`` and ``lp_reg_global.yaml``.

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
#: The config names it holds.
CONFIG_NAMES = ("kl_cov_global", "clip_cov_global", "high_entropy_global", "stare_global", "lp_reg_global")
