"""A test-only ``ActorRolloutRefWorker`` that reports the plugin's prepasses from inside its Ray process.

``ObservedActorRolloutRefWorker`` is verl 0.9.1's ``ActorRolloutRefWorker``, unchanged, plus:

* it enters ``verl_klcov_global.step.observe_selections`` for its whole life, so every prepass
  the hook runs in this process is recorded (process id, rows, quota, selected count, the
  prepass's duration);
* ``prepass_records()`` returns them (one list per worker) and ``reset_prepass_records()``
  clears them, both over Ray like any other worker method;
* ``hook_installed()`` tells whether the plugin's hook is active in the worker process;
  ``uninstall_hook()`` removes it (to check that a missing hook fails loudly).
"""

from __future__ import annotations

import contextlib
import os

from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.engine_workers import ActorRolloutRefWorker

from verl_klcov_global.engine import patches as engine_patches, step as engine_step


class ObservedActorRolloutRefWorker(ActorRolloutRefWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._prepasses: list[dict] = []
        self._observing = contextlib.ExitStack()
        self._observing.enter_context(engine_step.observe_selections(self._record_prepass))

    def _record_prepass(self, engine, result) -> None:
        selection = result.selection
        self._prepasses.append(
            dict(
                pid=os.getpid(),
                rank=self.rank,
                rows=int(selection.mask.shape[0]),
                quota=int(selection.quota),
                selected=int(selection.mask.sum()),
                prepass_seconds=float(result.prepass_seconds),
            )
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def prepass_records(self) -> list[dict]:
        return list(self._prepasses)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def reset_prepass_records(self) -> None:
        self._prepasses.clear()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def hook_installed(self) -> bool:
        return engine_patches.is_hook_installed()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def uninstall_hook(self) -> None:
        engine_patches.uninstall_hook()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def install_hook(self) -> None:
        engine_patches.install_hook()
