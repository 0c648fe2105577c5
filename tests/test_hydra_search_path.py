"""The plugin's configs on every Hydra app's search path (``hydra_plugins.verl_klcov_global_searchpath``).

Composed in-process as ``python -m verl.trainer.main_ppo`` composes (its primary config path is
verl's ``trainer/config``): ``--config-name=kl_cov_global`` / ``clip_cov_global`` resolve from the
package's configs without ``--config-path``; a user's own ``--config-path`` holding a config of the
same name wins; and the search-path plugin finds the folder without importing the package (so no
Hydra app of the environment pays for torch and verl, or breaks if the plugin cannot import).
``scripts/test_wheel.sh`` checks the same from an installed wheel.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import verl
from hydra_plugins.verl_klcov_global_searchpath import verl_klcov_global_searchpath as searchpath
from verl_klcov_global.configs import CONFIG_DIR, CONFIG_NAMES

MAIN_PPO_CONFIG_DIR = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")


def _compose(config_dir: str, name: str):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name=name)
        sources = [(s.provider, s.scheme(), s.path) for s in GlobalHydra.instance().config_loader().get_sources()]
    GlobalHydra.instance().clear()
    return config, sources


def test_the_package_holds_the_one_copy_of_each_config():
    assert sorted(f for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml")) == sorted(f"{n}.yaml" for n in CONFIG_NAMES)
    assert searchpath.config_dir() == CONFIG_DIR


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_main_ppo_finds_the_plugin_configs_without_config_path(name):
    config, sources = _compose(MAIN_PPO_CONFIG_DIR, name)
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == name
    assert config.actor_rollout_ref.actor.policy_loss._target_.startswith("verl_klcov_global.config.")
    # appended after the app's own config path: theirs first, ours after
    providers = [provider for provider, _, _ in sources]
    assert providers.index("main") < providers.index(searchpath.PROVIDER)
    assert (searchpath.PROVIDER, "file", CONFIG_DIR) in sources


def test_a_users_own_config_path_wins(tmp_path):
    (tmp_path / "kl_cov_global.yaml").write_text(
        "hydra:\n  searchpath:\n    - pkg://verl.trainer.config\n"
        "defaults:\n  - ppo_trainer\n  - _self_\n"
        "trainer:\n  project_name: users_own_kl_cov_global\n")
    config, _ = _compose(str(tmp_path), "kl_cov_global")
    assert config.trainer.project_name == "users_own_kl_cov_global"
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "vanilla"  # verl's default, not the plugin's


def test_no_folder_no_search_path_entry(monkeypatch):
    monkeypatch.setattr(searchpath.importlib.util, "find_spec", lambda name: None)
    assert searchpath.config_dir() is None

    class _SearchPath:
        def append(self, **kwargs):  # pragma: no cover - must not be called
            raise AssertionError(kwargs)

    searchpath.VerlKLCovGlobalSearchPathPlugin().manipulate_search_path(_SearchPath())


def test_the_search_path_plugin_does_not_import_the_package(tmp_path):
    """An unrelated Hydra app composes with the plugin's folder on its path, importing neither the plugin nor torch."""
    (tmp_path / "app.yaml").write_text("x: 1\n")
    code = (
        "import sys\n"
        "from hydra import compose, initialize_config_dir\n"
        "from hydra.core.global_hydra import GlobalHydra\n"
        f"with initialize_config_dir(config_dir={str(tmp_path)!r}, version_base=None):\n"
        "    assert compose(config_name='app').x == 1\n"
        "    paths = [s.path for s in GlobalHydra.instance().config_loader().get_sources()]\n"
        f"assert {CONFIG_DIR!r} in paths, paths\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('verl_klcov_global', 'verl', 'torch')]\n"
        "assert not loaded, loaded\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr
