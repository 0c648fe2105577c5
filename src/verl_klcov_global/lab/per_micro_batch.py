"""The lab's comparators: the authors' per-loss-call rules of the global modes that verl has no counterpart of.

A comparator (:class:`verl_klcov_global.per_call.Comparator`) is a verl policy loss that selects inside each loss
call, i.e. per training micro-batch, as the authors' code does; ``diagnose`` and the experiment run it beside its
global mode to show what the global selection changes. Each lives in its method's folder
(``methods/<name>/authors.py``, named ``COMPARATOR``), which the method's row names in ``ModeSpec.comparator``.
Only the lab imports and registers them (:func:`comparator_of`, :func:`register`), in-process; the plugin and its
entry point never do. The micro-batch's entropy and proxy reach a comparator through the blocks of
:mod:`verl_klcov_global.per_call`, re-exported here.

What a comparator's loss call reads beyond verl's arguments, this module provides per micro-batch:

* ``reads="entropy"``: the micro-batch's entropy. A registered policy loss never sees entropy, but verl's
  ``ppo_loss`` gets ``model_output["entropy"]`` when the micro-batch's ``calculate_entropy`` is set; the lab's loss
  function (:func:`ppo_loss_with_entropy`) converts it to the padded layout with verl's ``no_padding_2_padding`` and
  calls ``ppo_loss`` inside :func:`provide_micro_batch_entropy`; the comparator reads :func:`micro_batch_entropy`.
* ``reads="proxy"``: the proxy log-probs held from verl's log-prob pass, a per-token field
  (:data:`~verl_klcov_global.mode_config.PROXY_FIELD`) of the minibatch that verl's split slices; read through
  :func:`provide_micro_batch_proxy` / :func:`micro_batch_proxy`.
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

from ..mode_config import PROXY_FIELD
from ..per_call import (
    Comparator,
    MicroBatchEntropyUnavailableError,
    MicroBatchProxyUnavailableError,
    micro_batch_entropy,
    micro_batch_proxy,
    provide_micro_batch_entropy,
    provide_micro_batch_proxy,
)

__all__ = [
    "Comparator",
    "MicroBatchEntropyUnavailableError",
    "MicroBatchProxyUnavailableError",
    "comparator_of",
    "micro_batch_entropy",
    "micro_batch_proxy",
    "ppo_loss_with_entropy",
    "provide_micro_batch_entropy",
    "provide_micro_batch_proxy",
    "register",
    "selected_metrics",
]


#: The comparators :func:`register` put in verl's registry in this process, by name.
_REGISTERED: dict[str, Comparator] = {}


def comparator_of(mode: Any) -> Optional[Comparator]:
    """The :class:`Comparator` of a :class:`~verl_klcov_global.modes.ModeSpec` (its ``comparator`` module's
    ``COMPARATOR``, imported here, in the lab only), else None."""
    if mode.comparator is None:
        return None
    return importlib.import_module(mode.comparator).COMPARATOR


def register(comparator: Comparator) -> str:
    """Register ``comparator`` in verl's ``POLICY_LOSS_REGISTRY`` in this process (idempotent); returns its name."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss

    if POLICY_LOSS_REGISTRY.get(comparator.name) is not comparator.loss:
        register_policy_loss(comparator.name)(comparator.loss)
    _REGISTERED[comparator.name] = comparator
    return comparator.name


def selected_metrics() -> tuple[str, ...]:
    """Every registered comparator's selected-count metric (what the lab's counting loss function reads)."""
    return tuple(comparator.selected_metric for comparator in _REGISTERED.values())


def ppo_loss_with_entropy(config, model_output, data, dp_group=None):
    """verl's ``ppo_loss``; for a registered comparator, inside the block that hands it what it reads: this
    micro-batch's entropy (``model_output["entropy"]``, padded as ``ppo_loss`` pads it) or its proxy slice."""
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    loss_mode = config.policy_loss.get("loss_mode", "vanilla")
    comparator = _REGISTERED.get(loss_mode)
    if comparator is None or comparator.reads is None:
        return ppo_loss(config, model_output, data, dp_group)
    if comparator.reads == "proxy":  # the proxy held from the log-prob pass, a per-token field of the minibatch
        from ..layout import micro_batch_values

        if PROXY_FIELD not in data.keys():
            raise MicroBatchProxyUnavailableError(
                f"loss_mode={loss_mode}: the micro-batch has no {PROXY_FIELD} field "
                "(verl_klcov_global.lab.experiment.one_update stores it)")
        with provide_micro_batch_proxy(micro_batch_values(data, PROXY_FIELD)):
            return ppo_loss(config, model_output, data, dp_group)
    entropy = model_output.get("entropy", None)
    if entropy is None:
        raise MicroBatchEntropyUnavailableError(
            f"loss_mode={loss_mode}: the engine computed no entropy for this micro-batch; set the minibatch's "
            f"non-tensor key calculate_entropy=True (verl_klcov_global.lab.experiment.one_update does)"
        )
    with provide_micro_batch_entropy(no_padding_2_padding(entropy, data).detach()):
        return ppo_loss(config, model_output, data, dp_group)
