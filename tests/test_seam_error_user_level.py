"""A moved verl seam, as a user meets it: the plugin's seam error comes first, in the driver and in a Ray worker.

The plugin is loaded by its ``verl.plugins`` entry point (the default route), where verl's loader catches
the plugin's exception and logs it at DEBUG. A ``sitecustomize.py`` on ``PYTHONPATH`` (:data:`MOVE_TRAIN_BATCH`)
moves one seam the way a future verl could: ``BaseEngine.train_batch`` gains a parameter right after verl
defines it, before the plugin checks it. Nothing of the plugin is mocked.

* driver: a real ``python -m verl.trainer.main_ppo`` with ``loss_mode=kl_cov_global`` stops before Ray
  starts; the first error line is the seam error, the last exception is the same error, no install hint and
  no ``Unsupported loss mode``;
* Ray workers: the same message, from a worker that loads verl through the entry point and looks the loss up
  as verl's ``ppo_loss`` does, and from a worker that loads the plugin through the driver's worker loader
  (``VERL_USE_EXTERNAL_MODULES=verl_klcov_global_loader``, with the install hint the driver ships): the loader
  passes the seam error on instead of its "cannot import it ... install" message.

``tests/test_seams.py`` checks each seam in-process, the message text, and the import of the package
over a moved seam; these tests check what reaches the user on the route where verl swallows that error.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

import verl

from verl_klcov_global.driver import WORKER_LOADER_DIR
from verl_klcov_global.install_hint import INSTALL_HINT

from .trainer_support.e2e import ray_started
from .trainer_support.env import INHERITED_ENV_TO_DROP, REPO_ROOT

pytestmark = [pytest.mark.slow,  # fresh interpreters (and a local Ray cluster)
              pytest.mark.needs_entry_point_group, pytest.mark.needs_driver_validate_config]

#: Moves one seam after verl defines it: ``BaseEngine.train_batch(self, data, loss_function, extra=None)``.
MOVE_TRAIN_BATCH = '''
import importlib.machinery
import sys


class _MoveTrainBatch:
    def find_spec(self, name, path=None, target=None):
        if name != "verl.workers.engine.base":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        exec_module = spec.loader.exec_module

        def exec_and_move(module):
            exec_module(module)
            original = module.BaseEngine.train_batch

            def train_batch(self, data, loss_function, extra=None):
                return original(self, data, loss_function)

            module.BaseEngine.train_batch = train_batch

        spec.loader.exec_module = exec_and_move
        return spec


sys.meta_path.insert(0, _MoveTrainBatch())
'''

ERROR_NAME = "verl_klcov_global.seams.VerlSeamError"
#: A line that starts an error: an exception's name and a colon (a traceback's last line), or Hydra's
#: "Error executing job". verl's import warnings mention ``ModuleNotFoundError(...)`` mid-line only.
_ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception)\b:|Error\b)")
#: What must never be said about a moved seam: it is not a missing install.
_WRONG_ADVICE = (INSTALL_HINT, "cannot import it", "needs the plugin in every Ray process", "Unsupported loss mode",
                 "Are you sure that module")


def _env(tmp_path, *extra_path: str) -> dict[str, str]:
    site = tmp_path / "moved_seam"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(MOVE_TRAIN_BATCH)
    env = {k: v for k, v in os.environ.items() if k not in INHERITED_ENV_TO_DROP}
    env.update(PYTHONPATH=os.pathsep.join([str(site), *extra_path]), OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", RAY_DEDUP_LOGS="0", HYDRA_FULL_ERROR="0")
    return env


def _check_message(message: str) -> None:
    """The seam error's content: the seam and what was found, the verl found, the versions known to work, the fix."""
    assert message.startswith("verl-klcov-global "), message
    assert (f"cannot run on the verl it found (verl {verl.__version__} at "
            f"{os.path.dirname(os.path.abspath(verl.__file__))})") in message, message
    assert ("  - verl.workers.engine.base.BaseEngine.train_batch(self, data, loss_function): "
            "found parameters ['self', 'data', 'loss_function', 'extra']") in message, message
    assert "1 seam(s)" in message and "Known to work: verl 0.8.0, 0.9.1." in message, message
    assert 'pin a verl known to work (pip install "verl==0.9.1")' in message, message
    assert "or upgrade verl-klcov-global" in message, message


