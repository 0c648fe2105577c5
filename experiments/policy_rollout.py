"""Rollouts sampled from the policy being trained, reproducibly, for the in-process trainer loop.

:class:`PolicyRollout` stands in for verl's agent loop + rollout server + reward loop, like
:class:`.local_trainer.RandomRollout`, but each response is *sampled from the actor's current
weights*: the full parameter vector the trainer recorded at the weight version the rollout serves
(:class:`.local_trainer.WeightSync`, after every actor update), loaded into a plain HF copy of the
model (:class:`PolicySampler`). Temperature 1, the full vocabulary, a fixed response length
(``max_response_length`` tokens, EOS ignored like vLLM's ``ignore_eos``), scored by a rule reward
on the token ids.

Reproducible bit for bit and independent of request order: each request draws its tokens from its
own ``torch.Generator`` seeded by (rollout seed, weight version, request id, prompt ids) --
verl's stable ``det-<index>`` request ids -- and the requests of a call are batched in a canonical
order (by prompt length, then request id), so the float computation does not depend on the order
the requests arrive in.

Per call it also records harness-side figures (:attr:`PolicyRollout.figures`): the mean reward,
the sampling distribution's mean entropy and the token covariance of the sampled tokens' log-probs
with verl's GRPO advantage (group-normalised reward, ``epsilon = 1e-6``), the same definition for
every loss mode (the plugin's own ``cov_mean`` is logged by its global modes only).
"""

from __future__ import annotations

import hashlib
from typing import Callable, Optional, Sequence

import torch

from .local_trainer import RandomRollout

GRPO_EPSILON = 1e-6  # verl's compute_grpo_outcome_advantage


def request_seed(seed: int, weight_version: Optional[int], request_key: str, prompt_ids: Sequence[int]) -> int:
    """The 63-bit seed of one request's generator: a hash of what identifies the request."""
    text = f"{seed}|{weight_version}|{request_key}|{','.join(str(int(t)) for t in prompt_ids)}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


class PolicySampler:
    """A plain HF copy of the actor (``model_path``'s architecture, fp32, sdpa, eval mode) that samples.

    :meth:`load_flat` takes the actor's parameters as :func:`verl_klcov_global.lab.cpu.engine_params_flat`
    returns them (float64, the full state dict's tensors concatenated in sorted-key order).
    """

    def __init__(self, model_path: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                          attn_implementation="sdpa").eval()
        self.keys = sorted(self.model.state_dict())
        self.numel = sum(self.model.state_dict()[k].numel() for k in self.keys)

    def flat(self) -> torch.Tensor:
        """The sampler's parameters in :meth:`load_flat`'s layout (float64)."""
        state = self.model.state_dict()
        return torch.cat([state[k].reshape(-1).to(torch.float64) for k in self.keys])

    @torch.no_grad()
    def load_flat(self, flat: torch.Tensor) -> None:
        if flat.numel() != self.numel:
            raise ValueError(f"a weight version of {flat.numel()} numbers for a model of {self.numel} parameters")
        state, offset = self.model.state_dict(), 0
        for key in self.keys:
            target = state[key]
            target.copy_(flat[offset: offset + target.numel()].reshape(target.shape).to(target.dtype))
            offset += target.numel()

    @torch.no_grad()
    def sample(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], max_tokens: int):
        """Sample ``max_tokens`` tokens after each prompt, row ``i`` from ``torch.Generator().manual_seed(seeds[i])``.

        Returns ``(tokens, log_probs, entropies)``: per row, the sampled ids, their log-probs and the
        sampling distribution's entropy at each position. Rows are computed in the order given,
        batched by prompt length (callers pass a canonical order).
        """
        tokens: list = [None] * len(prompts)
        log_probs: list = [None] * len(prompts)
        entropies: list = [None] * len(prompts)
        by_length: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            by_length.setdefault(len(prompt), []).append(i)
        for rows in by_length.values():
            ids = torch.tensor([list(prompts[i]) for i in rows], dtype=torch.long)
            generators = [torch.Generator().manual_seed(int(seeds[i])) for i in rows]
            chosen, lps, ents = [], [], []
            for _ in range(max_tokens):
                logits = self.model(input_ids=ids).logits[:, -1, :].to(torch.float32)
                logp = torch.log_softmax(logits, dim=-1)
                probs = logp.exp()
                step = torch.stack([torch.multinomial(probs[j], 1, generator=g)[0] for j, g in enumerate(generators)])
                chosen.append(step)
                lps.append(logp.gather(1, step[:, None])[:, 0])
                ents.append(-(probs * logp).sum(dim=-1))
                ids = torch.cat([ids, step[:, None]], dim=1)
            chosen, lps, ents = (torch.stack(x, dim=1) for x in (chosen, lps, ents))
            for j, i in enumerate(rows):
                tokens[i], log_probs[i], entropies[i] = chosen[j].tolist(), lps[j].tolist(), ents[j].tolist()
        return tokens, log_probs, entropies


