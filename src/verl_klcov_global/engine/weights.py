"""The weights version of an engine: a counter bumped by every write of its parameters the plugin can see.

Statistics kept from verl's log-prob pass (:mod:`.kept_pass`) are the current policy's only while the
parameters are those that pass ran with. Every engine the plugin keeps statistics for is tracked here:

* an optimizer step bumps it (torch's ``Optimizer.register_step_post_hook`` on the engine's optimizer: every
  step, whoever makes it);
* a ``load_state_dict`` of the engine's module bumps it (``register_load_state_dict_post_hook``: verl's
  checkpoint load);
* verl's sharded weight restore of ``separate_async`` / fully async training bumps it (PATCH
  ``weight_restore_bumps_version``, :mod:`.patches`: :func:`weights_restored`);
* a rebuilt module or optimizer (``engine.initialize()``) is seen by identity, and starts a new version.

A bump frees the kept statistics at once, unless they are *held* for the whole update (``prepass_layout=old``'s
entropy, Lp-Reg's proxy: pi_old's statistics, which every optimizer step of the update reads); the version still
moves, so a held pass is never reused as the current policy's after the bump. Anything else that writes the
parameters in place between the pass and the update is not seen (nothing in verl's trainers does).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["EngineState", "state_of", "tracked_state", "weights_changed", "weights_restored", "weights_version"]


@dataclass
class EngineState:
    """Per engine: its weights version, the objects it is hooked on, and what is kept of verl's last log-prob pass
    (a :class:`.kept_pass.KeptPass`, or None and why not)."""

    module: Any  # weakref.ref to the module the hooks are on
    optimizer: Any  # weakref.ref to the optimizer the hooks are on
    handles: list = field(default_factory=list)
    version: int = 0
    kept: Any = None
    missing: str = "no log-prob pass kept yet"  # why nothing is kept now (what a look-up then reports)
    reason: str = "no look-up yet"  # the last reuse look-up's outcome: "reused" or its first mismatch

    def is_current_for(self, engine) -> bool:
        """The state was hooked on the engine's current module and optimizer (not rebuilt since)."""
        return self.module() is getattr(engine, "module", None) and self.optimizer() is getattr(engine, "optimizer",
                                                                                                 None)


_STATES: "weakref.WeakKeyDictionary[Any, EngineState]" = weakref.WeakKeyDictionary()


def state_of(engine) -> Optional[EngineState]:
    """The engine's state, or None when the plugin never kept anything for it."""
    return _STATES.get(engine)


def weights_version(engine) -> int:
    """The engine's weights version (0 until the plugin first kept statistics for it)."""
    state = _STATES.get(engine)
    return 0 if state is None else state.version


def weights_changed(engine, why: str) -> None:
    """Bump the engine's weights version and free its kept statistics, unless they are held for the update."""
    state = _STATES.get(engine)
    if state is None:
        return
    state.version += 1
    if state.kept is not None and state.kept.held:
        return  # pi_old's statistics, read by every optimizer step of the update
    if state.kept is not None:
        state.missing = f"the weights changed after verl's log-prob pass ({why})"
    state.kept = None


def weights_restored(module) -> None:
    """Someone wrote ``module``'s parameters (verl's sharded restore): bump every engine that holds it."""
    for engine, state in list(_STATES.items()):
        if state.module() is module:
            weights_changed(engine, "weights restored from a CPU copy")


def _bumper(engine, why: str):
    engine_ref = weakref.ref(engine)

    def hook(*_args, **_kwargs) -> None:
        engine = engine_ref()
        if engine is not None:
            weights_changed(engine, why)

    return hook


def tracked_state(engine) -> Optional[EngineState]:
    """The engine's state, hooked on its current module and optimizer (re-hooked, with a new version, when they
    were rebuilt); None for an engine without both (nothing can be tracked, so nothing is kept)."""
    module, optimizer = getattr(engine, "module", None), getattr(engine, "optimizer", None)
    if module is None or optimizer is None or not hasattr(optimizer, "register_step_post_hook") \
            or not hasattr(module, "register_load_state_dict_post_hook"):
        return None
    state = _STATES.get(engine)
    if state is not None and state.is_current_for(engine):
        return state
    version = 0
    if state is not None:  # engine.initialize() built new objects: what was kept is someone else's
        for handle in state.handles:
            handle.remove()
        version = state.version + 1
    state = EngineState(module=weakref.ref(module), optimizer=weakref.ref(optimizer), version=version)
    state.handles = [
        optimizer.register_step_post_hook(_bumper(engine, "optimizer step")),
        module.register_load_state_dict_post_hook(_bumper(engine, "load_state_dict: a checkpoint load")),
    ]
    _STATES[engine] = state
    return state
