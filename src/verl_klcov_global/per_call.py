"""The authors' per-loss-call rules (each method's ``authors.py``, the lab's comparators): what one is, and what its
loss call reads beyond verl's arguments.

A comparator is a verl policy loss that selects inside each loss call, i.e. per training micro-batch, as the
authors' code does. Only the lab imports and registers one (:mod:`verl_klcov_global.lab.per_micro_batch`); the
blocks here hand its loss call the micro-batch's entropy or proxy log-probs, which verl's policy-loss signature does
not carry. Pure torch and the standard library.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

__all__ = [
    "Comparator",
    "MicroBatchEntropyUnavailableError",
    "MicroBatchProxyUnavailableError",
    "micro_batch_entropy",
    "micro_batch_proxy",
    "provide_micro_batch_entropy",
    "provide_micro_batch_proxy",
]


@dataclass(frozen=True)
class Comparator:
    """One authors' per-loss-call rule as the lab runs it.

    * ``name``: its lab-only ``policy_loss.loss_mode`` (the global mode's ``ModeSpec.upstream``);
    * ``loss``: the verl policy loss (verl's signature: ``old_log_prob, log_prob, advantages, response_mask,
      loss_agg_mode, config, rollout_is_weights``);
    * ``config_class``: its ``policy_loss`` config class (the global mode's class with this ``loss_mode``, so its
      knobs are the mode's, written once);
    * ``selected_metric``: the metric that counts the tokens it selected in one micro-batch;
    * ``reads``: what its loss call reads beyond verl's arguments: ``"entropy"``, ``"proxy"`` or None.
    """

    name: str
    loss: Callable[..., tuple[torch.Tensor, dict[str, Any]]]
    config_class: type
    selected_metric: str
    reads: Optional[str] = None

    def __post_init__(self):
        if self.reads not in (None, "entropy", "proxy"):
            raise ValueError(f"{self.name}: reads must be None, 'entropy' or 'proxy', got {self.reads!r}")


class MicroBatchEntropyUnavailableError(RuntimeError):
    """A comparator that reads entropy was called without the micro-batch's entropy."""


class MicroBatchProxyUnavailableError(RuntimeError):
    """A comparator that reads the proxy was called without its micro-batch's proxy log-probs."""


_ENTROPY: contextvars.ContextVar[Optional[torch.Tensor]] = contextvars.ContextVar(
    "verl_klcov_global_lab_micro_batch_entropy", default=None
)
_PROXY: contextvars.ContextVar[Optional[torch.Tensor]] = contextvars.ContextVar("verl_klcov_global_lab_proxy",
                                                                                default=None)


@contextlib.contextmanager
def provide_micro_batch_entropy(entropy: torch.Tensor) -> Iterator[None]:
    """Make ``entropy`` (batch, response_len), aligned with the loss's ``response_mask``, the entropy
    a comparator reads inside this block."""
    token = _ENTROPY.set(entropy)
    try:
        yield
    finally:
        _ENTROPY.reset(token)


@contextlib.contextmanager
def provide_micro_batch_proxy(proxy: torch.Tensor) -> Iterator[None]:
    """Make ``proxy`` ((batch, response_len) log pi_proxy) the one a comparator's loss call reads."""
    token = _PROXY.set(proxy)
    try:
        yield
    finally:
        _PROXY.reset(token)


def micro_batch_entropy() -> Optional[torch.Tensor]:
    """The entropy of a :func:`provide_micro_batch_entropy` block around this call, else None."""
    return _ENTROPY.get()


def micro_batch_proxy() -> Optional[torch.Tensor]:
    """The proxy log-probs of a :func:`provide_micro_batch_proxy` block around this call, else None."""
    return _PROXY.get()
