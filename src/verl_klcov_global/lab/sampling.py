"""Responses sampled from a real HF causal LM, as a rollout would make them, for the lab's minibatches.

:func:`sample_chat_responses` applies the tokenizer's chat template to each prompt, samples
``samples_per_prompt`` responses per prompt at a temperature with a KV cache, one seeded
``torch.Generator`` (no top-k, no top-p: the model's full distribution), and stops each row at its
EOS. Rows are prompt-major (prompt i's samples are rows i*n .. i*n+n-1), so GRPO groups are
consecutive. The draws are reproducible on one machine; on another CPU the logits' last bits may
differ and, rarely, so may a draw.

:func:`arithmetic_prompts` is the built-in prompt set: small sums and differences made from a seed,
with their answers (for a reward that reads the decoded text). SmolLM2-135M-Instruct answers 3% of them (docs/
EVIDENCE.md); :func:`repeat_prompts` ("Repeat this number: N") is the set it answers about a third of, where GRPO
groups have reward variance to learn from. :func:`sample_token_responses` samples after prompts already tokenized
(a rollout's input); :func:`sample_after_random_prompts` after random prompt ids, every response at full length (a
model without a chat template, minibatches of one shape).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Optional

import torch
from verl.utils.model import compute_position_id_with_mask


@dataclass(frozen=True)
class Prompt:
    text: str
    answer: Optional[str] = None


def arithmetic_prompts(count: int, seed: int = 0) -> list[Prompt]:
    """``count`` questions "What is a + b?" / "What is a - b?" (two-digit numbers) with their answers."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if rng.random() < 0.5:
            prompts.append(Prompt(f"What is {a} + {b}? Answer with the number.", str(a + b)))
        else:
            a, b = max(a, b), min(a, b)
            prompts.append(Prompt(f"What is {a} - {b}? Answer with the number.", str(a - b)))
    return prompts


def repeat_prompts(count: int, seed: int = 0) -> list[Prompt]:
    """``count`` requests "Repeat this number: N" (N from 2 to 98) with N as the answer."""
    rng = random.Random(seed)
    return [Prompt(f"Repeat this number: {n}", str(n)) for n in (rng.randint(2, 98) for _ in range(count))]


def answer_reward(text: str, answer: str) -> float:
    """1.0 when the last integer in ``text`` is ``answer``, else 0.0."""
    numbers = re.findall(r"-?\d+", text.replace(",", ""))
    return 1.0 if numbers and numbers[-1] == answer else 0.0


@dataclass
class SampledBatch:
    """B = len(prompts) * samples_per_prompt rows; P the longest templated prompt, R the longest response.

    ``prompts`` (B, P) left-padded with ``pad_token_id``, ``prompt_mask`` (B, P); ``responses`` (B, R)
    right-padded, ``response_mask`` (B, R): 1 up to and including the row's EOS (or to
    ``max_new_tokens``); ``entropies`` (B, R) float32: the entropy (nats) of the distribution each
    response token was drawn from, 0 where masked; ``texts``: the decoded responses (special tokens
    dropped); ``answers``: each row's prompt's answer.
    """

    prompts: torch.Tensor
    prompt_mask: torch.Tensor
    responses: torch.Tensor
    response_mask: torch.Tensor
    entropies: torch.Tensor
    pad_token_id: int
    eos_token_id: int
    temperature: float
    texts: list[str] = field(default_factory=list)
    answers: list[Optional[str]] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return int(self.prompts.shape[0])

    def tokens(self) -> dict[str, torch.Tensor]:
        """verl's padded rollout fields: prompts, responses, input_ids, attention_mask, position_ids, response_mask."""
        attention_mask = torch.cat([self.prompt_mask, self.response_mask], dim=1)
        return dict(
            prompts=self.prompts,
            responses=self.responses,
            input_ids=torch.cat([self.prompts, self.responses], dim=1),
            attention_mask=attention_mask,
            position_ids=compute_position_id_with_mask(attention_mask),
            response_mask=self.response_mask,
        )


def load_policy(folder: str, device: str = "cpu"):
    """(model, tokenizer) from an HF folder: fp32, eval mode, on ``device``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval().to(device)
    return model, tokenizer


def template_prompts(tokenizer, prompts: list[Prompt]) -> list[list[int]]:
    """Each prompt as a user turn in the tokenizer's chat template, with the assistant's turn opened."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template; sampled responses need one (give a chat "
                         "model's folder)")
    out = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}], tokenize=True,
                                            add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        out.append(list(ids))
    return out


