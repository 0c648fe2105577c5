"""Rollouts a chat model makes, sampled from the actor's current weights, for the in-process trainer loop on a real LM.

:class:`ChatRollout` keeps :class:`.local_trainer.RandomRollout`'s batch layout (prompts through the tokenizer's
chat template, left-padded to ``max_prompt_length``; responses right-padded to ``max_response_length``; the
score at the last response token) and replaces what it generates:

* responses sampled from the latest weight version the trainer recorded (``params[-1]``: a
  :class:`.local_trainer.LatestWeights` in fp32, loaded into an HF copy of the model,
  :class:`.policy_rollout.PolicySampler`), by :func:`verl_klcov_global.lab.sampling.sample_token_responses`:
  a KV cache, temperature 1, the full vocabulary, each row stopped at its EOS (the EOS kept in the response,
  masked 1, as verl's rollout does), at most ``max_response_length`` tokens;
* a reward that reads the decoded text and the prompt's ground truth (``reward_model.ground_truth`` of the
  dataset row, which verl's ``_get_gen_batch`` hands the rollout): 1.0 when the last integer of the response
  is the answer, else 0.0 (:func:`verl_klcov_global.lab.sampling.answer_reward`).

One ``torch.Generator`` per call, seeded from (rollout seed, weight version, every prompt's ids) by
:func:`.policy_rollout.request_seed`; rows in the batch's order (verl's seeded dataloader): two runs whose
weights agree sample the same responses on one machine.

Per call (= trainer step) :attr:`ChatRollout.figures` records the mean reward, the mean entropy of the sampling
distribution over the response tokens, the mean response length and the share of responses that ended at EOS.
"""

from __future__ import annotations

from typing import Sequence

from .local_trainer import RandomRollout, RunConfig
from .policy_rollout import PolicySampler, request_seed


class ChatRollout(RandomRollout):
    """See the module docstring. ``params``: the trainer's weight history (``[-1]`` is the version to serve)."""

    def __init__(self, tokenizer, *, model_path: str, params, seed: int, max_prompt_length: int,
                 max_response_length: int):
        super().__init__(tokenizer, seed=seed, max_prompt_length=max_prompt_length,
                         max_response_length=max_response_length)
        self.sampler = PolicySampler(model_path)
        self.params = params
        self.figures: list[dict[str, float]] = []  # per call (= trainer step)
        self._answers: list[str] = []

    def generate_sequences(self, gen_batch):
        self._answers = [str(row["ground_truth"]) for row in gen_batch.non_tensor_batch["reward_model"]]
        return super().generate_sequences(gen_batch)

    def respond(self, prompts: Sequence[Sequence[int]]) -> list[tuple[list[int], float]]:
        from verl_klcov_global.lab.sampling import answer_reward, sample_token_responses

        if not len(self.params):
            raise RuntimeError("no weight version recorded yet: the trainer syncs weights before the first rollout")
        if len(self._answers) != len(prompts):
            raise RuntimeError(f"{len(prompts)} prompts and {len(self._answers)} ground truths: the rollout reads "
                               "them from the batch's reward_model field")
        self.sampler.load_flat(self.params[-1])
        everything = [t for prompt in prompts for t in [*prompt, -1]]  # -1: a separator no id takes
        batch = sample_token_responses(self.sampler.model, self.tokenizer, [list(p) for p in prompts],
                                       max_new_tokens=self.max_response_length, temperature=1.0,
                                       seed=request_seed(self.seed, self.weight_version, "batch", everything))
        rows, valid = [], batch.response_mask.bool()
        for i, (text, answer) in enumerate(zip(batch.texts, self._answers)):
            rows.append((batch.responses[i][valid[i]].tolist(), answer_reward(text, answer)))
        lengths = valid.sum(dim=1)
        ended = [bool(r and r[-1] == batch.eos_token_id) for r, _ in rows]
        self.figures.append({
            "reward_mean": sum(score for _, score in rows) / len(rows),
            "sample_entropy": float(batch.entropies.sum() / lengths.sum()),
            "response_length": float(lengths.float().mean()),
            "eos_share": sum(ended) / len(ended),
        })
        return rows


class MakeChatRollout:
    """``make_rollout`` for :func:`.local_trainer.run_trainer` (a class: it must pickle into a job process)."""

    def __init__(self, model_path: str):
        self.model_path = model_path

    def __call__(self, tokenizer, run: RunConfig, params):
        return ChatRollout(tokenizer, model_path=self.model_path, params=params, seed=run.seed,
                           max_prompt_length=run.max_prompt_length, max_response_length=run.max_response_length)


def write_repeat_dataset(path: str, n_prompts: int, data_source: str = "repeat_number") -> str:
    """A parquet file of ``n_prompts`` requests "Repeat this number: N" (:func:`repeat_prompts`, seed 0) in verl's RL
    dataset format, N as the ground truth."""
    import pandas as pd

    from verl_klcov_global.lab.sampling import repeat_prompts

    rows = [{"data_source": data_source, "prompt": [{"role": "user", "content": p.text}], "ability": "copy",
             "reward_model": {"style": "rule", "ground_truth": p.answer}, "extra_info": {"index": i, "split": "train"}}
            for i, p in enumerate(repeat_prompts(n_prompts, seed=0))]
    pd.DataFrame(rows).to_parquet(path)
    return path