def grpo_advantages(scores: Sequence[float], groups: Sequence) -> list[float]:
    """verl's GRPO outcome advantage per sequence: ``(r - mean_g) / (std_g + 1e-6)`` over each group ``g``
    (``torch.std``, unbiased; a group of one gets mean 0, std 1, like verl)."""
    out = [0.0] * len(scores)
    members: dict = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    for rows in members.values():
        values = torch.tensor([scores[i] for i in rows], dtype=torch.float32)
        mean, std = (values.mean(), values.std()) if len(rows) > 1 else (torch.tensor(0.0), torch.tensor(1.0))
        for i, v in zip(rows, ((values - mean) / (std + GRPO_EPSILON)).tolist()):
            out[i] = v
    return out


class PolicyRollout(RandomRollout):
    """:class:`.local_trainer.RandomRollout`'s batch layout, with responses sampled from the recorded
    weights (``params[-1]``, the latest weight version) and scored by ``reward(response_ids)``."""

    def __init__(self, tokenizer, *, model_path: str, params: list, reward: Callable[[Sequence[int]], float],
                 seed: int, max_prompt_length: int, max_response_length: int):
        super().__init__(tokenizer, seed=seed, max_prompt_length=max_prompt_length,
                         max_response_length=max_response_length)
        self.sampler = PolicySampler(model_path)
        self.params = params
        self.reward = reward
        self.figures: list[dict[str, float]] = []  # per call (= trainer step)

    def respond(self, prompts: Sequence[Sequence[int]]) -> list[tuple[list[int], float]]:
        if not self.params:
            raise RuntimeError("no weight version recorded yet: the trainer syncs weights before the first rollout")
        self.sampler.load_flat(self.params[-1])
        keys = [f"det-{i}" for i in range(len(prompts))]
        seeds = [request_seed(self.seed, self.weight_version, key, p) for key, p in zip(keys, prompts)]
        order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), keys[i]))
        tokens, log_probs, entropies = self.sampler.sample([prompts[i] for i in order], [seeds[i] for i in order],
                                                           self.max_response_length)
        unsorted: list = [None] * len(prompts)
        for position, i in enumerate(order):
            unsorted[i] = (tokens[position], log_probs[position], entropies[position])
        scores = [self.reward(t) for t, _, _ in unsorted]
        self.figures.append(self._figures(unsorted, scores, [tuple(p) for p in prompts]))
        return [(t, s) for (t, _, _), s in zip(unsorted, scores)]

    @staticmethod
    def _figures(rows, scores, groups) -> dict[str, float]:
        advantages = grpo_advantages(scores, groups)
        a = torch.tensor([adv for adv, (t, _, _) in zip(advantages, rows) for _ in t], dtype=torch.float64)
        lp = torch.tensor([x for _, lps, _ in rows for x in lps], dtype=torch.float64)
        ent = torch.tensor([x for _, _, ents in rows for x in ents], dtype=torch.float64)
        return {"reward_mean": float(sum(scores) / len(scores)), "sample_entropy": float(ent.mean()),
                "token_cov": float(((a - a.mean()) * (lp - lp.mean())).mean())}
