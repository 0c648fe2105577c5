"""The learning runs' task: a tiny Qwen2 of 64 token ids that learns, from scratch, to answer in a target set.

* :func:`build_learning_model` -- a random Qwen2 (vocab 64, hidden 64, 2 layers, 4 heads / 2 kv
  heads, 82,496 parameters, fp32) and a word-level tokenizer of 64 ids, built locally (no hub);
* :func:`write_dataset` -- ``n`` chat prompts "What is i + j?" in verl's RL dataset format;
* :func:`target_fraction` -- the verifiable reward: the fraction of a response's tokens that lie
  in :data:`TARGET_IDS` (8 of the 64 ids, never used by the prompts).

Why this task: a random policy over 64 ids starts near the uniform entropy ``ln 64 = 4.16`` and
a reward of ``8/64 = 0.125``; GRPO on it raises the reward to 1 by concentrating the mass on a
few target ids, so vanilla's entropy collapses within tens of steps -- the setting KL-Cov and
Clip-Cov are for. The answer does not depend on the prompt (a deliberate miniature).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Sequence

import torch

VOCAB_SIZE = 64
MODEL_KWARGS = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    attention_dropout=0.0,
)
PAD_TOKEN, IM_START_TOKEN, EOS_TOKEN, UNK_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"
_WORDS = ["user", "assistant", "system", "What", "is", "+", "?"] + [str(d) for d in range(10)]
#: The reward's target set: the last 8 ids, fillers no prompt contains.
TARGET_IDS = tuple(range(VOCAB_SIZE - 8, VOCAB_SIZE))
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer():
    """A word-level fast tokenizer of exactly :data:`VOCAB_SIZE` ids: 4 special tokens (pad, im_start,
    eos, unk), the prompts' words and single digits, then fillers ``<|t..|>`` (the target set among them).
    Whitespace (also ``\\n``) only separates words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = [PAD_TOKEN, IM_START_TOKEN, EOS_TOKEN, UNK_TOKEN] + _WORDS
    names += [f"<|t{i}|>" for i in range(len(names), VOCAB_SIZE)]
    tok = Tokenizer(models.WordLevel(vocab={name: i for i, name in enumerate(names)}, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    tok.add_special_tokens([PAD_TOKEN, IM_START_TOKEN, EOS_TOKEN, UNK_TOKEN])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN,
                                   unk_token=UNK_TOKEN)
    fast.chat_template = _CHAT_TEMPLATE
    if len(fast) != VOCAB_SIZE:
        raise RuntimeError(f"the learning tokenizer has {len(fast)} ids, expected {VOCAB_SIZE}")
    return fast


def build_learning_model(path: str, seed: int = 0) -> str:
    """Write the random Qwen2 of :data:`MODEL_KWARGS` (weights from ``torch.manual_seed(seed)``) and
    :func:`build_tokenizer` to ``path``; idempotent (returns at once when ``path/config.json`` exists)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".learning_qwen2_", dir=parent)
    try:
        tokenizer = build_tokenizer()
        ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
        config = Qwen2Config(**MODEL_KWARGS, **ids)
        config.architectures = ["Qwen2ForCausalLM"]
        torch.manual_seed(seed)
        Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(**ids).save_pretrained(tmp)
        try:
            os.rename(tmp, path)
        except OSError:
            if not os.path.exists(os.path.join(path, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


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
