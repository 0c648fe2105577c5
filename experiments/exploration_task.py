"""A deceptive task for the 64-id tiny Qwen2: an easy local optimum, and a better mode a collapsed policy stops sampling.

Reward of a response ``r`` of ``L`` tokens (``L`` = 8 in the study):

    reward(r) = easy_weight * (share of r's tokens in E)  +  pattern_bonus * [r shows the pattern P]

* the easy set E: the learning task's 8 target ids (``experiments.learning_task.TARGET_IDS``);
* the pattern P: the response's *first* token is one of 3 hidden ids (fillers that no prompt contains,
  outside E).

:data:`TASK` holds the values (:class:`DeceptiveTask`: 0.5, 1.0, the ids, the criteria). Why this design:

* **Findable but rare.** A random policy over 64 ids puts about ``3/64 = 4.7%`` of its first-token mass on
  the hidden ids: rare but findable (between 2% and 10%), so a step of 64 responses shows P about 3 times.
* **Exact probability.** P depends on the first token only, so its probability under a policy is the
  hidden ids' softmax mass at the first response position -- one forward of the prompt, no sampling
  (:meth:`DeceptiveTask.pattern_probability`). The premise is measured, not counted.
* **Deceptive, by design.** Raising E's share pays at all 8 positions, P at one; and a tiny model's output
  layer is shared across positions, so mass moved onto E at positions 2..8 moves onto E at position 1 too,
  where it takes mass from the hidden ids. A policy collapsed onto E scores 0.5 and stops sampling P.
  Whether vanilla does collapse before finding P is measured, not assumed (docs/EVIDENCE.md).
* **Better mode.** P with E elsewhere scores ``1.0 + 0.5 x 7/8 = 1.4375``: the best reachable reward,
  against 0.5 for the collapsed policy.

The study's criteria (stated before the runs):

* *found P* at the first step whose responses show P in at least 50% of the responses
  (``found_share``); a run that never does has not found it;
* *collapsed onto E* at the first step where E holds at least 90% of the response tokens
  (``collapse_share``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .learning_task import TARGET_IDS, VOCAB_SIZE


@dataclass(frozen=True)
class DeceptiveTask:
    """The reward and the criteria (the module docstring says why each value)."""

    #: The easy set E: the learning task's 8 target ids (56..63).
    easy_ids: tuple = tuple(TARGET_IDS)
    #: The hidden ids whose appearance as the first response token is the pattern P (fillers, outside E).
    hidden_ids: tuple = (40, 41, 42)
    easy_weight: float = 0.5
    pattern_bonus: float = 1.0
    #: A run has found P at the first step where at least this share of its responses show P.
    found_share: float = 0.5
    #: A run has collapsed onto E at the first step where E holds at least this share of the response tokens.
    collapse_share: float = 0.9

    def __post_init__(self):
        if max(self.easy_ids + self.hidden_ids) >= VOCAB_SIZE:
            raise ValueError(f"ids must lie below the vocabulary's {VOCAB_SIZE}")

    def easy_share(self, response_ids: Sequence[int]) -> float:
        """The share of ``response_ids`` in the easy set (0 for an empty response)."""
        if not len(response_ids):
            return 0.0
        easy = set(self.easy_ids)
        return sum(int(t) in easy for t in response_ids) / len(response_ids)

    def shows_pattern(self, response_ids: Sequence[int]) -> bool:
        """P: the response's first token is one of the hidden ids."""
        return len(response_ids) > 0 and int(response_ids[0]) in self.hidden_ids

    def reward(self, response_ids: Sequence[int]) -> float:
        """``easy_weight x easy share + pattern_bonus x [P]``."""
        return self.easy_weight * self.easy_share(response_ids) + (self.pattern_bonus if self.shows_pattern(
            response_ids) else 0.0)

    @torch.no_grad()
    def pattern_probability(self, model, prompts: Sequence[Sequence[int]]) -> list[float]:
        """P's exact probability per prompt under ``model`` (an HF causal LM, temperature 1): the softmax mass
        of the hidden ids at the first response position, from one forward of each prompt (prompts of one
        length batched; float32 logits as the sampler's, the sum in float64)."""
        out: list = [None] * len(prompts)
        by_length: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            by_length.setdefault(len(prompt), []).append(i)
        hidden = torch.tensor(self.hidden_ids)
        for length in sorted(by_length):
            rows = by_length[length]
            ids = torch.tensor([list(prompts[i]) for i in rows], dtype=torch.long)
            logp = torch.log_softmax(model(input_ids=ids).logits[:, -1, :].to(torch.float32), dim=-1)
            mass = logp[:, hidden].to(torch.float64).exp().sum(dim=-1)
            for i, value in zip(rows, mass.tolist()):
                out[i] = value
        return out


#: The study's task.
TASK = DeceptiveTask()
if set(TASK.easy_ids) & set(TASK.hidden_ids):
    raise AssertionError("the hidden ids must lie outside the easy set")
