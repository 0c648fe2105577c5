"""lab/sampling.py on the embedded tiny Qwen2 (its tokenizer has a chat template): the KV-cache sampler draws what
the model's full distribution gives, stops each row at EOS, and masks like verl's rollout."""

from __future__ import annotations

import torch

from verl_klcov_global.lab import sampling

# prompts of different lengths: the batch is left-padded, so the KV cache's positions and mask are exercised
PROMPTS = [sampling.Prompt("What is 12 + 30?", "42"),
           sampling.Prompt("Add these two numbers and give only the result, nothing else: 12 and 30.", "42")]


def _sample(model, tokenizer, **kwargs):
    return sampling.sample_chat_responses(model, tokenizer, PROMPTS, samples_per_prompt=3, max_new_tokens=12,
                                          seed=5, **kwargs)


def test_draws_are_reproducible_and_the_entropies_are_the_full_forwards(tiny_model_path):
    model, tokenizer = sampling.load_policy(tiny_model_path)
    first, again = _sample(model, tokenizer), _sample(model, tokenizer)
    assert torch.equal(first.responses, again.responses)
    assert first.batch_size == 6 and first.responses.shape[1] <= 12
    tokens = first.tokens()
    with torch.no_grad():  # one teacher-forced forward over prompt + response: the cache changed nothing
        logits = model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"],
                       position_ids=tokens["position_ids"]).logits
    width = first.prompts.shape[1]
    log_probs = torch.log_softmax(logits[:, width - 1:-1].float(), dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1) * first.response_mask
    torch.testing.assert_close(entropy, first.entropies, rtol=1e-4, atol=1e-5)
    # every prompt is the chat template's user turn, left-padded: the short one has padding
    templated = sampling.template_prompts(tokenizer, PROMPTS)
    assert len(templated[0]) < len(templated[1])
    assert all(int(row.sum()) == len(ids) for row, ids in zip(first.prompt_mask[::3], templated))
    assert int((first.prompt_mask == 0).sum()) > 0


def test_each_row_stops_at_its_eos_and_the_mask_ends_there(tiny_model_path):
    model, tokenizer = sampling.load_policy(tiny_model_path)
    free = _sample(model, tokenizer)
    stop = int(free.responses[0, 2])  # the third token row 0 draws becomes the EOS: the same draws, row 0 stops
    tokenizer.eos_token_id = stop
    tokenizer.pad_token_id = 0
    stopped = _sample(model, tokenizer)
    first_stop = int((free.responses[0] == stop).nonzero()[0])
    assert int(stopped.response_mask[0].sum()) == first_stop + 1  # the EOS itself is a response token
    assert torch.equal(stopped.responses[0, :first_stop + 1], free.responses[0, :first_stop + 1])
    assert int(stopped.responses[0, first_stop + 1:].abs().sum()) == 0  # padded after it
    assert float(stopped.entropies[0, first_stop + 1:].abs().sum()) == 0.0


def test_answer_reward_reads_the_last_number():
    assert sampling.answer_reward("59 + 63 = 122", "122") == 1.0
    assert sampling.answer_reward("The answer is 1,220.", "1220") == 1.0
    assert sampling.answer_reward("122 is wrong, it is 121", "122") == 0.0
    assert sampling.answer_reward("no number", "3") == 0.0


def test_without_stopping_at_eos_every_row_runs_to_full_length(tiny_model_path):
    model, tokenizer = sampling.load_policy(tiny_model_path)
    free = _sample(model, tokenizer)
    stop = int(free.responses[0, 2])  # as above: row 0 draws this id third
    tokenizer.eos_token_id = stop
    tokenizer.pad_token_id = 0
    full = sampling.sample_token_responses(model, tokenizer, sampling.template_prompts(tokenizer, PROMPTS) * 3,
                                           max_new_tokens=12, seed=5, stop_at_eos=False)
    assert full.responses.shape == (6, 12) and int(full.response_mask.sum()) == 6 * 12
    assert (full.responses == stop).any()  # the EOS was drawn and the rows went on


def test_responses_after_random_prompts_have_one_shape_and_follow_the_seed(tiny_model_path):
    model, tokenizer = sampling.load_policy(tiny_model_path)

    def draw(seed):
        return sampling.sample_after_random_prompts(model, tokenizer, batch_size=4, prompt_len=5, response_len=7,
                                                    vocab_size=512, seed=seed, temperature=0.5)

    first, again, other = draw(3), draw(3), draw(4)
    assert first.prompts.shape == (4, 5) and first.responses.shape == (4, 7)
    assert int(first.prompt_mask.sum()) == 20 and int(first.response_mask.sum()) == 28
    assert int(first.prompts.min()) >= 3  # no special token among the prompt ids
    assert torch.equal(first.prompts, again.prompts) and torch.equal(first.responses, again.responses)
    assert not torch.equal(first.prompts, other.prompts)


def test_the_peaked_model_scales_the_lm_head_and_keeps_the_ranking(tiny_model_path, tmp_path):
    from verl_klcov_global.lab.tiny import build_peaked_model

    path = build_peaked_model(str(tmp_path / "peaked"), tiny_model_path, 8.0)
    base, _ = sampling.load_policy(tiny_model_path)
    peaked, _ = sampling.load_policy(path)
    ids = torch.tensor([[5, 9, 17, 33]])
    with torch.no_grad():
        logits, sharper = base(input_ids=ids).logits, peaked(input_ids=ids).logits
    torch.testing.assert_close(sharper, 8.0 * logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(sharper.argsort(-1), logits.argsort(-1))
    p = torch.softmax(sharper[0, -1], -1)
    assert float(p.max() / p.median()) > 10 * float(torch.softmax(logits[0, -1], -1).max()
                                                      / torch.softmax(logits[0, -1], -1).median())