def sample_after_random_prompts(model, tokenizer, *, batch_size: int, prompt_len: int, response_len: int,
                                vocab_size: int, seed: int, temperature: float = 1.0,
                                first_id: int = 3) -> SampledBatch:
    """``batch_size`` rows of ``prompt_len`` random prompt ids (uniform in [``first_id``, ``vocab_size``), drawn from
    ``torch.Generator`` seeded ``seed``: ids below ``first_id`` are the special tokens), each followed by a response of
    exactly ``response_len`` tokens sampled from the model at ``temperature`` with seed ``seed``
    (``stop_at_eos=False``)."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(first_id, vocab_size, (batch_size, prompt_len), generator=generator)
    return sample_token_responses(model, tokenizer, prompts.tolist(), max_new_tokens=response_len,
                                  temperature=temperature, seed=seed, stop_at_eos=False)


def sample_chat_responses(model, tokenizer, prompts: list[Prompt], *, samples_per_prompt: int,
                          max_new_tokens: int, temperature: float = 1.0, seed: int = 0) -> SampledBatch:
    """Sample ``samples_per_prompt`` responses per prompt (see the module docstring)."""
    templated = [ids for ids in template_prompts(tokenizer, prompts) for _ in range(samples_per_prompt)]
    batch = sample_token_responses(model, tokenizer, templated, max_new_tokens=max_new_tokens,
                                   temperature=temperature, seed=seed)
    batch.answers = [prompt.answer for prompt in prompts for _ in range(samples_per_prompt)]
    return batch


@torch.no_grad()
def sample_token_responses(model, tokenizer, prompt_ids: list[list[int]], *, max_new_tokens: int,
                           temperature: float = 1.0, seed: int = 0, stop_at_eos: bool = True) -> SampledBatch:
    """One response per row of ``prompt_ids`` (token ids, templated already), drawn with a KV cache from one
    ``torch.Generator`` seeded ``seed`` on the host, each row stopped at its EOS (``answers`` left empty).

    ``stop_at_eos=False``: every row runs to ``max_new_tokens`` (an EOS drawn is a token like any other; the mask is
    all ones), for minibatches whose rows must all have the same length."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (sampling), got {temperature}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    templated = [list(ids) for ids in prompt_ids]
    batch, width = len(templated), max(len(ids) for ids in templated)
    prompt_ids = torch.full((batch, width), pad, dtype=torch.long)
    prompt_mask = torch.zeros(batch, width, dtype=torch.long)
    for row, ids in enumerate(templated):
        prompt_ids[row, width - len(ids):] = torch.tensor(ids)
        prompt_mask[row, width - len(ids):] = 1
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    generator = torch.Generator().manual_seed(seed)  # on the host: the same draws on any device's probabilities
    attention = prompt_mask.clone()
    positions = compute_position_id_with_mask(attention)
    out = model(input_ids=prompt_ids, attention_mask=attention, position_ids=positions, use_cache=True,
                logits_to_keep=1)
    next_position = positions[:, -1:] + 1
    tokens, entropies = [], []
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        log_probs = torch.log_softmax(out.logits[:, -1].float() / temperature, dim=-1)
        probs = log_probs.exp()
        entropy = -(probs * log_probs).sum(-1)
        drawn = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(device)
        tokens.append(torch.where(finished, torch.full_like(drawn, pad), drawn))
        entropies.append(torch.where(finished, torch.zeros_like(entropy), entropy))
        if stop_at_eos:
            finished = finished | (drawn == eos)
        if bool(finished.all()):
            break
        attention = torch.cat([attention, torch.ones(batch, 1, dtype=torch.long, device=device)], dim=1)
        out = model(input_ids=tokens[-1].unsqueeze(1), attention_mask=attention, position_ids=next_position,
                    past_key_values=out.past_key_values, use_cache=True)
        next_position = next_position + 1
    responses = torch.stack(tokens, dim=1).cpu()
    prompt_ids, prompt_mask = prompt_ids.cpu(), prompt_mask.cpu()
    # 1 through each row's first EOS (inclusive), as verl's rollout masks a response
    is_eos = (responses == eos) if stop_at_eos else torch.zeros_like(responses, dtype=torch.bool)
    after_eos = (torch.cumsum(is_eos.long(), dim=1) - is_eos.long()) > 0
    response_mask = (~after_eos).long()
    texts = [tokenizer.decode(row[mask.bool()].tolist(), skip_special_tokens=True)
             for row, mask in zip(responses, response_mask)]
    return SampledBatch(prompts=prompt_ids, prompt_mask=prompt_mask, responses=responses * response_mask
                        + pad * (1 - response_mask), response_mask=response_mask,
                        entropies=torch.stack(entropies, dim=1).cpu() * response_mask, pad_token_id=int(pad),
                        eos_token_id=int(eos), temperature=float(temperature), texts=texts)
