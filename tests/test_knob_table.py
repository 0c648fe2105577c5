"""Each knob is written once, on its config-class field (:mod:`verl_klcov_global.knob_doc`), and what shows knobs is
made from there: the README's table is exactly what ``python -m verl_klcov_global.knob_table`` prints, the mode
table's knob lists are the classes', and every key of a packaged YAML is a knob of its class at the class's default
(one documented exception)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from verl_klcov_global import knob_table
from verl_klcov_global.configs import CONFIG_NAMES
from verl_klcov_global.knob_doc import default_of, doc_of, knob_names
from verl_klcov_global.modes import MODES

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "src" / "verl_klcov_global" / "configs"
#: (config, key) -> the YAML's value where it is not the class's default, and why
YAML_EXCEPTIONS = {
    # the paper's coefficient; verl's own field (and so a plain loss_mode=kl_cov_global override, as verl's kl_cov)
    # keeps 0.1
    ("kl_cov_global", "ppo_kl_coef"): 1.0,
}


def test_the_readme_holds_the_table_the_command_makes():
    readme = (ROOT / "README.md").read_text()
    assert knob_table.table() in readme, (
        "README's knob table differs from the config classes: run python -m verl_klcov_global.knob_table --write "
        "README.md")


def test_every_built_in_mode_lists_its_class_knobs_and_each_knob_is_documented():
    for mode in knob_table.built_in_modes():
        assert mode.knobs == knob_names(mode.config_class)
        for name in mode.knobs + knob_names(mode.config_class, controller=True):
            doc = doc_of(mode.config_class, name)
            assert doc is not None and (doc.help or doc.row), (mode.name, name)


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_every_yaml_key_is_a_knob_of_its_class_at_the_class_default(name):
    node = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())["actor_rollout_ref"]["actor"]["policy_loss"]
    cls = MODES[name].config_class
    assert node.pop("_target_") == f"verl_klcov_global.config.{cls.__name__}" and node.pop("loss_mode") == name
    knobs = knob_names(cls) + knob_names(cls, controller=True)
    assert sorted(node) == sorted(knobs), "the YAML declares every knob of its class, and nothing else"
    for key, value in node.items():
        expected = YAML_EXCEPTIONS.get((name, key), default_of(cls, key))
        assert value == expected, (name, key, value, expected)


def test_the_yaml_exceptions_are_real():
    for (name, key), value in YAML_EXCEPTIONS.items():
        assert default_of(MODES[name].config_class, key) != value