def _first_error_line(output: str) -> str:
    return next((line for line in output.splitlines() if _ERROR_LINE.match(line)), "")


def _exception_text(output: str, start: int) -> str:
    """The seam error's text that starts at ``output[start:]`` (its name, its lines up to the fix)."""
    end = output.index("supports this verl.", start) + len("supports this verl.")
    return output[start:end]


def test_main_ppo_driver_shows_the_seam_error_first_and_stops_before_ray(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo",
                           "actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov_global"],
                          cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode != 0, out[-3000:]
    first = _first_error_line(out)
    assert first.startswith(f"{ERROR_NAME}: verl-klcov-global "), out[-3000:]  # written at load, before Hydra
    printed = _exception_text(out, out.index(first))
    _check_message(printed[len(ERROR_NAME) + 2:])
    # main_ppo's own error (validate_config, in the driver) is the same text, once more; nothing else failed.
    assert out.count(printed) == 2 and out.rstrip().endswith("for a complete stack trace."), out[-3000:]
    assert [line for line in out.splitlines() if _ERROR_LINE.match(line)] == [
        first, "Error executing job with overrides: ['actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov_global']",
        first], out[-3000:]
    for wrong in _WRONG_ADVICE:
        assert wrong not in out, (wrong, out[-3000:])
    assert not ray_started(out), out[-3000:]  # stopped before run_ppo's ray.init


_WORKERS = """
import json, os, sys
import ray

def probe():
    import contextlib, io, os
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            import verl  # entry point (and VERL_USE_EXTERNAL_MODULES where set)
            from verl.trainer.ppo.core_algos import get_policy_loss_fn
            # what verl's ppo_loss does at the first actor update
            get_policy_loss_fn("kl_cov_global")(old_log_prob=None, log_prob=None, advantages=None, response_mask=None)
            error = None
        except Exception as e:
            error = f"{type(e).__module__}.{type(e).__qualname__}: {e}"
    return {"pid": os.getpid(), "stderr": err.getvalue(), "error": error}

driver = probe()
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
remote = ray.remote(num_cpus=1)(probe)
loader_env = {"VERL_USE_EXTERNAL_MODULES": "verl_klcov_global_loader",
              "VERL_KLCOV_GLOBAL_REQUIRED_BY": "actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov_global",
              "VERL_KLCOV_GLOBAL_INSTALL_HINT": sys.argv[1]}
workers = ray.get([remote.remote(), remote.options(runtime_env={"env_vars": loader_env}).remote()])
print("RESULT " + json.dumps({"driver": driver, "entry_point_worker": workers[0], "loader_worker": workers[1]}))
"""


def test_ray_workers_show_the_drivers_seam_error_first_without_install_hint(tmp_path):
    # The loader module is importable in the workers as Ray's py_modules makes it in a real run.
    env = _env(tmp_path, os.path.dirname(WORKER_LOADER_DIR), REPO_ROOT)
    proc = subprocess.run([sys.executable, "-c", _WORKERS, INSTALL_HINT], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(lines[-1][len("RESULT "):])
    driver = report["driver"]
    assert driver["error"] and driver["error"].startswith(f"{ERROR_NAME}: "), driver
    _check_message(driver["error"][len(ERROR_NAME) + 2:])
    assert _first_error_line(driver["stderr"]) == driver["error"].splitlines()[0], driver
    pids = {driver["pid"]}
    for route in ("entry_point_worker", "loader_worker"):
        view = report[route]
        assert view["pid"] not in pids, report  # a Ray worker process of its own
        pids.add(view["pid"])
        # the same error, word for word, as in the driver: first on the worker's stderr, then raised
        assert view["error"] == driver["error"], (route, view)
        assert _first_error_line(view["stderr"]) == driver["error"].splitlines()[0], (route, view["stderr"])
        assert view["stderr"].count(driver["error"]) == 1, (route, view["stderr"])  # written once per process
        for wrong in _WRONG_ADVICE:
            assert wrong not in view["error"] + view["stderr"], (route, wrong, view)
