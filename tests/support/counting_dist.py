"""A stand-in for ``torch.distributed`` that records every collective: what the selection tests and
``benchmarks/bench_exchange.py`` count (one copy, here in test support; the benchmarks run from a
checkout, where ``tests.support`` is importable)."""

from __future__ import annotations

import torch.distributed as dist


class CountingDist:
    """Stand-in for ``torch.distributed`` that records every collective (name, bytes this rank contributes)."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def __getattr__(self, name):
        return getattr(dist, name)

    def all_reduce(self, tensor, *args, **kwargs):
        self.calls.append(("all_reduce", tensor.numel() * tensor.element_size()))
        return dist.all_reduce(tensor, *args, **kwargs)

    def all_gather(self, outputs, tensor, *args, **kwargs):
        self.calls.append(("all_gather", tensor.numel() * tensor.element_size()))
        return dist.all_gather(outputs, tensor, *args, **kwargs)

    def __getstate__(self):  # pragma: no cover - never pickled
        raise TypeError("CountingDist is process-local")
