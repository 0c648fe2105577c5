"""A built-in method added as part 2 of docs/ADDING_A_MODE.md writes it: a folder and one line.

The page's four blocks are the files of ``methods/top_advantages/``. Two ways of running them:

* in a temporary copy of the package, with ``"top_advantages"`` added to ``BUILT_IN_METHODS``: exactly one existing
  file changes, by one line; the method's name appears nowhere else; ``diagnose`` (a fresh process on the copy)
  runs the new mode through verl's real FSDP engine and finds it invariant to micro-batching, its knob given with
  ``--set``;
* in this process, the folder loaded as ``verl_klcov_global.methods.top_advantages`` (its relative imports reach
  the installed package): registered in verl's registry, checked by the driver, its mask taken from the channel,
  and through the real engine the same mask for 1 and 8 micro-batches, exactly the largest advantages.
"""

from __future__ import annotations

import filecmp
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn

import verl_klcov_global
from verl_klcov_global import driver, plugin
from verl_klcov_global.lab import tiny as _tiny
from verl_klcov_global.lab.experiment import EngineSpec, frozen_minibatch, run_block, static_layouts
from verl_klcov_global.layout import padded
from verl_klcov_global.loss import provide_selection_mask
from verl_klcov_global.modes import MODES, global_mode_of, unregister_mode
from verl_klcov_global.selection.knobs import ratio_quota

from .support.docs import section
from .trainer_support import trainer

PART_2 = "## Part 2: a built-in method of this repository"
FOLDER = "top_advantages"
NAME = "top_advantages_global"
PREFIX = "actor/top_advantages/"
RATIO = 0.01
NOISE_FACTOR = 10  # the mode's layout difference must stay within 10x the penalty-free control's
PACKAGE_DIR = Path(verl_klcov_global.__file__).parent
BUILT_IN_LINE = re.compile(r"^BUILT_IN_METHODS = \((.*)\)$", re.M)


def page_files() -> dict[str, str]:
    """The page's blocks by file name (``config.py``, ...): each ``### N. `methods/<folder>/<file>`...`` heading
    and the python block under it."""
    found = re.findall(r"^### \d+\. `methods/" + FOLDER + r"/(\w+\.py)`.*?\n```python\n(.*?)^```",
                       section("ADDING_A_MODE.md", PART_2), re.M | re.S)
    return dict(found)


def write_folder(methods_dir: Path) -> Path:
    """The method's folder under ``methods_dir``, as the page writes it (plus an empty ``__init__.py``)."""
    folder = methods_dir / FOLDER
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    for name, text in page_files().items():
        (folder / name).write_text(text)
    return folder


def add_the_line(methods_init: Path) -> None:
    """The one line: the folder's name at the end of ``BUILT_IN_METHODS``."""
    text = methods_init.read_text()
    assert len(BUILT_IN_LINE.findall(text)) == 1, "BUILT_IN_METHODS is no longer one line of methods/__init__.py"
    methods_init.write_text(BUILT_IN_LINE.sub(lambda m: f'BUILT_IN_METHODS = ({m.group(1)}, "{FOLDER}")', text))


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory) -> Path:
    """``src/`` of a temporary copy of the package with the method added; returns the folder to put on the path."""
    src = tmp_path_factory.mktemp("copy") / "src"
    shutil.copytree(PACKAGE_DIR, src / PACKAGE_DIR.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    copy = src / PACKAGE_DIR.name
    write_folder(copy / "methods")
    add_the_line(copy / "methods" / "__init__.py")
    return src


def _changed_and_added(original: Path, copy: Path) -> tuple[list[str], list[str]]:
    changed, added = [], []
    for path in sorted(copy.rglob("*.py")):
        relative = path.relative_to(copy)
        before = original / relative
        if not before.exists():
            added.append(str(relative))
        elif not filecmp.cmp(before, path, shallow=False):
            changed.append(str(relative))
    return changed, added


def test_the_page_has_the_four_files():
    assert sorted(page_files()) == ["config.py", "objective.py", "row.py", "selection.py"]


def test_a_method_is_a_folder_and_one_line(package_copy):
    copy = package_copy / PACKAGE_DIR.name
    changed, added = _changed_and_added(PACKAGE_DIR, copy)
    assert changed == ["methods/__init__.py"], changed  # the one existing file touched
    assert all(name.startswith(f"methods/{FOLDER}/") for name in added) and len(added) == 5
    before = (PACKAGE_DIR / "methods" / "__init__.py").read_text().splitlines()
    after = (copy / "methods" / "__init__.py").read_text().splitlines()
    assert len(before) == len(after) and sum(a != b for a, b in zip(before, after)) == 1
    # and nothing outside its folder and that line names it
    naming = [str(p.relative_to(copy)) for p in copy.rglob("*.py")
              if FOLDER in p.read_text() and not str(p.relative_to(copy)).startswith(f"methods/{FOLDER}/")]
    assert naming == ["methods/__init__.py"], naming


def _run_in_copy(package_copy: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package_copy), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)


