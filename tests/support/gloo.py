"""The tests' one way to run code on several gloo ranks: :func:`spawn_gloo`."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator

import torch

from verl_klcov_global.lab import cpu as _cpu


def spawn_gloo(fn: Callable, world_size: int, *args: Any, verl_platform: bool = False) -> list[Any]:
    """``fn(rank, world_size, *args)`` in ``world_size`` spawned processes, each with torch.distributed
    (gloo, 127.0.0.1, a fresh port) initialised first; the ranks' return values, in rank order.

    ``verl_platform``: install verl's CPU platform and patches (:func:`verl_klcov_global.lab.cpu.
    install_cpu_platform`) before the process group, where the rank builds engines or verl's device
    helpers pick where a collective's tensor goes. ``fn`` must be a module-level function (it is pickled
    by name); an exception in any rank is raised here (see :func:`verl_klcov_global.lab.cpu.spawn`).
    """
    return _cpu.spawn(_gloo_rank, world_size, fn, verl_platform, args)


def rank_threads(world_size: int) -> int:
    """torch's thread count in each of :func:`spawn_gloo`'s ``world_size`` ranks (``lab.cpu``'s spawn sets it)."""
    return max(1, (os.cpu_count() or 1) // world_size)


@contextlib.contextmanager
def threads_of_a_rank(world_size: int) -> Iterator[None]:
    """This process's torch threads set to a rank's (:func:`rank_threads`) inside the block: a single-process
    reference whose forwards must be the ranks' computation (same rows, same company, same threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(rank_threads(world_size))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _gloo_rank(rank: int, world_size: int, port: int, fn: Callable, verl_platform: bool, args: tuple) -> Any:
    from . import company_noise

    company_noise.install_if_requested()
    if verl_platform:
        _cpu.install_cpu_platform()
    _cpu.init_process_group_cpu(rank, world_size, port)
    return fn(rank, world_size, *args)
