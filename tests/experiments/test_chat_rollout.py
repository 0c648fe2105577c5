"""The real-model rollout harness (experiments/chat_rollout.py, local_trainer.LatestWeights): the weight history of a
large model, tied embeddings between the engine's flat vector and the sampler, and a chat rollout whose reward reads
the decoded text against the prompt's ground truth."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from experiments.chat_rollout import ChatRollout, write_repeat_dataset
from experiments.local_trainer import LatestWeights
from experiments.policy_rollout import PolicySampler
from verl_klcov_global.lab import sampling


def test_latest_weights_keep_one_fp32_version_and_count_them():
    seen = []
    weights = LatestWeights(on_version=lambda index, flat: seen.append((index, flat.dtype)))
    with pytest.raises(IndexError, match="latest"):
        weights[-1]
    for value in (1.0, 2.0, 3.0):
        weights.append(torch.full((4,), value, dtype=torch.float64))
    assert len(weights) == 3 and weights[-1].dtype == torch.float32 and torch.equal(weights[-1], torch.full((4,), 3.0))
    assert torch.equal(weights[2], weights[-1])
    with pytest.raises(IndexError, match="only the latest weight version is kept"):
        weights[0]
    assert seen == [(0, torch.float32), (1, torch.float32), (2, torch.float32)]


@pytest.fixture(scope="module")
def tied_model_path(tmp_path_factory):
    """The tiny Qwen2 with its input and output embeddings tied, as SmolLM2's are."""
    from verl_klcov_global.lab.tiny import TINY_MODEL_KWARGS, build_random_model

    return build_random_model(str(tmp_path_factory.mktemp("tied") / "model"),
                              {**TINY_MODEL_KWARGS, "tie_word_embeddings": True})


def test_the_engine_flat_vector_loads_into_the_sampler_with_tied_embeddings(tied_model_path):
    from verl_klcov_global.lab import cpu
    from verl_klcov_global.lab.experiment import EngineSpec, _release

    cpu.install_cpu_platform()
    cpu.init_process_group_cpu(0, 1)
    engine = EngineSpec(tied_model_path).build()
    try:
        with torch.no_grad():  # move the tied weight, as training does: both names must carry the new values
            embedding = engine.module.get_input_embeddings().weight
            (embedding.to_local() if hasattr(embedding, "to_local") else embedding).add_(0.125)  # one rank: all of it
        flat = cpu.engine_params_flat(engine, dtype=torch.float32)
        assert torch.equal(flat.double(), cpu.engine_params_flat(engine))  # fp32 holds the fp32 model exactly
    finally:
        _release(engine)
    sampler = PolicySampler(tied_model_path)
    assert sampler.model.config.tie_word_embeddings
    assert sampler.numel == flat.numel()
    before = sampler.model.get_input_embeddings().weight.clone()
    sampler.load_flat(flat)
    assert torch.equal(sampler.flat(), flat.double())
    loaded = sampler.model.get_input_embeddings().weight
    assert torch.equal(loaded, before + 0.125)  # the moved values arrived, not the file's
    assert loaded.data_ptr() == sampler.model.get_output_embeddings().weight.data_ptr()  # still one tensor


def test_sample_token_responses_draws_what_the_chat_sampler_draws(tiny_model_path):
    model, tokenizer = sampling.load_policy(tiny_model_path)
    prompts = sampling.repeat_prompts(2, seed=3)
    assert [p.text for p in prompts] == [f"Repeat this number: {p.answer}" for p in prompts]
    chat = sampling.sample_chat_responses(model, tokenizer, prompts, samples_per_prompt=2, max_new_tokens=6, seed=9)
    ids = [ids for ids in sampling.template_prompts(tokenizer, prompts) for _ in range(2)]
    direct = sampling.sample_token_responses(model, tokenizer, ids, max_new_tokens=6, seed=9)
    assert torch.equal(chat.responses, direct.responses) and chat.texts == direct.texts
    assert chat.answers == [p.answer for p in prompts for _ in range(2)] and direct.answers == []
    with pytest.raises(ValueError, match="max_new_tokens"):
        sampling.sample_token_responses(model, tokenizer, ids, max_new_tokens=0)


def _gen_batch(tokenizer, prompts):
    from verl import DataProto

    n = len(prompts)
    raw = np.empty(n, dtype=object)
    raw[:] = [[{"role": "user", "content": p.text}] for p in prompts]
    truth = np.empty(n, dtype=object)
    truth[:] = [{"style": "rule", "ground_truth": p.answer} for p in prompts]
    return DataProto.from_dict(non_tensors={"raw_prompt": raw, "reward_model": truth})


def test_chat_rollout_scores_the_decoded_text_against_the_ground_truth(tiny_model_path, monkeypatch):
    from verl.utils import hf_tokenizer

    tokenizer = hf_tokenizer(tiny_model_path)
    sampler_flat = PolicySampler(tiny_model_path).flat().float()
    weights = LatestWeights()
    weights.append(sampler_flat)
    prompts = [sampling.Prompt("Repeat this number: 7", "7"), sampling.Prompt("Repeat this number: 12", "12")]
    rollout = ChatRollout(tokenizer, model_path=tiny_model_path, params=weights, seed=1, max_prompt_length=64,
                          max_response_length=8)
    rollout.weight_version = 0
    # the reward sees the decoded response and the row's ground truth: make the text say the answer for row 1
    texts = {}

    def reward(text, answer):
        texts.setdefault(answer, text)
        return 1.0 if answer == "12" else 0.0

    monkeypatch.setattr(sampling, "answer_reward", reward)
    out = rollout.generate_sequences(_gen_batch(tokenizer, prompts))
    again = rollout.generate_sequences(_gen_batch(tokenizer, prompts))
    assert torch.equal(out.batch["responses"], again.batch["responses"])  # reproducible
    mask = out.batch["response_mask"]
    lengths = mask.sum(dim=1)
    assert set(texts) == {"7", "12"}
    for row, length in enumerate(lengths.tolist()):
        assert 1 <= length <= 8 and int(mask[row, :length].sum()) == length  # contiguous from the first token
        expected = 1.0 if row == 1 else 0.0
        assert out.batch["rm_scores"][row, length - 1].item() == expected
        assert float(out.batch["rm_scores"][row].sum()) == expected
    figures = rollout.figures[-1]
    assert figures["reward_mean"] == 0.5 and figures["response_length"] == float(lengths.float().mean())
    rollout.weight_version = 1  # another weight version: another seed
    other = rollout.generate_sequences(_gen_batch(tokenizer, prompts))
    assert not torch.equal(other.batch["responses"], out.batch["responses"])
    with pytest.raises(RuntimeError, match="ground truths"):
        rollout._answers = ["1"]
        rollout.respond([[1, 2, 3], [4, 5]])


def test_the_repeat_dataset_holds_each_prompt_and_its_answer(tmp_path):
    import pandas as pd

    frame = pd.read_parquet(write_repeat_dataset(str(tmp_path / "train.parquet"), 5))
    assert len(frame) == 5
    for prompt, truth in zip(frame["prompt"], frame["reward_model"]):
        assert prompt[0]["content"] == f"Repeat this number: {truth['ground_truth']}"
