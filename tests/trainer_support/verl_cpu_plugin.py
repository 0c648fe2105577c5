"""``VERL_USE_EXTERNAL_MODULES=tests.trainer_support.verl_cpu_plugin``: verl imports this on ``import verl``
in every process of a Ray run (test-only; see :mod:`tests.trainer_support.cpu`)."""

from . import cpu

cpu.install()
