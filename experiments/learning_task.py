"""The learning runs' task: a tiny Qwen2 of 64 token ids that learns, from scratch, to answer in a target set.

* :func:`build_learning_model` -- a random Qwen2 (vocab 64, hidden 64, 2 layers, 4 heads / 2 kv
  heads, 82,496 parameters, fp32) and a word-level tokenizer of 64 ids, built locally (no hub) by
  :func:`verl_klcov_global.lab.tiny.build_words_model`;
* :func:`write_dataset` -- ``n`` chat prompts "What is i + j?" in verl's RL dataset format;
* :func:`target_fraction` -- the verifiable reward: the fraction of a response's tokens that lie
  in :data:`TARGET_IDS` (8 of the 64 ids, never used by the prompts).

Why this task: a random policy over 64 ids starts near the uniform entropy ``ln 64 = 4.16`` and
a reward of ``8/64 = 0.125``; GRPO on it raises the reward to 1 by concentrating the mass on a
few target ids, so vanilla's entropy collapses within tens of steps -- the setting KL-Cov and
Clip-Cov are for. The answer does not depend on the prompt (a deliberate miniature).
"""

from __future__ import annotations

from typing import Sequence

from verl_klcov_global.lab import tiny as _tiny

VOCAB_SIZE = _tiny.WORDS_VOCAB_SIZE
#: The reward's target set: the last 8 ids, fillers no prompt contains.
TARGET_IDS = tuple(range(VOCAB_SIZE - 8, VOCAB_SIZE))


def build_learning_model(path: str, seed: int = 0) -> str:
    """The task's model: :func:`verl_klcov_global.lab.tiny.build_words_model` (written to ``path``, idempotent)."""
    return _tiny.build_words_model(path, seed)


def write_dataset(path: str, n_prompts: int, data_source: str = "learning_cpu") -> str:
    """A parquet file of ``n_prompts`` chat prompts in verl's RL dataset format (``What is i + i+1?``)."""
    import pandas as pd

    rows = [
        {
            "data_source": data_source,
            "prompt": [{"role": "user", "content": f"What is {i} + {i + 1}?"}],
            "ability": "target_tokens",
            "reward_model": {"style": "rule", "ground_truth": "target set"},
            "extra_info": {"index": i, "split": "train"},
        }
        for i in range(n_prompts)
    ]
    pd.DataFrame(rows).to_parquet(path)
    return path


def target_fraction(response_ids: Sequence[int]) -> float:
    """The reward in [0, 1]: the fraction of ``response_ids`` in :data:`TARGET_IDS` (0 for an empty response)."""
    if not len(response_ids):
        return 0.0
    targets = set(TARGET_IDS)
    return sum(int(t) in targets for t in response_ids) / len(response_ids)
