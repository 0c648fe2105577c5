"""Reproducible random-token responses for CPU trainer runs (no verl, no torch: standard library only).

A response is a pure function of ``(seed, weight_version, request_key, prompt_ids)``: the same run
configuration gives the same rollouts in every process and every run, whatever order the requests
arrive in. ``weight_version`` is the actor version the rollout serves (0 before the first update,
``s`` after trainer step ``s``); ``request_key`` tells apart the ``rollout.n`` identical requests
of one prompt (verl's ``det-<priority>`` request id under ``rollout.full_determinism``, i.e. the
sample's index in the trainer's batch).

Used by the in-process trainer (:mod:`experiments.local_trainer`) and, loaded from this
file, by the test-only ``cpu_random`` Ray rollout server (``tests/trainer_support``).
"""

from __future__ import annotations

import hashlib
import random
from typing import Optional, Sequence

FIRST_ORDINARY_TOKEN = 3  # lab.tiny's tokenizer: 0 pad, 1 <|im_start|>, 2 <|im_end|> (EOS)


def random_response(*, seed: int, weight_version: Optional[int], request_key: str, prompt_ids: Sequence[int],
                    max_tokens: int, vocab_size: int, eos_token_id: Optional[int]) -> list[int]:
    """Token ids of one response: length uniform in ``[1, max_tokens]``, ids uniform in
    ``[FIRST_ORDINARY_TOKEN, vocab_size)``, the last one replaced by EOS when shorter than ``max_tokens``."""
    if max_tokens < 1 or vocab_size <= FIRST_ORDINARY_TOKEN:
        raise ValueError(f"need max_tokens >= 1 and vocab_size > {FIRST_ORDINARY_TOKEN}, "
                         f"got {max_tokens} and {vocab_size}")
    text = f"{seed}|{weight_version}|{request_key}|{','.join(str(int(t)) for t in prompt_ids)}"
    rng = random.Random(int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little"))
    length = rng.randint(1, max_tokens)
    token_ids = [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(length)]
    if length < max_tokens and eos_token_id is not None:
        token_ids[-1] = eos_token_id
    return token_ids


def length_score(response_text: str) -> float:
    """The runs' rule reward: depends only on the response text, so the ``rollout.n`` responses of one
    prompt get different scores (random tokens never solve a task; a task reward would be 0 everywhere
    and GRPO's advantages with it)."""
    return (len(response_text) % 7) / 6.0
