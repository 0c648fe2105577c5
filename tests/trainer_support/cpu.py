"""Make verl's Ray trainer and workers run on CPU in the current process (test-only).

Called from :mod:`.verl_cpu_plugin` on ``import verl`` in every Ray process.

* The CPU platform, the "cpu" engine registration and the FSDP1 CPU patch come
  from ``src/verl_klcov_global/lab/cpu.py``, loaded from its file under another
  module name: importing ``verl_klcov_global.lab.cpu`` would import the plugin
  package (its ``__init__`` registers the loss and installs the hook), and the
  end-to-end test must prove that the *entry point alone* loads the plugin.
* PATCH ``gloo-process-group`` (verl 0.9.1 ``utils/distributed.py``
  ``initialize_global_process_group_ray`` ~83): verl builds the backend string
  ``f"cpu:gloo,{device}:{backend}"``, i.e. ``"cpu:gloo,cpu:gloo"`` on the CPU
  platform, which torch rejects. On CPU the default becomes plain ``"gloo"``.
* The CPU rollout (:mod:`.rollout`) is registered under ``cpu_random``.
* With ``KLCOV_STEP_RECORD_DIR`` set, every optimizer step is recorded (:mod:`.step_recorder`).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from types import ModuleType

from .env import REPO_ROOT

_HARNESS_MODULE = "_verl_klcov_global_cpu_harness"
_PATCHED = "__trainer_support_gloo__"


def cpu_harness() -> ModuleType:
    """``verl_klcov_global/lab/cpu.py`` as a standalone module; the package itself is not imported."""
    if _HARNESS_MODULE in sys.modules:
        return sys.modules[_HARNESS_MODULE]
    # This repository's copy: the CPU support must not depend on which ``verl_klcov_global`` a Ray
    # process can import (tests/test_driver_loading.py shadows it with a broken one).
    path = os.path.join(REPO_ROOT, "src", "verl_klcov_global", "lab", "cpu.py")
    spec = importlib.util.spec_from_file_location(_HARNESS_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_HARNESS_MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_HARNESS_MODULE]
        raise
    return module


def _patch_process_group_init() -> None:
    """PATCH gloo-process-group: plain "gloo" for verl's worker process group on the CPU platform."""
    from verl.utils import distributed

    original = distributed.initialize_global_process_group_ray
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        from verl.utils.device import get_device_name

        if backend is None and get_device_name() == "cpu":
            backend = "gloo"
        return original(timeout_second=timeout_second, backend=backend)

    setattr(initialize_global_process_group_ray, _PATCHED, True)
    distributed.initialize_global_process_group_ray = initialize_global_process_group_ray
    # Modules that imported the name before the patch (``from ... import``) keep the old one.
    for name in ("verl.workers.engine_workers", "verl.checkpoint_engine.base"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "initialize_global_process_group_ray"):
            module.initialize_global_process_group_ray = initialize_global_process_group_ray


def install() -> None:
    """CPU platform + gloo process groups + the ``cpu_random`` rollout [+ step records], in this process."""
    cpu_harness().install_cpu_platform()
    _patch_process_group_init()
    from ..support import company_noise

    company_noise.install_if_requested()
    from . import rollout, step_recorder

    rollout.register()
    step_recorder.install()
