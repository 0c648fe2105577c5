"""One version string, one true install hint (the package is on no index), docs that do not say otherwise."""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

import verl_klcov_global
from verl_klcov_global.install_hint import INSTALL_HINT

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = None


def test_version_is_pyprojects_read_from_the_installed_metadata():
    assert verl_klcov_global.__version__ == metadata.version("verl-klcov-global")
    if tomllib is not None:
        project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
        assert "version" in project and verl_klcov_global.__version__ == project["version"]
    # the only place the version is written: no literal copy in the package
    literal = re.compile(r"__version__\s*=\s*['\"]\d")
    assert not [p for p in (REPO / "src").rglob("*.py") if literal.search(p.read_text())]


def test_changelog_has_this_release():
    changelog = (REPO / "CHANGELOG.md").read_text()
    for version in ("0.1.0", "0.2.0", verl_klcov_global.__version__):
        assert re.search(rf"^## {re.escape(version)}\b", changelog, re.M), version


def test_the_install_hint_says_the_package_is_on_no_index_and_how_to_install():
    assert "not on any package index" in INSTALL_HINT
    for route in ("pip install /path/to/verl-klcov-global", "pip wheel --no-deps", "git+"):
        assert route in INSTALL_HINT, route


def test_no_file_claims_the_package_is_on_an_index():
    """`pip install verl-klcov-global` (a name, as from PyPI) appears nowhere: it cannot work."""
    claim = re.compile(r"pip install ['\"]?verl-klcov-global(?![\w/-])")
    files = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "src").rglob("*.py"),
             *(REPO / "examples").glob("*.sh"), *(REPO / "scripts").glob("*.sh")]
    offenders = [f"{p.relative_to(REPO)}:{n}" for p in files if p.is_file()
                 for n, line in enumerate(p.read_text().splitlines(), 1) if claim.search(line)]
    assert not offenders, offenders


def test_readme_commands_are_the_ones_ci_runs():
    readme, ci = (REPO / "README.md").read_text(), (REPO / ".ci" / "run").read_text()
    tests = "bash scripts/setup.sh --real-model && .venv/bin/python -m pytest -q"
    assert tests in readme and tests in ci
    assert "bash scripts/setup.sh && .venv/bin/verl-klcov-global diagnose" in readme
    assert ".venv/bin/verl-klcov-global diagnose" in ci and "bash scripts/test_wheel.sh" in ci
    assert "dist/verl_klcov_global-*.whl" in readme  # a glob: the README names no version


def test_every_packaged_config_is_package_data_and_selects_a_mode_of_the_table():
    """pyproject's package-data glob ships each configs/*.yaml (the wheel job checks the built wheel too)."""
    from verl_klcov_global.configs import CONFIG_DIR, CONFIG_NAMES
    from verl_klcov_global.modes import MODES

    if tomllib is not None:
        globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
        assert "configs/*.yaml" in globs["verl_klcov_global"]
    assert sorted(CONFIG_NAMES) == sorted(MODES)  # one config per mode of the table
    for name in CONFIG_NAMES:
        text = (Path(CONFIG_DIR) / f"{name}.yaml").read_text()
        assert f"loss_mode: {name}" in text and f"--config-name={name}" in text, name
