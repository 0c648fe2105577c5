import os
import warnings

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
warnings.filterwarnings("ignore", message=".*engine is not available.*")


import functools
import random
import re
import socket
from pathlib import Path

import pytest

# -- pytest-xdist (pyproject's addopts: `-n 2 --dist loadscope --no-loadscope-reorder`) -----------------
# xdist's loadscope sends all of a module's tests to one worker. Here that holds only for a module that
# defines a module-scoped fixture (an engine, a Ray worker group, a trainer run): the fixture is then
# built once, as in a serial run. Every other test is a unit of its own and goes to whichever worker is
# free, so a module of long independent tests (tests/engine/test_engine_kl_cov.py) is spread over both;
# units are handed out in collection order, the long engine tests first. Each worker is one process
# among PYTEST_XDIST_WORKER_COUNT on this machine's cores: its torch gets its share of the threads, and
# the gloo rendezvous ports it picks come from a range no other worker uses.
# (xdist's own `loadgroup` marks cannot do the grouping with pytest 9.2: xdist 3.8 renames the node id
# through an attribute pytest no longer reads.)

_SHARED_FIXTURE = re.compile(r"""@pytest\.fixture\(\s*scope\s*=\s*["'](module|class|package)["']""")


@functools.lru_cache(maxsize=None)
def _shares_a_module_fixture(path: str) -> bool:
    """Whether the test file ``path`` (relative to the rootdir) defines a module-, class- or package-scoped fixture."""
    try:
        return bool(_SHARED_FIXTURE.search(Path(path).read_text()))
    except OSError:
        return True  # unknown: keep its tests together, as plain loadscope does


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown where xdist is not installed
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None  # any other --dist: xdist's own scheduler
    from xdist.scheduler import LoadScopeScheduling

    root = Path(str(config.rootpath))

    class ModuleFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if _shares_a_module_fixture(str(root / path)) else nodeid

    return ModuleFixtureScheduling(config, log)


#: Rendezvous ports for the workers: below Linux's ephemeral range (32768-60999), where the kernel
#: never hands out a port on its own, split into one disjoint slice per xdist worker.
PORT_BASE, PORT_SLICE = 20000, 1000


def _xdist_worker() -> tuple[int, int] | None:
    """(index, count) of this xdist worker, None outside xdist (a serial run, `-n 0`, `-p no:xdist`)."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not name.startswith("gw"):
        return None
    return int(name[2:]), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def _worker_port_allocator(index: int):
    """find_free_port for xdist worker ``index``: a port of its own slice, free now (bound and released).

    The slices are disjoint, so two workers cannot pick the same port whatever their timing (the
    kernel's own free-port pick, `bind(0)`, can hand one worker the port another has just released and
    not yet bound). Ports are taken in turn from a random start, so consecutive tests in a worker and
    concurrent runs of the suite in other checkouts do not reuse the same ones.
    """
    low = PORT_BASE + index * PORT_SLICE
    state = {"next": random.randrange(PORT_SLICE)}

    def find_free_port() -> int:
        for _ in range(PORT_SLICE):
            port = low + state["next"]
            state["next"] = (state["next"] + 1) % PORT_SLICE
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port
        raise RuntimeError(f"xdist worker {index}: no free port in {low}-{low + PORT_SLICE - 1}")

    return find_free_port


@pytest.fixture(scope="session", autouse=True)
def _xdist_worker_share():
    """In an xdist worker: torch's thread share of the cores, and the worker's own slice of ports."""
    worker = _xdist_worker()
    if worker is None:
        yield
        return
    index, count = worker
    if PORT_BASE + (index + 1) * PORT_SLICE > 32768:
        raise pytest.UsageError(f"{count} xdist workers: the port slices would reach Linux's ephemeral range")
    import torch

    from verl_klcov_global.lab import cpu as lab_cpu

    # Two workers on two cores with torch's default (one thread per core each) oversubscribe the cores.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // count))
    # lab.cpu.spawn and init_process_group_cpu look the name up in their module at call time.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lab_cpu, "find_free_port", _worker_port_allocator(index))
        yield


@pytest.fixture(scope="session", autouse=True)
def _company_noise_emulation():
    """``VERL_KLCOV_EMULATE_COMPANY_NOISE=1``: this process's logits follow their micro-batch company
    (:mod:`tests.support.company_noise`); spawned ranks and Ray processes install it themselves."""
    from .support import company_noise

    company_noise.install_if_requested()
    yield


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """A random tiny Qwen2 + tokenizer built locally (no hub), shared by the engine tests."""
    from verl_klcov_global.lab.tiny import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"))


#: Set by .ci/run: a test that needs the real pretrained model fails, instead of skipping, where it is not set up.
REQUIRE_REAL_MODEL_ENV = "VERL_KLCOV_REQUIRE_REAL_MODEL"


@pytest.fixture(scope="session")
def smollm2_path():
    """SmolLM2-135M-Instruct's fp32 HF folder (lab/real_model.py), converted on first use. Where the wheel is not
    installed (``bash scripts/setup.sh --real-model``), the test skips with the reason; under .ci/run
    (``VERL_KLCOV_REQUIRE_REAL_MODEL=1``) it fails instead."""
    from verl_klcov_global.lab import real_model

    try:
        return real_model.prepare(real_model.SMOLLM2)
    except real_model.RealModelError as error:
        if os.environ.get(REQUIRE_REAL_MODEL_ENV) == "1":
            pytest.fail(f"{REQUIRE_REAL_MODEL_ENV}=1 (.ci/run) and the real model is not available: {error}")
        pytest.skip(f"the real model is not set up here: {error}")
