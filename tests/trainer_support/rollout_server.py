"""The Ray actor behind each ``cpu_random`` rollout replica (test-only; see :mod:`.rollout`).

Kept apart from :mod:`.rollout` and free of top-level verl imports: a fresh Ray process that
unpickles this class imports this module first, and ``import verl`` there loads the CPU support
(``VERL_USE_EXTERNAL_MODULES``), which imports :mod:`.rollout` -- a cycle if this module were it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any, Optional

_RESPONSES_MODULE = "_verl_klcov_global_random_responses"


def random_responses():
    """``experiments/random_responses.py`` of this checkout, loaded from its file: nothing else is
    imported (neither the plugin package -- the end-to-end test proves that only the entry point
    loads it -- nor ``experiments/__init__``)."""
    if _RESPONSES_MODULE not in sys.modules:
        from .env import REPO_ROOT  # standard library only

        path = os.path.join(REPO_ROOT, "experiments", "random_responses.py")
        if not os.path.exists(path):
            raise ImportError(f"{path} is missing: the cpu_random rollout needs this repository's experiments/")
        spec = importlib.util.spec_from_file_location(_RESPONSES_MODULE, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[_RESPONSES_MODULE] = module
    return sys.modules[_RESPONSES_MODULE]


class RandomTokenServer:
    """The "inference server" of one replica: a Ray actor answering ``generate`` with random tokens.

    Each response is a pure function of (seed, weight version, request id, prompt ids)
    (``experiments/random_responses.py``), so two runs with the same seed and data get the same rollouts
    whatever order the agent loop's requests arrive in. That needs verl's stable request ids
    ``det-<priority>`` (``actor_rollout_ref.rollout.full_determinism=True``); any other request id
    is refused, since a fresh uuid per request would make every run different.

    The legacy trainer numbers the samples of a batch (``priority``), so every request id is unique.
    verl's v1 trainer passes no priority: all its requests are ``det-0``, and the ``rollout.n``
    requests of one prompt are identical. The k-th repeat of a (weight version, request id, prompt)
    gets the key ``<request id>#<k>``: the n responses differ and their set is reproducible; which
    sample gets which depends on arrival order (and v1 orders groups by random uids anyway).
    """

    def __init__(self, vocab_size: int, eos_token_id: Optional[int], response_length: int, seed: int):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.response_length = response_length
        self.seed = seed
        self.generated = 0
        self.global_steps: Optional[int] = None  # weight version, reported like vLLM's server does
        self.repeats: dict = {}  # (weight version, request id, prompt) -> requests seen

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **unused: Any):
        from verl.workers.rollout.replica import TokenOutput

        if not str(request_id).startswith("det-"):
            raise ValueError(f"cpu_random needs verl's stable request ids ('det-<priority>'), got {request_id!r}: "
                             "set actor_rollout_ref.rollout.full_determinism=True")
        limit = min(self.response_length, int(sampling_params.get("max_tokens") or self.response_length))
        seen = (self.global_steps, str(request_id), tuple(prompt_ids))
        repeat = self.repeats.get(seen, 0)
        self.repeats[seen] = repeat + 1
        token_ids = random_responses().random_response(
            seed=self.seed, weight_version=self.global_steps,
            request_key=str(request_id) if repeat == 0 else f"{request_id}#{repeat}",
            prompt_ids=prompt_ids, max_tokens=limit, vocab_size=self.vocab_size, eos_token_id=self.eos_token_id)
        self.generated += 1
        return TokenOutput(token_ids=token_ids, stop_reason="completed",
                           extra_fields={"global_steps": self.global_steps})

    async def set_global_steps(self, global_steps: int):
        if global_steps != self.global_steps:
            self.repeats.clear()  # keyed by weight version: older entries cannot match again
        self.global_steps = global_steps

    def generated_count(self) -> int:
        return self.generated

    # Lifecycle calls the trainer makes on every replica; nothing to free or restore here.
    async def wake_up(self): ...

    async def sleep(self): ...

    async def clear_kv_cache(self): ...

    async def release_kv_cache(self): ...

    async def resume_kv_cache(self): ...

    async def abort_all_requests(self, reject_request: bool = False): ...

    async def resume_generation(self): ...

    async def start_profile(self, **kwargs): ...

    async def stop_profile(self): ...
