"""The plugin's command starts quietly (``quiet_start.py``): which processes it hides verl's import warnings in.

Fast: the detection on argv shapes, and that the quiet period hides and then restores. The two real
routes (console script, ``python -m``) in fresh interpreters are in tests/test_cli.py.
"""

from __future__ import annotations

import logging
import warnings

import pytest

from verl_klcov_global.quiet_start import is_plugin_command, quiet_verl_import, wants_quiet_start


@pytest.mark.parametrize("argv, orig_argv, expected", [
    (["/venv/bin/verl-klcov-global", "diagnose"], None, True),  # the console script
    (["verl-klcov-global"], None, True),
    (["-m", "diagnose"], ["/venv/bin/python", "-m", "verl_klcov_global", "diagnose"], True),  # python -m, mid-import
    (["-m", "diagnose"], ["python3", "-X", "dev", "-m", "verl_klcov_global", "diagnose"], True),
    (["-m", "diagnose"], ["python3", "-mverl_klcov_global", "diagnose"], True),
    (["-m"], ["python", "-m", "verl.trainer.main_ppo"], False),  # someone else's module
    (["-m"], ["python", "-m", "verl_klcov_global.lab"], False),
    (["/venv/lib/python3.11/site-packages/ray/_private/workers/default_worker.py"], None, False),  # a Ray worker
    (["/venv/bin/pytest", "-q"], None, False),
    (["-c"], ["python", "-c", "import verl_klcov_global"], False),
    ([], None, False),
])
def test_only_the_plugins_own_command_is_recognised(argv, orig_argv, expected):
    assert is_plugin_command(argv, orig_argv) is expected


def test_verbose_keeps_the_warnings():
    assert wants_quiet_start(["/venv/bin/verl-klcov-global", "diagnose"], []) is True
    assert wants_quiet_start(["/venv/bin/verl-klcov-global", "diagnose", "--verbose"], []) is False
    assert wants_quiet_start(["-m", "diagnose", "--verbose"], ["python", "-m", "verl_klcov_global", "diagnose",
                                                              "--verbose"]) is False


def test_the_quiet_period_hides_warnings_and_logs_then_restores_them(caplog):
    logger = logging.getLogger("verl_klcov_global.test_quiet_start")
    before = logging.root.manager.disable
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet = quiet_verl_import(["/venv/bin/verl-klcov-global", "diagnose"], [])
        warnings.warn("hidden while quiet", UserWarning)
        logger.warning("hidden while quiet")
        logger.error("errors still show")
        quiet.close()
        warnings.warn("shown after the close", UserWarning)
        logger.warning("shown after the close")
    assert [str(w.message) for w in seen] == ["shown after the close"]
    assert [r.getMessage() for r in caplog.records] == ["errors still show", "shown after the close"]
    assert logging.root.manager.disable == before


def test_any_other_process_is_left_alone(caplog):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet = quiet_verl_import(["/venv/bin/pytest"], [])
        warnings.warn("shown", UserWarning)
        logging.getLogger("verl_klcov_global.test_quiet_start").warning("shown")
        quiet.close()
    assert [str(w.message) for w in seen] == ["shown"] and [r.getMessage() for r in caplog.records] == ["shown"]