def test_the_copy_registers_the_new_mode_and_its_knob(package_copy, tmp_path):
    code = ("import verl_klcov_global as v, sys\n"
            f"assert v.__file__.startswith({str(package_copy)!r}), v.__file__\n"
            "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R\n"
            f"assert R[{NAME!r}] is v.MODES[{NAME!r}].policy_loss\n"
            f"assert v.MODES[{NAME!r}].knobs == ('top_advantages_ratio', 'prepass_layout'), v.MODES[{NAME!r}].knobs\n"
            "from verl_klcov_global.cli import build_parser\n"
            f"build_parser().parse_args(['diagnose', '--loss-mode', {NAME!r}, '--set', 'top_advantages_ratio=0.2'])\n"
            "print('ok')\n")
    out = _run_in_copy(package_copy, tmp_path, "-c", code)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.slow  # one diagnose block through verl's FSDP engine in a fresh process: ~1 min on 2 cores
def test_diagnose_runs_the_new_mode_in_the_copy(package_copy, tmp_path):
    report = tmp_path / "report.json"
    out = _run_in_copy(package_copy, tmp_path, "-m", "verl_klcov_global", "diagnose", "--loss-mode", NAME,
                       "--blocks", "1", "--batch-size", "16", "--response-len", "32",
                       "--set", "top_advantages_ratio=0.05", "--json", str(report))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["options"]["set_knobs"] == {"top_advantages_ratio": 0.05}
    row = result["modes"][NAME]
    assert row["masks_identical"] is True
    assert all(len(set(selected)) == 1 and selected[0] > 1 for selected in row["selected_per_layout"])


# -- the folder in this process ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder_module(tmp_path_factory):
    """The page's folder loaded as ``verl_klcov_global.methods.top_advantages`` (its row not yet registered)."""
    folder = write_folder(tmp_path_factory.mktemp("methods"))
    name = f"verl_klcov_global.methods.{FOLDER}"
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py", submodule_search_locations=[str(folder)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    try:
        yield name
    finally:
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]


@pytest.fixture
def new_mode(folder_module):
    row = importlib.reload(importlib.import_module(f"{folder_module}.row")) if f"{folder_module}.row" in sys.modules \
        else importlib.import_module(f"{folder_module}.row")
    plugin.install()  # what the entry point runs: registers every mode of the table
    try:
        yield row.TOP_ADVANTAGES
    finally:
        unregister_mode(NAME)
        POLICY_LOSS_REGISTRY.pop(NAME, None)


def _actor_config(mode, ratio=RATIO):
    if mode != NAME:
        return _tiny.make_actor_config(loss_mode=mode)
    config_class = MODES[NAME].config_class
    return _tiny.make_actor_config(policy_loss=config_class(top_advantages_ratio=ratio))


def test_the_row_is_registered_in_verls_registry(new_mode):
    assert get_policy_loss_fn(NAME) is new_mode.policy_loss
    assert new_mode.policy_loss.__name__ == f"compute_policy_loss_{NAME}"
    assert global_mode_of(_actor_config(NAME)) is new_mode
    assert new_mode.knobs == ("top_advantages_ratio", "prepass_layout")


def test_without_the_row_nothing_knows_the_mode():
    assert NAME not in MODES and NAME not in POLICY_LOSS_REGISTRY
    assert driver.check_trainer_config(trainer.compose_trainer_config(
        [f"actor_rollout_ref.actor.policy_loss.loss_mode={NAME}"], plugin_config=False)) is None


