"""The Ray actor behind each ``cpu_random`` rollout replica (test-only; see :mod:`.rollout`).

Kept apart from :mod:`.rollout` and free of top-level verl imports: a fresh Ray process that
unpickles this class imports this module first, and ``import verl`` there loads the CPU support
(``VERL_USE_EXTERNAL_MODULES``), which imports :mod:`.rollout` -- a cycle if this module were it.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Optional

_FIRST_ORDINARY_TOKEN = 3  # _tiny's tokenizer: 0 pad, 1 <|im_start|>, 2 <|im_end|> (EOS)


class RandomTokenServer:
    """The "inference server" of one replica: a Ray actor answering ``generate`` with random tokens."""

    def __init__(self, vocab_size: int, eos_token_id: Optional[int], response_length: int, seed: int):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.response_length = response_length
        self.seed = seed
        self.generated = 0
        self.global_steps: Optional[int] = None  # weight version, reported like vLLM's server does

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **unused: Any):
        from verl.workers.rollout.replica import TokenOutput

        limit = min(self.response_length, int(sampling_params.get("max_tokens") or self.response_length))
        digest = hashlib.sha256(f"{self.seed}:{self.generated}:{prompt_ids}".encode()).digest()
        rng = random.Random(int.from_bytes(digest[:8], "little"))
        self.generated += 1
        length = rng.randint(1, limit)
        token_ids = [rng.randrange(_FIRST_ORDINARY_TOKEN, self.vocab_size) for _ in range(length)]
        if length < limit and self.eos_token_id is not None:
            token_ids[-1] = self.eos_token_id
        return TokenOutput(token_ids=token_ids, stop_reason="completed",
                           extra_fields={"global_steps": self.global_steps})

    async def set_global_steps(self, global_steps: int):
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