def test_the_driver_checks_its_knob_and_strategy(new_mode):
    target = f"{new_mode.config_class.__module__}.{new_mode.config_class.__name__}"

    def compose(*overrides):
        return trainer.compose_trainer_config(
            [f"actor_rollout_ref.actor.policy_loss.loss_mode={NAME}",
             f"actor_rollout_ref.actor.policy_loss._target_={target}", *overrides], plugin_config=False)

    assert driver.check_trainer_config(compose()) == NAME
    with pytest.raises(driver.TrainerConfigError,
                       match=rf"loss_mode={NAME}: top_advantages_ratio must be finite and in \(0, 1\]"):
        driver.check_trainer_config(compose("+actor_rollout_ref.actor.policy_loss.top_advantages_ratio=2"))
    with pytest.raises(driver.TrainerConfigError, match=rf"loss_mode={NAME} supports verl's FSDP engine only.*"
                                                        r"actor_rollout_ref.actor.strategy=fsdp2.*another loss mode"):
        driver.check_trainer_config(compose("actor_rollout_ref.actor.strategy=megatron"))


def test_the_loss_takes_its_mask_from_the_channel(new_mode):
    torch.manual_seed(0)
    advantages = torch.randn(4, 6)
    old, new = torch.randn(4, 6), torch.randn(4, 6)
    response_mask = torch.ones(4, 6, dtype=torch.bool)
    config = _actor_config(NAME, 0.25)
    with pytest.raises(RuntimeError, match=f"loss_mode={NAME} was called without a precomputed selection mask"):
        get_policy_loss_fn(NAME)(old, new, advantages, response_mask, config=config)
    mask = advantages >= advantages.flatten().topk(6).values[-1]
    with provide_selection_mask(mask, {"quota": 6.0}):
        _, metrics = get_policy_loss_fn(NAME)(old, new, advantages, response_mask, config=config)
    assert metrics[f"{PREFIX}selected_in_micro_batch"] == 6 and metrics[f"{PREFIX}quota"] == 6


@pytest.mark.slow
def test_the_real_engine_runs_prepass_mask_loss_identically_for_1_and_8_micro_batches(new_mode, tiny_model_path):
    spec = EngineSpec(tiny_model_path)
    batch = frozen_minibatch(spec, 3, batch_size=16, prompt_len=8, response_len=32)
    results = run_block(spec, batch, static_layouts(16, 8), _actor_config, modes=("vanilla", NAME))
    ours, control = results[NAME], results["vanilla"]
    valid = int(padded(batch["response_mask"]).sum())
    assert ours.masks_identical is True
    assert ours.selected_per_layout == (ratio_quota(valid, RATIO),) * 2 and ratio_quota(valid, RATIO) > 1
    assert control.max_param_diff > 0, "no noise floor: the comparison proves nothing"
    assert ours.max_param_diff <= NOISE_FACTOR * control.max_param_diff, (ours.max_param_diff, control)


@pytest.mark.slow
def test_the_engines_mask_holds_the_largest_advantages_and_the_metrics_carry_the_prefix(new_mode, tiny_model_path):
    import functools

    from verl.workers.utils.losses import ppo_loss

    from verl_klcov_global.engine.step import observe_selections

    spec = EngineSpec(tiny_model_path)
    batch = frozen_minibatch(spec, 4, batch_size=16, prompt_len=8, response_len=32)
    engine = spec.build()
    results = []
    data = static_layouts(16, 4)[1].apply(batch.copy())
    loss_function = functools.partial(ppo_loss, config=_actor_config(NAME))
    with observe_selections(lambda _engine, result: results.append(result)), engine.train_mode():
        output = engine.train_batch(data, loss_function=loss_function)
    (result,) = results
    mask, advantages = result.selection.mask, padded(batch["advantages"])
    valid = padded(batch["response_mask"]).bool()
    assert result.mode is new_mode and int(mask.sum()) == ratio_quota(int(valid.sum()), RATIO)
    assert not (mask & ~valid).any()
    assert advantages[mask].min() >= advantages[valid & ~mask].max()  # exactly the largest advantages
    metrics = output["metrics"]
    assert sum(metrics[f"{PREFIX}selected_in_micro_batch"].values) == int(mask.sum())
    assert f"{PREFIX}prepass_seconds" in metrics and f"{PREFIX}quota" in metrics
